"""Pending delayed messages listed and cancelled in the store (store/timer/pending.py): a cancellation races no
fire, is found after a roll, and is in the log, so a timer rebuilt from the log keeps it. The ``StoreApi`` face
(pages, ids, not found) is tests/store/test_contract.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import trio

from store.api import NewMessage
from store.log.commitlog import CommitLogConfig
from store.log.record import now_ms
from store.node import StoreNode, open_store

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)
WAIT_S = 15.0


async def fired(node: StoreNode, count: int) -> None:
    """Wait until the dequeue step fired ``count`` messages (and dispatch indexed them)."""
    with trio.fail_after(WAIT_S):
        while node.timers.fired < count:
            await node.dispatcher.wait_dispatched(node.dispatcher.dispatched_offset + 1)
    await node.dispatcher.wait_dispatched(node.log.log.written_offset)


def payloads(node: StoreNode, topic: str) -> list[bytes]:
    return [record.payload for _, record in node.read(topic, 0, max_count=100).messages]


async def test_a_message_cancelled_after_the_dequeue_step_read_its_second_is_not_delivered(tmp_path: Path):
    """The dequeue step reads a second's entries when the second begins, then waits for each one's due ms: a
    cancellation in between still holds (the step fires under the cancellations' lock, what is still pending)."""
    async with open_store(tmp_path, CONFIG) as node:
        second = now_ms() // 1000 + 2
        cancelled, _ = await node.append([NewMessage("race", b"cancelled", "c", 1, deliver_at_ms=second * 1000 + 800),
                                          NewMessage("race", b"kept", "c", 1, deliver_at_ms=second * 1000 + 900)])
        with trio.fail_after(WAIT_S):
            while now_ms() < second * 1000 + 300:  # the step has the second's entries and waits for 800 ms
                await trio.sleep(0.01)
        assert await node.delayed.cancel(cancelled)
        await fired(node, 1)
        assert payloads(node, "race") == [b"kept"]
        assert (node.timers.pending, node.timers.cancelled) == (0, 1)


async def test_a_rolled_message_is_found_and_cancelled(tmp_path: Path):
    async with open_store(tmp_path, CONFIG, timer_window_s=2) as node:
        due = now_ms() + 4000  # beyond a 2-second window: placed in its last slot, then rolled
        rolled, _ = await node.append([NewMessage("roll", b"cancelled", "c", deliver_at_ms=due),
                                       NewMessage("roll", b"kept", "c", deliver_at_ms=due + 200)])
        with trio.fail_after(WAIT_S):
            while not node.timers.rolled:
                await node.dispatcher.wait_dispatched(node.dispatcher.dispatched_offset + 1)
        assert await node.delayed.cancel(rolled)
        assert not await node.delayed.cancel(rolled)
        await fired(node, 1)
        assert payloads(node, "roll") == [b"kept"]


async def test_a_cancellation_is_in_the_log_so_a_timer_rebuilt_from_the_log_keeps_it(tmp_path: Path):
    due = now_ms() + 3_600_000
    async with open_store(tmp_path, CONFIG) as node:
        cancelled, kept = await node.append([NewMessage("log", b"cancelled", "c", deliver_at_ms=due),
                                             NewMessage("log", b"kept", "c", deliver_at_ms=due)])
        assert await node.delayed.cancel(cancelled)
    shutil.rmtree(tmp_path / "timer")  # the TimerLog, the wheel and the checkpoint: derived, rebuilt from the log
    async with open_store(tmp_path, CONFIG) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 1
        assert [m.position.offset for m in (await node.delayed.page("", "", 0, 10)).messages] == [kept]
        assert not await node.delayed.cancel(cancelled)
