"""The ``StoreApi`` contract (store/api.py): one suite, run against both implementations over a real store node.

``local``: ``LocalStore`` over a store node in this process (the embedded gateway's). ``remote``: ``RemoteStore``
over the RPC server serving that node on a real socket (a cluster gateway's, a back-end client's). Code above the
store never asks which one it has, so each test here says what both must do, answers and errors alike; what only
one of them does (the remote one's reconnects and batching, the local one's calls in the caller's step) is
tested beside it (tests/store/rpc/, tests/store/test_node.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from store.api import (MAIN_LOG, Flow, InvalidOffset, LogFullError, NewMessage, Position, PullRequest,
                       RecordTooLarge, StoreApi, TopicError)
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import StoreNode, open_store
from store.rpc.client import RemoteStore
from store.rpc.server import serve_rpc
from tests.conftest import SMALL_RECORD_BYTES
from tests.helpers.fulldisk import fill

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


class Implementation:
    """Opens ``StoreApi`` clients of one kind, under node names of their own, on one store node."""

    def __init__(self, kind: str, node: StoreNode, nursery: trio.Nursery) -> None:
        self.kind = kind
        self.node = node
        self._nursery = nursery
        self._port = 0

    @asynccontextmanager
    async def connect(self, name: str) -> AsyncIterator[StoreApi]:
        if self.kind == "local":
            store = LocalStore(self.node, name, lease=True)
            try:
                yield store
            finally:
                store.close()
            return
        if not self._port:
            listeners = await self._nursery.start(serve_rpc, self.node, "127.0.0.1", 0)
            self._port = listeners[0].socket.getsockname()[1]
        async with RemoteStore.connect("127.0.0.1", self._port, node=name, timeout_s=WAIT_S) as store:
            yield store


@pytest.fixture(params=["local", "remote"])
async def stores(request, store_small_records, nursery) -> Implementation:
    return Implementation(request.param, store_small_records, nursery)


@pytest.fixture
async def api(stores) -> AsyncIterator[StoreApi]:
    async with stores.connect("gw-a") as store:
        yield store


def message(topic: str, payload: bytes = b"m", **fields) -> NewMessage:
    return NewMessage(topic, payload, **{"client_id": "dev1", "qos": 1, **fields})


async def dispatched(api: StoreApi) -> None:
    """Wait until everything appended so far is indexed (pullable)."""
    with trio.fail_after(WAIT_S):
        while (await api.statistics()).dispatch_lag:
            await trio.lowlevel.checkpoint()


# --- messages ------------------------------------------------------------------------------


async def test_appended_messages_are_pulled_back_in_order_from_any_queue_offset(api):
    first = await api.append([message("tele/a", b"one", qos=0), message("tele/a", b"two", retain=True)])
    (second,) = await api.append([message("tele/b", b"three", client_id="dev2", qos=2, packet_id=7)], durable=True)
    assert first[0] < first[1] < second
    await dispatched(api)
    whole, tail, empty = await api.pull([PullRequest("tele/a", 0), PullRequest("tele/a", 1),
                                         PullRequest("none", 0)])
    assert [(qoff, r.payload, r.qos, r.retain, r.offset) for qoff, r in whole.messages] == [
        (0, b"one", 0, False, first[0].offset), (1, b"two", 1, True, first[1].offset)]
    assert whole.next_offset == 2 and not whole.expired
    assert [r.payload for _, r in tail.messages] == [b"two"]
    assert empty.messages == [] and empty.next_offset == 0
    ((_, record),) = (await api.pull([PullRequest("tele/b", 0)]))[0].messages
    assert (record.topic, record.client_id, record.qos, record.packet_id) == ("tele/b", "dev2", 2, 7)
    assert await api.max_offsets(["tele/a", "tele/b", "none"]) == [2, 1, 0]
    limited = (await api.pull([PullRequest("tele/a", 0, max_count=1)]))[0]
    assert [r.payload for _, r in limited.messages] == [b"one"] and limited.next_offset == 1


async def test_append_nowait_either_appends_or_would_block(api):
    """Both may refuse to append without waiting (a remote store always does); what one does append is
    pulled back like any append."""
    try:
        offsets = api.append_nowait([message("now/a")])
    except trio.WouldBlock:
        offsets = await api.append([message("now/a")])
    assert len(offsets) == 1
    await dispatched(api)
    try:
        results = api.pull_nowait([PullRequest("now/a", 0)])
    except trio.WouldBlock:
        results = await api.pull([PullRequest("now/a", 0)])
    assert [r.offset for _, r in results[0].messages] == offsets.offsets


async def test_retained_messages_are_found_by_the_filters_that_match_their_topics(api):
    await api.append([message("home/kitchen/temp", b"21", retain=True), message("home/hall/temp", b"19",
                                                                                retain=True),
                      message("home/kitchen/light", b"on")])
    await dispatched(api)
    assert sorted(r.payload for r in await api.retained("home/+/temp")) == [b"19", b"21"]
    assert [r.topic for r in await api.retained("home/kitchen/#")] == ["home/kitchen/temp"]
    assert await api.retained("office/#") == []


async def test_the_log_is_read_raw_from_a_record_boundary(api):
    offsets = await api.append([message("raw/a", b"x" * 100), message("raw/a", b"y" * 100)], durable=True)
    bounds = await api.read_log(Position(MAIN_LOG, 0), 0)
    assert bounds.data == b"" and bounds.flushed > offsets[1].offset and bounds.min_offset == 0
    span = await api.read_log(offsets[0], 1 << 20)
    assert span.log == MAIN_LOG and span.start == offsets[0].offset and span.data_end == span.flushed == bounds.flushed
    assert len(span.data) == span.data_end - span.start and b"y" * 100 in span.data
    with pytest.raises(InvalidOffset) as refused:  # beyond the flushed end: the local store's exception
        await api.read_log(Position(MAIN_LOG, bounds.flushed + 4096), 1024)
    assert refused.value.offset == bounds.flushed + 4096


async def test_statistics_count_what_was_written(api):
    before = await api.statistics()
    await api.append([message("stat/a")], durable=True)
    after = await api.statistics()
    assert after.written_offset > before.written_offset and after.flushed_offset == after.written_offset
    assert not after.disk_full


# --- delayed messages ---------------------------------------------------------------------


async def every_page(api: StoreApi, **query) -> tuple[list[list[str]], list]:
    """The payload-less view of every page of ``delayed_list(**query)`` (their messages' ids), and the messages."""
    pages, messages, after = [], [], 0
    while True:
        page = await api.delayed_list(after=after, **query)
        pages.append([m.position.id for m in page.messages])
        messages += page.messages
        if not page.next:
            return pages, messages
        after = page.next


async def test_pending_delayed_messages_are_listed_by_topic_and_by_client_in_pages(api):
    later = 10 ** 13  # due long after the test
    positions = await api.append([message("dl/a", b"1", client_id="c1", deliver_at_ms=later),
                                  message("dl/b", b"22", client_id="c1", qos=0, deliver_at_ms=later + 1),
                                  message("dl/a", b"333", client_id="c2", qos=2, retain=True, deliver_at_ms=later + 2),
                                  message("dl/a", b"now", client_id="c1")])
    ids = [positions[i].id for i in range(3)]
    pages, listed = await every_page(api, topic="dl/a", limit=1)
    assert pages == [[ids[0]], [ids[2]]]  # one per page, then the last page says so
    assert [(m.topic, m.client_id, m.due_ms, m.qos, m.retain, m.payload_bytes) for m in listed] == [
        ("dl/a", "c1", later, 1, False, 1), ("dl/a", "c2", later + 2, 2, True, 3)]
    assert (await every_page(api, client_id="c1"))[0] == [[ids[0], ids[1]]]
    assert (await every_page(api, topic="dl/a", client_id="c2"))[0] == [[ids[2]]]
    assert (await every_page(api, topic="dl/none"))[0] == [[]]
    with pytest.raises(ValueError):
        await api.delayed_list(limit=0)


async def test_a_cancelled_delayed_message_is_never_delivered_and_is_cancelled_once(api):
    due = int(time.time() * 1000) + 500
    cancelled, kept = await api.append([message("dl/c", b"cancelled", deliver_at_ms=due),
                                        message("dl/c", b"kept", deliver_at_ms=due + 100)])
    assert await api.delayed_cancel(cancelled)
    assert not await api.delayed_cancel(cancelled)  # already cancelled: not found
    assert not await api.delayed_cancel(Position(MAIN_LOG, cancelled.offset + 1))  # no record starts there
    assert not await api.delayed_cancel(Position(7, cancelled.offset))  # no such log
    assert [m.position for m in (await api.delayed_list(topic="dl/c")).messages] == [kept]
    with trio.fail_after(WAIT_S):
        while (await api.statistics()).timers.fired < 1:  # "kept" went out, after "cancelled" was due
            await trio.sleep(0.02)
    await dispatched(api)
    records = (await api.pull([PullRequest("dl/c", 0)]))[0].messages
    assert [r.payload for _, r in records] == [b"kept"]
    timers = (await api.statistics()).timers
    assert (timers.pending, timers.fired, timers.cancelled) == (0, 1, 1)
    assert not await api.delayed_cancel(kept)  # fired: not found either
# --- batch records ---------------------------------------------------------------------------


async def test_a_batch_is_one_record_whose_messages_have_positions_and_queue_offsets_of_their_own(api):
    """``append(batch=True)``: one record (docs/storage.md, "Batch records"), yet every message is pulled as if it
    had been appended alone, from any queue offset, with its own fields, between single records."""
    (single,) = await api.append([message("bat/a", b"before")])
    batch = [message("bat/a", b"m%d" % i, client_id=f"dev{i}", qos=i % 3, retain=i == 3, born_ms=1_000 + i,
                     properties=b"\x01\x01" if i == 2 else b"") for i in range(20)]
    positions = await api.append(batch, batch=True)
    (after,) = await api.append([message("bat/a", b"after")])
    base = positions[0].offset
    assert positions.offsets == [base + i for i in range(20)] and single.offset < base < after.offset
    assert after.offset > base + 20  # the record holds more bytes than messages: no other record starts inside
    await dispatched(api)
    assert await api.max_offsets(["bat/a", "bat/#"]) == [22, 22]
    whole = (await api.pull([PullRequest("bat/a", 0, max_count=100)]))[0]
    assert [r.payload for _, r in whole.messages] == [b"before", *(m.payload for m in batch), b"after"]
    assert [qoff for qoff, _ in whole.messages] == list(range(22)) and whole.next_offset == 22
    got = [r for _, r in whole.messages[1:21]]
    assert [(r.offset, r.client_id, r.qos, r.retain, r.born_ms, r.properties) for r in got] == [
        (base + i, m.client_id, m.qos, m.retain, m.born_ms, m.properties) for i, m in enumerate(batch)]
    for start in (5, 20):  # inside the batch, and its last message
        tail = (await api.pull([PullRequest("bat/a", start, max_count=100)]))[0]
        assert [qoff for qoff, _ in tail.messages] == list(range(start, 22))
    cut = (await api.pull([PullRequest("bat/a", 3, max_count=4)]))[0]  # a pull that ends inside the batch
    assert [(qoff, r.payload) for qoff, r in cut.messages] == [(q, b"m%d" % (q - 1)) for q in range(3, 7)]
    assert cut.next_offset == 7
    assert [(r.payload, r.offset) for r in await api.retained("bat/a")] == [(b"m3", base + 3)]


async def test_a_batch_is_indexed_into_the_wildcard_queues_active_when_it_is_appended(api):
    await api.activate("fleet2/+/t", "dev9")
    await api.append([message("fleet2/x/t", b"%d" % i) for i in range(3)], batch=True)
    await dispatched(api)
    assert await api.max_offsets(["fleet2/+/t"]) == [3]
    result = (await api.pull([PullRequest("fleet2/+/t", 1)]))[0]
    assert [(qoff, r.payload, r.topic) for qoff, r in result.messages] == [(1, b"1", "fleet2/x/t"),
                                                                           (2, b"2", "fleet2/x/t")]


async def test_a_group_claims_and_acknowledges_messages_inside_a_batch_one_by_one(api):
    await api.append([message("jobs2/a", b"%d" % i) for i in range(6)], batch=True)
    await dispatched(api)
    await api.join("$group/w2", "jobs2/a", "m1", start="earliest")
    first = await api.claim("$group/w2", "jobs2/a", "m1", 2)
    assert [(qoff, r.payload) for qoff, r in first.messages] == [(0, b"0"), (1, b"1")]
    assert await api.ack("$group/w2", "jobs2/a", "m1", [1]) == 0  # 0 still held: the committed offset waits
    rest = await api.claim("$group/w2", "jobs2/a", "m1", 10)
    assert [qoff for qoff, _ in rest.messages] == [2, 3, 4, 5]
    assert await api.ack("$group/w2", "jobs2/a", "m1", [0, 2, 3, 4, 5]) == 6


async def test_a_batch_over_the_record_limit_is_split_into_batch_records_that_fit(api):
    """Four messages of a third of ``max_record_bytes`` each: two batch records of two, in order, every message
    with its own position (a gap between the records: the first holds more bytes than messages). Random payloads:
    the records stay as long as their messages (a compressed body would be shorter)."""
    batch = [message("bat/fit", b"%d" % i + random.Random(i).randbytes(SMALL_RECORD_BYTES // 3)) for i in range(4)]
    positions = (await api.append(batch, batch=True)).offsets
    assert positions[1] == positions[0] + 1 and positions[3] == positions[2] + 1
    assert positions[2] > positions[0] + SMALL_RECORD_BYTES // 2  # the second record starts past the first
    await dispatched(api)
    got = (await api.pull([PullRequest("bat/fit", 0, max_count=10)]))[0]
    assert [(qoff, r.offset, r.payload) for qoff, r in got.messages] == [
        (i, positions[i], m.payload) for i, m in enumerate(batch)]


async def test_a_batch_that_cannot_be_written_is_refused_whole(api):
    with pytest.raises(RecordTooLarge):  # one message too large for a record of its own: no part of the batch
        await api.append([message("bat/err"), message("bat/err", b"x" * SMALL_RECORD_BYTES)], batch=True)
    with pytest.raises(ValueError, match="one topic"):
        await api.append([message("bat/err"), message("bat/other")], batch=True)
    with pytest.raises(ValueError, match="packet id"):
        await api.append([message("bat/err", qos=2, packet_id=3)], batch=True)
    assert await api.max_offsets(["bat/err", "bat/other"]) == [0, 0]
    assert len(await api.append([message("bat/err")], batch=True)) == 1


# --- subscriptions, offsets and events ------------------------------------------------------


async def test_activate_starts_a_subscription_at_the_head_and_release_ends_it(api):
    await api.append([message("fleet/a"), message("fleet/b")])
    await dispatched(api)
    assert await api.activate("fleet/+", "dev9") == 0  # a new wildcard queue starts empty
    await api.append([message("fleet/c")])
    await dispatched(api)
    assert await api.max_offsets(["fleet/+"]) == [1]
    assert await api.activate("fleet/a", "dev9") == 1  # an exact topic's queue: at its head
    assert await api.release("fleet/+", "dev9") is True
    assert await api.release("fleet/+", "dev9") is False


async def test_committed_offsets_are_read_back_and_never_move_back(api):
    await api.commit_offsets({"dev9": {"a/b": 3, "a/+": 1}, "$share/g": {"a/b": 2}})
    assert await api.get_offsets("dev9") == {"a/b": 3, "a/+": 1}
    assert await api.get_offsets("$share/g") == {"a/b": 2}
    await api.commit_offsets({"dev9": {"a/b": 1}})  # a late commit of a connection taken over
    assert await api.get_offsets("dev9") == {"a/b": 3, "a/+": 1}
    assert await api.get_offsets("nobody") == {}


async def test_events_come_for_watched_queues_only(stores):
    async with stores.connect("gw-a") as api, stores.connect("gw-b") as other:
        api.watch("ev/a")
        await api.max_offsets([])  # a round trip: the watch is registered
        await other.append([message("ev/b"), message("ev/a")])
        with trio.fail_after(WAIT_S):
            events = await api.events()
        assert events == {"ev/a": 1}
        with pytest.raises(trio.WouldBlock):  # taken: nothing is pending
            api.events_nowait()
        await other.append([message("ev/a")])
        with trio.fail_after(WAIT_S):
            while (events := _pending_events(api)) is None:  # routed to this node by now, or soon
                await trio.sleep(0.01)
        assert events == {"ev/a": 2}
        api.unwatch("ev/a")


def _pending_events(api) -> dict[str, int] | None:
    """The events routed to ``api``'s node already, taken without waiting; None when none are."""
    try:
        return api.events_nowait()
    except trio.WouldBlock:
        return None


# --- consumer groups ---------------------------------------------------------------------


async def test_a_group_hands_messages_to_its_members_until_they_acknowledge_them(api):
    await api.append([message("jobs/a", b"0")])
    await dispatched(api)
    assert await api.join("$group/workers", "jobs/a", "m1", start="earliest") == 0
    claimed = await api.claim("$group/workers", "jobs/a", "m1", 10)
    assert [(qoff, r.payload) for qoff, r in claimed.messages] == [(0, b"0")] and claimed.next_offset == 1
    assert (await api.claim("$group/workers", "jobs/a", "m1", 10)).messages == []  # it holds them: not again
    assert await api.ack("$group/workers", "jobs/a", "m1", [0]) == 1
    await api.leave("$group/workers", "jobs/a", "m1")
    with pytest.raises(ValueError):
        await api.join("$group/workers", "jobs/a", "m1", start="sometime")


# --- POP consumption -------------------------------------------------------------------------


async def test_a_pop_hands_out_messages_with_handles_that_acknowledge_once_and_change_invisible_time(api):
    await api.append([message("jobs/p", b"0"), message("jobs/p", b"1")])
    await dispatched(api)
    popped = await api.pop("workers", "jobs/p", "m1", 10, invisible_s=60, start="earliest")
    assert [(p.offset, p.attempt, p.record.payload) for p in popped] == [(0, 1, b"0"), (1, 1, b"1")]
    assert await api.pop("workers", "jobs/p", "m2", 10, invisible_s=60) == []  # in flight: not again
    assert await api.pop_ack([popped[0].handle, popped[0].handle]) == [True, False]
    assert await api.get_offsets("$pop/workers") == {"jobs/p": 1}
    renewed = await api.change_invisible(popped[1].handle, 0)
    assert renewed is not None and await api.change_invisible(popped[1].handle, 5) is None
    (again,) = await api.pop("workers", "jobs/p", "m2", 10, invisible_s=60, wait_s=WAIT_S)
    assert (again.offset, again.attempt) == (1, 2) and await api.pop_ack([renewed]) == [False]
    with pytest.raises(ValueError):
        await api.pop_ack(["not a handle"])
    with pytest.raises(ValueError):
        await api.pop("workers", "jobs/p", "m1", 10, invisible_s=0)


# --- sessions --------------------------------------------------------------------------------


async def test_a_session_is_opened_saved_loaded_listed_and_ended(api):
    assert await api.open_session("dev9", clean_start=False, expiry_s=60) is None  # a new session
    await api.save_session("dev9", b"\x00state")
    assert await api.load_session("dev9") == b"\x00state"
    assert await api.sessions() == ["dev9"]
    await api.commit_offsets({"dev9": {"s/a": 2}})
    assert await api.open_session("dev9", clean_start=False, expiry_s=60) == b"\x00state"  # resumed
    await api.close_session("dev9", expiry_s=60, will_delay_s=None)
    assert await api.load_session("dev9") == b"\x00state"  # closed, not expired: kept
    assert await api.end_session("dev9") is True
    assert await api.load_session("dev9") is None and await api.get_offsets("dev9") == {}
    assert await api.sessions() == []
    assert await api.end_session("dev9") is False


async def test_qos2_messages_await_release_until_released(api):
    (offset,) = await api.append([message("q2/a", qos=2, client_id="dev5", packet_id=11)])
    assert await api.awaiting_release("dev5") == {11: offset}
    await api.release_awaiting([Flow("dev5", 11, offset)])
    assert await api.awaiting_release("dev5") == {}
    assert await api.awaiting_release("nobody") == {}


async def test_a_client_that_connects_to_another_node_is_reported_moved(stores):
    async with stores.connect("gw-a") as first, stores.connect("gw-b") as second:
        await first.open_session("dev3", clean_start=False, expiry_s=60)
        await second.open_session("dev3", clean_start=False, expiry_s=60)
        with trio.fail_after(WAIT_S):
            assert await first.moved() == ["dev3"]
        assert await second.admin_call("dev3", "client") is None  # connected to the asking node itself


async def test_available_at_once_while_connected(api):
    with trio.move_on_after(WAIT_S) as waited:
        await api.wait_available()
    assert not waited.cancelled_caught  # it returned: it did not wait for a store that is there
    assert len(await api.append([message("avail/a")])) == 1  # and the store takes writes at once


# --- errors ------------------------------------------------------------------------------


async def test_bad_input_is_refused_with_the_same_exceptions_and_nothing_is_appended(api):
    with pytest.raises(RecordTooLarge):
        await api.append([message("err/a", b"x" * (SMALL_RECORD_BYTES * 2))])
    with pytest.raises(ValueError, match="QoS must be 0, 1 or 2"):
        await api.append([message("err/a", qos=3)])
    with pytest.raises(TopicError, match="'#' must be the last level"):
        await api.activate("err/#/b", "dev1")
    with pytest.raises(ValueError, match="max_count and max_bytes must be positive"):
        await api.pull([PullRequest("err/a", 0, max_count=0)])
    assert await api.max_offsets(["err/a"]) == [0]  # nothing was appended, and the store goes on
    assert len(await api.append([message("err/a")])) == 1


@pytest.fixture
async def full_stores(small_disk, request, nursery) -> AsyncIterator[Implementation]:
    """Store clients of the kind asked for, over a store node on a small tmpfs of its own."""
    async with open_store(small_disk / "data", CommitLogConfig(segment_bytes=1 << 20)) as node:
        yield Implementation(request.param, node, nursery)


@pytest.mark.parametrize("full_stores", ["local", "remote"], indirect=True)
async def test_a_full_disk_refuses_appends_with_log_full_and_keeps_what_was_stored(full_stores, small_disk):
    async with full_stores.connect("gw-a") as api:
        (stored,) = await api.append([message("full/a", b"kept")], durable=True)
        fill(small_disk / "filler")
        with pytest.raises(LogFullError):
            await api.append([message("full/a", b"x" * 2048) for _ in range(600)], durable=True)
        (small_disk / "filler").unlink()
        (after,) = await api.append([message("full/a", b"after")], durable=True)  # room again: at once
        await dispatched(api)
        records = (await api.pull([PullRequest("full/a", 0)]))[0].messages
        assert [(r.offset, r.payload) for _, r in records] == [(stored.offset, b"kept"), (after.offset, b"after")]
