"""Firing at a rate (store/timer/): messages falling due together go in a few writes, the ends the timer keeps in
memory until its checkpoint are bounded, and the TimerLog is read and patched in blocks."""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path

import pytest
import trio

from store.api import NewMessage
from store.control import TimersFired
from store.log.commitlog import CommitLogConfig
from store.log.record import Record, now_ms
from store.node import StoreNode, open_store
from store.timer import applier, dequeue, timerlog
from store.timer.applier import TimerApplier
from store.timer.checkpoint import TimerCheckpoint, read_checkpoint, write_checkpoint
from store.timer.dequeue import TICK_MS
from store.timer.timerlog import TimerEntry, TimerLog
from tests.helpers.timers import control_record, delayed_record, timers_fired

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)


async def all_fired(node: StoreNode, topic: str, count: int) -> None:
    """Until ``topic``'s queue has ``count`` messages (waits on dispatch progress, never on a clock)."""
    with trio.fail_after(30):
        while node.queues.max_offset(topic) < count:
            await node.dispatcher.wait_dispatched(node.dispatcher.dispatched_offset + 1)


async def test_messages_falling_due_a_millisecond_apart_fire_in_a_few_writes_never_early(tmp_path: Path):
    """1,000 messages due over one second: one write (and TimersFired record) per tick of the dequeue step, not
    one per message or two as each fell due."""
    async with open_store(tmp_path, CONFIG) as node:
        first = now_ms() + 2000
        await node.append([NewMessage("cmd/a", i.to_bytes(4, "big"), "app", 1, deliver_at_ms=first + i)
                           for i in range(1000)])
        await all_fired(node, "cmd/a", 1000)
        records = node.read("cmd/a", 0, max_count=1000).messages
        assert [int.from_bytes(rec.payload, "big") for _, rec in records] == list(range(1000))  # in due order
        assert all(rec.store_ms >= first + int.from_bytes(rec.payload, "big") for _, rec in records)
        fired = timers_fired(node)
        assert sum(len(f.entries) for f in fired) == 1000
        assert len(fired) <= 1000 // TICK_MS + 5


def log_records(node: StoreNode) -> list[Record]:
    """Every record in the log, as stored (a batch record whole), in log order."""
    log = node.log.log
    found, offset = [], log.min_offset
    while offset < log.written_offset:
        scan = log.scan(offset)
        found += scan.records
        offset = scan.next_offset
    return found


async def test_messages_of_one_topic_firing_together_are_one_batch_record_each_read_once_in_due_order(
        tmp_path: Path):
    """Due at the same moment (in the order sent), the messages of two topics (retained and QoS 2 ones among them) fire in one write:
    each topic's run of QoS 0 and 1 messages is one batch record (one record and index entry, not one per message),
    a retained or QoS 2 one a record of its own, and a subscriber of each topic reads every message once, in due
    order, with its client id, QoS and properties ([MQTT-4.6.0-5]: the order per topic is kept)."""
    async with open_store(tmp_path, CONFIG) as node:
        due = now_ms() + 1500
        sent = [NewMessage(f"cmd/{'de'[i % 2]}", i.to_bytes(4, "big"), f"app{i % 3}", 1, properties=b"\x01\x01",
                           deliver_at_ms=due) for i in range(40)]
        sent += [NewMessage("cmd/d", b"kept", "app", 1, retain=True, deliver_at_ms=due),
                 NewMessage("cmd/e", b"two", "app", 2, deliver_at_ms=due)]
        await node.append(sent)
        await all_fired(node, "cmd/d", 21)
        await all_fired(node, "cmd/e", 21)
        (fired,) = timers_fired(node)  # all due within a tick: one write
        assert len(fired.entries) == 42
        for topic, first in (("cmd/d", 0), ("cmd/e", 1)):
            got = [rec for _, rec in node.read(topic, 0, max_count=100).messages]
            assert [rec.payload for rec in got if rec.payload not in (b"kept", b"two")] == \
                [i.to_bytes(4, "big") for i in range(first, 40, 2)]
            assert [(rec.client_id, rec.qos, rec.properties) for rec in got if rec.payload not in (b"kept", b"two")] == \
                [(f"app{i % 3}", 1, b"\x01\x01") for i in range(first, 40, 2)]
            assert [rec.batch_count for rec in log_records(node) if rec.topic == topic and rec.batch_count] == [20]
        assert [(rec.retain, rec.qos) for _, rec in node.read("cmd/d", 0, max_count=100).messages
                if rec.payload == b"kept"] == [(True, 1)]
        assert [rec.qos for _, rec in node.read("cmd/e", 0, max_count=100).messages if rec.payload == b"two"] == [2]


async def test_ends_kept_in_memory_past_a_count_bring_the_checkpoint_forward(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """Entries the timer's checkpoint covers are ended in memory until the next checkpoint: past ``ENDS_FLUSH``
    of them dispatch flushes at once rather than at its 30 s interval, so firing never piles them up."""
    monkeypatch.setattr(applier, "ENDS_FLUSH", 100)
    monkeypatch.setattr(dequeue, "CHUNK", 100)  # the 300 fire in 3 writes: the last one brings a flush too
    async with open_store(tmp_path, CONFIG) as node:
        due = now_ms() + 2000
        await node.append([NewMessage("cmd/b", b"x", "app", 1, deliver_at_ms=due) for _ in range(300)])
    async with open_store(tmp_path, CONFIG) as node:  # reopened: every entry is covered by the checkpoint
        opened_at = node.timers.checkpoint
        await all_fired(node, "cmd/b", 300)
        fired_to = node.log.log.written_offset
        (offset,) = await node.append([NewMessage("cmd/c", b"after", "app", 1)])
        await node.dispatcher.wait_dispatched(offset + 1)  # dispatch's turn after the one that applied the ends
        with trio.fail_after(10):  # well before dispatch's 30 s interval
            while node.timers.checkpoint < fired_to - 1:
                await trio.sleep(0.01)  # polling a condition: the flush runs in a task of its own, and the
                # timer's checkpoint is written by a thread of its own
        assert node.timers.checkpoint > opened_at
        assert node.timers.pending == 0


def test_ends_and_reads_by_block_touch_only_their_entries(tmp_path: Path):
    log = TimerLog(tmp_path / "timerlog")
    made = [TimerEntry(0, 5000 + i, 5_000_000 + i, 100 * i, 100 * i, 0, 50, 7, 9) for i in range(1, 201)]
    for entry in made:
        log.append(entry)
    ends = {1: 11, 2: 12, 3: 13, 70: 170, 140: 240, 200: 300}
    log.write_ends(ends)
    log.ends = {5: 105}  # an end kept in memory (covered by the last checkpoint) is applied to what is read
    wanted = [1, 2, 3, 4, 5, 70, 139, 140, 199, 200]
    expected = [made[pos - 1]._replace(done_at=ends.get(pos, 105 if pos == 5 else 0)) for pos in wanted]
    assert log.read_many(wanted) == expected
    assert [entry for _, entry in log.entries()] == [made[pos - 1]._replace(done_at=ends.get(pos, log.ends.get(pos, 0)))
                                                     for pos in range(1, 201)]
    log.close()


def test_a_slots_entries_read_in_file_order_skip_those_of_other_slots(tmp_path: Path):
    """Chains interleaved in the TimerLog (two seconds, and a later revolution of the first one's slot): each
    slot gives its own entries in the order they were placed, whether read in blocks or walked."""
    timers = TimerApplier(tmp_path, window_s=100)
    offset = 0
    for i in range(30):
        for second in (5000, 5001, 5100):
            offset += 10
            timers.apply(*delayed_record(offset, second * 1000 + i, store_ms=5_001_000))
    for i in range(50):  # then a long run of another second: the next entry of 5000 is far from the others
        offset += 10
        timers.apply(*delayed_record(offset, 5_002_000 + i, store_ms=5_001_000))
    offset += 10
    timers.apply(*delayed_record(offset, 5_000_999, store_ms=5_001_000))
    got = {second: [(e.due_ms // 1000, e.due_ms % 1000) for _, e in timers.due_entries(second)]
           for second in (5000, 5001, 5002)}
    assert got[5000] == [(s, i) for i in range(30) for s in (5000, 5100)] + [(5000, 999)]
    assert got[5001] == [(5001, i) for i in range(30)] and got[5002] == [(5002, i) for i in range(50)]
    timers.close()


def blocked_checkpoints(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> threading.Event:
    """Checkpoint files are written only once the returned event is set (then, with ``fail``, not at all: a full
    disk)."""
    release = threading.Event()
    write = applier.write_checkpoint

    def blocked(path: Path, checkpoint: TimerCheckpoint) -> None:
        release.wait()
        if fail:
            raise OSError(errno.ENOSPC, "no space left on device")
        write(path, checkpoint)

    monkeypatch.setattr(applier, "write_checkpoint", blocked)
    return release


def three_pending_one_ended(directory: Path) -> TimerApplier:
    """Entries at 10 and 20 (second 5,000) and 30 (second 5,001), checkpointed at 40; the first ended at 50."""
    timers = TimerApplier(directory, window_s=100)
    for offset, due in ((10, 5_000_000), (20, 5_000_000), (30, 5_001_000)):
        timers.apply(*delayed_record(offset, due))
    timers.flush(40)
    timers.settle()
    fired = TimersFired([(10, 1, 5_000_000)])
    timers.apply(control_record(50, fired), fired)
    return timers


def test_a_slot_read_in_slices_gives_its_entries_and_holds_the_lock_only_while_a_slice_is_read(tmp_path: Path):
    """The dequeue step reads a second's slot a slice at a time, between other steps of the event loop: whether the
    chain is walked (5000: an entry every sixth) or read in blocks (5001), the slices give the slot's pending
    entries once each, and a record applied between two slices (dispatch, in the same thread) is not held up (a
    lock held across slices would deadlock here) and is not given (it is the next turn's: ``take_low``)."""
    timers = TimerApplier(tmp_path, window_s=100)
    offset = 0
    for i in range(10):
        offset += 10
        timers.apply(*delayed_record(offset, 5_000_000 + i, store_ms=5_001_000))
        for j in range(5):
            offset += 10
            timers.apply(*delayed_record(offset, 5_001_000 + i * 5 + j, store_ms=5_001_000))
    for second, count in ((5000, 10), (5001, 50)):
        whole = timers.due_entries(second)
        sliced = timers.due_slices(second, 4)
        got = next(sliced)
        timers.take_low()
        offset += 10
        timers.apply(*delayed_record(offset, second * 1000 + 999, store_ms=5_001_000))  # between two slices
        for found in sliced:
            assert len(found) <= 4
            got += found
        assert sorted(got) == whole and len(whole) == count
        assert timers.take_low() == second and timers.due_entries(second)[-1][1].offset_real == offset
    timers.close()


async def test_a_second_read_in_many_slices_fires_in_due_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """300 messages due within one second, scheduled latest first, read 16 to a slice: each slice is sorted on its
    own and the runs merged as the batches fire, so they go in due order (log order for equal due times), once."""
    monkeypatch.setattr(dequeue, "SLICE", 16)
    async with open_store(tmp_path, CONFIG) as node:
        first = (now_ms() // 1000 + 3) * 1000  # all in one wheel second
        dues = [first + (299 - i) // 2 * 6 for i in range(300)]  # latest first, two at each due time
        await node.append([NewMessage("cmd/a", i.to_bytes(4, "big"), "app", 1, deliver_at_ms=due)
                           for i, due in enumerate(dues)])
        await all_fired(node, "cmd/a", 300)
        records = node.read("cmd/a", 0, max_count=1000).messages
        got = [int.from_bytes(rec.payload, "big") for _, rec in records]
        assert got == sorted(range(300), key=lambda i: (dues[i], i))
        assert sum(len(f.entries) for f in timers_fired(node)) == 300
        assert all(rec.store_ms >= dues[int.from_bytes(rec.payload, "big")] for _, rec in records)


def test_dispatch_applies_on_while_a_checkpoint_is_written_and_the_files_never_run_ahead_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A checkpoint's files are written by a thread of its own (writing 100,000 ends held dispatch for a quarter
    of a second): ``flush`` returns at once, the records applied meanwhile are read back right, and an end applied
    meanwhile is the next checkpoint's, not in the files: reopened as after a crash, the timer is at the
    checkpoint."""
    timers = three_pending_one_ended(tmp_path)
    release = blocked_checkpoints(monkeypatch)
    flushing = threading.Thread(target=timers.flush, args=(60,))
    flushing.start()
    flushing.join(10)
    try:
        assert not flushing.is_alive()  # dispatch did not wait for the files
        fired = TimersFired([(20, 2, 5_000_000)])
        timers.apply(control_record(70, fired), fired)  # an entry the checkpoint being written covers
        timers.apply(*delayed_record(80, 5_000_500))  # a new one, in the slot whose ends are being written
        assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [80]
        assert [entry.offset_real for _, entry in timers.due_entries(5_001)] == [30]
        assert timers.pending == 2 and timers.checkpoint == 40  # not written yet
    finally:
        release.set()
    timers.settle()
    assert timers.checkpoint == 60
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [80]
    timers.close()  # no flush: the crash
    timers = TimerApplier(tmp_path, window_s=100)
    assert timers.checkpoint == 60 and timers.pending == 2  # 20 and 30: the end at 70 and the entry at 80 are after
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [20]
    timers.close()


def test_a_checkpoint_that_could_not_be_written_leaves_its_changes_to_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    timers = three_pending_one_ended(tmp_path)
    blocked_checkpoints(monkeypatch, fail=True).set()
    timers.flush(60)
    timers.settle()
    assert timers.checkpoint == 40  # logged, not moved
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [20]
    monkeypatch.undo()
    timers.flush(60)
    timers.settle()
    timers.close()
    timers = TimerApplier(tmp_path, window_s=100)
    assert timers.checkpoint == 60 and timers.pending == 2
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [20]
    timers.close()


def made_entries(log: TimerLog, count: int) -> list[TimerEntry]:
    """``count`` entries appended to ``log``, each field distinct from its neighbours' (a patch that spills over a
    field or an entry shows)."""
    made = [TimerEntry(i, 5000 + i, 5_000_000 + 7 * i, 100 * i, 100 * i + 1, 0, 50 + i, 3 * i, (1 << 63) + i)
            for i in range(1, count + 1)]
    for entry in made:
        log.append(entry)
    return made


@pytest.mark.parametrize("order", ["file", "shuffled"])
def test_ends_written_in_slices_and_blocks_patch_their_entries_only_in_any_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str):
    """A checkpoint's ends go into the TimerLog a few sorted at a time and a block at a time (the writer's thread
    holds the GIL in short stretches, timerlog.py ``SORT_SLICE``, ``WRITE_BLOCK``): runs of ended entries across
    blocks (patched by one strided copy each), dense and sparse ones, the first and the last entry, given in file
    order (firing in due order) or in none. Each entry's ``done_at`` is the one given, every other byte as it was,
    and a checkpoint records the same ends."""
    monkeypatch.setattr(timerlog, "SORT_SLICE", 7)
    monkeypatch.setattr(timerlog, "WRITE_BLOCK", 16)
    log = TimerLog(tmp_path / "timerlog")
    made = made_entries(log, 500)
    wanted = [1, *range(10, 81), *range(100, 161, 2), *range(170, 200, 3), 260, 330, 331, 395, 460, 500]
    if order == "shuffled":
        random.Random(28).shuffle(wanted)
    ends = {pos: (1 << 62) + 1000 * pos for pos in wanted}
    log.write_ends(ends)
    assert [entry for _, entry in log.entries()] == [entry._replace(done_at=ends.get(pos, 0))
                                                     for pos, entry in enumerate(made, 1)]
    write_checkpoint(tmp_path / "checkpoint", TimerCheckpoint(9, 500, 1, 5001, 100, {0: 1}, {5: 1}, {}, ends))
    found = read_checkpoint(tmp_path / "checkpoint")
    assert found is not None and list(found.ends.items()) == list(ends.items())
    log.close()


def test_ends_checkpointed_in_no_order_are_in_the_files_after_a_restart(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """The timer's checkpoint writer puts ends applied in no file order (messages scheduled in no due order) into
    the TimerLog: reopened, the timer has the same pending entries, slots and counts, reading them from the files
    alone."""
    monkeypatch.setattr(timerlog, "SORT_SLICE", 5)
    monkeypatch.setattr(timerlog, "WRITE_BLOCK", 8)
    timers = TimerApplier(tmp_path, window_s=100)
    dues = [5_000_000 + random.Random(7).randrange(3000) for _ in range(120)]
    for i, due in enumerate(dues):
        timers.apply(*delayed_record(10 * (i + 1), due, store_ms=4_999_000))
    timers.flush(2000)
    timers.settle()
    fired = sorted(range(120), key=lambda i: dues[i])[:90]  # in due order: positions in no order
    for n, start in enumerate(range(0, 90, 20)):
        record = TimersFired([(10 * (i + 1), i + 1, dues[i]) for i in fired[start:start + 20]])
        timers.apply(control_record(3000 + 10 * n, record), record)
    timers.flush(4000)
    timers.settle()
    before = {second: timers.due_entries(second) for second in (5000, 5001, 5002)}
    timers.close()
    timers = TimerApplier(tmp_path, window_s=100)
    assert timers.checkpoint == 4000 and timers.pending == 30 and timers.entries_read == 0
    assert {second: timers.due_entries(second) for second in (5000, 5001, 5002)} == before
    assert sorted(entry.offset_real for found in before.values() for _, entry in found) == \
        sorted(10 * (i + 1) for i in set(range(120)) - set(fired))
    ended = {pos: entry.done_at for pos, entry in TimerLog(tmp_path / "timerlog").entries()}  # the file alone
    assert sorted(pos for pos, done_at in ended.items() if done_at) == sorted(i + 1 for i in fired)
    timers.close()
