"""Dispatch's flush (store/dispatch.py, ``Dispatcher._flush``) over a real CommitLog and RocksDB: the steps go on
while RocksDB writes the flush's memtables, and a crash image taken meanwhile opens to a consistent index.

RocksDB's background threads are held (tests/helpers/rocksdb_held.py), so the flush waits inside RocksDB for as
long as the test needs: what a flush of a large memtable on a busy disk does for hundreds of ms.
"""

import shutil
import threading
import time

import trio

from lightqueue.queues import LightQueues
from retain.store import RetainedStore
from store.control import Activated, Committed, Delayed, TimersFired, encode_control
from store.dispatch import Dispatcher
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import decode_record, encode_record
from store.queuecontrol import QueueControls
from store.rocks import open_db
from store.timer import applier
from store.timer.applier import TimerApplier
from tests.helpers.dispatch import SEGMENT, Node, decode, dump
from tests.helpers.powerloss import lose_unflushed_tail
from tests.helpers.rocksdb_held import flushes_held, unwritten

WAIT_S = 20.0
"""A guard against a step stuck behind the flush, not a timing: each wait ends as soon as its condition holds."""


async def test_dispatch_indexes_new_records_while_its_flush_waits_for_rocksdb(tmp_path):
    n = Node(tmp_path)
    n.dispatcher = Dispatcher(n.log, n.lq, flush_bytes=1, activations=QueueControls(n.lq))  # a flush per step
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(n.dispatcher.run)
            with flushes_held():
                n.append("a/1")
                first = n.log.written_offset
                n.dispatcher.wake()
                with trio.fail_after(WAIT_S):
                    while not unwritten(n.db):  # the flush switched the index memtable and waits for RocksDB
                        await trio.sleep(0.01)
                n.append("a/2", "b/1")
                n.dispatcher.wake()
                with trio.fail_after(WAIT_S):  # before: the run loop waited for the whole flush
                    await n.dispatcher.wait_dispatched(n.log.written_offset)
                assert n.lq.max_offset("a/2") == n.lq.max_offset("b/1") == 1
                assert unwritten(n.db) and n.dispatcher.statistics().flushed_offset < first  # still in RocksDB
            with trio.fail_after(WAIT_S):
                while n.dispatcher.statistics().flushed_offset < n.log.written_offset:
                    await trio.sleep(0.01)  # the first flush took its checkpoint at ``first``; the next one the rest
            nursery.cancel_scope.cancel()
    finally:
        n.close()


class RetainingNode:
    """A CommitLog, light queues, retained messages and the queues' control records, flushing after every step."""

    def __init__(self, path):
        self.log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT))
        self.db = open_db(path / "index")
        self.lq = LightQueues(self.db)
        self.retained = RetainedStore(self.db)
        self.dispatcher = Dispatcher(self.log, self.lq, retained=self.retained, flush_bytes=1,
                                     activations=QueueControls(self.lq))

    def publish(self, topic, payload, retain=False):
        return self.log.append(encode_record(topic, payload, retain=retain, queues=self.lq.targets(topic)))

    def control(self, control):
        return self.log.append_batch([encode_control(control, 0, SEGMENT)[0]])

    def dispatch_all(self):
        while self.dispatcher.dispatch_once() is not None:
            pass

    def payloads(self, queue):
        pulled = self.lq.pull(queue, 0, 1000, 1 << 20, self.log, decode)
        return [(m.topic, m.payload) for _, m in pulled.messages]

    def retained_payloads(self):
        return {r.topic: decode_record(r.record, 0, r.log_offset).payload for r in self.retained.lookup("#")}

    def close(self):
        self.dispatcher.close()
        self.retained.close()
        self.db.close()
        self.log.close()


def test_a_crash_image_taken_while_a_flush_waits_for_rocksdb_opens_to_a_consistent_index(tmp_path):
    """Power loss in the middle of a flush: the log keeps what was fsynced, RocksDB what it had written. Dispatch
    went on meanwhile (before, its step waited for the flush); the image opens with no part past the log's end,
    every acknowledged (fsynced) message indexed, every entry pointing at its record, and the same index a rebuild
    from its log derives."""
    live, image = tmp_path / "live", tmp_path / "image"
    n = RetainingNode(live)
    acked = []
    try:
        n.control(Activated("a/+", "s1", n.lq.filter_id("a/+")))
        n.dispatch_all()
        for i in range(5):
            n.publish("a/x", b"m%d" % i)
            acked.append(("a/x", b"m%d" % i))
        n.publish("cfg/a", b"1", retain=True)
        n.dispatch_all()  # flushed: the index on disk is at the log's end so far
        with flushes_held():
            for i in range(5, 10):
                n.publish("a/x", b"m%d" % i)
                acked.append(("a/x", b"m%d" % i))
            n.publish("cfg/a", b"2", retain=True)
            n.control(Committed("s1", {"a/+": 3}))
            n.log.flush()  # acknowledged, as under the sync policy
            flushing = threading.Thread(target=n.dispatcher.dispatch_once)  # its step, then its flush: held
            flushing.start()
            deadline = time.monotonic() + WAIT_S
            while not unwritten(n.db) and time.monotonic() < deadline:
                time.sleep(0.01)  # polling a condition: the flush switched the index memtable, waits for RocksDB
            assert flushing.is_alive() and unwritten(n.db)
            for i in range(10, 15):
                n.publish("a/x", b"m%d" % i)
                acked.append(("a/x", b"m%d" % i))
            n.publish("cfg/b", b"3", retain=True)
            n.log.flush()
            n.publish("a/x", b"lost")  # in the page cache only: a power loss takes it
            stepping = threading.Thread(target=n.dispatcher.dispatch_once)
            stepping.start()
            stepping.join(WAIT_S)
            assert not stepping.is_alive(), "a dispatch step waited for the flush"
            assert n.lq.max_offset("a/x") == 16  # indexed, the last only in the memtable
            shutil.copytree(live, image)  # the disk as it is now (the memtables are in memory only)
        flushing.join(WAIT_S)
        assert not flushing.is_alive()
    finally:
        n.close()
    lose_unflushed_tail(image / "commitlog")

    shutil.copytree(image, tmp_path / "rebuilt")
    shutil.rmtree(tmp_path / "rebuilt" / "index")
    dumps = []
    for path in (image, tmp_path / "rebuilt"):
        n = RetainingNode(path)
        try:
            assert n.dispatcher.recover() == {}  # nothing derived was past the log's end
            assert n.payloads("a/x") == acked and n.payloads("a/+") == acked
            assert n.retained_payloads() == {"cfg/a": b"2", "cfg/b": b"3"}
            assert n.lq.get_offsets("s1") == {"a/+": 3}
            dumps.append((dump(n.db), n.retained_payloads()))
        finally:
            n.close()
    assert dumps[0] == dumps[1]


def test_the_timers_early_checkpoint_is_taken_alone_with_the_log_durable_up_to_it(tmp_path, monkeypatch):
    """Ends the timer keeps in memory past ``ENDS_FLUSH`` ask for its checkpoint before dispatch's interval
    (``EarlyCheckpoint``): the timer alone takes its state at the dispatched offset, and its writer makes the log
    durable up to there before writing it; the index's memtable is not switched (no table for RocksDB to write
    and compact: RocksDB's threads are held here, so one switched would stay unwritten) and dispatch's flushed
    offset stays where it was. Opened again without a flush (a crash), the timer is at that checkpoint."""
    monkeypatch.setattr(applier, "ENDS_FLUSH", 3)
    n = Node(tmp_path)
    timers = TimerApplier(tmp_path / "timer", window_s=100, log=n.log)
    n.dispatcher = Dispatcher(n.log, n.lq, activations=QueueControls(n.lq), appliers=[timers], flush_bytes=1)
    n.control(*(Delayed("c", "t", 5_000_000 + i, b"x") for i in range(5)))
    n.append("a/1")
    while n.dispatcher.dispatch_once() is not None:
        pass  # flushed after each step: the checkpoint covers the entries, whose ends then wait in memory
    assert timers.checkpoint == n.log.written_offset and timers.pending == 5
    n.dispatcher = Dispatcher(n.log, n.lq, activations=QueueControls(n.lq), appliers=[timers], early=timers)
    flushed = n.dispatcher.statistics().flushed_offset
    n.control(TimersFired([(entry.offset_real, pos, entry.due_ms) for pos, entry in timers.due_entries(99)[:3]]))
    n.append("a/2")
    try:
        with flushes_held():
            while n.dispatcher.dispatch_once() is not None:
                pass
            assert timers.checkpoint == n.log.written_offset and timers.pending == 2
            assert n.log.flushed_offset >= timers.checkpoint
            assert unwritten(n.db) == 0 and n.dispatcher.statistics().flushed_offset == flushed
    finally:
        timers.close()  # no flush: the crash
        n.db.close()
        n.log.close()
    timers = TimerApplier(tmp_path / "timer", window_s=100)
    assert timers.checkpoint > flushed and timers.pending == 2
    timers.close()
