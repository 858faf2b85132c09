"""The MQTT listener: one connection per client, driving a sans-IO ``Channel``, with tasks only while it has work.

This is EMQX's ``emqx_connection``: it owns the transport (its byte stream,
gateway/node/transports.py), the decoder, the encoder and the timers, and
executes the actions the channel returns (``gateway/mqtt/actions.py``).
Actions that touch the socket or a timer are done here; the ones that need
the store or other connections (sessions, appends, subscriptions, pulls) go,
in order, to the node through the ``Backend`` interface
(``gateway/node/node.py`` implements it).

An idle plain TCP connection has no task: its socket is in the node's one
``Poller`` (gateway/node/poller.py), which hands every read to
:meth:`Connection.received` in its own step (``MqttDecoder.feed`` ->
``channel.handle_in`` per packet). Tasks run while there is work:

- the reader: a TLS or WebSocket stream's connection task reads it (:meth:`Connection.run`); a polled
  socket's reader runs only while a pause (back-pressure: too much node work queued for the connection, a
  full in-flight window, the CONNECT not answered yet) holds bytes back, and reads them once it ends;
- the writer, while bytes wait that the transport did not take in place: joins
  everything the channel wants sent into one ``send_all`` and reports written
  deliveries (``SocketWritten``);
- the worker, while node actions wait: hands them to the backend, one batch
  at a time, so the node sees them in the order the channel asked for them.
  Across connections the node keeps the read order of activations and
  appends (gateway/node/order.py): an append read while an activation read before
  it waits is queued behind an ``AfterReads`` mark;
- the closing task of a polled socket, from :meth:`Connection.close` on (a stream's is its connection task).

Timers (keepalive, commit, the CONNECT deadline) are handles in the node's one
``Timers`` task (gateway/node/timers.py).

Error handling: nothing a client sends may stop the listener. Decoder errors
go to ``channel.handle_protocol_error``; any other failure inside a connection
is logged with the client id and the reason and ends that connection only.

Resource handling: each connection's stream is closed by the connection, after
the writes queued before the ``Close`` action (bounded by ``CLOSE_TIMEOUT_S``)
and a lingering half-close (``LINGER_S``, ``LINGER_BYTES``) that lets the
client read the last packet before the socket goes; node work still pending
for the session then (store calls, its save) goes on behind the closed socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, final

import trio

from gateway.mqtt.state import State
from gateway.mqtt.actions import (
    Action, Activate, AfterReads, Append, ArmTimer, CancelTimer, Close, CommitOffsets, ConnectionLost, Deliver, Event,
    Pull, Pulled, Send, SocketWritten,
)
from gateway.node import clientlog
from gateway.node.admission import Admission
from gateway.mqtt.channel import KEEPALIVE_TIMER, Channel, ChannelConfig
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.lazy import Queued, appended
from gateway.node.listeners import BoundListener, ListenerSpec, Peer, serve_listeners
from gateway.mqtt.packets import Puback, Publish, Subscribe
from gateway.mqtt.properties import EMPTY_PROPERTIES
from gateway.node.poller import Poller
from gateway.mqtt.reasons import RemoteProtocolError
from gateway.node.timers import Timer, Timers
from gateway.node.transports import RECEIVE_BYTES, PolledSocket, Receiver, Transport, stream_transport
from store.log.aio import LatencyBuckets

__all__ = ["Backend", "Connection", "Traffic", "serve_mqtt"]

LOGGER = logging.getLogger(__name__)

MAX_QUEUED_ACTIONS = 1024
"""Stop reading from a client while this many node actions of its connection wait (QoS 0 floods)."""

WS_MESSAGE_PACKETS = 2
"""A WebSocket message may hold this many maximum-size packets: clients send one packet per message, but MQTT
lets packets share a message, and a whole message is buffered before the decoder sees it."""

SYNC_WRITES = 4
"""``Connection._flush`` writes at most this many times in a row before leaving the rest to the writer task."""

CLOSE_TIMEOUT_S = 10.0
"""How long a closing connection waits for its last writes, and then for its store results (to save an exact
session: the socket is closed by then, so the client never waits for the store)."""

LINGER_S = 2.0
"""After its last write the server half-closes a connection and reads and discards what the client still sends,
until the client closes too or this long: closing a socket with unread input makes the kernel send a reset, which
discards what was not transmitted yet (the refusing CONNACK, the DISCONNECT's reason) and may reach the client
before it read them. Long enough for a client to read its last packet over a slow link; the client's registration
is released before, so a reconnect with the same client id does not wait for it."""

LINGER_BYTES = 256 * 1024
"""A lingering connection reads at most this much: a client that keeps sending costs bounded work."""


DELIVERY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0)
"""Upper bounds of the publish-to-delivery latency buckets: an online subscriber gets a message in milliseconds;
the long tail (minutes) is sessions catching up after being offline or slow."""


@dataclass(slots=True)
class Traffic:
    """Counters of everything the connections of a node received and sent (the ``$SYS`` figures and metrics)."""

    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    messages_in_by_qos: list[int] = field(default_factory=lambda: [0, 0, 0])  # PUBLISHes received, index = QoS
    messages_out_by_qos: list[int] = field(default_factory=lambda: [0, 0, 0])  # PUBLISHes sent, index = QoS
    # queue messages from their store time to the write of their PUBLISH (retained ones excluded)
    delivery_latency: LatencyBuckets = field(default_factory=lambda: LatencyBuckets(DELIVERY_BUCKETS_S))

    def delivered(self, deliver: Deliver) -> None:
        """Count a ``Deliver`` handed to the socket writer: its packets, by QoS, and their latency.

        Every packet of the batch is counted at the age of its oldest queue
        message: an upper bound, one histogram update per batch.
        """
        self.messages_out += deliver.count
        by_qos = self.messages_out_by_qos
        by_qos[0] += deliver.by_qos[0]
        by_qos[1] += deliver.by_qos[1]
        by_qos[2] += deliver.by_qos[2]
        if deliver.oldest_ms:
            self.delivery_latency.observe(max(0.0, time.time() - deliver.oldest_ms / 1000), deliver.count)


class Backend(Protocol):
    """What a connection needs from its node."""

    channel_config: ChannelConfig
    connect_timeout_s: float
    traffic: Traffic
    timers: Timers  # the node's one timer task: keepalive, commit and CONNECT deadlines of every connection
    reads: Poller  # the node's one read task for plain TCP sockets (their transports, gateway/node/transports.py)
    nursery: trio.Nursery  # where connections run their writer and worker tasks

    def pull_cached(self, connection: Connection, action: Pull) -> Pulled | None:
        """Answer a pull from memory if the node can (the queue cache has it), else None: ``perform`` will."""
        ...

    def commit_now(self, connection: Connection, action: CommitOffsets) -> bool:
        """Post an offset commit now if the node can (no store call needed); False: ``perform`` will."""
        ...

    def append_now(self, connection: Connection, action: Append) -> bool:
        """Append now and feed the answer if the node can without waiting; False: ``perform`` will."""
        ...

    def append_mark(self) -> int | None:
        """For an append read now and left to ``perform``: the mark to queue before it (``AfterReads``) while
        activations read earlier wait to be applied, else None (gateway/node/order.py)."""
        ...

    def activation_read(self, connection: Connection, action: Activate) -> None:
        """The channel asked for this activation (its SUBSCRIBE was read): appends read from now on wait
        until ``perform`` has applied it."""
        ...

    async def perform(self, connection: Connection, actions: list[Action]) -> None:
        """Execute node actions in order, feeding their answers to ``connection.feed``."""
        ...

    def connection_closed(self, connection: Connection) -> None:
        """The connection is gone (socket closed, channel settled or abandoned)."""
        ...


@final
class Connection:
    """One client connection: transport, decoder, channel, timers, and its queue of node actions.

    Tasks are spent only while there is work (see the module docstring): a polled socket is read in the poller's
    step (:meth:`start`), a stream by the connection's task (:meth:`run`); a writer task lives while bytes wait for
    the socket and a worker task while node actions wait for the backend. Timers are handles in the node's
    ``Timers``. The tasks run in the node's nursery, each in a cancel scope of the connection's, so an idle
    plain TCP device costs no task and no nursery.

    Resource handling: the connection owns ``transport`` and closes it when it ends (then calls ``ended``).
    """

    __slots__ = (
        "channel", "peer", "username", "cert_identity", "_finished", "_done", "_transport", "_backend",
        "_traffic", "_decoder", "_out", "_out_seq", "_writing", "_work", "_working", "_changed", "_closing",
        "_read_scope", "_broken", "_timers", "_due", "_running", "_scopes", "_holding", "_lift", "_mark",
        "_backlog", "_shutting", "_resuming", "_ended", "__weakref__",
    )

    def __init__(
        self, transport: Transport, backend: Backend, peer: str, cert_identity: str | None = None,
        ended: Callable[[], None] | None = None,
    ) -> None:
        """``peer`` is the client's address and port, ``host:port`` (for logs; ``host`` is read from it),
        ``cert_identity`` the verified client-certificate CN (mTLS), if any; ``ended()`` is called once the
        transport is closed (a polled socket's listener hands its admission over: gateway/node/listeners.py)."""
        config = backend.channel_config
        self.channel = Channel(config)
        self.peer = peer
        self.cert_identity = cert_identity
        self.username: str | None = None  # the authenticated user name (None: anonymous), set when the node accepts
        self._finished: trio.Event | None = None  # made by the first waiter: most connections never have one
        self._done = False
        self._transport = transport
        self._backend = backend
        self._traffic = backend.traffic
        self._decoder = MqttDecoder(role=Role.SERVER, max_packet_size=config.max_packet_size,
                                    max_connect_size=config.max_connect_size, repeat_limit=config.repeat_limit)
        self._out: Queued[bytes] = ()  # bytes to write (a list once there are some: gateway/mqtt/lazy.py)
        self._out_seq: int | None = None  # highest Deliver seq among the bytes in _out
        self._writing = False  # a writer task runs (it holds bytes taken from _out until they are written)
        self._work: Queued[Action] = ()  # node actions for the worker, in order
        self._working = False  # a worker task runs (it holds the batch it hands to the backend)
        self._changed: trio.Event | None = None  # created by a waiter in _until, set by _signal
        self._closing = False
        self._read_scope: trio.CancelScope | None = None  # run()'s: a stream's reading task (a polled socket has none)
        self._broken = False
        self._timers: dict[str, Timer] | None = None  # the heap's timers by name (the commit's), made at the first
        self._due: int | None = None  # the wheel's tick of the CONNECT deadline, then of the keep alive (Timers.arm)
        self._running = False  # run() serves the connection: tasks and timers may start
        self._scopes: dict[str, trio.CancelScope] | None = None  # the tasks' while they run; made by the first
        self._holding = False  # the reader is processing a read: _flush waits for its end
        self._lift = transport.accepted  # called once the client is accepted (CONNACK sent), then dropped
        self._mark = -1  # the last read-order mark queued (AfterReads)
        self._backlog = False  # a pause stopped decoding: packets read before it may wait in the decoder
        self._shutting = False  # the socket is being closed before the node settled the session
        self._resuming = False  # a task waits for a pause to end to read a polled socket again (_resume)
        self._ended = ended

    @property
    def client_id(self) -> str:
        return self.channel.client_id

    @property
    def host(self) -> str:
        """The client's address without the port (per-source limits): read from ``peer`` when asked (at CONNECT), not
        kept as a second string per connection."""
        return self.peer.rpartition(":")[0]

    @property
    def closing(self) -> bool:
        """The connection is closing: its transport reads nothing more."""
        return self._closing

    async def wait_finished(self) -> None:
        """Return once the connection is gone (node told; the socket at most lingers): what a takeover waits for."""
        if self._done:
            await trio.lowlevel.checkpoint()
            return
        if self._finished is None:
            self._finished = trio.Event()
        await self._finished.wait()

    # --- executing actions --------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Give the channel a node event and execute what it answers."""
        self.execute(self.channel.handle_event(event))

    def feed_all(self, events: Sequence[Event]) -> None:
        """:meth:`feed` each event in order (``Channel.handle_events``: one list of answers, applied at once); what
        they answer goes out in one write (a read round's acknowledgements)."""
        holding = self._holding
        self._holding = True
        try:
            self._apply(self.channel.handle_events(events))
        finally:
            self._holding = holding
            self._start_pending()

    def requeue(self, actions: list[Action]) -> None:
        """Node actions the backend took in this step but must leave to ``perform`` after all. They go first:
        nothing the connection queued after them has run yet (its worker starts in a later step)."""
        self._work = [*actions, *self._work]
        self._start_pending()

    def execute(self, actions: list[Action]) -> None:
        """Execute the channel's actions in order: socket and timer ones now, node ones queued for the worker."""
        self._apply(actions)
        self._start_pending()

    def _start_pending(self) -> None:
        """Write what is queued, start the worker for queued node actions (a write's ``SocketWritten`` may
        have queued some), and wake the waiters."""
        if self._lift is not None and self.channel.state is State.CONNECTED:
            self._lift()
            self._lift = None
        if self._running:
            self._flush()
            if self._work and not self._working:
                self._working = True
                self._backend.nursery.start_soon(self._task, "worker", self._worker)
        self._signal()

    def _apply(self, actions: list[Action]) -> None:
        """Each action by its handler (``_APPLY``): socket and timer ones now, node ones queued for the worker."""
        for action in actions:
            _APPLY.get(type(action), Connection._queue)(self, action)

    def _append(self, action: Append) -> None:
        # In order (no work waits), the node may take it now.
        if not (self._work or self._working) and self._backend.append_now(self, action):
            return
        mark = self._backend.append_mark()
        if mark is not None and mark > self._mark:  # after the activations read before it
            self._mark = mark
            self._work = appended(self._work, AfterReads(mark), action)
        else:
            self._work = appended(self._work, action)

    def _send(self, action: Send) -> None:
        level = self.channel.protocol_level
        self._out = appended(self._out, *(encode(packet, level) for packet in action.packets))

    def _deliver(self, action: Deliver) -> None:
        self._out = appended(self._out, action.data)
        self._out_seq = action.seq
        self._traffic.delivered(action)

    def _close_action(self, action: Close) -> None:
        clientlog.closed(self, action)
        self.close()

    def _arm_timer(self, action: ArmTimer) -> None:
        self._arm(action.name, action.delay_s)

    def _cancel_timer(self, action: CancelTimer) -> None:
        if action.name == KEEPALIVE_TIMER:
            self._backend.timers.disarm(self, self._due)
            self._due = None
            return
        timer = self._timers.pop(action.name, None) if self._timers else None
        if timer is not None:
            timer.cancel()

    def _activate(self, action: Activate) -> None:
        self._backend.activation_read(self, action)
        self._work = appended(self._work, action)

    def _pull(self, action: Pull) -> None:
        if not self._work and not self._working:  # in order: no work waits, so the node may answer now
            pulled = self._backend.pull_cached(self, action)
            if pulled is not None:  # a cache hit: answered without a worker hop
                self.feed(pulled)
                return
        self._work = appended(self._work, action)

    def _commit(self, action: CommitOffsets) -> None:
        # In order (no work waits), the node may post it now: it is answered by nothing, and a pull the same step
        # asks for (its news) then finds no work waiting, so the cache answers it in this step, not the worker.
        if not (self._work or self._working) and self._backend.commit_now(self, action):
            return
        self._work = appended(self._work, action)

    def _queue(self, action: Action) -> None:
        """A node action: the worker hands it to the node, in order."""
        self._work = appended(self._work, action)

    def _flush(self) -> None:
        """Write the queued bytes now while the transport takes them whole (a plain TCP socket); else start the
        writer task.

        A socket with room in its buffer (nearly always) takes a write at
        once: doing it here saves a task and two switches per write, which is
        what a lightly loaded node spends most on. At most ``SYNC_WRITES``
        writes in a row (a write's ``SocketWritten`` may deliver more), so a
        backlog goes out through the writer task, taking turns with the other
        connections. A nested call (an event fed while writing) leaves the
        bytes it queued to the outer one, and the reader holds its writes
        until it has processed everything it read (``_holding``): one write for
        a read's worth of acknowledgements.
        """
        if self._writing or self._holding:
            return
        self._writing = True
        try:
            for _ in range(0 if self._broken else SYNC_WRITES):
                if not self._out:
                    break
                data = b"".join(self._out)
                try:
                    sent = self._transport.send_nowait(data)
                except trio.WouldBlock:  # a full socket buffer, or a stream: the writer task sends it
                    break
                except OSError as exc:
                    self._broken = True
                    self._writing = False
                    self.feed(ConnectionLost(f"send failed: {exc!r}"))
                    return
                self._traffic.bytes_out += sent
                if sent < len(data):
                    self._out = [data[sent:]]  # the writer sends the rest, then reports the Deliver written
                    break
                seq = self._out_seq
                self._out = ()
                self._out_seq = None
                if seq is not None:
                    self._apply(self.channel.handle_event(SocketWritten(seq)))
        finally:
            self._writing = False
        if self._out:
            self._writing = True
            self._backend.nursery.start_soon(self._task, "writer", self._writer)

    def close(self) -> None:
        """Stop reading and close once the node has settled the channel and the queued bytes are written: the
        reading task ends (a stream), or a task starts that does it (a polled socket)."""
        if self._closing:
            return
        self._closing = True
        if self._read_scope is not None:
            self._read_scope.cancel()
        elif self._running:
            self._backend.nursery.start_soon(self._end)
        self._signal()

    def stalled(self) -> None:
        """The polled socket has bytes that a pause left unread: a task waits for the pause to end (``_resume``)."""
        self._resume_soon()

    def failed(self, exc: Exception) -> None:
        """Processing a polled read raised (a bug): it ends this connection only."""
        LOGGER.error("connection failed: %r", exc, exc_info=exc,
                     extra={"ctx": {"client_id": self.client_id, "peer": self.peer}})
        self._broken = True
        self.close()

    def _signal(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    def _arm(self, name: str, delay_s: float) -> None:
        """Arm the channel's timer ``name``: the keep alive in the node's wheel, the others as heap timers."""
        if name == KEEPALIVE_TIMER:
            if not self._running or self._closing:
                self._backend.timers.disarm(self, self._due)
                self._due = None
            else:
                self._due = self._backend.timers.arm(self, delay_s, self._due)
            return
        timers = self._timers
        if timers is None:
            timers = self._timers = {}
        old = timers.pop(name, None)
        if old is not None:
            old.cancel()
        if not self._running or self._closing:
            return
        timers[name] = self._backend.timers.call_later(delay_s, lambda: self._fire(name))

    def expired(self) -> None:
        """The wheel's deadline came (``Timers.arm``): the CONNECT's while none was read, else the keep alive's (a
        client without one has only its CONNECT deadline, moot once its CONNECT was read)."""
        self._due = None
        if self.channel.state is State.AWAIT_CONNECT:
            self._connect_deadline()
        elif self.channel.keep_alive:
            self._fire(KEEPALIVE_TIMER)

    def _fire(self, name: str) -> None:
        """A timer of this connection came due (in the node's timer task: a failure must stay in this connection).

        A keep-alive expiry first asks the kernel whether the client's bytes wait unread: they are its activity,
        as are packets a pause left in the decoder (``_backlog``).
        """
        if self._timers:
            self._timers.pop(name, None)
        if self._closing:
            return
        try:
            waiting = name == KEEPALIVE_TIMER and (self._backlog or self._transport.bytes_waiting())
            self.execute(self.channel.handle_timeout(name, waiting))
        except Exception as exc:
            LOGGER.error("connection failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"client_id": self.client_id, "peer": self.peer, "timer": name}})
            self._broken = True
            self.close()

    def _connect_deadline(self) -> None:
        if self.channel.state is State.AWAIT_CONNECT and self._transport.bytes_waiting():
            # The client did send; the node has not read it yet (a busy event loop): not the client's fault.
            self._arm_connect_deadline()
            return
        if self.channel.state is State.AWAIT_CONNECT:
            LOGGER.info("closing connection: no CONNECT within %s s", self._backend.connect_timeout_s,
                        extra={"ctx": {"peer": self.peer}})
            self.close()

    def _arm_connect_deadline(self) -> None:
        self._due = self._backend.timers.arm(self, self._backend.connect_timeout_s, self._due)

    # --- tasks --------------------------------------------------------------------------

    def start(self, begin: Callable[[Receiver], None]) -> None:
        """Serve a connection over a polled socket: ``begin(self)`` (``PolledSocket.start``) has its reads handed
        to :meth:`received` in the poller's step, so it has no task while idle; a task starts while it has work
        (writer, worker, a pause with bytes waiting: ``_resume``) and when it closes (:meth:`close`: its last
        writes, the session settled, the socket closed, ``ended`` called)."""
        self._running = True
        self._arm_connect_deadline()
        begin(self)

    async def run(self, read: Callable[[Receiver], Awaitable[bool]]) -> None:
        """Serve a connection over a stream (TLS, WebSocket) until the channel closes it or the stream fails; then
        close the stream. This task reads: ``read`` (``StreamTransport.read``) hands one read to :meth:`received`.

        Error handling: a failure is logged with the client id and ends this connection only.
        """
        self._read_scope = trio.CancelScope()
        self._running = True
        self._arm_connect_deadline()
        try:
            with self._read_scope:
                await self._read(read)
        except Exception as exc:  # one connection's failure must not stop the listener
            await self._end(exc)
            return
        await self._end()

    async def _end(self, failure: Exception | None = None) -> None:
        """Close the connection: its last writes (bounded by ``CLOSE_TIMEOUT_S``), the node told, the socket
        closed after a lingering half-close; ``failure`` (a bug) skips the writes and is logged."""
        self._closing = True  # the channel closes on every way reading ends; this is the backstop
        try:
            self._stop_timers()
            if failure is None:
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    # Its last packets, then the socket goes at once: the node's work for the session (its save,
                    # store calls that meet an outage) finishes or fails behind it, and the client need not wait for
                    # it. A closing channel sends nothing more.
                    await self._until(lambda: not (self._out or self._writing) or self._broken)
                    if not self._settled():
                        self._shutting = True
                        self._backend.nursery.start_soon(self._shut)
                    await self._until(self._settled)
        except Exception as exc:
            failure = exc
        finally:
            if failure is not None:
                LOGGER.error("connection failed: %r", failure, exc_info=failure,
                             extra={"ctx": {"client_id": self.client_id, "peer": self.peer}})
            self._running = False
            self._stop_timers()
            for scope in (self._scopes or {}).values():
                scope.cancel()
            with trio.CancelScope(shield=True):
                await self._until(lambda: not (self._writing or self._working))
            self._release_buffers()
            self._backend.connection_closed(self)
            self._done = True
            if self._finished is not None:
                self._finished.set()
            try:
                if not self._shutting:
                    await self._shut()
            finally:
                ended = self._ended
                self._ended = None
                if ended is not None:
                    ended()

    def _stop_timers(self) -> None:
        self._backend.timers.disarm(self, self._due)
        self._due = None
        if self._timers:
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()

    async def _shut(self) -> None:
        """Linger (cancelled when the node stops: no lingering), then close the socket; nothing is written after."""
        try:
            await self._linger()
        finally:
            self._broken = True
            with trio.CancelScope(shield=True):
                await self._transport.aclose()

    async def _linger(self) -> None:
        """Half-close, then read and discard input until the client closes too, ``LINGER_S`` pass or
        ``LINGER_BYTES`` arrive, so the socket is not closed with unread input (a reset): ``Transport.linger``
        (a WebSocket's close handshake does it by itself, TLS on its TCP connection)."""
        if self._broken:
            return
        with trio.move_on_after(LINGER_S):
            await self._transport.linger(LINGER_BYTES)

    def _release_buffers(self) -> None:
        """Drop what the ended connection still buffers (a partial packet, unsent bytes, queued work), so its memory
        goes now, whoever still holds the connection (a takeover waiting, a log record, a reference cycle)."""
        self._decoder.discard()
        self._out = ()
        self._work = ()

    async def _task(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run the writer, the worker or the reader in the node's nursery; a failure ends this connection only."""
        if self._scopes is None:
            self._scopes = {}
        scope = self._scopes[name] = trio.CancelScope()
        if not self._running:
            scope.cancel()  # started after the connection ended: only its clean-up runs
        try:
            with scope:
                await body()
        except Exception as exc:
            LOGGER.error("connection failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"client_id": self.client_id, "peer": self.peer, "task": name}})
            self._broken = True
            self.close()
        finally:
            scopes = self._scopes
            del scopes[name]  # type: ignore[index]
            if not scopes:
                self._scopes = None  # an idle connection keeps no empty dict

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    def _settled(self) -> bool:
        state = self.channel.state
        idle = not self._work and not self._working
        return idle and (state is State.CLOSED or state is State.AWAIT_CONNECT)

    def paused(self) -> bool:
        """Reading waits: the node has too much work queued for the connection, a 3.1.1 in-flight window is full,
        or the CONNECT is read and not answered yet (a client not yet accepted buffers at most one read more)."""
        return len(self._work) >= MAX_QUEUED_ACTIONS or self.channel.input_paused \
            or self.channel.state is State.CONNECTING

    async def _read(self, read: Callable[[Receiver], Awaitable[bool]]) -> None:
        """A stream's reader: ``read`` hands each read to :meth:`received`; return when the connection ends.

        Raises:
            Exception: what processing a read raised (a bug: it ends this connection only).
        """
        while True:
            if self.paused():
                await self._until(lambda: not self.paused())
            if self._backlog:  # the packets read before the pause first: the client may send nothing more
                if not self._backend.reads.alone(self._decode):
                    return
                continue
            if not await read(self):
                return

    def receive_failed(self, exc: Exception) -> None:
        """A read failed: the connection is lost."""
        self.feed(ConnectionLost(f"receive failed: {exc!r}"))

    def received(self, data: bytes) -> bool:
        """Decode ``data`` and hand each packet to the channel; False once reading must end (the client closed
        the connection, sent a malformed packet, or the channel closed it)."""
        if not data:
            self.feed(ConnectionLost("closed by the client"))
            return False
        self._traffic.bytes_in += len(data)
        self._decoder.feed(data)
        return self._backend.reads.alone(self._decode)  # in the poller's round, or a round of its own

    def _decode(self) -> bool:
        """Hand the decoded packets to the channel until more bytes are needed or reading pauses (:meth:`paused`:
        a 3.1.1 client's in-flight window is full, or too much node work waits); False as :meth:`received`.

        A pause stops decoding too, not only reading: a 3.1.1 client may pipeline any number of QoS 1
        PUBLISHes in one read, and back-pressure must not turn into a disconnect. The rest waits in the
        decoder (at most one read) until the reader resumes.
        """
        decoder = self._decoder
        channel = self.channel
        traffic = self._traffic
        self._backlog = False
        holding = self._holding
        self._holding = True  # the answers to everything read go out in one write, after the loop
        try:
            paused = self.paused()
            while True:
                try:
                    packet = NEED_DATA if paused else decoder.next_packet()
                except RemoteProtocolError as err:
                    self.execute(channel.handle_protocol_error(err, decoder.protocol_level))
                    return False
                if packet is NEED_DATA:
                    self._backlog = paused
                    self.execute(channel.input_done())
                    break
                if type(packet) is Puback:
                    # A subscriber's read is mostly PUBACKs: the shortest-form ones after this come as packet ids.
                    packet_ids = decoder.pubacks()
                    self._apply(channel.handle_pubacks(packet, packet_ids) if packet_ids
                                else channel.handle_in(packet))
                    paused = self.paused()
                    continue
                if type(packet) is Subscribe:
                    run = [packet]  # the SUBSCRIBEs read after it go with it, as one run
                    try:
                        while decoder.next_is_subscribe():
                            following = decoder.next_packet()
                            if type(following) is not Subscribe:
                                break  # NEED_DATA: the rest of it is still to come
                            run.append(following)
                    except RemoteProtocolError as err:
                        self._apply(channel.handle_subscribes(run))
                        self.execute(channel.handle_protocol_error(err, decoder.protocol_level))
                        return False
                    self._apply(channel.handle_subscribes(run))
                    paused = self.paused()
                    continue
                if type(packet) is not Publish or packet.qos:
                    if type(packet) is Publish:
                        traffic.messages_in += 1
                        traffic.messages_in_by_qos[packet.qos] += 1
                    self._apply(channel.handle_in(packet))  # started and flushed once, after the loop
                    paused = self.paused()
                    continue
                # A QoS 0 PUBLISH, most of a flood: read while not paused, it can pause reading only by the node
                # work its answer queues (it holds nothing back, opens no session, leaves CONNECTING unchanged).
                # The ones after it that repeat it but for their payloads come from the decoder as payloads only.
                payloads = decoder.repeats(packet.topic) \
                    if packet.properties is EMPTY_PROPERTIES and not packet.retain and packet.topic else None
                count = 1 + len(payloads) if payloads else 1
                traffic.messages_in += count
                traffic.messages_in_by_qos[0] += count
                actions = channel.handle_repeats(packet, payloads) if payloads else channel.handle_in(packet)
                if len(actions) == 1 and type(actions[0]) is Append:
                    self._append(actions[0])  # what a valid one answers: no walk of the action table
                else:
                    self._apply(actions)
                paused = len(self._work) >= MAX_QUEUED_ACTIONS
        finally:
            self._holding = holding
            if not holding:
                self._start_pending()
        if self._backlog and self._read_scope is None:  # a polled socket: no reading task to decode it later
            self._resume_soon()
        return not self._closing

    def _resume_soon(self) -> None:
        """Start the task that reads a polled socket again once a pause ends (``_resume``), unless it runs."""
        if not self._resuming and self._running and not self._closing:
            self._resuming = True
            self._backend.nursery.start_soon(self._task, "reader", self._resume)

    async def _resume(self) -> None:
        """A polled socket's reader while a pause holds bytes back (unread, or read and left in the decoder):
        wait for the pause to end, decode what waits, then have the poller report the socket again. Bytes that
        arrive once the pause ended are read by the poller at once, in their order, even before this task runs."""
        try:
            while not self._closing:
                await self._until(lambda: not self.paused() or self._closing)
                if self._closing or not self._backlog:
                    break
                self._backend.reads.alone(self._decode)
        finally:
            self._resuming = False
        if not self._closing:
            self._transport.resume()

    async def _writer(self) -> None:
        """Write what is queued until nothing is; then end (the next ``execute`` with bytes starts another)."""
        try:
            while self._out:
                data = b"".join(self._out)
                seq = self._out_seq
                self._out = ()
                self._out_seq = None
                if self._broken:
                    continue
                try:
                    await self._transport.send_all(data)
                    self._traffic.bytes_out += len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._broken = True
                    self.feed(ConnectionLost(f"send failed: {exc!r}"))
                    continue
                if seq is not None:
                    self.feed(SocketWritten(seq))
        finally:
            self._writing = False
            self._signal()

    async def _worker(self) -> None:
        """Hand queued node actions to the backend, a batch at a time, until none are queued; then end."""
        try:
            while self._work:
                batch, self._work = self._work, ()
                await self._backend.perform(self, batch)
                self._signal()
        finally:
            self._working = False
            self._signal()


_APPLY: dict[type, Callable[[Connection, Any], None]] = {
    Append: Connection._append,  # a flood is one per PUBLISH read
    Send: Connection._send,
    Deliver: Connection._deliver,
    Close: Connection._close_action,
    ArmTimer: Connection._arm_timer,
    CancelTimer: Connection._cancel_timer,
    Activate: Connection._activate,
    Pull: Connection._pull,
    CommitOffsets: Connection._commit,  # a subscriber's, every ``commit_every`` acknowledgements
}
"""How a connection applies each kind of channel action; the others are node actions, queued for its worker."""


async def serve_mqtt(
    backend: Backend,
    specs: Sequence[ListenerSpec],
    *,
    admission: Admission | None = None,
    task_status: trio.TaskStatus[list[BoundListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen as ``specs`` say (TCP, TLS, WebSocket; gateway/node/listeners.py) and serve every connection with
    ``backend`` until cancelled.

    ``task_status.started`` receives the bound listeners in the order of ``specs`` (port 0 picks a free port).
    ``admission`` decides each accepted socket before any TLS, WebSocket or MQTT work (None: all admitted).

    Error handling: a failing connection is logged and closed; the listeners keep serving.
    """

    def handler(stream: trio.abc.Stream, peer: Peer) -> Awaitable[None]:
        # Returns the connection's coroutine rather than awaiting it: one frame less per connection.
        transport = stream_transport(stream)
        return Connection(transport, backend, peer.address, peer.identity).run(transport.read)

    def adopt(stream: trio.SocketStream, peer: Peer, ended: Callable[[], None]) -> None:
        transport = PolledSocket(stream, backend.reads)
        Connection(transport, backend, peer.address, ended=ended).start(transport.start)

    config = backend.channel_config
    await serve_listeners(handler, specs, adopt=adopt, admission=admission, handshake_timeout_s=backend.connect_timeout_s,
                          max_message_size=WS_MESSAGE_PACKETS * config.max_packet_size,
                          connect_message_size=config.max_connect_size + RECEIVE_BYTES, task_status=task_status)
