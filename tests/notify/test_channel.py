"""notify/channel.py: a mailbox merges events while they wait and hands them over all at once."""

import pytest
import trio
import trio.testing

from notify.channel import EventMailbox
from notify.router import NotifyRouter

TIMEOUT_S = 10  # generous on two shared cores; the tests never wait for time, only for conditions


async def test_a_waiting_consumer_is_woken_by_a_post():
    mailbox = EventMailbox()
    got = []

    async def consumer():
        got.append(await mailbox.get())

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            mailbox.post({"a": 1, "b": 2})
    assert got == [{"a": 1, "b": 2}]
    assert mailbox.statistics().pending == 0


async def test_a_slow_consumer_gets_one_merged_dict_and_the_highest_offsets():
    mailbox = EventMailbox()
    mailbox.post({"a": 1, "b": 5})
    mailbox.post({"a": 3, "c": 1})
    mailbox.post({"b": 4})  # lower than the pending 5: the higher offset wins
    with trio.fail_after(TIMEOUT_S):
        assert await mailbox.get() == {"a": 3, "b": 5, "c": 1}
    with pytest.raises(trio.WouldBlock):
        mailbox.get_nowait()
    stats = mailbox.statistics()
    assert (stats.posts, stats.events_posted, stats.events_merged, stats.takes) == (3, 5, 2, 1)


async def test_memory_is_bounded_by_queues_not_events():
    mailbox = EventMailbox()
    for batch in range(1000):
        mailbox.post({f"q{i}": batch * 10 + i for i in range(50)})
    assert mailbox.statistics().pending == 50
    assert mailbox.get_nowait() == {f"q{i}": 9990 + i for i in range(50)}


async def test_a_cancelled_get_loses_nothing():
    mailbox = EventMailbox()
    with trio.fail_after(TIMEOUT_S):
        with trio.move_on_after(0) as scope:
            await mailbox.get()  # cancelled before it could take anything
        assert scope.cancelled_caught
        mailbox.post({"a": 1})
        with trio.CancelScope() as scope:
            scope.cancel()
            await mailbox.get()  # cancelled at its first checkpoint: the event stays pending
        assert mailbox.statistics().pending == 1
        assert await mailbox.get() == {"a": 1}


async def test_close_wakes_the_consumer_which_drains_then_ends():
    mailbox = EventMailbox()
    ended = trio.Event()

    async def consumer():
        with pytest.raises(trio.EndOfChannel):
            await mailbox.get()
        ended.set()

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            mailbox.close()
            await ended.wait()
    closed = EventMailbox()
    closed.post({"a": 1})
    closed.close()
    closed.close()
    with pytest.raises(trio.ClosedResourceError, match="closed"):
        closed.post({"b": 2})
    assert closed.get_nowait() == {"a": 1}  # what was pending is still delivered
    with pytest.raises(trio.EndOfChannel):
        closed.get_nowait()
    assert closed.statistics().closed


async def test_router_and_mailboxes_deliver_each_node_only_its_queues():
    """The embedded wiring: dispatch listener -> route -> post per node; one consumer task per node."""
    router = NotifyRouter()
    mailboxes = {"gw1": EventMailbox(), "gw2": EventMailbox()}
    router.register("gw1", "a/b")
    router.register("gw2", "a/+")
    router.register("gw2", "c")
    received: dict[str, list[dict[str, int]]] = {"gw1": [], "gw2": []}

    async def consume(node: str) -> None:
        while True:
            try:
                received[node].append(await mailboxes[node].get())
            except trio.EndOfChannel:
                return

    def listener(events: dict[str, int]) -> None:
        for node, mine in router.route(events).items():
            mailboxes[node].post(mine)

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for node in mailboxes:
                nursery.start_soon(consume, node)
            listener({"a/b": 1, "a/+": 1})
            listener({"a/b": 2, "c": 4, "zzz": 9})  # two batches before anyone ran: merged
            await trio.testing.wait_all_tasks_blocked()
            listener({"c": 5})
            await trio.testing.wait_all_tasks_blocked()
            for node in list(mailboxes):
                router.drop_node(node)
                mailboxes[node].close()
    assert received["gw1"] == [{"a/b": 2}]
    assert received["gw2"] == [{"a/+": 1, "c": 4}, {"c": 5}]
    assert router.statistics().unrouted == 1
