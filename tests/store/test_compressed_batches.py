"""Compressed batch bodies (docs/storage.md, "Compressed batch bodies") through every reader of a store node: real
CommitLogs and RocksDB, the node closed and opened again so reads come from the disk, not the records kept in
memory."""

from __future__ import annotations

from pathlib import Path

from store.api import NewMessage, PullRequest, group_owner
from store.dump import dump
from store.local import LocalStore
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_ZSTD, decode_record, new_batch
from store.node import open_store
from store.repair import repair
from tests.helpers.batches import readings, zstd_batch

ZSTD = CommitLogConfig(batch_compression="zstd")
OFF = CommitLogConfig(batch_compression="off")


def batch(topic: str, count: int, seed: int, **fields) -> list[NewMessage]:
    return [NewMessage(topic, p, client_id=f"dev-{i % 3}", qos=1, **fields) for i, p in enumerate(readings(count, seed))]


async def append(data: Path, config: CommitLogConfig, batches: list[list[NewMessage]]) -> list[int]:
    """Append each batch as batch records (``append(batch=True)``), wait until indexed; the positions of all."""
    async with open_store(data, config) as node:
        store = LocalStore(node, "writer")
        positions = []
        for messages in batches:
            positions += (await store.append(messages, batch=True)).offsets
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        store.close()
    return positions


def stored_flags(data: Path) -> list[int]:
    """The flags of every record of the log, as stored."""
    with CommitLog.open(data / "commitlog", OFF) as log:
        return [r.flags for r in log.scan(0).records]


async def test_every_reader_of_a_restarted_node_gets_the_messages_of_compressed_batches(tmp_path):
    sent = [batch("tele/a", 40, 1), batch("tele/a", 40, 2, retain=True)]
    positions = await append(tmp_path, ZSTD, sent)
    assert all(flags & FLAG_ZSTD for flags in stored_flags(tmp_path))
    expected = [(q, positions[q], m.payload, m.client_id) for q, m in enumerate(sent[0] + sent[1])]
    async with open_store(tmp_path, ZSTD) as node:
        store = LocalStore(node, "reader")
        [pulled] = await store.pull([PullRequest("tele/a", 0, 100)])
        assert [(q, r.offset, r.payload, r.client_id) for q, r in pulled.messages] == expected
        [raw] = await store.pull_raw([PullRequest("tele/a", 0, 100)])  # the RPC's form: a batch record whole
        assert [(q + i, message.payload) for q, (offset, data, first, stop) in raw.messages
                for i, message in enumerate(decode_record(data, 0, offset).messages[first:stop], first)] == [
            (q, payload) for q, _, payload, _ in expected]
        group = group_owner("g")
        await store.join(group, "tele/a", "m1", start="earliest")
        claimed = await store.claim(group, "tele/a", "m1", 100)
        assert [(q, r.payload) for q, r in claimed.messages] == [(q, p) for q, _, p, _ in expected]
        popped = await store.pop(group_owner("p"), "tele/a", "m2", 100, invisible_s=30, start="earliest")
        assert [(p.offset, p.record.payload) for p in popped] == [(q, p) for q, _, p, _ in expected]
        [retained] = await store.retained("tele/a")  # the last retained message of the second batch
        assert (retained.offset, retained.payload) == (positions[-1], sent[1][-1].payload)
        store.close()


async def test_raw_batches_written_before_compression_was_switched_on_are_still_read(tmp_path):
    old = await append(tmp_path, OFF, [batch("tele/b", 30, 3)])
    new = await append(tmp_path, ZSTD, [batch("tele/b", 30, 4)])
    assert [bool(flags & FLAG_ZSTD) for flags in stored_flags(tmp_path)] == [False, True]
    async with open_store(tmp_path, ZSTD) as node:
        [pulled] = await LocalStore(node, "reader").pull([PullRequest("tele/b", 0, 100)])
    assert [(r.offset, r.payload) for _, r in pulled.messages] == list(
        zip(old + new, readings(30, 3) + readings(30, 4)))


async def test_a_compressed_batch_that_does_not_inflate_costs_that_batch_only(tmp_path):
    """Its frame and CRC are right, its body is not a zstd frame: dispatch skips it like a CRC-bad record; a repair
    (the index derived again from the log) makes the same index."""
    with CommitLog.open(tmp_path / "commitlog", ZSTD) as log:
        first = log.append(new_batch("tele/c", batch("tele/c", 10, 5), 1, compress=True)[0])
        log.append(zstd_batch("tele/c", b"\x28\xb5\x2f\xfd garbage", 2))
        last = log.append(new_batch("tele/c", batch("tele/c", 10, 6), 3, compress=True)[0])
    async with open_store(tmp_path, ZSTD) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        [pulled] = await LocalStore(node, "reader").pull([PullRequest("tele/c", 0, 100)])
    assert [(r.offset, r.payload) for _, r in pulled.messages] == list(
        zip([first + i for i in range(10)] + [last + i for i in range(10)], readings(10, 5) + readings(10, 6)))
    before = dump(tmp_path / "index")
    repair(tmp_path, ZSTD)
    assert dump(tmp_path / "index") == before
