"""The failover wait of ``RemoteStore`` (store/rpc/client.py): an append that was sent and whose answer was lost is
failed, never made again (its outcome is unknown: a second copy of a QoS 2 message must not be stored), even with a
long ``failover_wait_s``; the appends after it go to the next connection. An idempotent call sent and unanswered (a
pull, a QoS 2 release) is made again on the next connection; an activation is not. A real store behind a TCP relay
that plays the network: it cuts the connection once a request's bytes are on their way, before the store reads them.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from store.api import Flow, NewMessage, PullRequest, StoreUnavailable
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from store.rpc.client import RemoteStore
from store.rpc.connection import NotSent
from store.rpc import wire as rpc
from store.rpc.server import serve_rpc

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


class Relay:
    """Forwards TCP connections to ``target``; once ``cut_next`` is set, the next bytes from the client that carry
    a request of kind ``cut_kind`` (default: an append) are dropped with the connection (both sides closed), as a
    network that fails mid-request."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.cut_next = False
        self.cut_kind: type = rpc.AppendRequest
        self.cut = trio.Event()

    async def handle(self, client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream("127.0.0.1", self.target) as store:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, store, client, nursery.cancel_scope)
                await self._pump(client, store, nursery.cancel_scope, cutting=True)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope,
                    cutting: bool = False) -> None:
        frames = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)  # what the client sends (cutting): is an append on its way?
        try:
            while data := await source.receive_some(65536):
                if cutting:
                    frames.receive_data(data)
                    kinds = set()
                    while (message := frames.next_message()) is not rpc.NEED_DATA:
                        kinds.add(type(message))
                    if self.cut_next and self.cut_kind in kinds:
                        self.cut_next = False
                        self.cut.set()
                        break
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


@asynccontextmanager
async def relayed(tmp_path, nursery) -> AsyncIterator[tuple[Relay, RemoteStore]]:
    """A real store behind a ``Relay``, and a ``RemoteStore`` through it with a long failover wait."""
    async with open_store(tmp_path / "data", CommitLogConfig()) as node:
        (listener,) = await nursery.start(partial(serve_rpc, node, "127.0.0.1", 0))
        relay = Relay(listener.socket.getsockname()[1])
        (front,) = await nursery.start(partial(trio.serve_tcp, relay.handle, 0, host="127.0.0.1"))
        async with RemoteStore.connect("127.0.0.1", front.socket.getsockname()[1], node="gw-a", timeout_s=WAIT_S,
                                       failover_wait_s=WAIT_S) as remote:
            yield relay, remote


async def test_an_append_sent_and_unanswered_fails_and_is_not_made_again_while_later_ones_wait_and_land(
        tmp_path, nursery):
    async with relayed(tmp_path, nursery) as (relay, remote):
        await remote.append([NewMessage("tele/a", b"before", "dev1", 1)])
        relay.cut_next = True
        with pytest.raises(StoreUnavailable) as raised:
            await remote.append([NewMessage("tele/a", b"lost", "dev1", 1)])
        assert not isinstance(raised.value, NotSent)  # it was sent: not retried, whatever the wait
        assert relay.cut.is_set()
        with trio.fail_after(WAIT_S):
            await remote.append([NewMessage("tele/a", b"after", "dev1", 1)])
        (result,) = await remote.pull([PullRequest("tele/a", 0)])
        assert [record.payload for _, record in result.messages] == [b"before", b"after"]


async def test_idempotent_calls_sent_and_unanswered_are_made_again_on_the_next_connection(tmp_path, nursery):
    """A pull (a read) and a QoS 2 release (store/awaiting.py: releasing a released flow changes nothing) whose
    answers were lost are made again on the next connection and answered there; an activation is not (made twice it
    would start the subscription later): it fails as without the wait."""
    async with relayed(tmp_path, nursery) as (relay, remote):
        position = (await remote.append([NewMessage("tele/a", b"qos2", "dev1", 2, packet_id=5)]))[0]
        assert await remote.awaiting_release("dev1") == {5: position}
        for kind in (rpc.Pull, rpc.ReleaseAwaiting, rpc.Activate):
            relay.cut, relay.cut_kind, relay.cut_next = trio.Event(), kind, True
            with trio.fail_after(WAIT_S):
                if kind is rpc.Pull:
                    (result,) = await remote.pull([PullRequest("tele/a", 0)])
                    assert [record.payload for _, record in result.messages] == [b"qos2"]
                elif kind is rpc.ReleaseAwaiting:
                    await remote.release_awaiting([Flow("dev1", 5, position)])
                    assert await remote.awaiting_release("dev1") == {}
                else:
                    with pytest.raises(StoreUnavailable) as raised:
                        await remote.activate("tele/#", "dev1")
                    assert not isinstance(raised.value, NotSent)
            assert relay.cut.is_set()
