"""When the leader answers a follower's fetch (store/replica/leader.py): at once when it has at least the fetch's
``min_bytes`` or an acknowledgement waits for the follower, after the fetch's ``max_wait_s`` for less, never for
another follower's fetch. On trio's clock standing still (pytest-trio's ``mock_clock``): a timeout ends only when
the test moves the clock, so "not answered yet" and "answered without waiting" are facts, not timings. A real
leader StoreNode (files, RocksDB, its RPC listener), followers over real sockets; the controller in memory."""

from __future__ import annotations

import time

import trio
import trio.testing

from store.replica.follower import FETCH_MAX_WAIT_S
from store.replica.leader import Answer
from tests.helpers.replication import WAIT_S, Follower, leader, messages

EPOCH = 1


async def settle(condition, what: str) -> None:
    """Let the tasks run until ``condition()`` holds: the clock stands still, so only their work moves anything
    (worker threads included, hence the bound in real time)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        await trio.testing.wait_all_tasks_blocked()


async def test_a_fetch_waits_for_its_min_bytes_and_at_its_max_wait_takes_what_there_is(tmp_path, mock_clock):
    async with leader(tmp_path / "a", acks="leader") as node:
        replication, log = node.replication, node.log.log
        end = log.written_offset
        await replication.fetch("b", EPOCH, EPOCH, end, end, 1 << 20)  # its first answer: the confirm offset
        answers: list[Answer] = []

        async def fetch() -> None:
            answers.append(await replication.fetch("b", EPOCH, EPOCH, end, end, 1 << 20, min_bytes=64 * 1024,
                                                   max_wait_s=0.02))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await node.append(messages(3))
            await trio.testing.wait_all_tasks_blocked()
            assert answers == []  # three records are less than it asked for
            mock_clock.jump(0.02)
            await settle(lambda: answers, "the fetch is answered once its max wait has passed")
        assert answers[0].data == log.read_frames(end, 1 << 20) and 0 < len(answers[0].data) < 64 * 1024
        more = log.written_offset
        await node.append(messages(400))  # 100 KB: more than it asks for, answered on the standing clock
        answer = await replication.fetch("b", EPOCH, EPOCH, more, more, 1 << 20, min_bytes=64 * 1024,
                                         max_wait_s=0.02)
        assert len(answer.data) == log.written_offset - more


async def test_a_caught_up_follower_is_answered_for_news_not_for_another_followers_fetch(tmp_path, mock_clock):
    """Two caught-up followers waking each other in turn made hundreds of empty rounds a second."""
    async with leader(tmp_path / "a", acks="leader", isr=("a", "b", "c")) as node:
        replication, log = node.replication, node.log.log
        end = log.written_offset
        for name in ("b", "c"):
            await replication.fetch(name, EPOCH, EPOCH, end, end, 1 << 20)  # told the confirm offset: no news now
        answers: dict[str, Answer] = {}

        async def fetch(name: str) -> None:
            answers[name] = await replication.fetch(name, EPOCH, EPOCH, end, end, 1 << 20)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch, "b")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(fetch, "c")
            await trio.testing.wait_all_tasks_blocked()
            assert answers == {}  # c's fetch is no news for b
            await node.append(messages(1))
            await settle(lambda: len(answers) == 2, "both are answered with the new record")
        assert answers["b"].data == answers["c"].data == log.read_frames(end, 1 << 20) != b""


async def test_a_trickle_under_acks_leader_is_confirmed_once_the_fetches_max_wait_passed(tmp_path, mock_clock):
    """The followers' fetches ask for many records a round (``FETCH_MIN_BYTES``): a message alone waits for their
    ``FETCH_MAX_WAIT_S``, and nothing else, before the replicas confirm it (and dispatch serves it)."""
    async with leader(tmp_path / "a", acks="leader", isr=("a", "b", "c")) as node, trio.open_nursery() as nursery:
        log = node.log.log
        followers = [Follower(tmp_path / name, name) for name in ("b", "c")]
        for f in followers:
            await nursery.start(f.run, node.port)
        await settle(lambda: log.confirm_offset == log.written_offset == min(f.written for f in followers),
                     "the followers caught up")
        for i in range(3):
            await node.append(messages(1, i))
            await trio.testing.wait_all_tasks_blocked()
            assert log.confirm_offset < log.written_offset  # their fetches wait for more
            mock_clock.jump(FETCH_MAX_WAIT_S)
            await settle(lambda: log.confirm_offset == log.written_offset, "the replicas confirm it after the wait")
        for f in followers:
            await f.stop()


async def test_a_trickle_under_acks_quorum_is_acknowledged_without_waiting_for_fetches_to_fill(tmp_path, mock_clock):
    """An acknowledgement waits for the followers: their waiting fetches are answered at once (the clock never
    moves here), so asking for many records a round costs a trickle of QoS 1 messages no latency."""
    async with leader(tmp_path / "a", acks="quorum", isr=("a", "b", "c")) as node, trio.open_nursery() as nursery:
        log = node.log.log
        followers = [Follower(tmp_path / name, name) for name in ("b", "c")]
        for f in followers:
            await nursery.start(f.run, node.port)
        for i in range(3):
            acked = trio.Event()

            async def append(start: int) -> None:
                await node.append(messages(1, start))  # returns once b and c hold it
                acked.set()

            nursery.start_soon(append, i)
            await settle(acked.is_set, "acknowledged, the clock standing still")
            assert log.confirm_offset == log.written_offset
        for f in followers:
            await f.stop()
