"""RemoteStore (store/rpc/client.py) against a real RPC server and store in this process, over real sockets."""

import socket

import pytest
import trio

from store.api import LeaseLost, NewMessage, PullRequest, RecordTooLarge, StoreUnavailable, TopicError
from store.control import ActivatedRun, decode_control
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from store.rpc import wire as rpc
from store.rpc.client import RemoteStore, StoreRpcError
from store.rpc.server import serve_rpc
from tests.helpers.ports import free_port

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for
SHORT_LEASE_S = 1.5
"""The node lease of the tests that wait for one to end, so they take seconds. The other tests keep the default
lease: a client whose process stalls for longer than its lease drops its link and fails the calls in flight
(store/rpc/connection.py, ``Link._away``), and a loaded 2-core machine stalls this process for over a second (the
stall watch's threshold, store/stalls.py): the concurrent-calls test failed that way with a 0.6 s lease."""


class Server:
    """The RPC server on a fixed port, which a test can stop and start again (a store restart, as clients see it)."""

    def __init__(self, store, nursery) -> None:
        self.store = store
        self.nursery = nursery
        self.port = free_port()
        self.scope: trio.CancelScope | None = None

    async def start(self) -> None:
        async def run(task_status):
            with trio.CancelScope() as self.scope:
                await serve_rpc(self.store, "127.0.0.1", self.port, task_status=task_status)

        await self.nursery.start(run)

    def stop(self) -> None:
        self.scope.cancel()


@pytest.fixture
async def server(store_small_records, nursery):
    server = Server(store_small_records, nursery)
    await server.start()
    return server


@pytest.fixture
async def short_lease_server(tmp_path, nursery):
    """The server of a store whose node leases end :data:`SHORT_LEASE_S` after a node's last frame."""
    async with open_store(tmp_path / "short", CommitLogConfig(), lease_s=SHORT_LEASE_S) as store:
        server = Server(store, nursery)
        await server.start()
        yield server
        server.stop()


def message(topic: str, payload: bytes = b"m", **fields) -> NewMessage:
    return NewMessage(topic, payload, **{"client_id": "dev1", "qos": 1, **fields})


async def disconnected(*clients) -> None:
    """Wait until each client saw its connection end."""
    with trio.fail_after(WAIT_S):
        for client in clients:
            while client.connected:
                await trio.lowlevel.checkpoint()


async def next_events(client, queue: str, offset: int) -> dict:
    """Events until one says ``queue`` reached ``offset``."""
    with trio.fail_after(WAIT_S):
        while True:
            events = await client.events()
            if events.get(queue, -1) >= offset:
                return events


async def test_calls_that_do_not_wait_always_would_block(server):
    """A round trip each: the awaiting forms are the ones to use (every call's answers and errors, the same as the
    local store's: tests/store/test_contract.py)."""
    async with RemoteStore.connect("127.0.0.1", server.port, node="gw-a") as remote:
        with pytest.raises(trio.WouldBlock):
            remote.pull_nowait([PullRequest("tele/+", 0, max_count=8)])
        with pytest.raises(trio.WouldBlock):
            remote.append_nowait([message("tele/a")])
        assert await remote.max_offsets(["tele/a"]) == [0]  # nothing was appended


async def test_concurrent_calls_travel_in_batches_and_a_bad_one_fails_alone(server):
    async with RemoteStore.connect("127.0.0.1", server.port) as remote:
        results = {}

        async def publish(i: int) -> None:
            try:
                results[i] = await remote.append([message(f"fleet/dev{i}", b"x" * (8192 if i == 7 else 10)),
                                                  message(f"fleet/dev{i}", b"second")])
            except RecordTooLarge as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(publish, i)
        assert isinstance(results.pop(7), RecordTooLarge)
        offsets = [o for pair in results.values() for o in pair]
        assert all(a < b for a, b in results.values()) and len(set(offsets)) == 398
        calls, requests = remote.client_statistics().batches["append"]
        assert calls == 200 and requests < 20  # batched: not one round trip per call

        async def pull(i: int) -> None:
            [result] = await remote.pull([PullRequest(f"fleet/dev{i}", 0)])
            results[i] = result

        while (await remote.statistics()).dispatch_lag:
            await trio.lowlevel.checkpoint()  # the pulls below must find everything dispatched
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(pull, i)
        assert [r.payload for _, r in results[3].messages] == [b"x" * 10, b"second"]
        assert results[7].messages == []
        calls, requests = remote.client_statistics().batches["pull"]
        assert calls == 200 and requests < 20


async def test_a_run_of_activations_is_one_request_and_one_record_with_each_refusal_in_its_place(server):
    """``activate_all`` over the wire (issue 31): one ``ActivateAll`` (it was a request per filter, each its own
    record), answered as the local store answers, a refused filter's ``TopicError`` or ``ValueError`` alone."""
    log = server.store.log.log
    async with RemoteStore.connect("127.0.0.1", server.port) as remote:
        starts = await remote.activate_all(["run/+", "run/a", "bad/#/x", "run/+"], "gw-holder")
        assert starts[:2] == [0, 0] and starts[3] == 0 and isinstance(starts[2], TopicError)
    activations = [decode_control(r) for r in log.scan(log.min_offset, 1 << 30).records
                   if r.control and r.topic == "$store/activated_run"]
    assert activations == [ActivatedRun("gw-holder", ["run/+", "run/a", "run/+"], [1, 0, 1])]
    assert server.store.queues.holders("run/+") == ["gw-holder"]


async def test_events_follow_watches_and_stop_after_unwatch(server):
    async with RemoteStore.connect("127.0.0.1", server.port, node="gw-a") as remote, \
            RemoteStore.connect("127.0.0.1", server.port, node="gw-b") as other:
        remote.watch("a/b")
        remote.watch("a/b")  # two local sessions
        other.watch("x")
        await other.append([message("a/b")])
        assert await next_events(remote, "a/b", 1) == {"a/b": 1}
        remote.unwatch("a/b")
        await other.append([message("a/b")])
        assert await next_events(remote, "a/b", 2) == {"a/b": 2}  # one session still reads it
        remote.unwatch("a/b")
        await remote.max_offsets([])  # a round trip: the unwatch went out before it
        sent = (await other.statistics()).notify_by_node
        assert sent == {"gw-a": 2, "gw-b": 0}
        other.watch("a/b")
        await other.append([message("a/b")])
        assert await next_events(other, "a/b", 3) == {"a/b": 3}  # routed: to gw-b only
        assert (await other.statistics()).notify_by_node == {"gw-a": 2, "gw-b": 1}
        assert remote.client_statistics().events_received == 2


async def test_calls_fail_while_the_store_is_down_and_work_after_it_returns(server):
    async with RemoteStore.connect("127.0.0.1", server.port, node="gw-a") as remote:
        remote.watch("a/b")
        await remote.append([message("a/b")])
        await next_events(remote, "a/b", 1)
        server.stop()
        await disconnected(remote)
        with pytest.raises(StoreUnavailable):
            await remote.append([message("a/b")])
        with pytest.raises(StoreUnavailable):
            await remote.max_offsets(["a/b"])
        assert isinstance(StoreUnavailable(), ConnectionError)  # the gateway answers it as a failed write
        await server.start()
        with trio.fail_after(WAIT_S):
            await remote.wait_connected()
        assert await remote.events() == {"a/b": 1}  # after a reconnect: one event per watched queue, at its head
        await remote.append([message("a/b")])
        assert await next_events(remote, "a/b", 2) == {"a/b": 2}  # the watch was registered again
        assert remote.client_statistics().connects == 2


async def test_appends_in_flight_when_the_store_goes_either_succeed_or_raise(store_small_records, server):
    async with RemoteStore.connect("127.0.0.1", server.port) as remote:
        outcomes = []

        async def publish(i: int) -> None:
            try:
                outcomes.append((await remote.append([message("burst", str(i).encode())]))[0])
            except StoreUnavailable:
                outcomes.append(None)

        async with trio.open_nursery() as nursery:
            for i in range(500):
                nursery.start_soon(publish, i)
            await trio.lowlevel.checkpoint()
            server.stop()
        acknowledged = [offset for offset in outcomes if offset is not None]
        assert len(outcomes) == 500 and None in outcomes
        for offset in acknowledged:  # no false acknowledgement: each acknowledged offset holds its record
            assert (await store_small_records.log.read(offset)).topic == "burst"


async def test_a_call_batched_on_a_link_that_broke_fails_at_once(server):
    """Between the break and the client dropping the link, calls still find it: they must not wait for ever
    (a PUBLISH at that moment got no PUBACK, and its connection's worker hung)."""
    async with RemoteStore.connect("127.0.0.1", server.port, node="gw-a") as remote:
        await remote.append([message("a/b")])
        link = remote._connection.link
        server.stop()
        with trio.fail_after(WAIT_S):
            while not link.broken:
                await trio.lowlevel.checkpoint()
        with trio.fail_after(WAIT_S), pytest.raises(StoreUnavailable):
            await link.appends[None].submit([NewMessage("a/b", b"late")])
        with trio.fail_after(WAIT_S), pytest.raises(StoreUnavailable):
            await link.pulls.submit([PullRequest("a/b", 0, 1, 1024)])


async def test_a_held_will_survives_a_store_restart_and_fires_when_the_node_is_gone(short_lease_server):
    async with RemoteStore.connect("127.0.0.1", short_lease_server.port, node="observer") as observer:
        observer.watch("will/dev1")
        async with RemoteStore.connect("127.0.0.1", short_lease_server.port, node="gw-a") as gateway:
            await gateway.open_session("dev1", clean_start=True, expiry_s=0, will=message("will/dev1", b"gone"))
            await gateway.open_session("dev2", clean_start=True, expiry_s=0, will=message("will/dev2", b"gone"))
            await gateway.close_session("dev2", expiry_s=0, will_delay_s=None)
            short_lease_server.stop()  # the store forgets where its clients are, and their wills ...
            await disconnected(gateway, observer)
            await short_lease_server.start()
            with trio.fail_after(WAIT_S):
                await gateway.wait_connected()
                await observer.wait_connected()
            await gateway.max_offsets([])  # ... and gw-a registered dev1 again first thing after reconnecting
            assert gateway.client_statistics().clients == 1
        events = await next_events(observer, "will/dev1", 1)  # gw-a is gone: its lease ends, its will fires
        assert events == {"will/dev1": 1}
        assert await observer.max_offsets(["will/dev2"]) == [0]


async def test_connect_gives_up_after_its_timeout_when_nobody_listens():
    with trio.fail_after(WAIT_S):
        with pytest.raises(StoreUnavailable, match="within 0.3 s"):
            async with RemoteStore.connect("127.0.0.1", free_port(), timeout_s=0.3):
                pass


async def test_a_store_of_another_protocol_version_is_refused(nursery):
    async def old_store(stream):
        decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
        while (hello := decoder.next_message()) is rpc.NEED_DATA:
            decoder.receive_data(await stream.receive_some(1024))
        await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.VERSION, f"not {hello.version}")))

    listeners = await nursery.start(trio.serve_tcp, old_store, 0)
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(StoreRpcError, match=f"version: not {rpc.PROTOCOL_VERSION}"):
        async with RemoteStore.connect("127.0.0.1", port):
            pass


class Freezer:
    """A TCP proxy between a client and the store that can stop passing bytes, closes included: the client's
    process frozen, as the store and the client see it (no byte, no close, until it thaws)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.thawed = trio.Event()
        self.thawed.set()

    def freeze(self) -> None:
        self.thawed = trio.Event()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.serve_tcp(self._handle, 0, host="127.0.0.1", task_status=task_status)

    async def _handle(self, downstream: trio.SocketStream) -> None:
        async with downstream, await trio.open_tcp_stream("127.0.0.1", self.target_port) as upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pipe, downstream, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pipe, upstream, downstream, nursery.cancel_scope)

    async def _pipe(self, source, sink, scope: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(65536):
                await self.thawed.wait()
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self.thawed.wait()
        scope.cancel()


async def test_a_client_back_after_its_lease_ended_is_fenced_and_its_writes_of_that_lease_are_refused(
        short_lease_server, nursery, caplog):
    freezer = Freezer(short_lease_server.port)
    [listener] = await nursery.start(freezer.serve)
    async with RemoteStore.connect("127.0.0.1", listener.socket.getsockname()[1], node="gw-a") as remote:
        ended = remote.epoch
        await remote.open_session("dev1", clean_start=True, expiry_s=0, will=message("will/dev1"))
        freezer.freeze()
        with trio.fail_after(WAIT_S):
            while not any(r.getMessage() == "gateway node lease ended" and getattr(r, "ctx", {}).get("node") == "gw-a"
                          for r in caplog.records):
                await trio.sleep(0.01)  # the store's lease timer: wait for its line
        freezer.thawed.set()
        with trio.fail_after(WAIT_S):
            assert await remote.moved() == ["dev1"]  # the clients of the ended lease are not this node's any more
        assert remote.epoch != ended
        with pytest.raises(LeaseLost):  # what is still written for dev1 names its ended lease
            await remote.append([message("a/b", b"stale")])
        with pytest.raises(LeaseLost):
            await remote.commit_offsets({"dev1": {"a/b": 1}})
        with pytest.raises(LeaseLost):
            await remote.save_session("dev1", b"blob")
        await remote.append([message("a/b", b"now", client_id="dev3")])  # another client: this lease's
        [result] = await remote.pull([PullRequest("a/b", 0, 10)])
        assert [record.payload for _, record in result.messages] == [b"now"]
