"""Rebuilding a damaged index from the CommitLog (``lightgate repair``), over a real CommitLog and RocksDB: the
rebuilt index is the one dispatch wrote, entry for entry, whatever subset of the keys RocksDB's repair kept."""

from __future__ import annotations

import pytest

from lightqueue import keys
from lightqueue.queues import LightQueues
from lightqueue.reindex import forget_derived
from store.dispatch import Dispatcher
from tests.helpers.dispatch import SEGMENT, Node, decode

TOPICS = ["s/1", "s/2", "a/b/c", "a/x/c", "t"]


def build(tmp_path) -> tuple[dict[bytes, bytes], int]:
    """A node's index after retention cut its log (queue minimum offsets above 0) and a filter activated late;
    returns the index, runs expanded, and the id of ``s/1``'s queue."""
    n = Node(tmp_path, controls=False, retention_hours=0, retention_max_bytes=4 * SEGMENT)
    try:
        n.lq.activate("s/+", "h1", 0)
        for round in range(12):
            if round == 9:
                n.lq.activate("a/+/c", "h2", n.log.written_offset)
            n.append(*(TOPICS * 40), payload=b"x" * 500)
            while n.dispatcher.dispatch_once() is not None:
                pass
            n.log.delete_expired()
        assert n.lq.min_offset("t") > 0 and n.lq.min_offset("s/+") > 0
        return readable(n.dump()), n.lq.queue_id("s/1")
    finally:
        n.close()


def readable(dump: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The index without the entries below their queue's minimum offset: retention keeps the run that holds the
    minimum whole, and pulls skip those entries (a rebuild does not write them again)."""
    low = {key[1:]: keys.U64.unpack(value)[0] for key, value in dump.items() if key[:1] == b"m"}
    return {key: value for key, value in dump.items()
            if key[:1] != b"E" or keys.U64.unpack_from(key, 9)[0] >= low.get(key[1:9], 0)}


def rebuilt(tmp_path, lose) -> tuple[Node, dict]:
    """Delete what ``lose(db)`` deletes (as RocksDB's repair drops a table's keys), then rebuild as the repair does."""
    n = Node(tmp_path, controls=False)
    lose(n.db)
    figures = forget_derived(n.db, n.log.min_offset, n.log.written_offset)
    n.lq = LightQueues(n.db)
    n.dispatcher = Dispatcher(n.log, n.lq)
    n.dispatcher.recover()
    return n, figures


def delete_prefix(db, prefix: bytes) -> None:
    db.delete_range(prefix, keys.prefix_end(prefix))


@pytest.mark.parametrize("lost", [b"E", b"C", b"M", b"EMC"], ids=["entries", "checkpoint", "max", "all-derived"])
def test_lost_derived_keys_are_written_again_at_their_original_queue_offsets(tmp_path, lost):
    before, _ = build(tmp_path)
    n, _ = rebuilt(tmp_path, lambda db: [delete_prefix(db, bytes([kind])) for kind in lost])
    try:
        assert readable(n.dump()) == before
    finally:
        n.close()


def test_half_lost_ids_and_a_lost_activation_are_restored_and_the_entries_rebuilt(tmp_path):
    before, s1 = build(tmp_path)

    def lose(db):
        delete_prefix(db, b"E")
        db.delete(keys.name_key("s/1"))  # its id survives in Q
        db.delete(keys.id_key(keys.U64.unpack(db.get(keys.name_key("t")))[0]))  # its name survives in N
        db.delete(keys.active_key("a/+/c"))  # its queue is still named: it was active
        db.delete(keys.NEXT_ID)

    n, figures = rebuilt(tmp_path, lose)
    try:
        assert figures["ids_restored"] == 2 and figures["filters_reactivated"] == 1
        after = readable(n.dump())
        # The filter is active since the log's start now: the records listing its id are those appended while
        # it was active, so its entries are the same.
        assert after.pop(keys.active_key("a/+/c")) == keys.U64.pack(0)
        before.pop(keys.active_key("a/+/c"))
        assert after == before
        assert n.lq.queue_id("s/1") == s1
    finally:
        n.close()


def test_an_activation_whose_queue_id_is_lost_gets_a_new_queue_from_the_logs_end(tmp_path):
    build(tmp_path)

    def lose(db):
        qid = keys.U64.unpack(db.get(keys.name_key("s/+")))[0]
        db.delete(keys.name_key("s/+"))
        db.delete(keys.id_key(qid))

    n, figures = rebuilt(tmp_path, lose)
    try:
        assert figures["filters_with_new_ids"] == 1
        assert n.lq.max_offset("s/+") == 0  # the records listing the lost id cannot be told apart
        n.append("s/1", "t")
        n.dispatcher.dispatch_once()
        messages = n.lq.pull("s/+", 0, 10, 1 << 20, n.log, decode).messages
        assert [m.topic for _, m in messages] == ["s/1"]  # what comes next reaches the filter
    finally:
        n.close()
