"""``lightgate analytics`` in Spark processes of its own: a multi-process cluster (``local-cluster``: a master,
two executor JVMs and their Python workers) that has no file system shared with the store and no copy of the
project, and a stream stopped by ``--timeout``. Slow: each test starts its own Spark."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from tests.helpers.spark_fixtures import (
    TABLES,
    analytics_args,
    store_node,
    table_rows,
    telemetry,
    tier_then_expire,
    write_log,
)

from spark_analytics import cli
from spark_analytics.microbatch import read_state

pytestmark = [pytest.mark.slow, pytest.mark.spark]

from tests.helpers.processes import ROOT  # noqa: E402  (the repo root, whatever the depth of this folder)
CLUSTER = "local-cluster[2,1,1024]"
"""Two executors of one core and 1 GiB each: separate JVMs with their own Python workers, as on real machines."""


def start_lightgate(*argv: str, env: dict[str, str], output: Path) -> subprocess.Popen[bytes]:
    """``lightgate ...`` started in a process of its own, from the repository root; stdout and stderr go to
    ``output`` (a file: a pipe nobody reads while the caller works could fill and block the process)."""
    with output.open("wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "gateway.app.cli", *argv], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT)


def lightgate(*argv: str, env: dict[str, str], output: Path, timeout: float = 600) -> tuple[int, str]:
    """Run ``lightgate ...`` as :func:`start_lightgate`; its exit code and output."""
    with start_lightgate(*argv, env=env, output=output) as proc:
        code = proc.wait(timeout)
    return code, output.read_text(errors="replace")


def isolated_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Spark Python workers see the dependencies but not the project: they run
    ``python -S`` (no .pth files, so not the editable install) with only site-packages on their path, so the
    project's code reaches the executors only in the zip the CLI ships."""
    worker = tmp_path / "python-without-project"
    worker.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    worker.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    return {**env, "PYSPARK_PYTHON": str(worker), "PYTHONPATH": sysconfig.get_paths()["purelib"],
            "SPARK_LOCAL_IP": "127.0.0.1"}


def test_a_multi_process_cluster_without_the_files_gives_the_local_result(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_log(data, telemetry(3000, devices=9, bad_every=31))  # 5 segments
    # the tier on a file:// URI (3 segments, the newest of them still local too), the rest on the store node
    tier_then_expire(data, convert=3, keep_local=1)
    tier = (data / "tier").as_uri()
    with store_node(data) as address:
        flags = ["--store", address, "--tier", tier, "--metrics", "temp,hum", "--no-chart"]
        # the cluster run (its driver and two executor JVMs to start) and the local run side by side
        with start_lightgate("analytics", "batch", *flags, "--out", str(tmp_path / "cluster"), "--master", CLUSTER,
                             "--conf", "spark.executor.memory=512m", env=isolated_env(tmp_path),
                             output=tmp_path / "cluster.log") as proc:
            assert cli.run(analytics_args("batch", *flags, "--out", str(tmp_path / "local"))) == 0
            assert proc.wait(600) == 0, (tmp_path / "cluster.log").read_text(errors="replace")[-5000:]
    for name in TABLES:
        assert table_rows(tmp_path / "cluster" / name) == table_rows(tmp_path / "local" / name), name


def test_a_stream_stopped_by_timeout_ends_cleanly_after_the_running_micro_batch(tmp_path: Path) -> None:
    """A backlog of 20 rate-limited micro-batches: ``--timeout`` stops the stream after the one running then, not
    after the backlog (the source admits no record past the timeout), and interrupts nothing. Local mode."""
    write_log(tmp_path / "data", telemetry(2000, devices=5))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code, output = lightgate("analytics", "stream", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                             "--checkpoint", str(tmp_path / "checkpoint"), "--metrics", "temp,hum", "--windows",
                             "1m", "--interval", "1s", "--timeout", "15s", "--max-records-per-trigger", "100",
                             env=env, output=tmp_path / "stream.log")
    assert code == 0, output[-5000:]
    assert "stopped after --timeout 15 s" in output
    assert "Traceback" not in output and "Exception" not in output, output[-5000:]
    read = read_state(tmp_path / "checkpoint").rows
    assert read < 2000 and read % 100 == 0, read  # whole micro-batches, and the backlog left for the next run
