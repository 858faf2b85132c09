"""Back-end producers (store/clients/producer.py) and store access (store/rpc/access.py, its wiring in gateway/app/cli.py).

In-process tests run a real store node and its RPC server on real sockets; the
slow test runs `lightgate store` and `lightgate gateway` processes with
authentication on and a paho MQTT 5 device that receives what the producer sends.
"""



from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from gateway.app import config as cfg
from gateway.app.cli import _store_access
from gateway.auth.passwords import PasswordFile
from gateway.mqtt.properties import PacketType, decode_properties
from lightqueue.topics import TopicError
from store.api import MAIN_LOG, Flow, NewMessage, Position, PullRequest, group_owner
from store.clients.producer import BATCH_MAX_COUNT, Message, Producer, encode_properties
from store.local import LocalStore
from store.log.record import RecordTooLarge
from store.rpc.access import AccessDenied, Peer, StoreAccess, Verdict
from store.rpc.client import RemoteStore, StoreRpcError
from store.rpc.server import serve_rpc
from tests.helpers.backend import WAIT_S, Device, cluster


# --- processes ----------------------------------------------------------------------------------


# --- in-process store ---------------------------------------------------------------------------


async def serve(nursery, store, access: StoreAccess | None = None) -> int:
    listeners = await nursery.start(lambda task_status: serve_rpc(store, "127.0.0.1", 0, access=access,
                                                                  task_status=task_status))
    return listeners[0].socket.getsockname()[1]


def test_common_properties_encode_as_the_gateway_decodes_them():
    block = encode_properties(payload_format_indicator=1, message_expiry_interval=60, content_type="text/plain",
                              response_topic="reply/svc", correlation_data=b"\x00\x01",
                              user_properties=[("k", "v"), ("k", "w")])
    props = decode_properties(block, 0, len(block), PacketType.PUBLISH)
    assert (props.payload_format_indicator, props.message_expiry_interval, props.content_type,
            props.response_topic, props.correlation_data, props.user_properties) == \
        (1, 60, "text/plain", "reply/svc", b"\x00\x01", (("k", "v"), ("k", "w")))
    assert encode_properties() == b""
    with pytest.raises(ValueError, match="payload_format_indicator"):
        encode_properties(payload_format_indicator=2)
    with pytest.raises(TopicError):
        encode_properties(response_topic="reply/#")


async def test_sends_are_batched_stored_in_order_and_each_handle_gets_its_offset(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, client_id="svc-1", batch_max_delay_ms=50) as producer:
        handles = [await producer.send("cmd/dev1", b"%d" % i, qos=1, content_type="text/plain") for i in range(300)]
        retained = await producer.send("status/dev1", b"on", qos=0, retain=True, properties=b"\x01\x01")
        offsets = [await handle for handle in handles]
        await producer.flush()
        stats = producer.statistics()
    assert offsets == sorted(offsets) and len(set(offsets)) == 300 and await retained > offsets[-1]
    assert stats.stored == 301 and stats.failed == 0 and stats.batches < 301
    async with RemoteStore.connect("127.0.0.1", port, node="reader") as client:
        [cmd, status] = await client.pull([PullRequest("cmd/dev1", 0, 1000), PullRequest("status/dev1", 0, 10)])
        [kept] = await client.retained("status/#")
    records = [record for _, record in cmd.messages]
    assert [r.payload for r in records] == [b"%d" % i for i in range(300)]
    assert {(r.client_id, r.qos, r.retain) for r in records} == {("svc-1", 1, False)}
    assert decode_properties(records[0].properties, 0, len(records[0].properties), PacketType.PUBLISH).content_type \
        == "text/plain"
    [(_, on)] = status.messages
    assert (on.payload, on.qos, on.retain, on.properties, kept.payload) == (b"on", 0, True, b"\x01\x01", b"on")


async def test_a_bad_message_fails_alone_and_bad_arguments_fail_at_send(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, batch_max_delay_ms=1000) as producer:
        before = await producer.send("a/b", b"1")
        huge = await producer.send("a/b", b"x" * 8192)  # above the store's max_record_bytes of 4096
        after = await producer.send("a/b", b"2")
        await producer.flush()
        with pytest.raises(RecordTooLarge):
            await huge
        assert await before < await after
        with pytest.raises(TopicError):
            await producer.send("a/+", b"wildcards are for filters")
        with pytest.raises(ValueError, match="qos"):
            await producer.send("a/b", b"", qos=3)


@pytest.mark.parametrize("where", ["rpc", "local"])
async def test_same_topic_runs_are_batch_records_and_a_message_too_large_fails_alone_in_order(
        where, store_small_records, nursery):
    """A run of one topic is written as batch records (its messages' positions follow one another: no single
    record is one byte long); a message too large fails alone and one close to the limit is stored alone, and
    the topic keeps its order around both (what the store learns of its limit: the Welcome, or its config)."""
    near = 4096 - 200  # its own record fits the store's max_record_bytes of 4096; in a batch record, barely
    sends = [b"a0", b"a1", b"a2", b"x" * 8192, b"a3", b"a4", b"n" * near, b"a5", b"a6"]
    local = LocalStore(store_small_records, "local-producer")
    try:
        async with Producer.over(local, client_id="svc-2") if where == "local" else \
                Producer.connect("127.0.0.1", await serve(nursery, store_small_records), client_id="svc-2") \
                as producer:
            handles = await producer.send_batch([Message("runs/a", payload) for payload in sends] +
                                                [Message("runs/b", b"b%d" % i) for i in range(3)])
            with pytest.raises(RecordTooLarge):
                await handles[3]
            offsets = [(await handle).offset for i, handle in enumerate(handles) if i != 3]
    finally:
        local.close()
    a, b = offsets[:8], offsets[8:]
    assert a == sorted(a) and b == sorted(b)
    assert (a[1] - a[0], a[2] - a[1], a[4] - a[3], a[7] - a[6], b[1] - b[0], b[2] - b[1]) == (1,) * 6
    assert a[5] - a[4] > 1 and a[6] - a[5] > near  # the one near the limit is a record of its own
    [result] = await LocalStore(store_small_records, "reader").pull([PullRequest("runs/a", 0, 100)])
    assert [record.payload for _, record in result.messages] == [p for i, p in enumerate(sends) if i != 3]
    assert [record.offset for _, record in result.messages] == a


async def test_flush_returns_at_once_when_nothing_waits_and_the_block_flushes_on_exit(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, batch_max_delay_ms=60_000) as producer:
        with trio.fail_after(WAIT_S):
            await producer.flush()
        handle = await producer.send("a/b", b"sent last")
    assert handle.done()
    assert (await handle).offset >= 0


# --- AutoBatch and send_batch -------------------------------------------------------------------


async def pulled(port: int, queue: str, token: str = "") -> list[bytes]:
    async with RemoteStore.connect("127.0.0.1", port, node="reader", token=token) as client:
        [result] = await client.pull([PullRequest(queue, 0, 10_000)])
    return [record.payload for _, record in result.messages]


async def test_a_batch_leaves_when_full_each_handle_resolves_alone_and_each_topic_keeps_its_order(
        store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, batch_max_count=4, batch_max_delay_ms=60_000) as producer:
        handles = [await producer.send(f"order/{'ab'[i % 2]}", b"%d" % i) for i in range(6)]
        with trio.fail_after(WAIT_S):  # the first four are a full batch: they leave without waiting the delay
            first = [await handle for handle in handles[:4]]
        assert not handles[4].done() and not handles[5].done()  # the last two wait for the delay (a minute)
        assert producer.statistics().buffered == 2
        await producer.flush()
        last = [await handle for handle in handles[4:]]
    a_offsets = [p.offset for p in (first[0], first[2], last[0])]
    b_offsets = [p.offset for p in (first[1], first[3], last[1])]
    assert a_offsets == sorted(a_offsets) and b_offsets == sorted(b_offsets)
    assert first[0].offset < first[2].offset < first[1].offset  # in a batch, a topic's messages go together
    assert await pulled(port, "order/a") == [b"0", b"2", b"4"]
    assert await pulled(port, "order/b") == [b"1", b"3", b"5"]


async def test_a_batch_leaves_after_its_delay_without_a_flush(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, batch_max_delay_ms=20) as producer:
        handle = await producer.send("delay/a", b"alone")
        with trio.fail_after(WAIT_S):
            assert (await handle).offset >= 0  # no flush, no full batch: the delay sent it
        assert producer.statistics().batches == 1


async def test_closing_the_producer_stores_every_message_sent(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, batch_max_delay_ms=60_000, batch_max_count=100_000) as producer:
        handles = [await producer.send("close/a", b"%d" % i, qos=0) for i in range(1000)]
        handles += await producer.send_batch([Message("close/a", b"batch"), Message("close/b", b"batch")])
        handles.append(await producer.send("close/a", b"last"))
        assert not any(handle.done() for handle in handles[:1000])
    assert all(handle.done() for handle in handles)
    assert await pulled(port, "close/a") == [b"%d" % i for i in range(1000)] + [b"batch", b"last"]
    assert await pulled(port, "close/b") == [b"batch"]


async def test_send_batch_is_one_request_and_each_message_has_its_own_outcome(store_small_records, nursery):
    access = StoreAccess(token="gw-secret", authenticate=check_password, authorize=only_cmd)
    port = await serve(nursery, store_small_records, access)
    async with Producer.connect("127.0.0.1", port, username="svc", password="secret") as producer:
        handles = await producer.send_batch([
            Message("cmd/dev1", b"one", qos=1, content_type="text/plain"),
            Message("secret/x", b"the ACL says no"),
            Message("cmd/dev1", b"x" * 8192),  # above the store's max_record_bytes of 4096
            Message("cmd/dev2", b"two", qos=0),
            Message("cmd/dev1", b"later", delay_s=3600),  # a delayed message: its Delayed record's position
            Message("cmd/dev1", b"three"),
        ])
        with trio.fail_after(WAIT_S):
            one, two, later, three = await handles[0], await handles[3], await handles[4], await handles[5]
            with pytest.raises(AccessDenied, match="publish"):
                await handles[1]
            with pytest.raises(RecordTooLarge):
                await handles[2]
        assert producer.statistics().batches == 1  # all six in one request, sent at once (no delay waited)
        with pytest.raises(TopicError):  # checked whole before anything is sent
            await producer.send_batch([Message("cmd/dev1", b"fine"), Message("cmd/+", b"a filter")])
        assert producer.statistics().sent == 6
    assert one.offset < later.offset < three.offset and two.offset >= 0
    assert await pulled(port, "cmd/dev1", "gw-secret") == [b"one", b"three"]


@asynccontextmanager
async def producer_on(where: str, store, nursery, **settings):
    """A producer over the RPC or on a ``LocalStore`` of ``store`` (``settings``: ``Producer.over``'s)."""
    if where == "rpc":
        async with Producer.connect("127.0.0.1", await serve(nursery, store), **settings) as producer:
            yield producer
        return
    local = LocalStore(store, "local-producer")
    try:
        async with Producer.over(local, **settings) as producer:
            yield producer
    finally:
        local.close()


async def stored(store, queue: str) -> list:
    reader = LocalStore(store, "reader")
    try:
        [result] = await reader.pull([PullRequest(queue, 0, 10_000)])
    finally:
        reader.close()
    return [record for _, record in result.messages]


@pytest.mark.parametrize("where", ["rpc", "local"])
async def test_a_send_batch_of_payloads_is_one_batch_record_each_payload_at_its_position(
        where, store_small_records, nursery):
    payloads = [b"p%d" % i for i in range(10)]
    async with producer_on(where, store_small_records, nursery, client_id="svc-p") as producer:
        handle = await producer.send_batch(payloads, topic="pay/a", qos=0, content_type="text/plain")
        with trio.fail_after(WAIT_S):
            positions = await handle
        assert handle.done() and len(handle) == len(positions) == 10
        assert [handle[i].result() for i in range(10)] == list(positions) and handle[-10].result() == positions[0]
        assert producer.statistics().batches == 1  # sent at once, in one request
    offsets = [p.offset for p in positions]
    assert offsets == list(range(offsets[0], offsets[0] + 10))  # one batch record: position base + i
    records = await stored(store_small_records, "pay/a")
    assert [(r.offset, r.payload, r.client_id, r.qos, r.retain) for r in records] == \
        [(o, p, "svc-p", 0, False) for o, p in zip(offsets, payloads)]
    assert {decode_properties(r.properties, 0, len(r.properties), PacketType.PUBLISH).content_type
            for r in records} == {"text/plain"}


@pytest.mark.parametrize("where", ["rpc", "local"])
async def test_a_payload_too_large_fails_alone_and_a_run_over_one_record_is_cut_in_order(
        where, store_small_records, nursery):
    """A run of payloads goes whole into one batch record only when it can: a payload over the record limit fails
    alone (its neighbours are stored, in order), and a run whose messages each fit but not all together is cut
    into records, in order. Plain sends of one topic are such a run too (until another send joins them)."""
    payloads = [b"a0", b"a1", b"x" * 8192, b"a2"]
    many = [b"%03d" % i + b"m" * 397 for i in range(20)]  # 8,000 bytes: two records of 4,096 at least
    async with producer_on(where, store_small_records, nursery, client_id="svc-q",
                           batch_max_delay_ms=60_000) as producer:
        sends = [await producer.send("pay/d", p) for p in payloads]
        await producer.flush()
        with pytest.raises(RecordTooLarge):
            await sends[2]
        sends = [await producer.send("pay/e", p) for p in payloads[:2]]  # a run, then messages: one with options
        sends += [await producer.send("pay/e", b"e0", qos=0), await producer.send("pay/e", b"e1")]
        handle = await producer.send_batch(payloads, topic="pay/b")
        cut = await producer.send_batch(many, topic="pay/c")
        with trio.fail_after(WAIT_S):
            with pytest.raises(RecordTooLarge):
                await handle
            with pytest.raises(RecordTooLarge):
                await handle[2]
            kept = [await handle[i] for i in (0, 1, 3)]
            positions = await cut
        assert producer.statistics().failed == 2
        sent = [await send for send in sends]
    assert [r.payload for r in await stored(store_small_records, "pay/d")] == [b"a0", b"a1", b"a2"]
    records = await stored(store_small_records, "pay/e")
    assert [(r.offset, r.payload, r.qos) for r in records] == \
        [(p.offset, payload, qos) for p, payload, qos in zip(sent, [b"a0", b"a1", b"e0", b"e1"], [1, 1, 0, 1])]
    assert [p.offset for p in kept] == sorted(p.offset for p in kept)
    assert [(r.offset, r.payload) for r in await stored(store_small_records, "pay/b")] == \
        [(p.offset, payload) for p, payload in zip(kept, [b"a0", b"a1", b"a2"])]
    records = await stored(store_small_records, "pay/c")
    assert [(r.offset, r.payload) for r in records] == [(p.offset, payload) for p, payload in zip(positions, many)]
    assert records[-1].offset - records[0].offset > len(many)  # more than one record


async def test_sends_and_a_send_batch_of_payloads_go_in_one_request_each_with_its_own_outcome(
        store_small_records, nursery):
    """The sends buffered go with the ``send_batch`` that follows them, in one request; each topic keeps its
    order, each handle answers its own message (a topic the ACL denies fails all of its messages, alone), and
    callbacks are called with the handle they were given to."""
    access = StoreAccess(token="gw-secret", authenticate=check_password, authorize=only_cmd)
    port = await serve(nursery, store_small_records, access)
    called: list = []
    async with Producer.connect("127.0.0.1", port, username="svc", password="secret",
                                batch_max_delay_ms=60_000) as producer:
        first = await producer.send("cmd/a", b"s0")
        denied = await producer.send("secret/x", b"no")
        other = await producer.send("cmd/b", b"s1")
        run = await producer.send_batch([b"r0", b"r1", b"r2"], topic="cmd/a")
        refused = await producer.send_batch([b"n0", b"n1"], topic="secret/y")
        later = await producer.send_batch([b"d0", b"d1"], topic="cmd/a", delay_s=3600)  # delayed: not batched
        first.add_done_callback(called.append)
        run.add_done_callback(called.append)
        with trio.fail_after(WAIT_S):
            positions = await run
            s0, s1 = await first, await other
            delayed = await later
            for failing in (denied, refused, refused[0], refused[1]):
                with pytest.raises(AccessDenied):
                    await failing
        stats = producer.statistics()
    assert called == [first, run]
    assert (stats.stored, stats.failed) == (7, 3) and stats.batches <= 3  # the run waiting joins the next request
    assert s0.offset < positions[0].offset < positions[1].offset < positions[2].offset and s1.offset >= 0
    assert len(set(delayed.offsets)) == 2 and delayed.offsets[0] > positions[2].offset
    assert await pulled(port, "cmd/a", "gw-secret") == [b"s0", b"r0", b"r1", b"r2"]
    assert await pulled(port, "cmd/b", "gw-secret") == [b"s1"]


class HeldStore:
    """A ``LocalStore`` whose appends wait for ``release`` and count the groups of each request: what the producer
    puts in one request shows while the first is held in flight."""

    def __init__(self, store) -> None:
        self.local = LocalStore(store, "held-producer")
        self.release = trio.Event()
        self.requests: list[int] = []

    @property
    def max_record_bytes(self) -> int:
        return self.local.max_record_bytes

    async def append_groups(self, groups, *, durable=None, batched=()):
        self.requests.append(len(groups))
        await self.release.wait()
        return await self.local.append_groups(groups, durable=durable, batched=batched)


async def test_a_send_batch_leaves_with_every_batch_waiting_before_it_in_one_request(store_small_records):
    """While a request is in flight, the sends and ``send_batch`` calls that follow wait; the next request takes
    them all (fewer, larger requests), each topic in order and each handle with its own message's position."""
    held = HeldStore(store_small_records)
    try:
        async with Producer.over(held, client_id="held", batch_max_delay_ms=60_000) as producer:
            first = await producer.send_batch([b"f0", b"f1"], topic="held/a")
            with trio.fail_after(WAIT_S):
                while not held.requests:  # the first request is in flight, held
                    await trio.testing.wait_all_tasks_blocked()
            sends = [await producer.send("held/a", b"s%d" % i) for i in range(3)]
            second = await producer.send_batch([b"b0", b"b1"], topic="held/a")
            third = await producer.send_batch([Message("held/b", b"c0"), Message("held/a", b"c1")])
            held.release.set()
            with trio.fail_after(WAIT_S):
                positions = [*await first, *[await s for s in sends], *await second, await third[1]]
                other = await third[0]
            assert producer.statistics().batches == 2 and len(held.requests) == 2
    finally:
        held.local.close()
    records = await stored(store_small_records, "held/a")
    assert [(r.offset, r.payload) for r in records] == \
        [(p.offset, payload) for p, payload in zip(positions, [b"f0", b"f1", b"s0", b"s1", b"s2", b"b0", b"b1", b"c1"])]
    assert [(r.offset, r.payload) for r in await stored(store_small_records, "held/b")] == [(other.offset, b"c0")]


async def test_send_waits_while_the_producer_holds_its_total_bytes(store_small_records, nursery):
    port = await serve(nursery, store_small_records)
    async with Producer.connect("127.0.0.1", port, total_batch_max_bytes=1000,
                                batch_max_delay_ms=60_000) as producer:
        first = [await producer.send("full/a", b"x" * 400) for _ in range(2)]
        third: list = []

        async def send_third() -> None:
            third.append(await producer.send("full/a", b"y" * 400))

        nursery.start_soon(send_third)
        await trio.testing.wait_all_tasks_blocked()
        stats = producer.statistics()
        assert not third and stats.waits == 1 and stats.held_bytes == 800  # 1200 would exceed 1000: it waits
        with pytest.raises(trio.WouldBlock):
            producer.send_nowait("full/a", b"z")
        await producer.flush()  # the first two leave, and their answers free the room
        with trio.fail_after(WAIT_S):
            while not third:
                await trio.testing.wait_all_tasks_blocked()
        assert producer.statistics().held_bytes == 400
    assert all(handle.done() for handle in first + third)
    assert await pulled(port, "full/a") == [b"x" * 400] * 2 + [b"y" * 400]


async def test_a_producer_appends_to_a_store_in_this_process_as_over_the_rpc(store_small_records):
    local = LocalStore(store_small_records)
    try:
        async with Producer.over(local, client_id="in-process") as producer:
            handles = await producer.send_batch([Message("local/a", b"1"), Message("local/a", b"x" * 8192)])
            handles.append(await producer.send("local/a", b"2"))
        with pytest.raises(RecordTooLarge):
            await handles[1]
        [result] = await local.pull([PullRequest("local/a", 0, 10)])
        assert [(record.payload, record.client_id) for _, record in result.messages] == [(b"1", "in-process"),
                                                                                        (b"2", "in-process")]
        assert (await handles[0]).offset == result.messages[0][1].offset
    finally:
        local.close()


async def test_a_loop_of_sends_lets_the_other_tasks_run_before_its_batch_fills(store_small_records):
    """AutoBatch's ``send`` returns without a scheduler round (a round per message would cost more than the
    message), yet a service's loop of sends must not hold its other tasks (a consumer's claims and
    acknowledgements) for a whole batch of 2,000: it lets them run every ``SEND_SLICE_S`` of sending."""
    local = LocalStore(store_small_records)
    turns = [0]

    async def other_task():
        while True:
            turns[0] += 1
            await trio.lowlevel.checkpoint()

    try:
        async with Producer.over(local, client_id="loop", batch_max_delay_ms=60_000) as producer, \
                trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            before = turns[0]
            for i in range(BATCH_MAX_COUNT - 1):  # never a full batch: no yield for that
                await producer.send("loop/a", b"%d" % i)
            assert turns[0] > before
            nursery.cancel_scope.cancel()
    finally:
        local.close()


# --- access -------------------------------------------------------------------------------------


def check_password(username, password, source) -> Verdict:
    if (username, password) == ("svc", b"secret"):
        return Verdict(True, "svc")
    return Verdict(False, why="bad user name or password")


def only_cmd(username, client_id, access, topic) -> bool:
    return access == "publish" and topic.startswith("cmd/") or access == "subscribe" and topic.startswith("tele/")


async def test_the_store_admits_clients_by_password_and_checks_their_topics(store_small_records, nursery):
    access = StoreAccess(token="gw-secret", authenticate=check_password, authorize=only_cmd)
    port = await serve(nursery, store_small_records, access)
    with pytest.raises(StoreRpcError, match="denied"):
        async with Producer.connect("127.0.0.1", port, username="svc", password="wrong", timeout_s=5):
            pass
    async with Producer.connect("127.0.0.1", port, username="svc", password="secret") as producer:
        allowed = await producer.send("cmd/dev1", b"ok")
        denied = await producer.send("secret/x", b"no")
        await producer.flush()
        assert (await allowed).offset >= 0
        with pytest.raises(AccessDenied, match="publish"):
            await denied
        with pytest.raises(AccessDenied, match="gateway nodes only"):  # sessions are the gateways' business
            await producer.client.save_session("dev1", b"blob")
        with pytest.raises(AccessDenied, match="subscribe"):
            await producer.client.join(group_owner("g"), "cmd/#", "")
        with pytest.raises(AccessDenied, match="groups as their connection"):  # not an MQTT shared group
            await producer.client.join("$share/g", "cmd/#", "")
        qos2 = NewMessage("cmd/dev1", b"m", "dev1", 2, packet_id=7)
        with pytest.raises(AccessDenied, match="packet id"):  # it would mark a flow of dev1 as awaiting PUBREL
            await producer.client.append([qos2])
        with pytest.raises(AccessDenied, match="gateway nodes only"):
            await producer.client.release_awaiting([Flow("dev1", 7, Position(MAIN_LOG, 0))])
    async with RemoteStore.connect("127.0.0.1", port, node="gw-a", token="gw-secret") as gateway:
        await gateway.open_session("dev1", clean_start=False, expiry_s=60)  # the token makes a trusted gateway node
        await gateway.save_session("dev1", b"blob")
        assert await gateway.load_session("dev1") == b"blob"
        [position] = await gateway.append([qos2])  # a device's QoS 2 PUBLISH: the record says it awaits PUBREL
        assert await gateway.awaiting_release("dev1") == {7: position}
        await gateway.release_awaiting([Flow("dev1", 7, position)])
        assert await gateway.awaiting_release("dev1") == {}
    with pytest.raises(StoreRpcError, match="denied"):  # '$' names are the store's own
        async with RemoteStore.connect("127.0.0.1", port, node="$groups-1", token="gw-secret", timeout_s=5):
            pass


def test_store_access_policy():
    assert StoreAccess().admit("gw", "", None, None, "10.0.0.1") == Peer(True, client_id="gw")  # nothing set: open
    access = StoreAccess(token="t", authenticate=check_password)
    assert access.admit("gw", "t", None, None, "10.0.0.1") == Peer(True, client_id="gw")
    assert access.admit("gw", "nope", None, None, "10.0.0.1").why == "bad store token"
    assert access.admit("svc-1", "", "svc", b"secret", "10.0.0.1") == Peer(False, "svc", "svc-1")
    assert not access.admit("svc-1", "", "svc", b"bad", "10.0.0.1").accepted
    access.check(Peer(False, "svc", "svc-1"), "publish", "any/topic")  # no ACL: any topic
    assert not StoreAccess(token="t").admit("svc-1", "", "svc", b"secret", "10.0.0.1").accepted


def settings(tmp_path, **values) -> cfg.Config:
    conf = {o.key: o.default for o in cfg.OPTIONS}
    conf.update({key.replace("__", "."): value for key, value in values.items()})
    return cfg.Config(conf)


def test_cli_wiring_checks_back_end_clients_with_the_password_file_and_acl(tmp_path):
    passwords = PasswordFile.load_or_empty(tmp_path / "passwd")
    passwords.set_password("svc", "secret")
    passwords.save()
    (tmp_path / "acl").write_text("user svc\nallow publish cmd/#\nallow subscribe tele/#\n")
    assert _store_access(settings(tmp_path)).open
    with pytest.raises(ValueError, match="store.token"):
        _store_access(settings(tmp_path, auth__password_file=str(tmp_path / "passwd")))
    access = _store_access(settings(tmp_path, store__token="gw-token-0123456789", auth__password_file=str(tmp_path / "passwd"),
                                    auth__acl_file=str(tmp_path / "acl"), auth__failure_delay_s=0.0))
    peer = access.admit("svc-1", "", "svc", b"secret", "127.0.0.1")
    assert peer == Peer(False, "svc", "svc-1")
    assert not access.admit("svc-1", "", "svc", b"wrong", "127.0.0.1").accepted
    assert not access.admit("svc-1", "", None, None, "127.0.0.1").accepted  # a password file: no anonymous
    access.check(peer, "publish", "cmd/dev1")
    access.check(peer, "subscribe", "tele/#")
    with pytest.raises(AccessDenied):
        access.check(peer, "publish", "tele/dev1")


# --- processes: producer -> store -> gateway -> device ---------------------------------------------


@pytest.mark.slow
def test_a_device_on_a_cluster_gateway_receives_what_a_producer_sends(tmp_path):
    passwords = PasswordFile.load_or_empty(tmp_path / "passwd")
    passwords.set_password("svc", "svc-secret")
    passwords.set_password("dev1", "dev-secret")
    passwords.save()
    (tmp_path / "acl").write_text("user svc\nallow publish cmd/#\n\nuser dev1\nallow subscribe cmd/dev1/#\n")
    flags = ("--store-token", "gw-token-0123456789", "--auth-password-file", str(tmp_path / "passwd"),
             "--auth-acl-file", str(tmp_path / "acl"), "--auth-failure-delay-s", "0")
    with cluster(tmp_path, *flags) as (store, store_port, gateway, mqtt_port):
        device = Device(mqtt_port, "dev1", "dev1", "dev-secret")
        device.subscribe("cmd/dev1/#", qos=1)

        async def produce() -> None:
            with pytest.raises(StoreRpcError, match="denied"):
                async with Producer.connect("127.0.0.1", store_port, username="svc", password="bad", timeout_s=5):
                    pass
            async with Producer.connect("127.0.0.1", store_port, username="svc", password="svc-secret") as producer:
                handles = [await producer.send(f"cmd/dev1/{i % 3}", b"%d" % i, qos=1, content_type="text/plain",
                                         user_properties=[("from", "billing")]) for i in range(50)]
                denied = await producer.send("tele/dev1/temp", b"not the service's topic")
                for handle in handles:
                    await handle
                with pytest.raises(AccessDenied):
                    await denied

        trio.run(produce)
        received = [device.messages.get(timeout=WAIT_S) for _ in range(50)]
        assert sorted(int(m.payload) for m in received) == list(range(50))
        first = received[0]
        assert first.qos == 1 and first.properties.ContentType == "text/plain"
        assert first.properties.UserProperty == [("from", "billing")]
        device.close()
        assert not store.errors() and not gateway.errors()
    assert store.proc.returncode == 0 and gateway.proc.returncode == 0


async def test_a_producer_cancels_its_delayed_messages_by_id_on_topics_it_may_publish_to(store_small_records, nursery):
    access = StoreAccess(token="gw-secret", authenticate=check_password, authorize=only_cmd)
    port = await serve(nursery, store_small_records, access)
    later = 10 ** 13  # due long after the test
    async with RemoteStore.connect("127.0.0.1", port, node="gw-a", token="gw-secret") as gateway:
        [other] = await gateway.append([NewMessage("secret/x", b"s", "dev1", deliver_at_ms=later)])
    async with Producer.connect("127.0.0.1", port, username="svc", password="secret") as producer:
        position = await (await producer.send("cmd/dev1", b"later", deliver_at=later))
        kept = await (await producer.send("cmd/dev1", b"kept", deliver_at=later))
        assert await producer.cancel_delayed(position.id)
        assert not await producer.cancel_delayed(position.id)  # cancelled already: not pending
        assert not await producer.cancel_delayed(Position(MAIN_LOG, 10 ** 9))  # no such record
        with pytest.raises(AccessDenied, match="publish"):  # a message of a topic it may not publish to
            await producer.cancel_delayed(other.id)
        with pytest.raises(AccessDenied, match="gateway nodes only"):  # listing is the operators' (the admin API)
            await producer.client.delayed_list()
        with pytest.raises(ValueError, match="not a delayed message id"):
            await producer.cancel_delayed("cmd/dev1")
    assert store_small_records.timers.pending == 2 and store_small_records.timers.cancelled == 1
    page = await store_small_records.delayed.page("", "", 0, 10)
    assert [m.position for m in page.messages] == [other, kept]
