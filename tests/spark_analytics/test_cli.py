"""``lightgate analytics batch|stream`` end to end (spark_analytics.cli), in the test SparkSession."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.processes import ROOT
from tests.helpers.spark_fixtures import (
    analytics_args,
    telemetry,
    write_log,
)

from spark_analytics import cli
from spark_analytics.outputs import delta_available

pytestmark = pytest.mark.spark


def test_batch_writes_tables_chart_and_summary(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path / "data", telemetry(1500, devices=5, bad_every=30))
    out = tmp_path / "out"
    args = analytics_args("batch", "--data", str(tmp_path / "data"), "--out", str(out), "--from", "2023-11-14",
                 "--to", "2100-01-01")
    assert cli.run(args) == 0
    printed = capsys.readouterr()
    assert "Fleet telemetry" in printed.out and "1,450" in printed.out and "quarantined" in printed.out
    assert "metrics: temp, hum" in printed.err  # guessed from the payloads
    for table in ("device_1m", "device_1h", "topic_1m", "quarantine"):
        assert any((out / table).glob("date=2023-11-14/*.parquet")), table
    assert spark.read.schema("device string, gap_s double").parquet(str(out / "silence_gaps")).count() == 0
    minute = spark.read.parquet(str(out / "device_1m"))
    assert {"temp_p50", "temp_p95", "hum_stddev", "date"} <= set(minute.columns)
    assert minute.agg({"count": "sum"}).first()[0] == 1450
    assert spark.read.parquet(str(out / "quarantine")).count() == 50
    assert spark.read.parquet(str(out / "device_last_seen")).count() == 5
    assert (out / "fleet_metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stream_available_now(spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    offsets = write_log(tmp_path / "data", telemetry(400, devices=4, bad_every=40))
    end = (tmp_path / "data" / "commitlog" / "flushed").read_bytes()[:8]
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    args = analytics_args("stream", "--data", str(tmp_path / "data"), "--out", str(out), "--checkpoint", str(checkpoint),
                 "--metrics", "temp,hum", "--windows", "1m", "--watermark", "1m", "--max-records-per-trigger", "250")
    with caplog.at_level(logging.INFO, logger="spark_analytics.cli"):
        assert cli.run(args) == 0
    # stderr is no terminal here: no status line is drawn, and the log has one line per micro-batch
    lines = [r.getMessage() for r in caplog.records if "micro-batch" in r.getMessage()]
    log_end = int.from_bytes(end, "big")
    assert lines[0].startswith("streaming: micro-batch 0, 250 records, offsets ..")
    assert f"offsets ..{offsets[250]}, {log_end - offsets[250]:,} log bytes behind" in lines[0]
    assert lines[1].startswith(f"streaming: micro-batch 1, 150 records, {log_end - offsets[250]:,} log bytes, "
                               f"offsets {offsets[250]}..{log_end}, 0 log bytes behind, ")
    assert lines[1].endswith(" records/s") and len(lines) == 2
    assert spark.read.parquet(str(out / "quarantine")).count() == 10
    assert spark.read.parquet(str(out / "device_1m")).agg({"count": "sum"}).first()[0] > 0
    assert spark.read.parquet(str(out / "device_last_seen")).count() == 4


@pytest.mark.skipif(not delta_available(), reason="delta-spark is not installed (it is optional)")
def test_batch_writes_delta_when_asked(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path / "data", telemetry(300, devices=3))
    out = tmp_path / "out"
    assert cli.run(analytics_args("batch", "--data", str(tmp_path / "data"), "--out", str(out), "--format", "delta",
                         "--metrics", "temp,hum", "--no-chart")) == 0
    assert (out / "device_1m" / "_delta_log").is_dir()


def test_bad_arguments_exit_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        analytics_args("batch", "--data", str(tmp_path), "--out", str(tmp_path), "--from", "someday")
    with pytest.raises(SystemExit):
        analytics_args("batch", "--data", str(tmp_path), "--out", str(tmp_path), "--topic", "a/#/b")
    assert cli.run(analytics_args("batch", "--data", str(tmp_path / "none"), "--out", str(tmp_path))) == 2
    if not delta_available():
        assert cli.run(analytics_args("batch", "--data", str(tmp_path), "--out", str(tmp_path), "--format", "delta")) == 2


def test_positions_and_several_topics_become_reader_options(tmp_path: Path) -> None:
    args = analytics_args("stream", "--data", str(tmp_path), "--out", str(tmp_path), "--checkpoint", str(tmp_path),
                          "--topic", "a/+/t", "--topic", "b/#", "--start-offset", "0",
                          "--end-time", "1970-01-01T00:00:05Z")
    assert cli._reader_options(args) == {"verifyCrc": "true", "topicFilters": '["a/+/t", "b/#"]',
                                         "path": str(tmp_path), "startingOffsets": "0", "endingTimestamp": "5000"}
    one = analytics_args("batch", "--data", str(tmp_path), "--out", str(tmp_path), "--start-time", "1000",
                         "--end-offset", "4096")
    assert cli._reader_options(one) == {"verifyCrc": "true", "topicFilter": "#", "path": str(tmp_path),
                                        "startingTimestamp": "1000", "endingOffsets": "4096"}
    for clash in (("--start-offset", "0", "--start-time", "0"), ("--end-offset", "x")):
        with pytest.raises(SystemExit):
            analytics_args("batch", "--data", str(tmp_path), "--out", str(tmp_path), *clash)


@pytest.mark.slow
def test_spark_starts_without_its_start_up_lines(tmp_path: Path) -> None:
    """The JVM's start-up chatter (Spark's default log4j profile, its default log level and how to change it,
    NativeCodeLoader) is not printed: the driver gets our log4j2 configuration (spark_analytics/session.py)."""
    started = subprocess.run(
        [sys.executable, "-c", "from spark_analytics.session import spark_session; "
                               "spark_session(app_name='quiet').range(3).count()"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert started.returncode == 0, started.stderr
    for noise in ("log4j profile", "Setting default log level", "setLogLevel", "NativeCodeLoader", " WARN "):
        assert noise not in started.stderr, started.stderr
