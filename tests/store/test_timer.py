"""Delayed delivery in the store (store/timer/): the Delayed record, the TimerLog and wheel derived from the log, the
dequeue step re-appending each due message once, rolls beyond the window, restarts, and the retention guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from store.api import NewMessage
from store.control import Delayed, TimersFired, decode_control
from store.dump import dump
from store.log.commitlog import CommitLogConfig
from store.log.record import now_ms
from store.node import StoreNode, open_store
from store.timer.applier import TimerApplier
from store.timer.dequeue import CHUNK
from tests.helpers.processes import ROOT
from tests.helpers.timers import control_record, delayed_record, timers_fired

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)


async def delivered(node: StoreNode, topic: str, count: int, timeout: float = 15) -> list:
    """The messages of ``topic``'s queue once it has ``count`` (waits on dispatch progress, never on a clock)."""
    with trio.fail_after(timeout):
        while node.queues.max_offset(topic) < count:
            await node.dispatcher.wait_dispatched(node.dispatcher.dispatched_offset + 1)
    return [record for _, record in node.read(topic, 0, max_count=count + 10).messages]


def fired_entries(node: StoreNode) -> list[int]:
    """The Delayed offsets named by every TimersFired record in the log."""
    return [entry[0] for fired in timers_fired(node) for entry in fired.entries]


async def test_a_delayed_message_is_delivered_to_its_topic_at_its_due_time_and_only_then(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as node:
        due = now_ms() + 1500
        (offset,) = await node.append([NewMessage("cmd/dev-1", b"off", "app", 1, True, b"", 0, 0, due)])
        await node.append([NewMessage("cmd/dev-1", b"now", "app", 1)])
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 1 and node.timers.pending_of("app") == 1 and node.timers.pending_of("x") == 0
        assert [rec.payload for _, rec in node.read("cmd/dev-1", 0).messages] == [b"now"]  # not delivered early
        (_, late) = await delivered(node, "cmd/dev-1", 2)
        assert now_ms() >= due and late.payload == b"off"
        assert (late.client_id, late.qos, late.retain, late.topic) == ("app", 1, True, "cmd/dev-1")
        assert late.store_ms >= due  # Message Expiry counts from the store time of this record: the due time
        assert node.queues.max_offset("$store/delayed") == 0  # the system queue itself is never a topic
        assert node.timers.pending == 0 and node.timers.pending_of("app") == 0
        assert fired_entries(node) == [offset]


async def test_messages_due_while_the_node_was_down_go_at_once_in_due_order_and_once(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as node:
        now = now_ms()
        dues = [now + 1200, now + 1100, now + 1300, now + 600_000]  # the last stays pending
        await node.append([NewMessage("t", b"%d" % i, "c", 1, deliver_at_ms=d) for i, d in enumerate(dues)])
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 4
    with trio.fail_after(10):
        while now_ms() < now + 1300:
            await trio.sleep(0.05)  # the clock must pass the dues while the node is closed: this is the condition
    async with open_store(tmp_path, CONFIG) as node:
        assert node.timers.pending == 4  # rebuilt from the TimerLog and its checkpoint
        got = await delivered(node, "t", 3)
        assert [r.payload for r in got] == [b"1", b"0", b"2"]
        assert node.timers.pending == 1
    async with open_store(tmp_path, CONFIG) as node:  # and never again
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 1 and node.queues.max_offset("t") == 3


async def test_a_message_due_beyond_the_window_rolls_and_still_goes_at_its_due_time(tmp_path: Path):
    async with open_store(tmp_path, CONFIG, timer_window_s=2) as node:
        due = now_ms() + 3500  # beyond a 2-second window: placed in its last slot, then rolled
        await node.append([NewMessage("r", b"rolled", "c", deliver_at_ms=due)])
        (late,) = await delivered(node, "r", 1)
        assert now_ms() >= due and late.payload == b"rolled"
        assert node.timers.rolled >= 1 and node.timers.pending == 0


async def test_retention_keeps_every_segment_a_pending_entry_points_into(tmp_path: Path):
    config = CommitLogConfig(segment_bytes=64 << 10, max_record_bytes=16 << 10, retention_hours=0,
                             retention_max_bytes=64 << 10)
    async with open_store(tmp_path, config) as node:
        (offset,) = await node.append([NewMessage("k", b"kept", "c", deliver_at_ms=now_ms() + 3_600_000)])
        for _ in range(20):  # several segments of ordinary traffic after it
            await node.append([NewMessage("fill", b"x" * 8000)])
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        log = node.log.log
        await trio.to_thread.run_sync(log.delete_expired)
        assert log.min_offset <= offset  # the pending entry's segment stayed, and so did every one after it
        assert log.read(offset).control


WRITER = textwrap.dedent("""
    import os, signal, sys, trio
    from pathlib import Path
    from store.api import NewMessage
    from store.log.commitlog import CommitLogConfig
    from store.log.record import now_ms
    from store.node import open_store
    from store.timer import applier, dequeue

    dequeue.CHUNK = int(sys.argv[3])
    EARLY = int(sys.argv[5])  # ends kept in memory that bring the timer's checkpoint forward (0: the default)
    applier.ENDS_FLUSH = EARLY or applier.ENDS_FLUSH

    async def main():
        data, config, now = Path(sys.argv[1]), CommitLogConfig(flush=sys.argv[2]), now_ms()
        async with open_store(data, config) as store:
            messages = [NewMessage("t", b"%d" % i, "pub", 1, deliver_at_ms=now + 1000 + int(sys.argv[4]) * i)
                        for i in range(60)]
            for i in range(0, 60, 10):
                await store.append(messages[i:i + 10], durable=True)
            print("acknowledged", 60, flush=True)
            if not EARLY:
                await kill_while_firing(store)
        async with open_store(data, config) as store:  # the checkpoint covers every entry: their ends wait in memory
            await kill_while_firing(store)

    async def kill_while_firing(store):
        with trio.fail_after(30):  # SIGKILL while the dequeue step is between its batches (and, with EARLY, once
            # the timer's own checkpoint passed the index's)
            while not (store.queues.max_offset("t") and store.timers.pending) or EARLY and \
                    store.timers.checkpoint <= store.dispatcher.statistics().flushed_offset:
                await store.dispatcher.wait_dispatched(store.dispatcher.dispatched_offset + 1)
        print("delivered", store.queues.max_offset("t"), "pending", store.timers.pending, "timer checkpoint",
              store.timers.checkpoint, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    trio.run(main)
""")


def crash_writer(data: Path, flush: str, chunk: int = CHUNK, apart_ms: int = 20, early: int = 0) -> str:
    """A store process that acknowledges 60 delayed messages (due ``apart_ms`` apart) and is SIGKILLed while they
    fire (``chunk``: messages per write); with ``early``, it is opened again first, and killed once ``early`` ends
    brought the timer's checkpoint forward on its own."""
    proc = subprocess.run([sys.executable, "-c", WRITER, str(data), flush, str(chunk), str(apart_ms), str(early)],
                          capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return proc.stdout


async def delivered_once_after_restart(data: Path, flush: str) -> None:
    async with open_store(data, CommitLogConfig(flush=flush)) as node:
        got = await delivered(node, "t", 60, timeout=30)
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 0  # nothing left that could fire again
        payloads = [record.payload for record in got]
        assert sorted(payloads) == sorted(b"%d" % i for i in range(60))  # none lost, none twice
        assert payloads == [b"%d" % i for i in range(60)]  # in due order
        assert len(fired_entries(node)) == 60


@pytest.mark.slow
def test_a_sigkill_while_delayed_messages_fire_loses_none_and_delivers_none_twice(tmp_path: Path):
    out = crash_writer(tmp_path, "sync")
    assert "delivered" in out, out
    trio.run(delivered_once_after_restart, tmp_path, "sync")


@pytest.mark.slow
def test_a_sigkill_between_the_writes_of_one_fired_batch_loses_none_and_delivers_none_twice(tmp_path: Path):
    """60 messages due at the same millisecond fire as one batch, in writes of 10 (``CHUNK``), each with the
    TimersFired record of its own entries: killed after some of the writes, the rest fire after the restart, once,
    in due order (for one due time: the order they were published in)."""
    out = crash_writer(tmp_path, "sync", chunk=10, apart_ms=0)
    assert "delivered" in out, out
    assert 0 < int(out.split("delivered")[1].split()[0]) < 60, out
    trio.run(delivered_once_after_restart, tmp_path, "sync")


@pytest.mark.slow
def test_a_power_loss_while_delayed_messages_fire_loses_none_and_delivers_none_twice(tmp_path: Path):
    """The log is cut at its flushed mark (the acknowledged Delayed records were made durable; the fired messages
    and their TimersFired records after the mark are lost); the timer's files are kept as the kill left them."""
    out = crash_writer(tmp_path, "async")
    assert "delivered" in out, out
    cut_at_flushed_mark(tmp_path)
    trio.run(delivered_once_after_restart, tmp_path, "async")


@pytest.mark.slow
def test_a_power_loss_after_the_timers_own_checkpoint_loses_none_and_delivers_none_twice(tmp_path: Path):
    """Ends kept in memory past ``ENDS_FLUSH`` bring the timer's checkpoint forward alone (store/dispatch.py
    ``EarlyCheckpoint``: the index keeps its older checkpoint, and dispatch its lock): its writer makes the log
    durable up to the checkpoint before writing it, so a power loss (the log cut at its flushed mark) leaves no
    timer state past the log; after the restart dispatch applies from the index's checkpoint, the timer from its
    own, and every message is delivered once, in due order."""
    out = crash_writer(tmp_path, "async", chunk=10, apart_ms=50, early=10)
    assert "timer checkpoint" in out, out
    checkpoint = int(out.split("timer checkpoint")[1].split()[0])
    assert cut_at_flushed_mark(tmp_path) >= checkpoint
    trio.run(delivered_once_after_restart, tmp_path, "async")


def cut_at_flushed_mark(data: Path) -> int:
    """The power loss: every byte of the log after its flushed mark is gone (the timer's files are kept as the
    kill left them). Returns the mark."""
    flushed = int.from_bytes((data / "commitlog" / "flushed").read_bytes()[:8], "big")
    for segment in sorted((data / "commitlog").glob("0*[0-9]")):
        base = int(segment.name)
        size = segment.stat().st_size
        if base + size > flushed:
            with open(segment, "r+b") as handle:
                handle.seek(max(0, flushed - base))
                handle.write(bytes(size - max(0, flushed - base)))
    return flushed


def test_on_open_the_timer_forgets_what_came_after_its_checkpoint_and_dispatch_applies_it_again(tmp_path: Path):
    """A crash after ends were written to the TimerLog but before the checkpoint covered them: those ends are
    undone (the records that made them may be lost with the log's tail); the entries below it are kept."""
    timers = TimerApplier(tmp_path, window_s=100)
    timers.apply(*delayed_record(10, 5_000_000))
    timers.apply(*delayed_record(20, 5_001_000))
    timers.flush(30)
    timers.apply(control_record(40, TimersFired([(10, 1, 5_000_000)])), TimersFired([(10, 1, 5_000_000)]))
    timers.apply(*delayed_record(50, 5_002_000))
    assert timers.pending == 2
    timers.close()  # no flush: the crash
    timers = TimerApplier(tmp_path, window_s=100)
    assert timers.checkpoint == 30 and timers.pending == 2  # both entries below 30, neither ended
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [10]
    timers.rewind(15)  # a follower's truncate below the second entry
    assert timers.pending == 1 and timers.checkpoint == 15
    timers.close()


def test_an_end_found_at_another_position_still_ends_its_entry_once(tmp_path: Path):
    """After a rebuild from a log that retention shortened, TimerLog positions differ from where the ends were
    written: the entry is found by its Delayed record's offset, and an end for a record older than the log is a
    no-op."""
    timers = TimerApplier(tmp_path, window_s=100)
    timers.apply(*delayed_record(10, 5_000_000))
    timers.apply(*delayed_record(20, 5_000_500))
    fired = TimersFired([(5, 1, 4_999_000), (20, 1, 5_000_500)])  # 5: gone with retention; 20: at position 2 here
    timers.apply(control_record(30, fired), fired)
    timers.apply(control_record(31, fired), fired)  # idempotent
    assert timers.pending == 1 and [e.offset_real for _, e in timers.due_entries(5_000)] == [10]
    timers.close()


def test_one_record_ending_entries_of_several_slots_and_clients_leaves_each_count_right(tmp_path: Path):
    """A ``TimersFired`` changes each slot and count once for all the entries it ends there (not once per entry):
    each slot keeps its other entries and is cleared with its last, each client's cap and the retention guard
    count what is left, and a position named twice ends its entry once."""
    timers = TimerApplier(tmp_path, window_s=100)
    for offset, due_ms, client in [(10, 5_000_100, "a"), (20, 5_000_200, "a"), (30, 5_000_300, "b"),
                                   (40, 5_001_100, "b"), (50, 5_001_200, "b")]:
        timers.apply(*delayed_record(offset, due_ms, client=client))
    fired = TimersFired([(10, 1, 5_000_100), (30, 3, 5_000_300), (40, 4, 5_001_100), (30, 3, 5_000_300)])
    timers.apply(control_record(60, fired), fired)
    assert timers.fired == 3 and timers.pending == 2
    assert (timers.pending_of("a"), timers.pending_of("b")) == (1, 1)
    assert [e.offset_real for _, e in timers.due_entries(5_000)] == [20]
    assert [e.offset_real for _, e in timers.due_entries(5_001)] == [50]
    rest = TimersFired([(20, 2, 5_000_200), (50, 5, 5_001_200)])
    timers.apply(control_record(70, rest), rest)
    assert timers.pending == 0 and (timers.pending_of("a"), timers.pending_of("b")) == (0, 0)
    assert timers.next_due(4_999, 5_010) is None and timers.may_delete(0, 1 << 30)  # both slots cleared
    timers.apply(*delayed_record(80, 5_001_300))  # a cleared slot starts a new chain
    assert [(pos, e.offset_real) for pos, e in timers.due_entries(5_001)] == [(6, 80)]
    timers.close()


def test_the_timerlog_starts_again_empty_when_nothing_is_pending_at_a_flush(tmp_path: Path):
    timers = TimerApplier(tmp_path, window_s=100)
    timers.apply(*delayed_record(10, 5_000_000))
    timers.flush(20)
    assert (tmp_path / "timerlog").stat().st_size == 64  # one entry, pending
    fired = TimersFired([(10, 1, 5_000_000)])
    timers.apply(control_record(30, fired), fired)
    timers.flush(40)
    assert (tmp_path / "timerlog").stat().st_size == 0 and timers.pending == 0
    timers.apply(*delayed_record(50, 5_001_000))  # the next one starts at position 1
    assert [pos for pos, _ in timers.due_entries(5_001)] == [1]
    timers.close()
    timers = TimerApplier(tmp_path, window_s=100)  # a crash before the next checkpoint: re-applied from 40
    assert timers.checkpoint == 40 and timers.pending == 0
    timers.close()


async def test_a_delayed_qos2_message_awaits_pubrel_from_its_record(tmp_path: Path):
    """[MQTT-4.3.3-2]: until PUBREL, a resend of a QoS 2 PUBLISH is not stored again; the store knows the flow
    awaits PUBREL from the Delayed record itself (its frame keeps the packet id), as from a message record."""
    async with open_store(tmp_path, CONFIG) as node:
        (offset,) = await node.append([NewMessage("t", b"x", "pub", 2, packet_id=7,
                                                  deliver_at_ms=now_ms() + 600_000)])
        assert await node.sessions.awaiting_release("pub") == {7: offset}
        record = node.log.log.read(offset)
        assert record.control and record.packet_id == 7 and isinstance(decode_control(record), Delayed)


async def pending_far(node: StoreNode, count: int) -> None:
    """``count`` delayed messages due in an hour, in 3 topics and over 7 seconds, applied by dispatch."""
    due = now_ms() + 3_600_000
    for start in range(0, count, 500):
        await node.append([NewMessage(f"far/{i % 3}", b"%d" % i, f"c{i % 4}", 1, deliver_at_ms=due + i % 7 * 1000)
                           for i in range(start, min(count, start + 500))])
    await node.dispatcher.wait_dispatched(node.log.log.written_offset)


async def test_opening_a_store_with_pending_messages_reads_no_timerlog_entry(tmp_path: Path):
    """The wheel and the counts are kept with the checkpoint: open costs the records after it, not the pending
    entries (10 M of them would be 640 MB of TimerLog to walk)."""
    async with open_store(tmp_path, CONFIG) as node:
        await pending_far(node, 3000)
    before = dump(tmp_path / "index")
    async with open_store(tmp_path, CONFIG) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 3000 and node.timers.pending_of("c1") == 750
        assert node.timers.entries_read == 0
    assert dump(tmp_path / "index") == before and before["timer"]["pending"] == 3000


@pytest.mark.parametrize("deleted", [("wheel",), ("checkpoint",), ("timerlog",), ("wheel", "timerlog", "checkpoint")])
async def test_the_timer_files_deleted_come_back_from_the_log_and_dump_the_same(tmp_path: Path, deleted):
    """The log is the only truth: the TimerLog, wheel and checkpoint are derived, and any of them deleted is
    derived again (the wheel from the TimerLog, the rest from the log) to the same pending entries; what fired
    before (its TimersFired in the log) does not fire again."""
    async with open_store(tmp_path, CONFIG) as node:
        await pending_far(node, 600)
        due = now_ms() + 300
        await node.append([NewMessage("soon", b"%d" % i, "c0", 1, deliver_at_ms=due) for i in range(5)])
        assert len(await delivered(node, "soon", 5)) == 5
    before = dump(tmp_path / "index")
    assert before["timer"]["pending"] == 600 and "inconsistent" not in before["timer"]
    for name in deleted:
        (tmp_path / "timer" / name).unlink()
    async with open_store(tmp_path, CONFIG) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 600 and node.timers.pending_of("c0") == 150
        assert node.queues.max_offset("soon") == 5
    assert dump(tmp_path / "index") == before


def test_a_checkpoint_whose_writes_into_the_files_were_lost_is_written_again_on_open(tmp_path: Path):
    """A power loss right after a checkpoint: its changes of the wheel and of the ends never reached the files,
    which hold the previous checkpoint's state; opening writes them from the checkpoint (its redo), reading no
    entry."""
    timers = TimerApplier(tmp_path, window_s=100)
    timers.apply(*delayed_record(10, 5_000_000))
    timers.apply(*delayed_record(20, 5_000_000))
    timers.flush(30)
    fired = TimersFired([(10, 1, 5_000_000)])
    timers.apply(control_record(40, fired), fired)  # ends a checkpointed entry and changes its slot
    timers.apply(*delayed_record(50, 5_001_000))
    timers.flush(60)
    files = {name: (tmp_path / name).read_bytes() for name in ("wheel", "timerlog")}
    timers.close()
    timerlog = bytearray(files["timerlog"])
    timerlog[40:48] = bytes(8)  # entry 1's done_at as the file had it before the checkpoint of 60
    (tmp_path / "timerlog").write_bytes(timerlog)
    (tmp_path / "wheel").write_bytes(bytes(len(files["wheel"])))  # the slots as of no checkpoint at all
    timers = TimerApplier(tmp_path, window_s=100)
    assert timers.checkpoint == 60 and timers.pending == 2 and timers.entries_read == 0
    assert [entry.offset_real for _, entry in timers.due_entries(5_000)] == [20]
    assert [entry.offset_real for _, entry in timers.due_entries(5_001)] == [50]
    assert timers.next_due(4_990, 5_050) == 5_000
    timers.close()
