"""The store node's RPC server: gateway nodes reach the store's ``StoreClient`` calls over TCP.

One trio task group per connection (one connection = one attached gateway node):

- the reader decodes frames (store/rpc/wire.py) and hands each request on: appends
  to the appender, the other requests to their own tasks (at most
  ``MAX_CONCURRENT_REQUESTS`` at once: then reading stops, which is the
  backpressure to a gateway that asks faster than the store answers);
- the appender runs append requests one at a time, in arrival order, so a
  gateway's appends land in the CommitLog in the order it sent them;
- the writer joins every queued answer into one ``send_all``;
- the notifier pushes the node's merged topic events (its ``EventMailbox``);
- the heartbeat task sends a heartbeat five times per lease and closes a
  connection silent for a lease (``LEASE_S`` by default).

Every request is executed through a ``LocalStoreClient`` attached under the
node's name, so a remote gateway gets exactly the embedded one's behaviour;
only appends (records encoded straight from the wire messages), pulls and
retained lookups (raw record bytes that the client decodes) are served here
directly: the store's CPU is the one every gateway shares.

Who is who: a gateway node (trusted, the store token) is attached under the
node name of its Hello; a back-end client (user name and password) under
``$client/<user>:<name>``, its own namespace, so it can never take a gateway
node's name (and with it the node's connection, events and wills). Before a
peer is admitted the store buffers at most one ``rpc.MAX_HELLO_BYTES`` frame,
for at most ``HANDSHAKE_TIMEOUT_S``; refusals are logged once per peer address
per ``REFUSAL_LOG_S``.

Fencing (store/leases.py): each gateway connection serves one lease epoch;
a write that names another epoch (an ended lease of the node: it was frozen
or cut off, and its clients may have moved) is refused with
``ErrorKind.FENCED``, or ignored when it is a one-way message.

Error handling: a request that fails is answered with ``Error(id, kind,
message)`` and the connection goes on; a frame that breaks the wire format
(oversized, malformed, not a Hello first, another protocol version) is
answered with ``Error(0, ...)`` and the connection is closed. Nothing a peer
sends stops the listener.

Resource handling: each connection's stream is closed by its handler; the
node is detached from notify when its connection ends, and its lease
(store/leases.py) ends ``LEASE_S`` later unless it reconnects.
"""

from __future__ import annotations

import logging
import secrets
from functools import partial
from itertools import count
from typing import Any, final

import trio

from lightqueue.topics import TopicError
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied, Peer, StoreAccess, Verdict
from store.local import LocalStoreClient, NewMessage, read_log_span, store_statistics
from store.log.errors import LogFullError, OffsetExpired
from store.groups import GroupCoordinator
from store.leases import LeaseLost, NodeLeases
from store.node import StoreNode
from store.log.record import Record, RecordTooLarge, new_record, now_ms

__all__ = ["RpcServer", "serve_rpc"]

LOGGER = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024
"""One ``receive_some`` reads up to this much: a burst of pipelined requests is decoded in one wake-up."""

HANDSHAKE_TIMEOUT_S = 5.0
"""A connection that sends no whole Hello within this is closed (a port scanner, a stuck or hostile peer): a gateway
sends its Hello as soon as TCP connects, so a few seconds cover a busy machine."""

REFUSAL_LOG_S = 60.0
"""Refused connections are logged once per peer address per this period (the next line says how many were not):
a peer that retries, or opens hundreds of connections, cannot fill the store's log."""

REFUSAL_PEERS = 1024
"""Peer addresses whose last refusal line is remembered; beyond, the oldest is forgotten (bounded memory)."""

BACKEND_PREFIX = "$client/"
"""The namespace of back-end clients' node names (``$client/<user>:<name>``): Hellos may not name ``$`` nodes, and
user names hold no ``:``, so no back-end client can take a gateway node's name, nor another user's."""

ADMIN_TIMEOUT_S = 20.0
"""How long the store waits for a node's answer to a forwarded admin call (a disconnect waits up to 15 s for the
client's connection to close)."""

MAX_CONCURRENT_REQUESTS = 64
"""Requests of one connection executed at once (pulls, offsets, sessions); more wait in the socket, so one gateway
cannot queue unbounded work. Each may hold a worker thread; trio's default thread limit (40) caps them anyway."""

APPENDS_QUEUED = 16
"""Append requests of one connection waiting for the appender before reading stops."""

MAX_PULL_BYTES = 16 * 1024 * 1024
"""A queue read's byte budget is capped at this, so a pull answer stays well under the frame limit."""

CLIENT_MESSAGES = frozenset({rpc.Heartbeat, rpc.AppendRequest, rpc.MaxOffsets, rpc.GetStatistics, rpc.Join, rpc.Claim,
                             rpc.Ack, rpc.Leave})
"""What a back-end client (not a trusted gateway node, store/rpc/access.py) may send: appends and consumer groups.
Sessions, wills, watches and other owners' offsets are the gateways'."""

_GROUP_CALLS = frozenset({rpc.Join, rpc.Claim, rpc.Ack, rpc.Leave})

STATISTICS_LOG_S = 60.0
"""How often the store logs its notify routing figures (events sent per node, suppressed), when they changed."""


def _raw(raw: bytes, log_offset: int) -> tuple[int, bytes]:
    return log_offset, raw


def _error(request_id: int, exc: BaseException) -> rpc.Error:
    """The wire error for an exception of a store call: the client raises the same kind."""
    if isinstance(exc, AccessDenied):
        kind = rpc.ErrorKind.DENIED
    elif isinstance(exc, LeaseLost):
        kind = rpc.ErrorKind.FENCED
    elif isinstance(exc, RecordTooLarge):
        kind = rpc.ErrorKind.RECORD_TOO_LARGE
    elif isinstance(exc, OffsetExpired):
        kind = rpc.ErrorKind.EXPIRED
    elif isinstance(exc, TopicError):
        kind = rpc.ErrorKind.TOPIC
    elif isinstance(exc, ValueError):
        kind = rpc.ErrorKind.VALUE
    elif isinstance(exc, LogFullError):
        kind = rpc.ErrorKind.LOG_FULL
    elif isinstance(exc, OSError):
        kind = rpc.ErrorKind.OS
    else:
        kind = rpc.ErrorKind.INTERNAL
    return rpc.Error(request_id, kind, str(exc) or type(exc).__name__)


def encode_groups(
    store: StoreNode, groups: list[list[rpc.WireMessage]]
) -> list[list[tuple[bytes, Record]] | ValueError]:
    """The records of each group with their target queues fixed now, or the ``ValueError`` of the group's first
    message that does not encode (``StoreNode.append_groups`` does the same for mappings of fields: here the wire
    message's fields go to the encoder as keywords, without a mapping per message, a third of the cost)."""
    max_size = store.log.log.config.max_record_bytes
    targets = store.queues.targets
    now = now_ms()
    encoded: list[list[tuple[bytes, Record]] | ValueError] = []
    for group in groups:
        try:
            encoded.append([new_record(m.topic, m.payload, client_id=m.client_id, qos=m.qos, retain=m.retain,
                                       properties=m.properties, born_ms=m.born_ms, queues=targets(m.topic),
                                       max_size=max_size, store_ms=now, packet_id=m.packet_id) for m in group])
        except ValueError as exc:
            encoded.append(exc)
    return encoded


def to_new_message(wire: rpc.WireMessage) -> NewMessage:
    """A wire message as the store appends it."""
    return wire.topic, wire.payload, {"client_id": wire.client_id, "qos": wire.qos, "retain": wire.retain,
                                      "properties": wire.properties, "born_ms": wire.born_ms,
                                      "packet_id": wire.packet_id}


@final
class _Ask:
    """A forwarded admin call waiting for the node's ``AdminAnswer``."""

    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: bytes | None | OSError = None


@final
class _Connection:
    """One gateway node's connection, after the handshake; it serves the node's lease ``epoch``."""

    def __init__(self, server: RpcServer, stream: trio.SocketStream, decoder: rpc.FrameDecoder, node: str,
                 peer: Peer | None = None, epoch: int = 0) -> None:
        self.node = node
        self.peer = peer or Peer(True, client_id=node)
        self.epoch = epoch
        self.closed = trio.Event()  # set once the node is detached (a replacing connection waits for it)
        self.cancel_scope = trio.CancelScope()
        self._server = server
        self._stream = stream
        self._decoder = decoder
        self._client = LocalStoreClient(server.store, node)
        self._out: list[bytes] = []
        self._out_ready = trio.Event()
        self._slots = trio.Semaphore(MAX_CONCURRENT_REQUESTS)
        self._appends_in, self._appends_out = trio.open_memory_channel[rpc.AppendRequest](APPENDS_QUEUED)
        self._asks: dict[int, _Ask] = {}  # admin calls forwarded to this node, by ask id
        self._ask_ids = count(1)
        self._fenced = 0  # writes of an ended lease refused on this connection

    def close(self) -> None:
        self._client.close()
        for ask in self._asks.values():
            ask.value = OSError(f"the gateway node {self.node} went away before answering")
            ask.done.set()

    def current(self, epoch: int) -> bool:
        """Whether a write naming lease ``epoch`` (0: this connection's) may take effect; the first refusal is logged.

        Raises nothing: the caller refuses (a request) or ignores (a one-way message) a stale write.
        """
        if not epoch or epoch == self.epoch:
            return True
        self._fenced += 1
        if self._fenced == 1:
            LOGGER.warning("writes of an ended lease refused: the node's clients of that lease are no longer its own",
                           extra={"ctx": {"node": self.node, "ended_epoch": epoch, "epoch": self.epoch}})
        return False

    def check_epoch(self, epoch: int) -> None:
        """Raise ``LeaseLost`` for a write of an ended lease (see :meth:`current`)."""
        if not self.current(epoch):
            raise LeaseLost(f"lease {epoch} of node {self.node} has ended (the node holds lease {self.epoch} now)")

    async def ask(self, client_id: str, op: rpc.AdminOp, query: bytes = b"") -> bytes | None:
        """Forward an admin call about ``client_id`` (or a list call with ``query``) to this node and wait for its
        answer.

        Raises:
            OSError: the node did not answer within ``ADMIN_TIMEOUT_S``, or went away.
        """
        ask_id = next(self._ask_ids)
        ask = self._asks[ask_id] = _Ask()
        try:
            self.send(rpc.AdminAsk(ask_id, client_id, op, query))
            with trio.move_on_after(ADMIN_TIMEOUT_S):
                await ask.done.wait()
        finally:
            del self._asks[ask_id]
        if not ask.done.is_set():
            raise OSError(f"the gateway node {self.node} did not answer within {ADMIN_TIMEOUT_S} s")
        if isinstance(ask.value, OSError):
            raise ask.value
        return ask.value

    def send(self, message: Any) -> None:
        """Queue one frame for the writer."""
        try:
            frame = rpc.encode(message)
        except rpc.RpcProtocolError as exc:  # an answer too large for a frame: the request's problem
            frame = rpc.encode(rpc.Error(getattr(message, "id", 0), rpc.ErrorKind.INTERNAL, str(exc)))
        self._out.append(frame)
        self._out_ready.set()

    async def run(self) -> None:
        """Serve the connection until the peer closes it, breaks the protocol, falls silent, or is replaced."""
        with self.cancel_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                nursery.start_soon(self._notifier)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._appender)
                try:
                    await self._reader(nursery)
                finally:
                    await self._flush_out()
                    nursery.cancel_scope.cancel()

    async def _flush_out(self) -> None:
        """Send what is queued (a closing Error frame) before the connection closes; bounded by a short wait."""
        if self._out:
            with trio.move_on_after(1.0):
                data = b"".join(self._out)
                self._out.clear()
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def _reader(self, nursery: trio.Nursery) -> None:
        decoder = self._decoder
        leases = self._server.leases
        while True:
            try:
                message = decoder.next_message()
            except rpc.RpcProtocolError as exc:
                LOGGER.warning("RPC connection closed: %s", exc, extra={"ctx": {"node": self.node}})
                self.send(rpc.Error(0, rpc.ErrorKind.PROTOCOL, str(exc)))
                return
            if message is rpc.NEED_DATA:
                if decoder.eof:
                    return
                try:
                    data = await self._stream.receive_some(RECEIVE_BYTES)
                except trio.BrokenResourceError:
                    return
                decoder.receive_data(data)
                leases.seen(self.node)
                continue
            kind = type(message)
            if not self.peer.trusted and kind not in CLIENT_MESSAGES:
                denied = rpc.ErrorKind.DENIED
                if hasattr(message, "id"):
                    self.send(rpc.Error(message.id, denied, f"{kind.__name__} is for gateway nodes only"))
                    continue
                self.send(rpc.Error(0, denied, f"{kind.__name__} is for gateway nodes only"))
                return
            if kind is rpc.AppendRequest:
                await self._appends_in.send(message)
            elif kind is rpc.Heartbeat:
                pass
            elif kind is rpc.Watch:
                if not self._watch(message):
                    return
            elif kind is rpc.HoldWill:
                if self.current(message.epoch):
                    self._server.hold_will(self.node, message)
            elif kind is rpc.DropWill:
                if self.current(message.epoch):
                    leases.drop(self.node, message.client_id)
            elif kind is rpc.Present:
                if self.current(message.epoch):
                    self._server.present(self.node, message.client_id, again=message.again)
            elif kind is rpc.Absent:
                if self.current(message.epoch):
                    self._server.absent(self.node, message.client_id)
            elif kind is rpc.AdminAnswer:
                ask = self._asks.get(message.id)
                if ask is not None:  # else it came too late
                    ask.value = message.value
                    ask.done.set()
            elif kind is rpc.Hello:
                self.send(rpc.Error(0, rpc.ErrorKind.PROTOCOL, "Hello after the handshake"))
                return
            else:
                await self._slots.acquire()
                nursery.start_soon(self._answer, message)

    def _watch(self, message: rpc.Watch) -> bool:
        """Apply the node's watch deltas; False (after an Error frame) if a queue name is not a topic filter."""
        try:
            for queue, delta in message.deltas.items():
                for _ in range(delta):
                    self._client.watch(queue)
                for _ in range(-delta):
                    self._client.unwatch(queue)
        except TopicError as exc:
            self.send(rpc.Error(0, rpc.ErrorKind.PROTOCOL, f"watch: {exc}"))
            return False
        return True

    async def _answer(self, request: Any) -> None:
        try:
            self.send(await self._execute(request))
        except Exception as exc:  # the request's failure, answered; the connection goes on
            error = _error(request.id, exc)
            if error.kind is rpc.ErrorKind.INTERNAL:
                LOGGER.error("RPC request failed: %r", exc, exc_info=exc,
                             extra={"ctx": {"node": self.node, "request": type(request).__name__}})
            self.send(error)
        finally:
            self._slots.release()

    async def _execute(self, request: Any) -> Any:
        client = self._client
        kind = type(request)
        rid = request.id
        if kind is rpc.PullRequest:
            return rpc.Pulled(rid, await trio.to_thread.run_sync(self._pull, request.reads))
        if kind is rpc.Activate:
            return rpc.Value(rid, await client.activate(request.queue, request.holder))
        if kind is rpc.Release:
            self.check_epoch(request.epoch)
            return rpc.Value(rid, await client.release(request.queue, request.holder))
        if kind is rpc.MaxOffsets:
            return rpc.Offsets(rid, await client.max_offsets(request.queues))
        if kind is rpc.GetOffsets:
            return rpc.Value(rid, await client.get_offsets(request.owner))
        if kind is rpc.CommitOffsets:
            self.check_epoch(request.epoch)
            await client.commit_offsets(request.commits)
            return rpc.Done(rid)
        if kind is rpc.DeleteOwner:
            self.check_epoch(request.epoch)
            await client.delete_owner(request.owner)
            return rpc.Done(rid)
        if kind is rpc.GetRetained:
            found = await trio.to_thread.run_sync(self._server.store.retained.lookup, request.filter)
            return rpc.RecordList(rid, [(r.log_offset, r.record) for r in found])
        if kind is rpc.SaveSession:
            self.check_epoch(request.epoch)
            await client.save_session(request.client_id, request.blob)
            return rpc.Done(rid)
        if kind is rpc.LoadSession:
            return rpc.Value(rid, await client.load_session(request.client_id))
        if kind is rpc.DropSession:
            self.check_epoch(request.epoch)
            await client.drop_session(request.client_id)
            return rpc.Done(rid)
        if kind is rpc.GetAwaiting:
            return rpc.Awaiting(rid, await client.awaiting_release(request.client_id))
        if kind is rpc.ReleaseAwaiting:
            await client.release_awaiting(request.flows)
            return rpc.Done(rid)
        if kind is rpc.ReadLog:
            span = await trio.to_thread.run_sync(read_log_span, self._server.store, request.offset, request.max_bytes)
            return rpc.LogBytes(rid, span.start, span.data, span.data_end, span.flushed, span.min_offset)
        if kind in _GROUP_CALLS:
            return await self._group_call(request)
        if kind is rpc.AdminCall:
            return rpc.Value(rid, await self._server.admin_call(self.node, request.client_id, request.op))
        if kind is rpc.AdminCallAll:
            return rpc.NodeAnswers(rid, *await self._server.admin_call_all(self.node, request.op, request.query))
        if kind is rpc.GetStatistics:
            stats = store_statistics(self._server.store)
            return rpc.Statistics(rid, rpc.WireStatistics(
                stats.written_offset, stats.flushed_offset, stats.dispatched_offset, stats.log_bytes,
                stats.queue_ids, stats.active_filters, stats.retained, stats.notify_sent, stats.notify_suppressed,
                dict(stats.notify_by_node), stats.corrupt_records, stats.disk_full))
        raise TypeError(f"not a request: {kind.__name__}")

    async def _group_call(self, request: rpc.GroupRequest) -> Any:
        """A consumer-group call (store/groups.py); this connection is the member."""
        groups = self._server.groups
        kind = type(request)
        if kind is rpc.Join:
            self._server.access.check(self.peer, "subscribe", request.filter)
            return rpc.Value(request.id, await groups.join(self.node, request.group, request.filter, request.start,
                                                           request.at))
        if kind is rpc.Claim:
            entries = await groups.claim(self.node, request.group, request.filter, request.max_count,
                                         request.max_bytes, request.wait_ms / 1000)
            return rpc.Claimed(request.id, entries)
        if kind is rpc.Ack:
            return rpc.Value(request.id, await groups.ack(self.node, request.group, request.filter, request.offsets))
        groups.leave(self.node, request.group, request.filter)
        return rpc.Done(request.id)

    def _denied_groups(self, groups: list[list[rpc.WireMessage]]) -> dict[int, rpc.Error]:
        """The append groups with a topic this connection may not publish to (none for a trusted one)."""
        denied: dict[int, rpc.Error] = {}
        if self.peer.trusted:
            return denied
        check = self._server.access.check
        for index, group in enumerate(groups):
            try:
                for message in group:
                    check(self.peer, "publish", message.topic)
                    if message.packet_id:  # it would mark a flow of the client id it names as awaiting PUBREL
                        raise AccessDenied("only gateway nodes append messages with a packet id")
            except AccessDenied as exc:
                denied[index] = _error(0, exc)
        return denied

    def _pull(self, reads: list[rpc.QueueRead]) -> list[rpc.RawRecords]:
        """The reads (worker thread): index scans and CommitLog reads, records left undecoded."""
        store = self._server.store
        pull = store.queues.pull
        log = store.log.log
        results = []
        for read in reads:
            result = pull(read.queue, read.from_offset, read.max_count, min(read.max_bytes, MAX_PULL_BYTES), log, _raw)
            entries = [(qoff, log_offset, raw) for qoff, (log_offset, raw) in result.messages]
            results.append(rpc.RawRecords(entries, result.next_offset, result.expired))
        return results

    async def _appender(self) -> None:
        store = self._server.store
        async for request in self._appends_out:
            if not self.current(request.epoch):
                self.send(rpc.Error(request.id, rpc.ErrorKind.FENCED, f"lease {request.epoch} has ended"))
                continue
            denied = self._denied_groups(request.groups)
            groups = [[] if index in denied else group for index, group in enumerate(request.groups)]
            try:
                results = await store.append_encoded(encode_groups(store, groups), durable=request.durable)
            except Exception as exc:  # the write failed (OSError) or a bug: the whole request fails
                error = _error(request.id, exc)
                if error.kind is rpc.ErrorKind.INTERNAL:
                    LOGGER.error("append failed: %r", exc, exc_info=exc, extra={"ctx": {"node": self.node}})
                self.send(error)
                continue
            offsets: list[list[int]] = []
            errors: dict[int, rpc.Error] = {}
            for index, result in enumerate(results):
                if index in denied:
                    offsets.append([])
                    errors[index] = denied[index]
                elif isinstance(result, ValueError):
                    offsets.append([])
                    errors[index] = _error(0, result)
                else:
                    offsets.append(result)
            self.send(rpc.Appended(request.id, offsets, errors))

    async def _writer(self) -> None:
        while True:
            if not self._out:
                self._out_ready = trio.Event()
                await self._out_ready.wait()
                continue
            data = b"".join(self._out)
            self._out.clear()
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.cancel_scope.cancel()
                return

    async def _notifier(self) -> None:
        while True:
            try:
                events = await self._client.events()
            except trio.EndOfChannel:
                return
            self.send(rpc.Events(events))

    async def _heartbeat(self) -> None:
        leases = self._server.leases
        while True:
            await trio.sleep(self._server.heartbeat_s)
            silent = leases.silent_for(self.node)
            if silent > self._server.lease_s:
                LOGGER.warning("RPC connection closed: the gateway node was silent for %.1f s", silent,
                               extra={"ctx": {"node": self.node}})
                self.cancel_scope.cancel()
                return
            self.send(rpc.Heartbeat())


@final
class RpcServer:
    """Serves one store node to any number of gateway nodes.

    Args:
        store: the open store node.
        nursery: where lease timers run (store/leases.py); it must outlive the listener.
        lease_s: how long a gateway node's lease outlives its last frame (told to it in the Welcome).
        access: who may connect and what they may do (store/rpc/access.py); default: everyone, trusted.

    It also runs the store's consumer groups (store/groups.py): each connection that joins one is a member,
    and leaves every group when it closes.
    """

    def __init__(self, store: StoreNode, nursery: trio.Nursery, *, lease_s: float = rpc.LEASE_S,
                 access: StoreAccess | None = None) -> None:
        self.store = store
        self.lease_s = lease_s
        self.heartbeat_s = lease_s / rpc.HEARTBEATS_PER_LEASE
        self.leases = NodeLeases(store.append_many, nursery, lease_s)
        self.access = access or StoreAccess()
        self.groups = GroupCoordinator(store)
        nursery.start_soon(self.groups.run)
        self.store_id = secrets.token_hex(8)  # leases of an earlier store process are not this one's
        self._connections: dict[str, _Connection] = {}
        self._presence: dict[str, str] = {}  # client id -> the gateway node it is connected to (or has a will on)
        self._handshakes: set[rpc.FrameDecoder] = set()  # connections not admitted yet
        self._refusals: dict[str, tuple[float, int]] = {}  # peer address -> (last line logged, refusals since)

    def handshake_bytes(self) -> int:
        """Bytes buffered for connections that are not admitted yet (bounded by ``rpc.MAX_HELLO_BYTES`` each)."""
        return sum(decoder.buffered for decoder in self._handshakes)

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection: handshake, then requests until it ends; always closes the stream."""
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            peer = "?"
        try:
            async with stream:
                decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES, rpc.MAX_HELLO_BYTES)
                self._handshakes.add(decoder)
                try:
                    hello = await self._handshake(stream, decoder, peer)
                    admitted = None if hello is None else await self._admit(stream, hello, peer)
                finally:
                    self._handshakes.discard(decoder)
                if hello is None or admitted is None:
                    return
                decoder.allow(rpc.MAX_FRAME_BYTES)
                name = hello.node if admitted.trusted else f"{BACKEND_PREFIX}{admitted.username or ''}:{hello.node}"
                await self._serve(stream, decoder, name, peer, admitted, hello)
        except Exception as exc:  # one connection's failure must not stop the listener
            LOGGER.error("RPC connection failed: %r", exc, exc_info=exc, extra={"ctx": {"peer": peer}})

    def _refused(self, why: str, peer: str, **ctx: Any) -> None:
        """Log a refused connection: the first of a peer address at once, then one line per ``REFUSAL_LOG_S``."""
        host = peer.rpartition(":")[0] or peer
        now = trio.current_time()
        last = self._refusals.get(host)
        if last is not None and now - last[0] < REFUSAL_LOG_S:
            self._refusals[host] = (last[0], last[1] + 1)
            return
        if last is None and len(self._refusals) >= REFUSAL_PEERS:
            del self._refusals[next(iter(self._refusals))]  # the address logged longest ago
        self._refusals[host] = (now, 0)
        LOGGER.warning("RPC connection refused: %s", why,
                       extra={"ctx": {"peer": peer, **ctx, "refused_unlogged": last[1] if last else 0}})

    async def _handshake(self, stream: trio.SocketStream, decoder: rpc.FrameDecoder, peer: str) -> rpc.Hello | None:
        """A valid Hello; None after refusing the connection (an Error frame when possible).

        Until the Hello is whole, the connection may cost at most one ``rpc.MAX_HELLO_BYTES`` frame (a larger
        length is refused at once) and ``HANDSHAKE_TIMEOUT_S``.
        """
        refusal: rpc.Error | None = None
        with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
            try:
                message = decoder.next_message()
                while message is rpc.NEED_DATA and not decoder.eof:
                    decoder.receive_data(await stream.receive_some(rpc.MAX_HELLO_BYTES))
                    message = decoder.next_message()
            except rpc.RpcProtocolError as exc:
                refusal = rpc.Error(0, rpc.ErrorKind.PROTOCOL, str(exc))
            except trio.BrokenResourceError:
                return None
            else:
                if type(message) is not rpc.Hello:
                    refusal = rpc.Error(0, rpc.ErrorKind.PROTOCOL,
                                        "the first frame must be a Hello" if message is not rpc.NEED_DATA
                                        else "the connection ended before a Hello")
                elif message.version != rpc.PROTOCOL_VERSION:
                    refusal = rpc.Error(0, rpc.ErrorKind.VERSION,
                                        f"protocol version {message.version} is not supported: this store speaks "
                                        f"version {rpc.PROTOCOL_VERSION}")
                elif not message.node:
                    refusal = rpc.Error(0, rpc.ErrorKind.PROTOCOL, "the node name must not be empty")
                else:
                    return message
        if refusal is None:
            refusal = rpc.Error(0, rpc.ErrorKind.PROTOCOL, f"no Hello within {HANDSHAKE_TIMEOUT_S} s")
        self._refused(refusal.message, peer)
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(rpc.encode(refusal))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        return None

    async def _admit(self, stream: trio.SocketStream, hello: rpc.Hello, peer: str) -> Peer | None:
        """The peer the Hello's credentials admit (store/rpc/access.py); None after refusing it with an Error frame.

        A refusal waits the authenticator's brute-force delay before it answers.
        """
        if hello.node.startswith("$"):
            verdict: Verdict | Peer = Verdict(False, why="node names starting with '$' are the store's own")
        elif self.access.open:
            return Peer(True, client_id=hello.node)
        else:
            source = peer.rpartition(":")[0] or peer
            verdict = await trio.to_thread.run_sync(self.access.admit, hello.node, hello.token, hello.username,
                                                    hello.password, source)
        if isinstance(verdict, Peer):
            return verdict
        self._refused(verdict.why, peer, node=hello.node, username=hello.username)
        await trio.sleep(verdict.delay_s)
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.DENIED, "not authorized")))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        return None

    async def _serve(self, stream: trio.SocketStream, decoder: rpc.FrameDecoder, node: str, peer: str,
                     admitted: Peer, hello: rpc.Hello) -> None:
        old = self._connections.get(node)
        if old is not None:  # the node reconnected before its old connection was seen to end: that one is stale
            LOGGER.warning("gateway node reconnected: closing its previous connection",
                           extra={"ctx": {"node": node, "peer": peer}})
            old.cancel_scope.cancel()
            await old.closed.wait()
        # A lease of an earlier store process (a restart) is adopted: its clients stay the node's.
        epoch, resumed = self.leases.connected(node, hello.epoch, adopt=hello.store_id != self.store_id)
        resumed = resumed or not hello.epoch  # a first connection has nothing to resume
        connection = self._connections[node] = _Connection(self, stream, decoder, node, admitted, epoch)
        LOGGER.info("gateway node connected" if admitted.trusted else "back-end client connected",
                    extra={"ctx": {"node": node, "peer": peer, "epoch": epoch, "resumed": resumed}})
        if not resumed:
            LOGGER.warning("gateway node came back after its lease ended: it must drop the clients of that lease",
                           extra={"ctx": {"node": node, "ended_epoch": hello.epoch, "epoch": epoch}})
        try:
            connection.send(rpc.Welcome(rpc.PROTOCOL_VERSION, node, self.heartbeat_s, self.lease_s, self.store_id,
                                        epoch, resumed))
            await connection.run()
        finally:
            connection.close()
            self.groups.leave_all(node)
            self.leases.disconnected(node)
            if self._connections.get(node) is connection:
                del self._connections[node]
                self._forget_clients(node)
            connection.closed.set()
            LOGGER.info("gateway node disconnected", extra={"ctx": {"node": node, "peer": peer}})

    def _forget_clients(self, node: str) -> None:
        """A node that went away has no clients (it says ``Present`` again for those it has, when back)."""
        for client_id in [c for c, n in self._presence.items() if n == node]:
            del self._presence[client_id]

    def present(self, node: str, client_id: str, *, again: bool = False) -> None:
        """``client_id`` connected to ``node``: the node that had it before, if another, gets ``ClientMoved``.

        That node closes its connection of the client (a takeover across nodes, MQTT 5 reason 0x8E), and a
        will it delays for the client does not fire: the session resumed here. The newest connection wins
        ([MQTT-3.1.4-3]): a presence sent ``again`` (re-registered after a reconnect) is an older connection,
        so it never displaces a client placed on another node; ``node`` gets ``ClientMoved`` instead.
        """
        before = self._presence.get(client_id)
        if again and before is not None and before != node:
            self._notify_moved(node, client_id)
            return
        self._presence[client_id] = node
        if not again:
            self.leases.resumed_on(node, client_id)
        if before is not None and before != node:
            self._notify_moved(before, client_id)

    def _notify_moved(self, node: str, client_id: str) -> None:
        connection = self._connections.get(node)
        if connection is not None:
            connection.send(rpc.ClientMoved(client_id))

    def hold_will(self, node: str, message: rpc.HoldWill) -> None:
        """Hold a client's will under ``node``'s lease; a will sent ``again`` for a client placed on another node
        is that node's business (the client's newer connection is there)."""
        placed = self._presence.get(message.client_id)
        if message.again and placed is not None and placed != node:
            return
        self.leases.hold(node, message.client_id, to_new_message(message.message), message.delay_s)

    async def admin_call(self, node: str, client_id: str, op: rpc.AdminOp) -> bytes | None:
        """Run admin ``op`` on the node ``client_id`` is connected to, for ``node``'s admin API; None when it is
        placed on no other node (``node`` answers from what it has).

        Raises:
            OSError: that node did not answer in time, or went away.
        """
        owner = self._presence.get(client_id)
        connection = self._connections.get(owner) if owner is not None and owner != node else None
        if connection is None:
            return None
        return await connection.ask(client_id, op)

    async def admin_call_all(self, node: str, op: rpc.AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Run list ``op`` at once on every other gateway node that has clients (the presence), for ``node``'s
        admin API: (the answers by node name, the nodes that did not answer in time or went away)."""
        answers: dict[str, bytes] = {}
        missing: list[str] = []

        async def ask(name: str, connection: _Connection) -> None:
            try:
                answer = await connection.ask("", op, query)
            except OSError:
                missing.append(name)
                return
            if answer is not None:
                answers[name] = answer

        async with trio.open_nursery() as nursery:
            for name in sorted(set(self._presence.values()) - {node}):
                connection = self._connections.get(name)
                if connection is not None:
                    nursery.start_soon(ask, name, connection)
        return answers, sorted(missing)

    def absent(self, node: str, client_id: str) -> None:
        """``client_id`` is gone from ``node`` (ignored if another node has it since)."""
        if self._presence.get(client_id) == node:
            del self._presence[client_id]

    def figures(self) -> dict[str, Any]:
        """The notify routing and lease figures an operator watches (the periodic log line)."""
        notify = self.store.router.statistics()
        leases = self.leases.statistics()
        return {"notify_sent": notify.sent, "notify_suppressed": notify.suppressed,
                "notify_unrouted": notify.unrouted, "nodes": sorted(self._connections),
                "clients_placed": len(self._presence),
                "wills_held": leases.wills_held, "wills_fired": leases.wills_fired,
                "consumer_groups": [(g.group, g.queue, g.members, g.committed, g.unacked)
                                    for g in self.groups.statistics()]}


async def serve_rpc(
    store: StoreNode,
    host: str,
    port: int,
    *,
    lease_s: float = rpc.LEASE_S,
    access: StoreAccess | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``store`` over the RPC on ``host:port`` until cancelled.

    ``task_status.started`` receives the listeners (port 0 picks a free port: read it from them).
    ``lease_s``, ``access`` (who may connect, store/rpc/access.py; default: everyone, trusted): see ``RpcServer``.
    """
    async with trio.open_nursery() as nursery:
        server = RpcServer(store, nursery, lease_s=lease_s, access=access)
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, port, host=host))
        nursery.start_soon(_log_statistics, server)
        task_status.started(listeners)


async def _log_statistics(server: RpcServer) -> None:
    """Every ``STATISTICS_LOG_S``, log the routing figures if they changed: the operator's view of notify."""
    last: dict[str, Any] | None = None
    while True:
        await trio.sleep(STATISTICS_LOG_S)
        figures = server.figures()
        if figures != last:
            LOGGER.info("store statistics", extra={"ctx": figures})
            last = figures
