"""Telemetry payload parsing and quarantine reasons (spark_analytics.telemetry), without Spark."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from tests.helpers.spark_fixtures import Msg, telemetry, write_log

from spark_analytics.framing import DecodeOptions, scan_range
from spark_analytics.layout import list_segments, read_flushed
from spark_analytics.planning import plan_ranges
from spark_analytics.telemetry import TelemetryMapping, TelemetryParser


def parse(tmp_path: Path, msgs: list[Msg], mapping: TelemetryMapping) -> list[dict]:
    write_log(tmp_path, msgs)
    directory = tmp_path / "commitlog"
    parser = TelemetryParser(mapping)
    out = []
    for part in plan_ranges(list_segments(directory), read_flushed(directory)):
        for rng in part:
            for frames in scan_range(rng, DecodeOptions()):
                batch = parser.parse(frames)
                assert batch.schema == mapping.arrow_schema()
                out += batch.to_pylist()
    return out


def test_device_from_topic_and_metrics(tmp_path: Path) -> None:
    msgs = telemetry(500, bad_every=0)
    got = parse(tmp_path, msgs, TelemetryMapping(("temp", "hum")))
    assert len(got) == 500 and all(r["error"] is None and r["payload"] is None for r in got)
    for r, m in zip(got, msgs):
        assert r["device"] == m.topic.split("/")[1] and r["topic"] == m.topic
        assert r["event_ts"] == r["store_ts"] and round(r["store_ts"].timestamp() * 1000) == m.store_ms
    assert got[0]["temp"] == pytest.approx(float(eval(msgs[0].payload)["temp"]))
    assert got[5]["hum"] is None and got[5]["temp"] is not None  # partial metrics stay telemetry


def test_malformed_payloads_are_quarantined_with_reasons(tmp_path: Path) -> None:
    msgs = [
        Msg("f/d1/t", b'{"temp": 1.5, "hum": 2}', 1),
        Msg("f/d1/t", b"{not json", 2),
        Msg("f/d1/t", b"[1, 2]", 3),
        Msg("f/d1/t", b'{"temp": "warm"}', 4),
        Msg("f/d1/t", b'{"other": 1}', 5),
        Msg("f/d1/t", b"", 6),
        Msg("f/d1/t", b'{"temp": true}', 7),
        Msg("f", b'{"temp": 3}', 8),  # no device level in the topic
        Msg("f/d2/t", b'{"hum": 9, "extra": {"nested": [1]}}', 9),
    ]
    got = parse(tmp_path, msgs, TelemetryMapping(("temp", "hum")))
    errors = [r["error"] for r in got]
    assert errors[0] is None and errors[8] is None and got[8]["hum"] == 9.0
    assert errors[1].startswith("invalid payload: JSON is malformed")
    assert "Expected `object`" in errors[2]
    assert "$.temp" in errors[3] and "$.temp" in errors[6]
    assert errors[4] == "no metric field (temp, hum)"
    assert errors[5].startswith("invalid payload")
    assert errors[7] == "topic has no level 1"
    assert [r["payload"] for r in got] == [None if e is None else m.payload for e, m in zip(errors, msgs)]


@pytest.mark.parametrize(
    ("unit", "value", "expected"),
    [
        ("ms", "1700000000123", dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=dt.timezone.utc)),
        ("s", "1700000000.5", dt.datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=dt.timezone.utc)),
        ("iso", '"2024-02-03T04:05:06+02:00"', dt.datetime(2024, 2, 3, 2, 5, 6, tzinfo=dt.timezone.utc)),
        ("iso", '"2024-02-03T04:05:06"', dt.datetime(2024, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc)),
    ],
)
def test_payload_device_and_time(tmp_path: Path, unit: str, value: str, expected: dt.datetime) -> None:
    msgs = [Msg("any/topic", f'{{"id": 42, "at": {value}, "v": 1}}'.encode(), 5),
            Msg("any/topic", b'{"id": "x", "v": 1}', 6),
            Msg("any/topic", f'{{"at": {value}, "v": 1}}'.encode(), 7)]
    mapping = TelemetryMapping(("v",), device="payload:id", time="payload:at", time_unit=unit)
    got = parse(tmp_path, msgs, mapping)
    assert (got[0]["device"], got[0]["event_ts"], got[0]["error"]) == ("42", expected, None)
    assert got[1]["error"] == "missing or out-of-range time field 'at' (before 2000 or after 9999)"
    assert got[2]["error"] == "missing device field 'id'"


def test_mapping_validation_and_options_round_trip() -> None:
    mapping = TelemetryMapping(("temp", "hum"), device="payload:dev", time="payload:ts", time_unit="s")
    assert TelemetryMapping.from_options({k.upper(): v for k, v in mapping.to_options().items()}) == mapping
    names = mapping.arrow_schema().names
    assert names == ["offset", "store_ts", "topic", "device", "event_ts", "temp", "hum", "error", "payload"]
    assert mapping.arrow_schema().field("temp").type == pa.float64()
    for bad in [dict(metrics=()), dict(metrics=("a b",)), dict(metrics=("device",)), dict(metrics=("a", "a")),
                dict(metrics=("a",), device="topic:x"), dict(metrics=("a",), device="field:x"),
                dict(metrics=("a",), time="now"), dict(metrics=("a",), time_unit="h")]:
        with pytest.raises(ValueError):
            TelemetryMapping(**bad)


def test_a_byte_order_mark_is_skipped_an_unset_clock_is_quarantined_and_the_key_is_a_column(tmp_path: Path) -> None:
    msgs = [Msg("fleet/a/t", b'\xef\xbb\xbf{"seq": 7, "ts": 1700000000000, "v": 1.5}', 5),
            Msg("fleet/a/t", b'{"seq": 8, "ts": -5000, "v": 2}', 6),  # 1969: a clock that was never set
            Msg("fleet/a/t", b'{"seq": "x9", "ts": 5000, "v": 2}', 7),  # 1970
            Msg("fleet/a/t", b'{"ts": 1700000001000, "v": 3}', 8)]
    got = parse(tmp_path, msgs, TelemetryMapping(("v",), time="payload:ts", key="seq"))
    assert [(r["key"], r["v"], r["error"]) for r in got] == [
        ("7", 1.5, None),
        ("8", 2.0, "missing or out-of-range time field 'ts' (before 2000 or after 9999)"),
        ("x9", 2.0, "missing or out-of-range time field 'ts' (before 2000 or after 9999)"),
        (None, 3.0, None)]
