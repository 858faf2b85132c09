"""Telemetry aggregates (spark_analytics.aggregate) against a pure-Python reference."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.spark_fixtures import (
    T0_MS,
    Msg,
    telemetry,
    write_log,
)

from spark_analytics.aggregate import (
    AggregationConfig,
    device_windows,
    last_seen,
    quarantine,
    silence_gaps,
    topic_windows,
)
from spark_analytics.jobs import read_telemetry
from spark_analytics.telemetry import TelemetryMapping

pytestmark = pytest.mark.spark

MAPPING = TelemetryMapping(("temp", "hum"))
CONFIG = AggregationConfig(windows=(60, 3600), silence_s=300)


def fleet() -> list[Msg]:
    """Telemetry with quarantine rows and one device (dev3) silent for 10 minutes."""
    msgs = telemetry(4200, devices=7, step_ms=700, bad_every=37)
    silent = (T0_MS + 600_000, T0_MS + 1_200_000)
    return [m for m in msgs if not (m.topic == "fleet/dev3/telemetry" and silent[0] <= m.store_ms < silent[1])]


def reference(msgs: list[Msg], window_s: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (device, window start ms): count and per-metric values, from the raw messages."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for m in msgs:
        try:
            body = json.loads(m.payload)
        except ValueError:
            continue
        if not isinstance(body, dict) or not any(isinstance(body.get(k), (int, float)) and not isinstance(body.get(k), bool)
                                                 and not isinstance(body.get(k), str) for k in MAPPING.metrics):
            continue
        if any(isinstance(body.get(k), str) for k in MAPPING.metrics):
            continue
        start = m.store_ms - m.store_ms % (window_s * 1000)
        cell = out.setdefault((m.topic.split("/")[1], start), {"count": 0, **{k: [] for k in MAPPING.metrics}})
        cell["count"] += 1
        for k in MAPPING.metrics:
            if k in body:
                cell[k].append(float(body[k]))
    return out


def test_device_windows_equal_the_reference(spark: Any, tmp_path: Path) -> None:
    msgs = fleet()
    write_log(tmp_path, msgs)
    df = read_telemetry(spark, tmp_path, MAPPING).cache()
    for window_s in CONFIG.windows:
        want = reference(msgs, window_s)
        got = {(r.device, round(r.window_start.timestamp() * 1000)): r
               for r in device_windows(df, MAPPING.metrics, window_s, CONFIG).collect()}
        assert got.keys() == want.keys()
        for key, cell in want.items():
            row = got[key]
            assert row["count"] == cell["count"]
            for k in MAPPING.metrics:
                values = cell[k]
                assert row[f"{k}_count"] == len(values)
                assert (row[f"{k}_min"], row[f"{k}_max"]) == (min(values), max(values))
                assert row[f"{k}_mean"] == pytest.approx(statistics.fmean(values), abs=1e-9)
                if len(values) > 1:
                    assert row[f"{k}_stddev"] == pytest.approx(statistics.stdev(values), abs=1e-9)
                else:
                    assert row[f"{k}_stddev"] is None or math.isnan(row[f"{k}_stddev"])
                ordered = sorted(values)
                for p in CONFIG.percentiles:  # small groups: percentile_approx is exact
                    assert row[f"{k}_p{p * 100:g}"] == ordered[max(0, math.ceil(p * len(values)) - 1)]
    df.unpersist()


def test_topics_last_seen_gaps_and_quarantine(spark: Any, tmp_path: Path) -> None:
    msgs = fleet()
    write_log(tmp_path, msgs)
    df = read_telemetry(spark, tmp_path, MAPPING).cache()
    per_topic: dict[tuple[str, int], int] = defaultdict(int)
    for m in msgs:
        per_topic[(m.topic, m.store_ms - m.store_ms % 60_000)] += 1
    got = {(r.topic, round(r.window_start.timestamp() * 1000)): (r["count"], r.rate_per_s)
           for r in topic_windows(df, 60, CONFIG).collect()}
    assert got == {k: (v, v / 60) for k, v in per_topic.items()}

    bad = [r for r in quarantine(df).collect()]
    assert len(bad) == sum(1 for i in range(4200) if i % 37 == 36) - sum(
        1 for i in range(4200) if i % 37 == 36 and i % 7 == 3 and 600_000 <= i * 700 < 1_200_000)
    assert {r.error.split(":")[0] for r in bad} == {"invalid payload", "no metric field (temp, hum)"}

    gaps = [(r.device, r.gap_s) for r in silence_gaps(df, CONFIG).collect()]
    dev3 = sorted(m.store_ms for m in msgs if m.topic == "fleet/dev3/telemetry" and json_ok(m.payload))
    want_gaps = [("dev3", (b - a) / 1000) for a, b in zip(dev3, dev3[1:]) if b - a > 300_000]
    assert gaps == want_gaps and len(gaps) == 1

    seen = {r.device: r for r in last_seen(df, CONFIG).collect()}
    last = max(m.store_ms for m in msgs if json_ok(m.payload))
    for device, row in seen.items():
        times = [m.store_ms for m in msgs if m.topic == f"fleet/{device}/telemetry" and json_ok(m.payload)]
        assert round(row.last_seen.timestamp() * 1000) == max(times) and row.messages == len(times)
        assert row.silent_s == pytest.approx((last - max(times)) / 1000) and row.silent is False
    df.unpersist()


def json_ok(payload: bytes) -> bool:
    try:
        body = json.loads(payload)
    except ValueError:
        return False
    return isinstance(body, dict) and all(not isinstance(v, str) for v in body.values()) and (
        "temp" in body or "hum" in body)

