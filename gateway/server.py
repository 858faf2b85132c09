"""The MQTT listener: one trio task group per TCP connection, driving a sans-IO ``Channel``.

This is EMQX's ``emqx_connection``: it owns the socket, the decoder, the
encoder and the timers, and executes the actions the channel returns
(``gateway/actions.py``). Actions that touch the socket or a timer are done
here; the ones that need the store or other connections (sessions, appends,
subscriptions, pulls) go, in order, to the node through the ``Backend``
interface (``gateway/node.py`` implements it).

Per connection three tasks run:

- the reader: ``receive_some`` -> ``MqttDecoder.feed`` -> ``channel.handle_in``
  per packet; it stops reading while the node has too much work queued for the
  connection (backpressure to the client);
- the writer: joins everything the channel wants sent into one ``send_all``
  and reports written deliveries (``SocketWritten``);
- the worker: hands queued node actions to the backend, one batch at a time,
  so the node sees them in the order the channel asked for them.

Error handling: nothing a client sends may stop the listener. Decoder errors
go to ``channel.handle_protocol_error``; any other failure inside a connection
is logged with the client id and the reason and ends that connection only.

Resource handling: each connection's stream is closed by its handler, after
the writes queued before the ``Close`` action (bounded by ``CLOSE_TIMEOUT_S``).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol, final

import trio

from gateway._state import State
from gateway.actions import Action, ArmTimer, CancelTimer, Close, ConnectionLost, Deliver, Event, Send, SocketWritten
from gateway.channel import Channel, ChannelConfig
from gateway.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.packets import Publish
from gateway.reasons import RemoteProtocolError

__all__ = ["Backend", "Connection", "Traffic", "serve_mqtt"]

LOGGER = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024
"""One ``receive_some`` reads up to this much: a burst of small PUBLISHes is decoded in one wake-up."""

MAX_QUEUED_ACTIONS = 1024
"""Stop reading from a client while this many node actions of its connection wait (QoS 0 floods)."""

CLOSE_TIMEOUT_S = 10.0
"""How long a closing connection waits for its store results (to save an exact session) and its last writes."""


@dataclass(slots=True)
class Traffic:
    """Counters of everything the connections of a node received and sent (the ``$SYS`` figures)."""

    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class Backend(Protocol):
    """What a connection needs from its node."""

    channel_config: ChannelConfig
    connect_timeout_s: float
    traffic: Traffic

    async def perform(self, connection: Connection, actions: list[Action]) -> None:
        """Execute node actions in order, feeding their answers to ``connection.feed``."""
        ...

    def connection_closed(self, connection: Connection) -> None:
        """The connection is gone (socket closed, channel settled or abandoned)."""
        ...


@final
class Connection:
    """One client connection: socket, decoder, channel, timers, and its queue of node actions.

    Resource handling: :meth:`run` owns ``stream`` and closes it before returning.
    """

    def __init__(self, stream: trio.abc.Stream, backend: Backend, peer: str, host: str) -> None:
        """``peer`` is the client's address and port (for logs), ``host`` its address alone (per-source limits)."""
        config = backend.channel_config
        self.channel = Channel(config)
        self.peer = peer
        self.host = host
        self.username: str | None = None  # the authenticated user name (None: anonymous), set when the node accepts
        self.finished = trio.Event()  # set once the connection is completely gone (for takeovers)
        self._stream = stream
        self._backend = backend
        self._traffic = backend.traffic
        self._decoder = MqttDecoder(role=Role.SERVER, max_packet_size=config.max_packet_size)
        self._out: list[bytes] = []
        self._out_seq: int | None = None  # highest Deliver seq among the bytes in _out
        self._out_ready = trio.Event()
        self._sending = False  # the writer holds bytes taken from _out that are not written yet
        self._work: deque[Action] = deque()
        self._work_ready = trio.Event()
        self._busy = False
        self._changed = trio.Event()
        self._close_requested = trio.Event()
        self._broken = False
        self._timers: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    @property
    def client_id(self) -> str:
        return self.channel.client_id

    # --- executing actions --------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Give the channel a node event and execute what it answers."""
        self.execute(self.channel.handle_event(event))

    def execute(self, actions: list[Action]) -> None:
        """Execute the channel's actions in order: socket and timer ones now, node ones queued for the worker."""
        for action in actions:
            kind = type(action)
            if kind is Send:
                level = self.channel.protocol_level
                self._out.extend(encode(packet, level) for packet in action.packets)  # type: ignore[union-attr]
                self._out_ready.set()
            elif kind is Deliver:
                self._out.append(action.data)  # type: ignore[union-attr]
                self._out_seq = action.seq  # type: ignore[union-attr]
                self._traffic.messages_out += action.count  # type: ignore[union-attr]
                self._out_ready.set()
            elif kind is Close:
                LOGGER.info("closing connection: %s", action.log,  # type: ignore[union-attr]
                            extra={"ctx": {"client_id": self.client_id, "peer": self.peer,
                                           "reason": action.reason.name}})  # type: ignore[union-attr]
                self._close_requested.set()
            elif kind is ArmTimer:
                self._arm(action.name, action.delay_s)  # type: ignore[union-attr]
            elif kind is CancelTimer:
                scope = self._timers.pop(action.name, None)  # type: ignore[union-attr]
                if scope is not None:
                    scope.cancel()
            else:
                self._work.append(action)
                self._work_ready.set()
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _arm(self, name: str, delay_s: float) -> None:
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        if self._nursery is None or self._close_requested.is_set():
            return
        scope = trio.CancelScope()
        self._timers[name] = scope
        self._nursery.start_soon(self._timer, name, delay_s, scope)

    async def _timer(self, name: str, delay_s: float, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(delay_s)
            if self._timers.get(name) is scope:
                del self._timers[name]
            self.execute(self.channel.handle_timeout(name))

    # --- tasks --------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the channel closes it or the socket fails; then close the socket."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._worker)
                nursery.start_soon(self._writer)
                async with trio.open_nursery() as reading:
                    reading.start_soon(self._read_then_close)
                    reading.start_soon(self._connect_deadline)
                    await self._close_requested.wait()
                    reading.cancel_scope.cancel()
                for scope in self._timers.values():
                    scope.cancel()
                self._timers.clear()
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    await self._until(self._settled)
                    await self._until(lambda: not (self._out or self._sending) or self._broken)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._stream.aclose()
            self._backend.connection_closed(self)
            self.finished.set()

    async def _until(self, condition: object) -> None:
        while not condition():  # type: ignore[operator]
            await self._changed.wait()

    def _settled(self) -> bool:
        state = self.channel.state
        idle = not self._work and not self._busy
        return idle and (state is State.CLOSED or state is State.AWAIT_CONNECT)

    async def _read_then_close(self) -> None:
        await self._reader()
        self._close_requested.set()  # the channel closes on every way the reader ends; this is the backstop

    async def _reader(self) -> None:
        decoder = self._decoder
        channel = self.channel
        while True:
            await self._until(lambda: len(self._work) < MAX_QUEUED_ACTIONS)
            try:
                data = await self._stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.feed(ConnectionLost(f"receive failed: {exc!r}"))
                return
            if not data:
                self.feed(ConnectionLost("closed by the client"))
                return
            self._traffic.bytes_in += len(data)
            decoder.feed(data)
            while True:
                try:
                    packet = decoder.next_packet()
                except RemoteProtocolError as err:
                    self.execute(channel.handle_protocol_error(err, decoder.protocol_level))
                    return
                if packet is NEED_DATA:
                    break
                if type(packet) is Publish:
                    self._traffic.messages_in += 1
                self.execute(channel.handle_in(packet))
            if self._close_requested.is_set():
                return

    async def _connect_deadline(self) -> None:
        await trio.sleep(self._backend.connect_timeout_s)
        if self.channel.state is State.AWAIT_CONNECT:
            LOGGER.info("closing connection: no CONNECT within %s s", self._backend.connect_timeout_s,
                        extra={"ctx": {"peer": self.peer}})
            self._close_requested.set()

    async def _writer(self) -> None:
        while True:
            if not self._out:
                self._out_ready = trio.Event()
                await self._out_ready.wait()
                continue
            data = b"".join(self._out)
            seq = self._out_seq
            self._out.clear()
            self._out_seq = None
            if self._broken:
                self._signal()
                continue
            self._sending = True
            try:
                await self._stream.send_all(data)
                self._traffic.bytes_out += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._broken = True
                self.feed(ConnectionLost(f"send failed: {exc!r}"))
                continue
            finally:
                self._sending = False
            if seq is not None:
                self.feed(SocketWritten(seq))
            else:
                self._signal()

    async def _worker(self) -> None:
        while True:
            if not self._work:
                self._work_ready = trio.Event()
                await self._work_ready.wait()
                continue
            batch = list(self._work)
            self._work.clear()
            self._busy = True
            try:
                await self._backend.perform(self, batch)
            finally:
                self._busy = False
            self._signal()


async def serve_mqtt(
    backend: Backend,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` and serve every connection with ``backend`` until cancelled.

    ``task_status.started`` receives the listeners (port 0 picks a free port: read it from them).

    Error handling: a failing connection is logged and closed; the listener keeps serving.
    """

    async def handler(stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:
            host, port = "?", "?"
        peer = f"{host}:{port}"
        connection = Connection(stream, backend, peer, host)
        try:
            await connection.run()
        except Exception as exc:  # one connection's failure must not stop the listener
            LOGGER.error("connection failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"client_id": connection.client_id, "peer": peer}})

    await trio.serve_tcp(handler, port, host=host, task_status=task_status)
