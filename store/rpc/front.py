"""The store's RPC listener, which outlives the roles of a replica: what a connection gets depends on the phase
the listener is in when it arrives.

A replica of a replicated store keeps one listener for its whole life (its address is registered in the
controller) while its role changes: it leads (``serving``: connections are an ``RpcServer``'s, store/rpc/server.py)
or follows (``refusing``: every Hello is answered ``Error(0, NOT_LEADER, leader address)`` and the connection
closed, so gateways and back-end clients go to the leader, store/rpc/connection.py; but a log reader's Hello,
``$reader/<name>``, is admitted like the leader admits it and served from the follower's own log,
store/rpc/reader.py, so the Spark live tail need not load the leader). The role loop runs one
phase at a time; between phases (and before the first) a connection is refused as by a replica that knows no
leader. When a serving phase ends, every connection of it is closed (and waited for), so no write of the
ended role is answered after it: the clients reconnect and are redirected. The unreplicated store is one
serving phase for ever (``serve_rpc``).

Resource handling: each connection's stream is closed by the phase that handles it, or here when it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol, final

import trio

from store.rpc import wire as rpc
from store.rpc.access import StoreAccess, Verdict, admit_hello
from store.rpc.reader import ReadSpan, serve_reader

__all__ = ["RpcFront", "Served"]

LOGGER = logging.getLogger(__name__)

REFUSALS_LOGGED = 1024
"""Peer addresses whose refused log reader a refusing phase has logged; beyond, refusals are not logged (bounded)."""

REFUSE_TIMEOUT_S = 1.0
"""A refused connection waits this long at most for its Hello (read so that closing after the answer does not
reset the connection before the peer reads it) and for the answer to be sent."""


class Served(Protocol):
    """What the front serves while the replica leads: ``store.rpc.server.RpcServer``, whose module serves through it
    (so this module names the two calls it makes, and does not import it back)."""

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The server's own tasks, until cancelled; ``task_status.started`` once it serves."""

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection until it ends; always closes the stream."""


@final
class _Phase:
    """The connections of one phase, so that its end closes them all."""

    def __init__(self, handle: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
        self.handle = handle
        self.scopes: set[trio.CancelScope] = set()
        self.idle = trio.Event()  # set while no connection of the phase is open
        self.idle.set()

    async def run(self, stream: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self.scopes.add(scope)
            self.idle = trio.Event() if len(self.scopes) == 1 else self.idle
            try:
                await self.handle(stream)
            finally:
                self.scopes.discard(scope)
                if not self.scopes:
                    self.idle.set()

    async def end(self) -> None:
        """Close every connection of the phase and wait until they have ended."""
        for scope in self.scopes:
            scope.cancel()
        with trio.CancelScope(shield=True):  # bounded: each was cancelled
            await self.idle.wait()


@final
class RpcFront:
    """One RPC listener whose connections go to the phase it is in (see the module docstring).

    ``access``: who may connect (store/rpc/access.py), for the log readers a refusing phase serves; the serving
    phases' servers have their own.
    """

    def __init__(self, access: StoreAccess | None = None) -> None:
        self._phase: _Phase | None = None
        self._access = access or StoreAccess()

    async def serve(self, host: str, port: int,
                    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` until cancelled; ``task_status.started`` receives the listeners (port 0 picks a
        free port: read it from them)."""
        await trio.serve_tcp(self._handle, port, host=host, task_status=task_status)

    async def serving(self, server: Served,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve ``server`` to every connection until cancelled; then close the connections it had.

        ``task_status.started`` once connections are served (the server's background tasks running).
        """
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await self._during(_Phase(server.handle), task_status)

    async def refusing(self, leader: Callable[[], str], read_span: ReadSpan | None = None,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refuse every connection with ``NOT_LEADER`` naming ``leader()`` (``host:port``, empty: none known now)
        until cancelled; logs the first refusal of the phase. With ``read_span`` (the follower's log), log readers
        are admitted and served from it instead."""
        logged: list[str] = []
        readers = None if read_span is None else _Readers(self._access, read_span)
        await self._during(_Phase(partial(_refuse, leader, logged, readers=readers)), task_status)

    async def _during(self, phase: _Phase, task_status: trio.TaskStatus[None]) -> None:
        self._phase = phase
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            if self._phase is phase:
                self._phase = None
            await phase.end()

    async def _handle(self, stream: trio.SocketStream) -> None:
        phase = self._phase
        if phase is None:
            await _refuse(lambda: "", None, stream)
            return
        await phase.run(stream)


@final
class _Readers:
    """The log readers a follower serves from its own log (store/rpc/reader.py)."""

    def __init__(self, access: StoreAccess, read_span: ReadSpan) -> None:
        self.access = access
        self.read_span = read_span
        self.refusals_logged: set[str] = set()

    async def serve(self, stream: trio.SocketStream, decoder: rpc.FrameDecoder, hello: rpc.Hello) -> None:
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            peer = "?"
        source = peer.rpartition(":")[0] or peer

        def refused(verdict: Verdict) -> None:
            if source not in self.refusals_logged and len(self.refusals_logged) < REFUSALS_LOGGED:
                self.refusals_logged.add(source)
                LOGGER.warning("log reader refused: %s", verdict.why, extra={"ctx": {"peer": peer, "node": hello.node}})

        if await admit_hello(self.access, stream, hello, source, refused) is not None:
            await serve_reader(stream, decoder, hello.node.removeprefix(rpc.READER_PREFIX), peer, self.read_span)


async def _refuse(leader: Callable[[], str], logged: list[str] | None, stream: trio.SocketStream, *,
                  readers: _Readers | None = None) -> None:
    """Answer the connection's Hello with ``NOT_LEADER`` and close it (``logged``: the leaders this phase logged);
    a log reader's Hello goes to ``readers`` when given."""
    async with stream:
        hello = None
        decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES, rpc.MAX_HELLO_BYTES)
        with trio.move_on_after(REFUSE_TIMEOUT_S):
            try:
                while (hello := decoder.next_message()) is rpc.NEED_DATA and not decoder.eof:
                    decoder.receive_data(await stream.receive_some(rpc.MAX_HELLO_BYTES))
            except (rpc.RpcProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                return
        if (readers is not None and type(hello) is rpc.Hello and hello.version == rpc.PROTOCOL_VERSION
                and hello.node.startswith(rpc.READER_PREFIX)):
            await readers.serve(stream, decoder, hello)
            return
        address = leader()
        if logged is not None and address not in logged:
            logged.append(address)
            LOGGER.info("RPC connections refused: this replica does not lead",
                        extra={"ctx": {"leader": address or None}})
        with trio.move_on_after(REFUSE_TIMEOUT_S):
            try:
                await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.NOT_LEADER, address)))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
