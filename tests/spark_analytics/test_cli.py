"""``lightgate analytics batch|stream`` end to end (spark_analytics.cli), in the test SparkSession."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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


def test_stream_available_now(spark: Any, tmp_path: Path) -> None:
    write_log(tmp_path / "data", telemetry(400, devices=4, bad_every=40))
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    args = analytics_args("stream", "--data", str(tmp_path / "data"), "--out", str(out), "--checkpoint", str(checkpoint),
                 "--metrics", "temp,hum", "--windows", "1m", "--watermark", "1m")
    assert cli.run(args) == 0
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
