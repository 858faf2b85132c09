"""``lightgate analytics batch`` as an operator uses it: exact reruns over some days, de-duplication, the output
Parquet format, and clear errors instead of quiet failures. Tables are compared with pyarrow, not with Spark."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from tests.helpers.spark_fixtures import (
    TABLES,
    Msg,
    analytics_args,
    table_rows,
    telemetry,
    write_log,
)

from spark_analytics import cli
from spark_analytics.jobs import infer_metrics

pytestmark = pytest.mark.spark

DAY0_MS = 1_699_920_000_000  # 2023-11-14T00:00:00Z


def batch(data: Path, out: Path, *extra: str) -> int:
    return cli.run(analytics_args("batch", "--data", str(data), "--out", str(out), "--metrics", "temp,hum", "--no-chart",
                         *extra))


def test_a_rerun_of_some_days_leaves_every_table_as_a_full_run_writes_it(spark: Any, tmp_path: Path) -> None:
    # three days, 7 devices, each silent ~16 min between messages: gaps everywhere, across midnights too
    write_log(tmp_path / "data", telemetry(1900, devices=7, start_ms=DAY0_MS, step_ms=137_000, bad_every=23))
    full, rerun = tmp_path / "full", tmp_path / "rerun"
    assert batch(tmp_path / "data", full) == 0
    shutil.copytree(full, rerun)
    assert batch(tmp_path / "data", rerun, "--from", "2023-11-15", "--to", "2023-11-16") == 0  # the middle day
    assert batch(tmp_path / "data", rerun, "--from", "2023-11-16") == 0  # the last day, open-ended
    for name in TABLES:
        assert table_rows(rerun / name) == table_rows(full / name), name
    assert len(table_rows(full / "silence_gaps")) > 100 and len(table_rows(full / "quarantine")) > 50
    # the output format: zstd, INT64 microsecond timestamps with statistics (not INT96)
    parquet = pq.ParquetFile(next((full / "device_1m").glob("date=*/*.parquet"))).metadata
    column = next(parquet.row_group(0).column(i) for i in range(parquet.num_columns)
                  if parquet.row_group(0).column(i).path_in_schema == "window_start")
    assert (column.physical_type, column.compression) == ("INT64", "ZSTD") and column.statistics.has_min_max
    assert "timeUnit=microseconds" in str(parquet.schema.column(parquet.schema.names.index("window_start")).logical_type)


def test_a_range_that_does_not_fall_on_midnight_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path / "data", telemetry(100))
    assert batch(tmp_path / "data", tmp_path / "out", "--from", "2023-11-14T06:00:00Z") == 2
    assert "must be a UTC midnight" in capsys.readouterr().err
    assert batch(tmp_path / "data", tmp_path / "out", "--from", "2023-11-14", "--windows", "7m") == 2
    assert "must divide a day" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_duplicates_are_dropped_by_the_payload_key_and_sys_topics_are_not_read(
        spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    msgs = []
    for i in range(600):
        body = {"seq": i // 7, "temp": float(i % 40), "hum": 50}
        msg = Msg(f"fleet/dev{i % 7}/telemetry", json.dumps(body).encode(), DAY0_MS + i * 1000)
        msgs.append(msg)
        if i % 10 == 0:  # a QoS 1 message stored twice after a reconnect
            msgs.append(Msg(msg.topic, msg.payload, msg.store_ms + 400))
    msgs += [Msg("$SYS/broker/load", b'{"temp": 99, "hum": 1}', DAY0_MS + 5000 + i) for i in range(50)]
    write_log(tmp_path / "data", msgs)
    assert len(msgs) == 600 + 60 + 50
    assert batch(tmp_path / "data", tmp_path / "dedup", "--dedup", "seq") == 0
    counted = pq.read_table(tmp_path / "dedup" / "device_1m", columns=["count"]).column("count").to_pylist()
    assert sum(counted) == 600  # each message once, and no $SYS record
    summary = capsys.readouterr().out  # the records read, the repeats apart
    assert re.search(r"records read\s*│\s*660\b", summary) and re.search(r"repeats dropped.*│\s*60\b", summary)
    assert re.search(r"telemetry rows\s*│\s*600\b", summary)


def test_quiet_failures_are_now_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    payloads = [{"device": f"d{i % 3}", "seq": i, "ts": DAY0_MS + i, "sent_ns": (DAY0_MS + i) * 10**6,
                 "temp": 20.5, "hum": i % 100} for i in range(300)]
    write_log(data, [Msg(f"fleet/d{i % 3}/telemetry", json.dumps(p).encode(), DAY0_MS + i)
                     for i, p in enumerate(payloads)] + [Msg("$SYS/uptime", b'{"up": 5}', DAY0_MS + 400)])
    assert infer_metrics({"path": str(data), "topicFilter": "#"}) == ("temp", "hum")  # not seq, ts, sent_ns, up
    assert batch(data, tmp_path / "out", "--metrics", "tmp") == 2
    assert "metric(s) tmp are in none of the first 300 payloads" in capsys.readouterr().err
    assert cli.run(analytics_args("batch", "--data", str(data), "--out", str(tmp_path / "o"), "--topic", "other/#")) == 2
    assert "no records in" in capsys.readouterr().err
    (tmp_path / "not-a-log").mkdir()
    assert cli.run(analytics_args("batch", "--data", str(tmp_path / "not-a-log"), "--out", str(tmp_path / "o"))) == 2
    assert "no CommitLog at" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
