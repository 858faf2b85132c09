"""The Parquet tier (store/tier.py, store/tierfiles.py): sealed segments converted exactly once, crash-safe,
read back by pyarrow and DuckDB, retention guarded. The CommitLog's own reader is the reference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import trio
from tests.helpers.spark_fixtures import Msg, encode, telemetry, write_log

from store.api import NewMessage
from store.control import SessionSaved, encode_control
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_ZSTD, new_batch
from store.node import open_store
from store.tier import TierConfig, TierConverter
from store.tierfiles import TEMP_PREFIX, file_name, list_tier, open_tier, read_meta
from tests.helpers.processes import ROOT

SEGMENT = 64 * 1024
CONFIG = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT)


def log_records(data: Path) -> list[tuple]:
    """Every record of the CommitLog, read by the CommitLog itself."""
    out = []
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        offset = log.min_offset
        while offset < log.written_offset:
            scanned = log.scan(offset)
            out += [(r.offset, r.store_ms, r.born_ms, r.topic, r.client_id, r.qos, r.retain, r.properties, r.payload)
                    for r in scanned.records]
            offset = scanned.next_offset
    return out


def tier_rows(root: Path) -> list[tuple]:
    table = pq.read_table(root) if any(root.glob("*.parquet")) else None
    if table is None:
        return []
    cols = table.to_pydict()
    return [(o, int(s.timestamp() * 1000), int(b.timestamp() * 1000), t, c, q, r, p, pl) for o, s, b, t, c, q, r, p, pl
            in zip(*(cols[k] for k in ("offset", "store_ts", "born_ts", "topic", "client_id", "qos", "retain",
                                        "properties", "payload")))]


def mixed(n: int) -> list[Msg]:
    """Telemetry plus records with properties, retain and client ids, so every column is exercised."""
    msgs = telemetry(n, bad_every=17)
    return [Msg(m.topic, m.payload, m.store_ms, client_id=m.client_id, qos=m.qos, retain=i % 5 == 0,
                properties=b"\x26\x00\x01k\x00\x01v" if i % 7 == 0 else b"") for i, m in enumerate(msgs)]


def test_sealed_segments_become_one_parquet_file_each_with_every_record(tmp_path: Path) -> None:
    write_log(tmp_path, mixed(4000))
    expected = log_records(tmp_path)
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        converter = TierConverter(log, TierConfig(uri=str(tmp_path / "tier"), cpu_share=1.0, row_group_rows=300))
        converter.open()
        sealed = [s for s in log.segments() if s.sealed]
        assert converter.convert_pending() == len(sealed) > 3
        assert converter.convert_pending() == 0  # exactly once: nothing left to do
        active = log.segments()[-1].base
    files = list_tier(*open_tier(str(tmp_path / "tier")))
    assert [f.base for f in files] == [s.base for s in sealed]
    rows = tier_rows(tmp_path / "tier")
    assert rows == [r for r in expected if r[0] < active]  # the active segment is not converted
    fs, _root = open_tier(str(tmp_path / "tier"))
    meta, parquet = read_meta(fs, files[1].path)
    assert (meta.base, meta.end) == (sealed[1].base, sealed[1].end) and meta.records == parquet.num_rows
    assert parquet.num_row_groups >= 2
    columns = {parquet.row_group(0).column(i).path_in_schema: parquet.row_group(0).column(i)
               for i in range(parquet.num_columns)}
    assert all(c.compression == "ZSTD" for c in columns.values())
    assert columns["store_ts"].statistics.has_min_max and columns["topic"].statistics.has_min_max
    assert columns["store_ts"].physical_type == "INT64"  # a proper timestamp, not INT96
    assert columns["payload"].statistics is None or not columns["payload"].statistics.has_min_max


def test_a_file_uri_and_duckdb_reads_the_tier_directly(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000))
    expected = log_records(tmp_path)
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        converter = TierConverter(log, TierConfig(uri=(tmp_path / "tier").as_uri(), cpu_share=1.0))
        converter.open()
        converter.convert_pending()
        active = log.segments()[-1].base
    sealed = [r for r in expected if r[0] < active]
    got = duckdb.connect().execute(f"SELECT count(*), min(\"offset\"), max(\"offset\"), sum(octet_length(payload)) "
                     f"FROM read_parquet('{tmp_path / 'tier'}/*.parquet')").fetchone()
    assert got == (len(sealed), sealed[0][0], sealed[-1][0], sum(len(r[8]) for r in sealed))


def test_retention_deletes_only_segments_the_tier_holds(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000))
    config = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, retention_max_bytes=SEGMENT)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        converter = TierConverter(log, TierConfig(uri=str(tmp_path / "tier"), cpu_share=1.0))
        converter.open()
        first = log.segments()[0].base
        assert log.delete_expired() == []  # nothing is in the tier yet: retention must keep everything
        assert converter.convert(first)
        assert log.delete_expired() == [first]  # the tier holds it now
        converter.convert_pending()
        assert len(log.delete_expired()) >= 1
        assert [s.sealed for s in log.segments()] == [False]  # all converted, so all could go
        converter.close()


def test_tier_retention_deletes_old_files_once_the_local_copy_is_gone(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(2000))
    config = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, retention_max_bytes=1)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        converter = TierConverter(log, TierConfig(uri=str(tmp_path / "tier"), cpu_share=1.0, retention_hours=1))
        converter.open()
        converter.convert_pending()
        bases = [s.base for s in log.segments() if s.sealed]
        future = int(time.time() * 1000) + 10 * 3_600_000
        local_first = converter.delete_expired(future)
        assert local_first == []  # the local segments are still there
        log.delete_expired()
        assert converter.delete_expired(future) == bases
        assert list_tier(converter.fs, converter.root) == []


def test_a_stopped_conversion_leaves_no_visible_file_and_a_restart_converts_it_once(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000))
    (tmp_path / "tier").mkdir()
    leftover = tmp_path / "tier" / f"{TEMP_PREFIX}{file_name(0)}.dead.part"
    leftover.write_bytes(b"PAR1 half a file")
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        converter = TierConverter(log, TierConfig(uri=str(tmp_path / "tier"), cpu_share=1.0))
        converter.open()
        assert not leftover.exists()  # a crashed conversion's temporary file is cleaned up
        converter.stop()
        assert not converter.convert(0) and list_tier(converter.fs, converter.root) == []
        converter.convert_pending()
        active = log.segments()[-1].base
    assert tier_rows(tmp_path / "tier") == [r for r in log_records(tmp_path) if r[0] < active]


CHILD = """
import sys
from pathlib import Path
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import new_batch
from store.tier import TierConfig, TierConverter
log = CommitLog.open(Path(sys.argv[1]) / "commitlog", CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=1 << 20))
converter = TierConverter(log, TierConfig(uri=sys.argv[2], cpu_share=0.05, row_group_rows=1000))
converter.open()
converter.convert_pending()
"""


@pytest.mark.slow
def test_a_killed_converter_leaves_only_complete_files_and_resumes(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(30_000), segment_bytes=1 << 20)
    tier = tmp_path / "tier"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(tier)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tier.is_dir() and any(p.name.startswith(TEMP_PREFIX) for p in tier.iterdir())):
            assert child.poll() is None and time.monotonic() < deadline, "the child never started a file"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    for path in tier.glob("*.parquet"):  # whatever is visible is complete and readable
        pq.read_metadata(path)
    config = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=1 << 20)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        converter = TierConverter(log, TierConfig(uri=str(tier), cpu_share=1.0))
        converter.open()
        converter.convert_pending()
        active = log.segments()[-1].base
    assert not any(p.name.startswith(TEMP_PREFIX) for p in tier.iterdir())
    expected = [r for r in log_records(tmp_path) if r[0] < active]
    assert tier_rows(tier) == expected and len(expected) > 20_000


async def test_the_store_node_converts_sealed_segments_in_the_background(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    settings = {"tier.uri": str(tier), "tier.check_interval_s": 0.05, "tier.cpu_share": 1.0}
    config = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, flush_interval_ms=10,
                             flush_min_bytes=1)
    async with open_store(tmp_path, config, tier=settings) as store:
        for i in range(40):
            await store.append([NewMessage(f"fleet/d{i % 3}/telemetry", b'{"temp": %d}' % j) for j in range(100)],
                               durable=True)
        sealed = [s.base for s in store.log.log.segments() if s.sealed]
        with trio.fail_after(60):
            while len(list_tier(*open_tier(str(tier)))) < len(sealed):
                await trio.sleep(0.05)
    assert [f.base for f in list_tier(*open_tier(str(tier)))][: len(sealed)] == sealed


def test_control_records_are_not_converted_to_rows(tmp_path: Path) -> None:
    """The store's control records (FLAG_CONTROL) are in the CommitLog between the messages, not messages: the
    tier holds the messages only, and each file's record count says so."""
    messages = mixed(1500)
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        for i, msg in enumerate(messages):
            log.append(encode(msg))
            if i % 4 == 0:
                log.append(encode_control(SessionSaved(f"c{i}", b"blob" * 20), msg.store_ms, SEGMENT)[0])
        log.flush()
    check_converted(tmp_path, [r for r in log_records(tmp_path) if not r[3].startswith("$store/")])


def check_converted(data: Path, expected: list[tuple]) -> None:
    """Convert the sealed segments of the log under ``data``: the tier's rows are the ``expected`` rows of those
    segments, and each file's record count is its rows."""
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        converter = TierConverter(log, TierConfig(uri=str(data / "tier"), cpu_share=1.0))
        converter.open()
        assert converter.convert_pending() > 1
        active = log.segments()[-1].base
    assert tier_rows(data / "tier") == [r for r in expected if r[0] < active]
    fs, root = open_tier(str(data / "tier"))
    for file in list_tier(fs, root):
        meta, parquet = read_meta(fs, file.path)
        assert meta.records == parquet.num_rows


@pytest.mark.parametrize("compress", [False, True])
def test_a_batch_record_becomes_a_row_per_message(tmp_path: Path, compress: bool) -> None:
    """A batch record (docs/storage.md, "Batch records") is one frame of the log and one row per message in the
    tier: each at its position (the record's offset + its index), with its own fields; the record count is rows.
    A compressed body (``FLAG_ZSTD``) makes the same rows."""
    compressed = 0
    expected = []
    with CommitLog.open(tmp_path / "commitlog", CONFIG) as log:
        for n, msg in enumerate(mixed(1200)):
            if n % 2:
                r = log.read(log.append(encode(msg)))
                expected.append((r.offset, r.store_ms, r.born_ms, r.topic, r.client_id, r.qos, r.retain,
                                 r.properties, r.payload))
                continue
            items = [NewMessage(msg.topic, msg.payload + b"%d" % i, client_id=f"c{i}", qos=i % 3, retain=i == 0,
                                born_ms=msg.store_ms - i) for i in range(8)]
            raw = new_batch(msg.topic, items, msg.store_ms, compress=compress)[0]
            compressed += bool(raw[12] & FLAG_ZSTD)
            offset = log.append(raw)
            expected += [(offset + i, msg.store_ms, m.born_ms, msg.topic, m.client_id, m.qos, m.retain, b"",
                          m.payload) for i, m in enumerate(items)]
        log.flush()
    assert compressed > 500 if compress else compressed == 0  # of 600 batches: most save an eighth
    check_converted(tmp_path, expected)
