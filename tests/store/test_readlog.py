"""``StoreApi.read_log`` (CommitLog.read_span; the RPC's ReadLog): the log's raw bytes, the same through the
in-process and the RPC client, framed back into exactly the records the CommitLog's own scan returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from store.api import MAIN_LOG, NewMessage, Position
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.log.errors import OffsetExpired
from store.node import open_store
from store.log.record import decode_record
from store.rpc.client import RemoteStore
from store.rpc.server import serve_rpc

SEGMENT = 16 * 1024


async def read_all(client, chunk: int) -> list[tuple[int, bytes]]:
    """Every record from the log's start to its flushed end, framed from read_log's bytes alone."""
    first = await client.read_log(Position(MAIN_LOG, 0), 0)
    offset, out = first.min_offset, []
    while offset < first.flushed:
        span = await client.read_log(Position(MAIN_LOG, offset), chunk)
        offset = span.start
        pos = 0
        while pos + 4 <= len(span.data):
            size = int.from_bytes(span.data[pos : pos + 4], "big")
            if size == 0 or pos + size > len(span.data):
                break
            record = decode_record(span.data, pos, offset + pos)
            out.append((record.offset, record.payload))
            pos += size
        assert pos or span.start + len(span.data) == span.data_end, "no progress"
        offset += pos
    return out


async def test_both_clients_read_the_whole_log_as_the_commitlog_scans_it(tmp_path: Path, nursery) -> None:
    config = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, retention_max_bytes=SEGMENT,
                             retention_check_interval_s=0)  # retention runs only when the test calls it
    async with open_store(tmp_path, config) as store:
        for i in range(30):
            await store.append([NewMessage(f"a/{j}", b"x" * (j * 7 % 300)) for j in range(20)], durable=True)
        log = store.log.log
        expected, offset = [], 0
        while offset < log.written_offset:
            scanned = log.scan(offset)
            expected += [(r.offset, r.payload) for r in scanned.records]
            offset = scanned.next_offset
        assert len({s.base for s in log.segments()}) >= 5
        local = LocalStore(store, "reader")
        try:
            assert await read_all(local, 1000) == expected  # small reads: records cut at the end of a span
        finally:
            local.close()
        listeners = await nursery.start(lambda task_status: serve_rpc(store, "127.0.0.1", 0, task_status=task_status))
        port = listeners[0].socket.getsockname()[1]
        async with RemoteStore.connect("127.0.0.1", port, node="reader") as remote:
            assert await read_all(remote, 1 << 20) == expected
            with pytest.raises(ValueError, match="beyond the flushed end"):
                await remote.read_log(Position(MAIN_LOG, log.flushed_offset + 1), 10)
            await trio.to_thread.run_sync(log.delete_expired)
            with pytest.raises(OffsetExpired):
                await remote.read_log(Position(MAIN_LOG, 0), 10)
            bounds = await remote.read_log(Position(MAIN_LOG, 0), 0)  # bounds only: any offset
            assert (bounds.data, bounds.min_offset, bounds.flushed) == (b"", log.min_offset, log.flushed_offset) \
                and bounds.min_offset > 0
