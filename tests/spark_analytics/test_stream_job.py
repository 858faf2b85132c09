"""``lightgate analytics stream`` (spark_analytics.microbatch): one read of the CommitLog per micro-batch feeds every
output, and the tables equal what ``lightgate analytics batch`` writes over the same records, whatever the
micro-batches, re-runs and kills. Tables are compared with pyarrow, not with Spark."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F
from tests.helpers.spark_fixtures import (
    TABLES,
    Msg,
    analytics_args,
    encode,
    store_node,
    table_rows,
    write_log,
)

from store.node import StoreNode
from spark_analytics import cli
from spark_analytics.aggregate import AggregationConfig
from spark_analytics.jobs import read_telemetry, start_stream
from spark_analytics.microbatch import MicroBatchSink, read_state
from spark_analytics.outputs import publish
from spark_analytics.telemetry import TelemetryMapping

pytestmark = pytest.mark.spark

from tests.helpers.processes import ROOT  # noqa: E402  (the repo root, whatever the depth of this folder)
MIDNIGHT_MS = 1_700_006_400_000  # 2023-11-15T00:00:00Z
FLAGS = ("--metrics", "temp,hum", "--windows", "1m,1h", "--silence", "1m", "--dedup", "seq")
MAPPING = TelemetryMapping(("temp", "hum"), key="seq")
CONFIG = AggregationConfig(windows=(60, 3600), silence_s=60)


def fleet(rounds: int, *, start_ms: int = MIDNIGHT_MS - 3_600_000, first_round: int = 0) -> list[Msg]:
    """7 devices, one message each per 35 s round (store time 5 s apart), with a sequence number; dev0 is
    silent two rounds in five (gaps past 1 minute); every 10th message is stored twice 0.4 s later (a QoS 1
    resend after a reconnect) and every 23rd is malformed. From an hour before midnight: two event dates."""
    rnd = random.Random(first_round)
    msgs = []
    for i in range(first_round * 7, (first_round + rounds) * 7):
        device, seq = i % 7, i // 7
        if device == 0 and seq % 5 in (1, 2):
            continue
        body = {"seq": seq, "temp": round(rnd.uniform(-20, 40), 3), "hum": rnd.randint(0, 100)}
        payload = b"{broken" if i % 23 == 22 else json.dumps(body).encode()
        msg = Msg(f"fleet/dev{device}/telemetry", payload, start_ms + i * 5_000, client_id=f"dev{device}", qos=1)
        msgs.append(msg)
        if i % 10 == 3:
            msgs.append(Msg(msg.topic, msg.payload, msg.store_ms + 400, client_id=msg.client_id, qos=1))
    return msgs


def run_batch(data: Path, out: Path) -> None:
    assert cli.run(analytics_args("batch", "--data", str(data), "--out", str(out), "--no-chart", *FLAGS)) == 0


@dataclass(frozen=True)
class FleetLog:
    """A CommitLog of :func:`fleet` records that no test changes, and the tables a batch run writes over it."""

    data: Path
    msgs: list[Msg]
    offsets: list[int]
    batch: Path


@pytest.fixture(scope="module")
def fleet_log(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> FleetLog:
    """``fleet(200)`` (two event dates) and its batch run, once for the module: every stream test of it compares
    with the same batch tables, and none writes to the log."""
    root = tmp_path_factory.mktemp("fleet")
    msgs = fleet(200)
    offsets = write_log(root / "data", msgs)
    run_batch(root / "data", root / "batch")
    return FleetLog(root / "data", msgs, offsets, root / "batch")


def stream_to_the_end(spark: Any, out: Path, checkpoint: Path, **options: str) -> list[Any]:
    """``start_stream`` with trigger(availableNow): every record there is, then stop; the query's progress."""
    query = start_stream(spark, data=options.pop("path", None), out=out, checkpoint=checkpoint, mapping=MAPPING,
                         config=CONFIG, trigger={"availableNow": True}, reader_options=options, dedup=True)
    query.awaitTermination(300)
    assert not query.isActive and query.exception() is None, query.exception()
    return query.recentProgress


def assert_same_tables(got: Path, want: Path) -> None:
    for name in TABLES:
        assert table_rows(got / name) == table_rows(want / name), name


@pytest.mark.slow
def test_a_rate_limited_stream_writes_what_a_batch_run_writes(spark: Any, fleet_log: FleetLog, tmp_path: Path) -> None:
    msgs = fleet_log.msgs
    progress = stream_to_the_end(spark, tmp_path / "stream", tmp_path / "checkpoint", path=str(fleet_log.data),
                                 maxRecordsPerTrigger="500")
    batches = [p["numInputRows"] for p in progress if p["numInputRows"]]
    assert sum(batches) == len(msgs) and max(batches) <= 500 and len(batches) == 3  # each record read once
    lags = [latest - end for _start, end, latest in map(cli._positions, (progress[0], progress[-1]))]
    assert lags[0] > 0 and lags[1] == 0  # the lag, from the progress
    # 1 h windows, days, gaps and duplicates span micro-batches; the open windows at the end are there too
    assert_same_tables(tmp_path / "stream", fleet_log.batch)
    assert len(table_rows(fleet_log.batch / "silence_gaps")) > 40
    assert {r[0] for r in table_rows(fleet_log.batch / "device_day")} == {"2023-11-14", "2023-11-15"}
    state = read_state(tmp_path / "checkpoint")
    assert (state.rows, state.late) == (len(msgs), 0)
    assert len(list((tmp_path / "checkpoint" / "rows").iterdir())) < len(batches)  # closed windows' rows dropped


def test_the_status_line_leaves_the_lag_out_when_the_progress_has_none() -> None:
    """A micro-batch re-run from Spark's offset log after a restart does not ask the source for the end of the
    log: its progress has ``"latestOffset": "null"`` (the status line raised TypeError and the stream died)."""
    progress = {"batchId": 2, "numInputRows": 500, "processedRowsPerSecond": 100.0,
                "sources": [{"endOffset": '{"segment": 0, "position": 900}', "latestOffset": "null"}]}
    assert cli._progress_line(progress) == "streaming: micro-batch 2, 500 records, offsets ..900, 100 records/s"
    progress["sources"][0].update(latestOffset='{"segment": 0, "position": 1000}', startOffset='{"segment": 0, '
                                                                                             '"position": 400}')
    assert cli._progress_line(progress) == ("streaming: micro-batch 2, 500 records, 500 log bytes, offsets 400..900, "
                                            "100 log bytes behind, 100 records/s")


def test_each_micro_batch_reads_the_log_once(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[tuple[int, int]] = []
    read_log = StoreNode.read_log

    def counted(node: StoreNode, offset: int, max_bytes: int) -> Any:
        span = read_log(node, offset, max_bytes)
        if max_bytes > 0:
            served.append((span.start, span.start + len(span.data)))
        return span

    monkeypatch.setattr(StoreNode, "read_log", counted)
    part = fleet(150)
    offsets = write_log(tmp_path / "data", part)
    with store_node(tmp_path / "data") as address:  # every byte over the store RPC, where the spy sees it
        progress = stream_to_the_end(spark, tmp_path / "out", tmp_path / "checkpoint", store=address)
    assert [p["numInputRows"] for p in progress if p["numInputRows"]] == [len(part)]  # one micro-batch
    spans = sorted(served)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no byte of the log served twice
    assert spans[0][0] == offsets[0] and spans[-1][1] == offsets[-1] + len(encode(part[-1]))
    assert all(any(lo <= o < hi for lo, hi in spans) for o in offsets)
    assert all(any((tmp_path / "out" / name).rglob("*.parquet")) for name in TABLES)  # it fed every table


@pytest.mark.slow
def test_a_micro_batch_run_again_or_empty_changes_nothing(spark: Any, fleet_log: FleetLog, tmp_path: Path) -> None:
    """Spark re-runs a micro-batch whose commit a kill lost: the sink sees the batch id again. A micro-batch
    whose records the topic filter all left out changes nothing either, and aggregates nothing."""
    offsets = fleet_log.offsets
    rows = read_telemetry(spark, fleet_log.data, MAPPING)
    sink = MicroBatchSink(tmp_path / "out", tmp_path / "checkpoint", MAPPING, CONFIG, dedup=True)
    tables = lambda: {name: table_rows(tmp_path / "out" / name) for name in TABLES}  # noqa: E731
    sink(rows.where(F.col("offset") < offsets[700]), 0)
    middle = rows.where((F.col("offset") >= offsets[700]) & (F.col("offset") < offsets[1000]))
    sink(middle, 1)
    before = tables()
    sink(middle, 1)
    assert tables() == before
    sink(rows.where(F.lit(False)), 2)
    assert tables() == before
    assert not (tmp_path / "checkpoint" / "state" / f"{2:010d}" / "pending").exists()
    sink(rows.where(F.col("offset") >= offsets[1000]), 3)  # the state went on through the empty micro-batch
    assert_same_tables(tmp_path / "out", fleet_log.batch)
    with pytest.raises(RuntimeError, match="past the query's 0"):  # a checkpoint changed by hand
        sink(rows, 0)


def test_publish_finishes_the_moves_a_kill_interrupted(tmp_path: Path) -> None:
    out, pending = tmp_path / "out", tmp_path / "pending"
    old_open = out / "t" / "date=2023-11-14" / "open-0000000006-part-0.parquet"
    kept_final = out / "t" / "date=2023-11-14" / "final-0000000006-part-1.parquet"
    for path in (old_open, kept_final, *(pending / "t" / f"kind={k}" / "date=2023-11-15" / f"part-{k}.parquet"
                                        for k in ("final", "open"))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(path.name.encode())
    (pending / "t" / "kind=open" / "date=2023-11-15" / ".part-open.parquet.crc").write_bytes(b"")
    # the kill came after the first move
    moved = out / "t" / "date=2023-11-15" / "final-0000000007-part-final.parquet"
    moved.parent.mkdir(parents=True)
    os.replace(pending / "t" / "kind=final" / "date=2023-11-15" / "part-final.parquet", moved)
    for _ in range(2):
        publish(pending, out, 7, ["t"])
        files = sorted(p.relative_to(out / "t").as_posix() for p in (out / "t").rglob("*") if p.is_file())
        assert files == ["date=2023-11-14/final-0000000006-part-1.parquet",
                         "date=2023-11-15/final-0000000007-part-final.parquet",
                         "date=2023-11-15/open-0000000007-part-open.parquet"]


def test_the_former_stream_layout_and_delta_are_refused(spark: Any, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path / "data", fleet(20))
    (tmp_path / "out" / "device_1m" / "_spark_metadata").mkdir(parents=True)
    args = ("stream", "--data", str(tmp_path / "data"), "--checkpoint", str(tmp_path / "checkpoint"), *FLAGS)
    assert cli.run(analytics_args(*args, "--out", str(tmp_path / "out"))) == 2
    assert "written by the former stream" in capsys.readouterr().err
    assert cli.run(analytics_args(*args, "--out", str(tmp_path / "new"), "--format", "delta")) == 2
    assert "Parquet tables only" in capsys.readouterr().err


@pytest.mark.slow
def test_a_stream_killed_mid_way_and_restarted_writes_what_a_batch_run_writes(spark: Any, fleet_log: FleetLog,
                                                                              tmp_path: Path) -> None:
    msgs = fleet_log.msgs
    flags = ["stream", "--data", str(fleet_log.data), "--out", str(tmp_path / "stream"), "--checkpoint",
             str(tmp_path / "checkpoint"), "--max-records-per-trigger", "800", *FLAGS]
    commits = tmp_path / "checkpoint" / "query" / "commits"
    with subprocess.Popen([sys.executable, "-m", "gateway.app.cli", "analytics", *flags], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            while len([c for c in commits.glob("[0-9]*")] if commits.exists() else []) < 1:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
                try:
                    proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and its JVM, in the middle of micro-batch 1 (the last)
    assert read_state(tmp_path / "checkpoint").rows < len(msgs)
    assert cli.run(analytics_args(*flags)) == 0  # the restart: availableNow to the end
    assert_same_tables(tmp_path / "stream", fleet_log.batch)
    assert read_state(tmp_path / "checkpoint").rows == len(msgs)
