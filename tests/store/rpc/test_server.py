"""The store's RPC server (store/rpc/server.py) over real sockets, spoken to frame by frame."""

import logging
import os
from functools import partial

import pytest
import trio

from store.api import MAIN_LOG, Flow, NewMessage, Position, PullRequest
from store.log.record import decode_record
from store.rpc import server
from store.rpc import wire as rpc
from store.rpc.access import StoreAccess, Verdict
from store.rpc.connection import decoded
from store.rpc.server import RpcServer, serve_rpc
from tests.conftest import SMALL_RECORD_BYTES

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for
LEASE_S = 1.5  # short leases, so the silence and will tests take seconds; not shorter: a busy 2-core CI machine
# can stall the event loop for most of a second, and a missed heartbeat ends a lease a test needs


@pytest.fixture
async def port(store_small_records, nursery):
    listeners = await nursery.start(lambda task_status: serve_rpc(store_small_records, "127.0.0.1", 0,
                                                                  task_status=task_status))
    return listeners[0].socket.getsockname()[1]


class Raw:
    """A gateway-side connection that sends exactly the frames a test writes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        self.sending = trio.Lock()  # the test and keep_alive both send

    @classmethod
    async def open(cls, port: int, node: str | None = "gw-a", **hello) -> "Raw":
        raw = cls(await trio.open_tcp_stream("127.0.0.1", port))
        if node is not None:
            await raw.send(rpc.Hello(rpc.PROTOCOL_VERSION, node, **hello))
            raw.welcome = welcome = await raw.receive()
            assert welcome == rpc.Welcome(rpc.PROTOCOL_VERSION, welcome.node, LEASE_S / rpc.HEARTBEATS_PER_LEASE,
                                          LEASE_S, welcome.store_id, welcome.epoch, welcome.resumed,
                                          SMALL_RECORD_BYTES)  # the store's limit: what a producer batches by
            assert welcome.epoch > 0 and welcome.store_id
            assert welcome.node == node or hello.get("username")
        return raw

    async def send(self, *messages) -> None:
        await self.send_bytes(b"".join(rpc.encode(m) for m in messages))

    async def send_bytes(self, data: bytes) -> None:
        async with self.sending:
            await self.stream.send_all(data)

    async def receive(self, skip_heartbeats: bool = True):
        """The next message (heartbeats skipped); fails on close or timeout."""
        with trio.fail_after(WAIT_S):
            while True:
                message = self.decoder.next_message()
                if message is rpc.NEED_DATA:
                    data = await self.stream.receive_some(65536)
                    assert data, "the store closed the connection"
                    self.decoder.receive_data(data)
                elif not (skip_heartbeats and type(message) is rpc.Heartbeat):
                    return message

    async def closed(self) -> list:
        """Read until the store closes the connection; the messages it sent before (heartbeats skipped)."""
        messages = []
        with trio.fail_after(WAIT_S):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                self.decoder.receive_data(data)
                while (message := self.decoder.next_message()) is not rpc.NEED_DATA:
                    if type(message) is not rpc.Heartbeat:
                        messages.append(message)
                if not data:
                    return messages

    async def keep_alive(self) -> None:
        """Heartbeat as a gateway does (three per lease) until cancelled: the protocol's period, not a wait."""
        while True:
            await self.send(rpc.Heartbeat())
            await trio.sleep(LEASE_S / 3)


async def test_version_mismatch_is_refused_with_an_error_and_closed(port):
    raw = await Raw.open(port, node=None)
    await raw.send(rpc.Hello(rpc.PROTOCOL_VERSION + 1, "gw-a"))
    [error] = await raw.closed()
    assert error.id == 0 and error.kind is rpc.ErrorKind.VERSION
    assert f"version {rpc.PROTOCOL_VERSION + 1} is not supported" in error.message


@pytest.mark.parametrize("first", [rpc.Heartbeat(), rpc.MaxOffsets(1, ["a"]), rpc.Hello(rpc.PROTOCOL_VERSION, "")])
async def test_a_connection_must_start_with_a_named_hello(port, first):
    raw = await Raw.open(port, node=None)
    await raw.send(first)
    [error] = await raw.closed()
    assert error.kind is rpc.ErrorKind.PROTOCOL


@pytest.mark.parametrize("junk", [
    b"\x7f\xff\xff\xff",  # a 2 GiB frame announced
    (3).to_bytes(4, "big") + b"\xc1\xc1\xc1",  # not msgpack
    rpc.encode(rpc.Events({"a": 1})),  # a message only the store sends
])
async def test_bad_frames_get_an_error_frame_and_a_close_and_the_store_serves_on(port, junk):
    raw = await Raw.open(port)
    await raw.send_bytes(junk)
    [error] = await raw.closed()
    assert error.id == 0 and error.kind is rpc.ErrorKind.PROTOCOL
    other = await Raw.open(port, node="gw-b")
    await other.send(rpc.MaxOffsets(1, ["a/b"]))
    assert await other.receive() == rpc.Offsets(1, [0])


async def test_a_failed_request_is_answered_and_the_connection_goes_on(port):
    raw = await Raw.open(port)
    await raw.send(rpc.Activate(1, "a/#/b", "dev1"), rpc.Activate(2, "a/+", "dev1"))
    answers = {m.id: m for m in (await raw.receive(), await raw.receive())}
    assert answers[1].kind is rpc.ErrorKind.TOPIC and "'#' must be the last level" in answers[1].message
    assert answers[2] == rpc.Value(2, 0)


async def test_append_groups_fail_alone_and_pulls_return_the_records(port):
    raw = await Raw.open(port)
    good = [NewMessage("a/b", b"one", "dev1", 1), NewMessage("a/b", b"two", "dev1", 1)]
    too_large = [NewMessage("a/b", b"x" * 8192)]
    await raw.send(rpc.Watch({"a/#": 1}), rpc.AppendRequest(1, [good, too_large, [NewMessage("a/c", b"three")]]))
    appended = await raw.receive()
    assert await raw.receive() == rpc.Events({"a/#": 3})  # dispatched: the pulls below find everything
    assert appended.id == 1 and len(appended.positions[1]) == 0 and len(appended.positions[0]) == 2
    assert appended.errors[1].kind is rpc.ErrorKind.RECORD_TOO_LARGE
    await raw.send(rpc.Pull(2, [PullRequest("a/b", 0, 10, 1 << 20), PullRequest("a/#", 0, 10, 1 << 20)]))
    pulled = await raw.receive()
    by_b, by_a = pulled.results
    assert [(q, decode_record(r, 0, o).payload) for q, o, r in by_b.entries] == [(0, b"one"), (1, b"two")]
    assert by_b.next_offset == 2 and [o for _, o, _ in by_b.entries] == appended.positions[0].offsets
    assert [decode_record(r, 0, o).topic for _, o, r in by_a.entries] == ["a/b", "a/b", "a/c"]  # first-level queue


async def single_then_batch(raw: Raw, topic: str) -> tuple[list[NewMessage], int, list[int]]:
    """Append a single record, then a batch record of 40 messages, to ``topic``, watched: its dispatch is seen.
    Returns the batch, the single record's position and the batch's."""
    batch = [NewMessage(topic, b"m%d" % i, f"dev{i}", i % 2) for i in range(40)]
    await raw.send(rpc.Watch({topic: 1}),
                   rpc.AppendRequest(1, [[NewMessage(topic, b"before", "dev")], batch], batched=[1]))
    appended = await raw.receive()
    assert await raw.receive() == rpc.Events({topic: 41})
    return batch, appended.positions[0].offsets[0], appended.positions[1].offsets


async def test_claims_and_pulls_carry_a_batch_record_whole_once_with_the_messages_they_serve(port):
    """A batch record crosses the wire whole, once per read, with the range of its messages served
    (``RawRecords.batches``; docs/storage.md, "Batch records"): the store neither splits nor re-encodes it, and
    the client (``decoded``) serves each message once, in order, at its queue offset and position."""
    raw = await Raw.open(port)
    batch, single, positions = await single_then_batch(raw, "jobs/a")
    for rid, member in ((2, "m1"), (3, "m2")):
        await raw.send(rpc.Join(rid, "$group/w", "jobs/a", member, start="earliest"))
        assert await raw.receive() == rpc.Value(rid, 0)
    await raw.send(rpc.Claim(4, "$group/w", "jobs/a", 11, 1 << 20, 0, "m1"))  # the single record and 10 of the batch
    first = (await raw.receive()).result
    assert [entry[:2] for entry in first.entries] == [(0, single), (1, positions[0])] and first.batches == {1: (0, 10)}
    await raw.send(rpc.Leave(5, "$group/w", "jobs/a", "m1"))
    assert await raw.receive() == rpc.Done(5)
    await raw.send(rpc.Claim(6, "$group/w", "jobs/a", 100, 1 << 20, 0, "m2"))
    again = (await raw.receive()).result  # what m1 handed back, then the rest: the batch record twice
    assert [entry[:2] for entry in again.entries] == [(0, single), (1, positions[0]), (1, positions[0])]
    assert again.batches == {1: (0, 10), 2: (10, 40)} and again.next_offset == 41
    claimed = decoded(again).messages
    assert [(qoff, r.offset, r.payload, r.client_id, r.qos) for qoff, r in claimed] == [
        (0, single, b"before", "dev", 0),
        *((1 + i, positions[i], m.payload, m.client_id, m.qos) for i, m in enumerate(batch))]
    await raw.send(rpc.Ack(7, "$group/w", "jobs/a", [qoff for qoff, _ in claimed], "m2"))
    assert await raw.receive() == rpc.Value(7, 41)
    await raw.send(rpc.Pull(8, [PullRequest("jobs/a", 5, 30, 1 << 20)]))
    pulled = (await raw.receive()).results[0]
    assert len(pulled.entries) == 1 and pulled.batches == {0: (4, 34)} and pulled.next_offset == 35
    assert [(qoff, r.offset) for qoff, r in decoded(pulled).messages] == [
        (1 + i, positions[i]) for i in range(4, 34)]


async def test_claims_of_a_few_messages_of_a_large_batch_record_carry_a_record_of_those_only(port):
    """A claim served fewer than half of a batch record's messages gets a batch record of those only
    (``store.log.record.batch_part``, at the first one's position), not the record whole each time: each message
    once, in order, at its queue offset and position, as from the record whole."""
    raw = await Raw.open(port)
    batch = [NewMessage("jobs/r", os.urandom(1000), f"dev{i}", i % 2) for i in range(3)]  # random: stored raw
    await raw.send(rpc.Watch({"jobs/r": 1}), rpc.AppendRequest(1, [batch], batched=[0]))
    positions = (await raw.receive()).positions[0].offsets
    assert await raw.receive() == rpc.Events({"jobs/r": 3})
    await raw.send(rpc.Join(2, "$group/w", "jobs/r", "m1", start="earliest"))
    assert await raw.receive() == rpc.Value(2, 0)
    claimed = []
    for rid in range(3, 6):  # one message at a time
        await raw.send(rpc.Claim(rid, "$group/w", "jobs/r", 1, 1 << 20, 0, "m1"))
        result = (await raw.receive()).result
        [(qoff, log_offset, data)] = result.entries
        assert result.batches == {0: (0, 1)} and log_offset == positions[qoff] and len(data) < 1200  # not 3,000
        claimed += decoded(result).messages
    assert [(qoff, r.offset, r.payload, r.client_id, r.qos) for qoff, r in claimed] == [
        (i, positions[i], m.payload, m.client_id, m.qos) for i, m in enumerate(batch)]


async def test_a_pop_carries_a_batch_record_whole_once_with_a_handle_per_message(port):
    """A POP's answer carries a batch record whole, once, as claims do (``PopResult.result``), with each message's
    own receipt handle and attempt (``PopResult.handles``): each message goes to one member, once, and is
    acknowledged and made visible again by its own handle, the others of its record untouched."""
    raw = await Raw.open(port)
    batch, single, positions = await single_then_batch(raw, "jobs/p")

    async def answer(request):
        await raw.send(request)
        while type(message := await raw.receive()) is rpc.Events:  # a revived message is news of the queue
            pass
        assert message.id == request.id
        return message

    async def pop(rid: int, member: str, max_count: int, wait_ms: int = 0) -> rpc.PopResult:
        return await answer(rpc.Pop(rid, "workers", "jobs/p", max_count, 30_000, wait_ms, 5, 1 << 20, member,
                                    start="earliest"))

    first = await pop(2, "m1", 11)  # the single record and 10 messages of the batch record
    assert [entry[:2] for entry in first.result.entries] == [(0, single), (1, positions[0])]
    assert first.result.batches == {1: (0, 10)}
    rest = await pop(3, "m2", 100)  # the same record again, whole, with the 30 messages m1 did not get
    assert [entry[:2] for entry in rest.result.entries] == [(1, positions[0])] and rest.result.batches == {0: (10, 40)}
    popped = [(qoff, record, handle, attempt) for answer in (first, rest)
              for (qoff, record), (handle, attempt) in zip(decoded(answer.result).messages, answer.handles,
                                                            strict=True)]
    assert [(qoff, r.offset, r.payload, r.client_id, r.qos) for qoff, r, _, _ in popped] == [
        (0, single, b"before", "dev", 0),
        *((1 + i, positions[i], m.payload, m.client_id, m.qos) for i, m in enumerate(batch))]
    handles = [handle for _, _, handle, _ in popped]
    assert len(set(handles)) == 41 and {attempt for *_, attempt in popped} == {1}
    assert (await pop(4, "m3", 100)).handles == []  # every message is held

    acked = await answer(rpc.PopAck(5, handles[:6] + [handles[3]]))  # the single message and the batch's first 5
    assert acked.acked == [True] * 6 + [False]  # one message acknowledged once
    renewed = await answer(rpc.ChangeInvisible(6, handles[8], 0))  # the batch's 8th message only: visible now
    assert renewed.handle not in (None, handles[8])
    again = await pop(7, "m3", 100, wait_ms=int(WAIT_S * 1000))  # woken by the revive step
    assert again.result.batches == {0: (7, 8)} and again.handles[0][1] == 2  # its record whole, one message served
    [(qoff, record)] = decoded(again.result).messages
    assert (qoff, record.offset, record.payload) == (8, positions[7], b"m7")
    acked = await answer(rpc.PopAck(8, [handles[8], again.handles[0][0], handles[9]]))
    assert acked.acked == [False, True, True]  # the first handle went stale with the change


async def test_events_go_only_to_the_node_that_watches_the_queue(port):
    watcher = await Raw.open(port, node="gw-a")
    other = await Raw.open(port, node="gw-b")
    await watcher.send(rpc.Watch({"a/b": 1}))
    await other.send(rpc.Watch({"x/y": 1}), rpc.AppendRequest(1, [[NewMessage("a/b", b"m")]]))
    assert (await other.receive()).id == 1
    assert await watcher.receive() == rpc.Events({"a/b": 1})
    await other.send(rpc.GetStatistics(2))
    stats = (await other.receive()).stats
    assert stats.notify_by_node == {"gw-a": 1, "gw-b": 0}
    assert stats.notify_suppressed >= 1  # gw-b was not sent the a/b event


async def test_a_node_that_reconnects_replaces_its_old_connection(port):
    old = await Raw.open(port, node="gw-a")
    new = await Raw.open(port, node="gw-a")
    assert await old.closed() == []
    await new.send(rpc.Watch({"a/b": 1}), rpc.AppendRequest(1, [[NewMessage("a/b", b"m")]]))
    assert {type(await new.receive()), type(await new.receive())} == {rpc.Appended, rpc.Events}


def opened(rid: int, client_id: str, *, expiry_s: int = 0, payload: bytes | None = None, delay: int = 0):
    """An ``OpenSession`` of ``client_id``, with a will when ``payload`` is given."""
    return rpc.OpenSession(rid, client_id, False, expiry_s, None if payload is None else will(client_id, payload),
                           delay)


async def test_a_client_present_on_another_node_is_reported_moved_to_the_node_that_had_it(port):
    a = await Raw.open(port, node="gw-a")
    b = await Raw.open(port, node="gw-b")
    await a.send(opened(1, "dev1"), opened(2, "dev2"), opened(3, "dev3"), rpc.CloseSession(4, "dev3", 0))
    assert sorted([(await a.receive()).id for _ in range(4)]) == [1, 2, 3, 4]
    await b.send(opened(1, "dev3"), opened(2, "dev1"))  # dev3 left gw-a before: no notice for it
    assert await a.receive() == rpc.ClientMoved("dev1")
    assert sorted([(await b.receive()).id for _ in range(2)]) == [1, 2]
    await a.send(rpc.CloseSession(5, "dev1", 0))  # gw-b has dev1 now: gw-a's close changes nothing
    assert await a.receive() == rpc.Done(5)
    await a.send(opened(6, "dev1"))  # dev1 comes back to gw-a
    assert await b.receive() == rpc.ClientMoved("dev1")
    assert await a.receive() == rpc.Value(6, None)
    await a.send(rpc.MaxOffsets(7, []))
    assert await a.receive() == rpc.Offsets(7, [])  # and nothing else came to gw-a meanwhile


async def test_appends_of_a_client_present_on_another_node_are_refused_there(port):
    """A connection closing while the store is away (a failover) keeps its appends until the next link; meanwhile
    its publisher connected to another node and resent them there, which stored them and released their QoS 2
    flows. Stored again from the old node, they would be new messages [MQTT-4.3.3-2]: duplicates."""
    a = await Raw.open(port, node="gw-a")
    b = await Raw.open(port, node="gw-b")
    await a.send(opened(1, "dev1"), opened(2, "dev2"))
    assert sorted([(await a.receive()).id for _ in range(2)]) == [1, 2]
    await b.send(opened(1, "dev1"))
    assert await a.receive() == rpc.ClientMoved("dev1")
    assert await b.receive() == rpc.Value(1, None)
    resent = NewMessage("q2/dev1", b"m1", "dev1", 2, packet_id=7)
    await b.send(rpc.AppendRequest(2, [[resent]]))
    assert [len(p) for p in (await b.receive()).positions] == [1]
    late = rpc.AppendRequest(3, [[resent], [NewMessage("q2/dev2", b"m2", "dev2", 2, packet_id=7)],
                                 [NewMessage("will/dev1", b"gone", "dev1", 1)]])
    await a.send(late)
    appended = await a.receive()
    assert appended.id == 3 and appended.errors[0].kind is rpc.ErrorKind.FENCED and set(appended.errors) == {0}
    # dev2 is still gw-a's; dev1's will (due at the takeover: published by gw-a) opens no QoS 2 flow
    assert [len(p) for p in appended.positions] == [0, 1, 1]
    await b.send(rpc.Pull(4, [PullRequest("q2/dev1", 0, 10, 1 << 20)]))
    [result] = (await b.receive()).results
    assert [decode_record(r, 0, o).payload for _, o, r in result.entries] == [b"m1"]  # stored once


async def test_a_silent_node_is_closed_and_its_wills_fire_after_the_lease(port, nursery):
    observer = await Raw.open(port, node="observer")
    nursery.start_soon(observer.keep_alive)
    await observer.send(rpc.Watch({"will/dev1": 1}))
    silent = await Raw.open(port, node="gw-a")
    await silent.send(opened(1, "dev1", payload=b"gone"), opened(2, "dev2", payload=b"gone"),
                      rpc.CloseSession(3, "dev2", 0, None))  # a normal disconnect: no will
    with trio.fail_after(WAIT_S):
        answers = await silent.closed()  # silent for LEASE_S: closed
        assert sorted(type(m).__name__ for m in answers) == ["Done", "Value", "Value"]  # answered in any order
        events = await observer.receive()
    assert events == rpc.Events({"will/dev1": 1})
    await observer.send(rpc.Pull(1, [PullRequest("will/#", 0, 10, 1 << 20)]))
    [result] = (await observer.receive()).results
    assert [decode_record(r, 0, o).topic for _, o, r in result.entries] == ["will/dev1"]  # dev2's was dropped


async def test_heartbeats_keep_a_node_connected_and_the_store_sends_its_own(port, nursery):
    raw = await Raw.open(port)
    nursery.start_soon(raw.keep_alive)
    for _ in range(2 * rpc.HEARTBEATS_PER_LEASE):  # the store's heartbeats over two leases
        assert type(await raw.receive(skip_heartbeats=False)) is rpc.Heartbeat
    await raw.send(rpc.MaxOffsets(1, []))
    assert await raw.receive() == rpc.Offsets(1, [])


# --- leases and fencing -------------------------------------------------------------------


def will(client_id: str, payload: bytes = b"gone") -> NewMessage:
    return NewMessage(f"will/{client_id}", payload, client_id, 1)


async def test_a_node_back_within_its_lease_resumes_it_with_the_same_epoch(port):
    first = await Raw.open(port, node="gw-a")
    await first.stream.aclose()
    again = await Raw.open(port, node="gw-a", store_id=first.welcome.store_id, epoch=first.welcome.epoch)
    assert (again.welcome.epoch, again.welcome.resumed) == (first.welcome.epoch, True)


async def test_a_node_of_an_earlier_store_process_keeps_its_lease_epoch_and_its_clients(port):
    other = await Raw.open(port, node="gw-b")  # takes this store's first epochs
    raw = await Raw.open(port, node="gw-a", store_id="a-store-that-restarted", epoch=other.welcome.epoch)
    # Nothing of this store's ended: the lease is adopted with its epoch, so the writes the node makes for its
    # clients (which name it) are taken, and it registers its clients again.
    assert (raw.welcome.epoch, raw.welcome.resumed) == (other.welcome.epoch, True)
    await raw.send(rpc.AppendRequest(1, [[NewMessage("a/b", b"m", "dev1", 1)]], None, other.welcome.epoch))
    assert type(await raw.receive()) is rpc.Appended
    newer = await Raw.open(port, node="gw-c")
    assert newer.welcome.epoch > other.welcome.epoch  # an adopted epoch is never handed out again


async def test_a_node_back_after_its_lease_ended_is_told_and_its_writes_of_that_lease_are_refused(port, nursery):
    observer = await Raw.open(port, node="observer")
    nursery.start_soon(observer.keep_alive)
    await observer.send(rpc.Watch({"will/dev1": 1}))
    frozen = await Raw.open(port, node="gw-a")
    ended = frozen.welcome.epoch
    await frozen.send(opened(1, "dev1", payload=b"gone"))
    assert [type(m) for m in await frozen.closed()] == [rpc.Value]  # silent for the lease
    assert await observer.receive() == rpc.Events({"will/dev1": 1})  # the lease ended: its will is published
    woken = await Raw.open(port, node="gw-a", store_id=frozen.welcome.store_id, epoch=ended)
    nursery.start_soon(woken.keep_alive)
    assert not woken.welcome.resumed and woken.welcome.epoch != ended
    message = NewMessage("a/b", b"stale", "dev1", 1)
    await woken.send(rpc.AppendRequest(1, [[message]], None, ended), rpc.SaveSession(2, "dev1", b"blob", ended),
                     rpc.CommitOffsets(3, {"dev1": {"a/b": 1}}, ended), rpc.CloseSession(4, "dev1", 0, None, ended),
                     rpc.Release(5, "a/#", "dev1", ended),
                     rpc.ReleaseAwaiting(6, [Flow("dev1", 1, Position(MAIN_LOG, 0))], ended))
    answers = [await woken.receive() for _ in range(6)]
    assert sorted(a.id for a in answers) == [1, 2, 3, 4, 5, 6]
    assert {a.kind for a in answers} == {rpc.ErrorKind.FENCED}
    await woken.send(rpc.Reattach("dev2", 0, will("dev2"), 0, ended))  # ignored
    other = await Raw.open(port, node="gw-b")
    await other.send(opened(1, "dev2"))
    await woken.send(rpc.AppendRequest(7, [[NewMessage("a/b", b"now", "dev3", 1)]], None, woken.welcome.epoch))
    assert type(await woken.receive()) is rpc.Appended  # and no ClientMoved for dev2 came before it
    await woken.send(rpc.Pull(8, [PullRequest("a/b", 0, 10, 1 << 20)]))
    [result] = (await woken.receive()).results
    assert [decode_record(r, 0, o).payload for _, o, r in result.entries] == [b"now"]  # nothing stale appended


async def test_a_client_registered_again_never_displaces_its_newer_connection_elsewhere(port, nursery):
    observer = await Raw.open(port, node="observer")
    nursery.start_soon(observer.keep_alive)
    await observer.send(rpc.Watch({"will/dev1": 1}))
    a = await Raw.open(port, node="gw-a")
    nursery.start_soon(a.keep_alive)
    await a.send(opened(1, "dev1", payload=b"from a"))
    assert await a.receive() == rpc.Value(1, None)
    b = await Raw.open(port, node="gw-b")
    await b.send(opened(1, "dev1", payload=b"from b"))
    assert await a.receive() == rpc.ClientMoved("dev1")  # the newer connection is on gw-b
    assert await b.receive() == rpc.Value(1, None)
    # gw-a registers its (older) connection again, as after a reconnect: it is told to close it, gw-b keeps it
    await a.send(rpc.Reattach("dev1", 0, will("dev1", b"from a"), 0))
    assert await a.receive() == rpc.ClientMoved("dev1")
    await b.send(rpc.MaxOffsets(2, []))
    assert await b.receive() == rpc.Offsets(2, [])  # and nothing else came to gw-b
    assert await b.closed() == []  # gw-b goes silent: its lease ends with the will it holds
    assert await observer.receive() == rpc.Events({"will/dev1": 1})
    await observer.send(rpc.Pull(1, [PullRequest("will/dev1", 0, 10, 1 << 20)]))
    [result] = (await observer.receive()).results
    assert [decode_record(r, 0, o).payload for _, o, r in result.entries] == [b"from b"]


# --- who may connect ----------------------------------------------------------------------


def check_password(username, password, source) -> Verdict:
    return Verdict(True, username) if (username, password) == ("u", b"p") else Verdict(False, why="bad password")


async def test_a_back_end_user_cannot_take_a_gateway_node_name(store_small_records, nursery):
    access = StoreAccess(token="t", authenticate=check_password)
    listeners = await nursery.start(partial(serve_rpc, store_small_records, "127.0.0.1", 0, access=access))
    port = listeners[0].socket.getsockname()[1]
    gateway = await Raw.open(port, node="gw-a", token="t")
    nursery.start_soon(gateway.keep_alive)
    for _ in range(3):
        user = await Raw.open(port, node="gw-a", username="u", password=b"p")
        assert user.welcome.node == "$client/u:gw-a"  # its own namespace
        await user.send(rpc.Reattach("dev1", 0))  # a gateway's message: refused, and the connection closed
        [error] = await user.closed()
        assert error.kind is rpc.ErrorKind.DENIED
    await gateway.send(rpc.MaxOffsets(1, []))
    assert await gateway.receive() == rpc.Offsets(1, [])  # never closed meanwhile


async def test_before_authentication_frames_are_capped_and_the_handshake_has_a_deadline(store_small_records, nursery,
                                                                                         monkeypatch, caplog):
    monkeypatch.setattr(server, "HANDSHAKE_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="store.rpc.server")
    rpc_server = RpcServer(store_small_records)
    listeners = await nursery.start(partial(trio.serve_tcp, rpc_server.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    count = 8
    for _ in range(count):  # a 64 MiB frame announced: refused at its length
        raw = await Raw.open(port, node=None)
        await raw.send_bytes((rpc.MAX_FRAME_BYTES - 1).to_bytes(4, "big"))
        [error] = await raw.closed()
        assert error.kind is rpc.ErrorKind.PROTOCOL and f"limit of {rpc.MAX_HELLO_BYTES} bytes" in error.message
    stalled = [await Raw.open(port, node=None) for _ in range(count)]
    for raw in stalled:  # the largest frame allowed, never finished
        await raw.send_bytes(rpc.MAX_HELLO_BYTES.to_bytes(4, "big") + bytes(rpc.MAX_HELLO_BYTES - 1))
    with trio.fail_after(WAIT_S):
        while rpc_server.handshake_bytes() < count * (rpc.MAX_HELLO_BYTES + 3):
            await trio.sleep(0.01)  # the store reads at its pace: wait for what it holds
    assert rpc_server.handshake_bytes() <= count * (4 + rpc.MAX_HELLO_BYTES)
    for raw in stalled:
        [error] = await raw.closed()  # at the deadline
        assert "no Hello within 1.0 s" in error.message
    assert rpc_server.handshake_bytes() == 0
    refused = [r for r in caplog.records if r.getMessage().startswith("RPC connection refused")]
    assert len(refused) == 1  # 16 refusals of one peer address: one line
