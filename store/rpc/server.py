"""The store node's RPC server: remote nodes reach the store's ``StoreApi`` over TCP.

Each connection (one remote node) is served through a ``LocalStore`` attached under the node's name (store/local.py),
so a cluster gateway gets exactly the embedded one's behaviour: this module only translates frames to calls and
answers to frames, and reaches the store node past it only for the connection's own lease (connected, seen,
silent). Appends go through ``LocalStore.append_groups`` (one request's callers, one CommitLog write); pulls,
claims and retained lookups through its raw forms, as record bytes that the client decodes: the store's CPU is
the one every gateway shares.

One trio task group per connection:

- the reader decodes frames (store/rpc/wire.py) and hands each request on: appends
  to the appender, the other requests to their own tasks (at most
  ``MAX_CONCURRENT_REQUESTS`` at once: then reading stops, which is the
  backpressure to a node that asks faster than the store answers);
- the appender runs append requests one at a time, in arrival order, so a
  node's appends land in the CommitLog in the order it sent them;
- the writer joins every queued answer into one ``send_all``; it is the only task that sends on the socket
  after the handshake (a closing Error frame too: it sends that last, then ends);
- the notifiers push the node's merged topic events, its clients that moved away and admin asks;
- the heartbeat task sends a heartbeat five times per lease and closes a
  connection silent for a lease while the store ran (a stall of the store's own,
  seen by its watchdog, store/stalls.py, is not the node's silence).

Who is who: a gateway node (trusted, the store token) is attached under the
node name of its Hello; a back-end client (user name and password) under
``$client/<user>:<name>``, its own namespace, so it can never take a gateway
node's name (and with it the node's connection, events and clients); it may append (its topics checked by
the ACL, no QoS 2 packet ids) and use consumer groups (``$group/`` names, its connection the member). A replica
of a replicated group (``$replica/<name>``, the store token) only fetches the log (``Fetch``, answered by the
leader's ``Replication``, store/replica/leader.py, or ``NOT_LEADER``): it takes no lease and is attached to
nothing; nor does a log reader (``$reader/<name>``, the store token: ``ReadLog`` only, store/rpc/reader.py).
Before a peer is admitted the store buffers at most one ``wire.MAX_HELLO_BYTES`` frame, for at most
``HANDSHAKE_TIMEOUT_S``; refusals are logged once per peer address per ``REFUSAL_LOG_S``.

Fencing (store/leases.py): each connection serves one lease epoch of its node;
a write that names another epoch (an ended lease of the node: it was frozen
or cut off, and its clients may have moved) is refused with
``ErrorKind.FENCED``, or ignored when it is a one-way message. An append
group of QoS 2 messages of a client present on another node (it connected
there since) is refused the same way: that node has its session and its QoS 2
flows (``_moved_groups``).

Error handling: a request that fails is answered with ``Error(id, kind,
message)`` and the connection goes on; a frame that breaks the wire format
(oversized, malformed, not a Hello first, another protocol version) is
answered with ``Error(0, ...)`` and the connection is closed. Nothing a peer
sends stops the listener.

Resource handling: each connection's stream is closed by its handler; the
node is detached from the store when its connection ends, and its lease
ends ``lease_s`` later unless it reconnects.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from functools import partial
from typing import Any, final

import trio

from store.api import GROUP_PREFIX, MAIN_LOG, LeaderFenced, LeaseLost, NewMessage, Positions, PullResult, TopicError
from store.groups import Stored
from store.local import LocalStore
from store.node import StoreNode
from store.pop.handles import decode_handle
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied, Peer, StoreAccess, Verdict, admit_hello
from store.rpc.errors import error_frame
from store.rpc.front import RpcFront
from store.rpc.reader import next_message, serve_reader

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

MAX_CONCURRENT_REQUESTS = 64
"""Requests of one connection executed at once (pulls, offsets, sessions); more wait in the socket, so one gateway
cannot queue unbounded work. Each may hold a worker thread; trio's default thread limit (40) caps them anyway."""

FLUSH_S = 1.0
"""A closing connection waits this long at most for the writer to send its last frames (a closing Error frame)."""

APPENDS_QUEUED = 16
"""Append requests of one connection waiting for the appender before reading stops."""

MAX_PULL_BYTES = 16 * 1024 * 1024
"""A queue read's byte budget is capped at this, so a pull answer stays well under the frame limit."""

CLIENT_MESSAGES = frozenset({rpc.Heartbeat, rpc.AppendRequest, rpc.MaxOffsets, rpc.GetStatistics, rpc.Join, rpc.Claim,
                             rpc.Ack, rpc.Leave, rpc.CancelDelayed, rpc.Pop, rpc.PopAck, rpc.ChangeInvisible})
"""What a back-end client (not a trusted gateway node, store/rpc/access.py) may send: appends, consumer groups, POP
and cancellations of delayed messages (of topics it may publish to). Sessions, wills, watches, other owners' offsets
and the list of delayed messages are the gateways'."""

_GROUP_CALLS = frozenset({rpc.Join, rpc.Claim, rpc.Ack, rpc.Leave})

STATISTICS_LOG_S = 60.0
"""How often the store logs its notify routing figures (events sent per node, suppressed), when they changed."""


def _raw_records(messages: Sequence[tuple[int, Stored]], next_offset: int = 0, expired: bool = False) -> rpc.RawRecords:
    """A read's records as the wire carries them: ``(queue offset, log offset, bytes as stored)``, a batch record
    whole at its first message's queue offset with the messages served in ``batches``."""
    entries = []
    batches = {}
    for qoff, (log_offset, data, first, stop) in messages:
        if stop:
            batches[len(entries)] = (first, stop)
        entries.append((qoff - first, log_offset, data))
    return rpc.RawRecords(entries, next_offset, expired, batches)


def _read_records(result: PullResult[Stored]) -> rpc.RawRecords:
    return _raw_records(result.messages, result.next_offset, result.expired)


@final
class _Connection:
    """One node's connection, after the handshake; it serves the node's lease ``epoch``."""

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
        self._store = LocalStore(server.store, node)
        self._out: list[bytes] = []
        self._out_ready = trio.Event()
        self._ending = False  # the reader ended: the writer sends what is queued, then ends
        self._last: bytes | None = None  # the closing Error frame: the writer sends it after everything else
        self._written = trio.Event()  # the writer ended
        self._slots = trio.Semaphore(MAX_CONCURRENT_REQUESTS)
        self._appends_in, self._appends_out = trio.open_memory_channel[rpc.AppendRequest](APPENDS_QUEUED)
        self._fenced = 0  # writes of an ended lease refused on this connection
        self._handlers = {
            rpc.Pull: self._pull, rpc.Activate: self._activate, rpc.ActivateAll: self._activate_all,
            rpc.Release: self._release,
            rpc.MaxOffsets: self._max_offsets, rpc.GetOffsets: self._get_offsets, rpc.CommitOffsets: self._commit,
            rpc.GetRetained: self._retained, rpc.OpenSession: self._open_session, rpc.CloseSession: self._close_session,
            rpc.SaveSession: self._save_session, rpc.PatchSession: self._patch_session,
            rpc.LoadSession: self._load_session, rpc.EndSession: self._end_session, rpc.ListSessions: self._sessions, rpc.GetAwaiting: self._awaiting,
            rpc.ReleaseAwaiting: self._release_awaiting, rpc.GetStatistics: self._statistics,
            rpc.ReadLog: self._read_log, rpc.Join: self._join, rpc.Claim: self._claim, rpc.Ack: self._ack,
            rpc.Leave: self._leave, rpc.AdminCall: self._admin_call,
            rpc.AdminCallAll: self._admin_call_all, rpc.ListDelayed: self._list_delayed,
            rpc.CancelDelayed: self._cancel_delayed, rpc.Pop: self._pop, rpc.PopAck: self._pop_ack,
            rpc.ChangeInvisible: self._change_invisible,
        }

    def close(self) -> None:
        self._store.close()

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
                nursery.start_soon(self._mover)
                nursery.start_soon(self._asker)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._appender)
                try:
                    await self._reader(nursery)
                    await self._flush_out()
                finally:
                    nursery.cancel_scope.cancel()

    async def _flush_out(self) -> None:
        """Let the writer send what is queued and the closing Error frame, and end; bounded by ``FLUSH_S``."""
        self._ending = True
        self._out_ready.set()
        with trio.move_on_after(FLUSH_S):
            await self._written.wait()

    def _refuse(self, why: str, kind: rpc.ErrorKind = rpc.ErrorKind.PROTOCOL) -> None:
        """The peer broke the protocol, or sent what it may not: one WARNING line, and an ``Error(0)`` frame the
        writer sends before the connection closes."""
        LOGGER.warning("RPC connection closed: %s", why, extra={"ctx": {"node": self.node}})
        self._last = rpc.encode(rpc.Error(0, kind, why))

    async def _reader(self, nursery: trio.Nursery) -> None:
        decoder = self._decoder
        leases = self._server.store.leases
        while True:
            try:
                message = decoder.next_message()
            except rpc.RpcProtocolError as exc:
                self._refuse(str(exc))
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
                self._refuse(f"{kind.__name__} is for gateway nodes only", denied)
                return
            if kind is rpc.AppendRequest:
                await self._appends_in.send(message)
            elif kind is rpc.Heartbeat:
                pass
            elif kind is rpc.Watch:
                if not self._watch(message):
                    return
            elif kind is rpc.Reattach:
                if self.current(message.epoch):
                    self._store.reattach(message.client_id, expiry_s=message.expiry_s, will=message.will,
                                         will_delay_s=message.will_delay_s)
            elif kind is rpc.AdminAnswer:
                self._store.admin_answer(message.id, message.value)
            elif kind is rpc.Hello:
                self._refuse("Hello after the handshake")
                return
            elif kind is rpc.Fetch:
                self.send(rpc.Error(message.id, rpc.ErrorKind.DENIED, "Fetch is for replicas only"))
            else:
                await self._slots.acquire()
                nursery.start_soon(self._answer, message)

    def _watch(self, message: rpc.Watch) -> bool:
        """Apply the node's watch deltas; False (after an Error frame) if a queue name is not a topic filter."""
        try:
            for queue, delta in message.deltas.items():
                for _ in range(delta):
                    self._store.watch(queue)
                for _ in range(-delta):
                    self._store.unwatch(queue)
        except TopicError as exc:
            self._refuse(f"watch: {exc}")
            return False
        return True

    async def _answer(self, request: Any) -> None:
        try:
            self.send(await self._handlers[type(request)](request))
        except Exception as exc:  # the request's failure, answered; the connection goes on
            error = error_frame(request.id, exc)
            if error.kind is rpc.ErrorKind.INTERNAL:
                LOGGER.error("RPC request failed: %r", exc, exc_info=exc,
                             extra={"ctx": {"node": self.node, "request": type(request).__name__}})
            self.send(error)
        finally:
            self._slots.release()

    # --- requests: one ``StoreApi`` call each ------------------------------------------------

    async def _pull(self, request: rpc.Pull) -> rpc.Pulled:
        reads = [r if r.max_bytes <= MAX_PULL_BYTES else rpc.PullRequest(r.queue, r.from_offset, r.max_count,
                                                                          MAX_PULL_BYTES) for r in request.reads]
        return rpc.Pulled(request.id, [_read_records(result) for result in await self._store.pull_raw(reads)])

    async def _activate(self, request: rpc.Activate) -> rpc.Value:
        return rpc.Value(request.id, await self._store.activate(request.queue, request.holder))

    async def _activate_all(self, request: rpc.ActivateAll) -> rpc.Starts:
        starts = await self._store.activate_all(request.queues, request.holder)
        return rpc.Starts(request.id, [s if isinstance(s, int) else error_frame(request.id, s) for s in starts])

    async def _release(self, request: rpc.Release) -> rpc.Value:
        self.check_epoch(request.epoch)
        return rpc.Value(request.id, await self._store.release(request.queue, request.holder))

    async def _max_offsets(self, request: rpc.MaxOffsets) -> rpc.Offsets:
        return rpc.Offsets(request.id, await self._store.max_offsets(request.queues))

    async def _get_offsets(self, request: rpc.GetOffsets) -> rpc.Value:
        return rpc.Value(request.id, await self._store.get_offsets(request.owner))

    async def _commit(self, request: rpc.CommitOffsets) -> rpc.Done:
        self.check_epoch(request.epoch)
        await self._store.commit_offsets(request.commits)
        return rpc.Done(request.id)

    async def _retained(self, request: rpc.GetRetained) -> rpc.RecordList:
        return rpc.RecordList(request.id, await self._store.retained_raw(request.filter))

    async def _open_session(self, request: rpc.OpenSession) -> rpc.Value:
        return rpc.Value(request.id, await self._store.open_session(
            request.client_id, clean_start=request.clean_start, expiry_s=request.expiry_s, will=request.will,
            will_delay_s=request.will_delay_s))

    async def _close_session(self, request: rpc.CloseSession) -> rpc.Done:
        self.check_epoch(request.epoch)
        await self._store.close_session(request.client_id, expiry_s=request.expiry_s,
                                     will_delay_s=request.will_delay_s)
        return rpc.Done(request.id)

    async def _save_session(self, request: rpc.SaveSession) -> rpc.Done:
        self.check_epoch(request.epoch)
        await self._store.save_session(request.client_id, request.blob)
        return rpc.Done(request.id)

    async def _patch_session(self, request: rpc.PatchSession) -> rpc.Done:
        self.check_epoch(request.epoch)
        await self._store.patch_session(request.client_id, request.parts)
        return rpc.Done(request.id)

    async def _load_session(self, request: rpc.LoadSession) -> rpc.Value:
        return rpc.Value(request.id, await self._store.load_session(request.client_id))

    async def _end_session(self, request: rpc.EndSession) -> rpc.Value:
        return rpc.Value(request.id, await self._store.end_session(request.client_id))

    async def _sessions(self, request: rpc.ListSessions) -> rpc.Names:
        return rpc.Names(request.id, await self._store.sessions())

    async def _awaiting(self, request: rpc.GetAwaiting) -> rpc.Awaiting:
        return rpc.Awaiting(request.id, await self._store.awaiting_release(request.client_id))

    async def _release_awaiting(self, request: rpc.ReleaseAwaiting) -> rpc.Done:
        self.check_epoch(request.epoch)
        await self._store.release_awaiting(request.flows)
        return rpc.Done(request.id)

    async def _statistics(self, request: rpc.GetStatistics) -> rpc.Statistics:
        return rpc.Statistics(request.id, await self._store.statistics())

    async def _read_log(self, request: rpc.ReadLog) -> rpc.LogBytes:
        return rpc.LogBytes(request.id, await self._store.read_log(request.start, request.max_bytes))

    async def _list_delayed(self, request: rpc.ListDelayed) -> rpc.DelayedList:
        return rpc.DelayedList(request.id, await self._store.delayed_list(
            topic=request.topic, client_id=request.client_id, after=request.after, limit=request.limit))

    async def _cancel_delayed(self, request: rpc.CancelDelayed) -> rpc.Value:
        check = None if self.peer.trusted else partial(self._server.access.check, self.peer, "publish")
        return rpc.Value(request.id, await self._store.delayed_cancel(request.position, check=check))

    def _check_group(self, group: str, member: str) -> None:
        """A back-end client uses its own groups (``$group/``) as itself: its connection is the member."""
        if not self.peer.trusted and (not group.startswith(GROUP_PREFIX) or member):
            raise AccessDenied(f"back-end clients join {GROUP_PREFIX} groups as their connection only")

    async def _join(self, request: rpc.Join) -> rpc.Value:
        self._check_group(request.group, request.member)
        self._server.access.check(self.peer, "subscribe", request.queue)
        return rpc.Value(request.id, await self._store.join(request.group, request.queue, request.member,
                                                            start=request.start, at=request.at))

    async def _claim(self, request: rpc.Claim) -> rpc.Claimed:
        self._check_group(request.group, request.member)
        result = await self._store.claim_raw(request.group, request.queue, request.member, request.max_count,
                                             max_bytes=request.max_bytes, wait_s=request.wait_ms / 1000)
        return rpc.Claimed(request.id, _read_records(result))

    async def _ack(self, request: rpc.Ack) -> rpc.Value:
        self._check_group(request.group, request.member)
        return rpc.Value(request.id, await self._store.ack(request.group, request.queue, request.member,
                                                           request.offsets, below=request.below,
                                                           ranges=request.ranges))

    async def _leave(self, request: rpc.Leave) -> rpc.Done:
        self._check_group(request.group, request.member)
        await self._store.leave(request.group, request.queue, request.member)
        return rpc.Done(request.id)

    def _check_pop(self, group: str, queue: str) -> None:
        """A back-end client pops groups of its own namespace (no ``$`` name: those are the gateways') on queues it
        may subscribe to; a handle it acknowledges names its queue too."""
        if not self.peer.trusted:
            if group.startswith("$"):
                raise AccessDenied("back-end clients pop groups whose names do not start with '$'")
            self._server.access.check(self.peer, "subscribe", queue)

    async def _pop(self, request: rpc.Pop) -> rpc.PopResult:
        self._check_pop(request.group, request.queue)
        entries, handles = await self._store.pop_raw(request.group, request.queue, request.member or self.node,
                                                     request.max_count, invisible_s=request.invisible_ms / 1000,
                                                     wait_s=request.wait_ms / 1000, max_attempts=request.max_attempts,
                                                     max_bytes=request.max_bytes, start=request.start, at=request.at)
        return rpc.PopResult(request.id, _raw_records(entries), handles)

    async def _pop_ack(self, request: rpc.PopAck) -> rpc.PopAcks:
        for handle in request.handles:
            self._check_pop(*decode_handle(handle)[:2])
        return rpc.PopAcks(request.id, await self._store.pop_ack(request.handles))

    async def _change_invisible(self, request: rpc.ChangeInvisible) -> rpc.NewHandle:
        self._check_pop(*decode_handle(request.handle)[:2])
        return rpc.NewHandle(request.id, await self._store.change_invisible(request.handle,
                                                                            request.invisible_ms / 1000))

    async def _admin_call(self, request: rpc.AdminCall) -> rpc.Value:
        return rpc.Value(request.id, await self._store.admin_call(request.client_id, request.op))

    async def _admin_call_all(self, request: rpc.AdminCallAll) -> rpc.NodeAnswers:
        return rpc.NodeAnswers(request.id, *await self._store.admin_call_all(request.op, request.query))

    # --- appends, in order ----------------------------------------------------------------

    def _denied_groups(self, groups: list[list[NewMessage]]) -> dict[int, rpc.Error]:
        """The append groups this connection may not append: for a gateway node, those of a client present on
        another node (``_moved_groups``); for another peer, those with a topic it may not publish to."""
        if self.peer.trusted:
            return self._moved_groups(groups)
        denied: dict[int, rpc.Error] = {}
        check = self._server.access.check
        for index, group in enumerate(groups):
            try:
                for message in group:
                    check(self.peer, "publish", message.topic)
                    if message.packet_id:  # it would mark a flow of the client id it names as awaiting PUBREL
                        raise AccessDenied("only gateway nodes append messages with a packet id")
            except AccessDenied as exc:
                denied[index] = error_frame(0, exc)
        return denied

    def _moved_groups(self, groups: list[list[NewMessage]]) -> dict[int, rpc.Error]:
        """The append groups of QoS 2 messages (a packet id: each opens a flow of the session) of a client present
        on another node (``LeaseLost``): it connected there since this node read them, and that node has its
        session and its flows now (store/leases.py, "Presence"). A group is one connection's messages (one
        client). Such appends come late: made on a connection that was closing while the store was away (a
        failover), they wait for the next link; by then the publisher may have resent them to its new
        connection, which stored them and completed their flows, and stored again here they would be new
        messages (duplicates, [MQTT-4.3.3-2]). Other messages of such a client (QoS 0 and 1, its will due at
        the takeover) are not refused: they open no flow, and QoS 1 is at least once."""
        where = self._server.store.leases.where
        moved: dict[int, rpc.Error] = {}
        for index, group in enumerate(groups):
            if not any(message.packet_id for message in group):
                continue
            client_id = group[0].client_id
            node = where(client_id)
            if node is not None and node != self.node:
                moved[index] = error_frame(0, LeaseLost(f"client {client_id!r} is present on node {node!r} now"))
        return moved

    async def _appender(self) -> None:
        store = self._store
        async for request in self._appends_out:
            if not self.current(request.epoch):
                self.send(rpc.Error(request.id, rpc.ErrorKind.FENCED, f"lease {request.epoch} has ended"))
                continue
            denied = self._denied_groups(request.groups)
            groups = [[] if index in denied else group for index, group in enumerate(request.groups)]
            try:
                batched = [i in request.batched for i in range(len(groups))] if request.batched else ()
                results = await store.append_groups(groups, durable=request.durable, batched=batched)
            except Exception as exc:  # the write failed (OSError) or a bug: the whole request fails
                error = error_frame(request.id, exc)
                if error.kind is rpc.ErrorKind.INTERNAL:
                    LOGGER.error("append failed: %r", exc, exc_info=exc, extra={"ctx": {"node": self.node}})
                self.send(error)
                continue
            positions: list[Positions] = []
            errors: dict[int, rpc.Error] = {}
            for index, result in enumerate(results):
                if index in denied:
                    positions.append(Positions(MAIN_LOG, []))
                    errors[index] = denied[index]
                elif isinstance(result, ValueError):
                    positions.append(Positions(MAIN_LOG, []))
                    errors[index] = error_frame(0, result)
                else:
                    positions.append(result)
            self.send(rpc.Appended(request.id, positions, errors))

    # --- pushing ----------------------------------------------------------------------------

    async def _writer(self) -> None:
        """The one sender on the socket: every queued frame, in order, until the reader ended and none is left;
        then the closing Error frame, if any, last."""
        try:
            while True:
                last = None
                if not self._out:
                    if not self._ending:
                        self._out_ready = trio.Event()
                        await self._out_ready.wait()
                        continue
                    last, self._last = self._last, None
                    if last is None:
                        return
                    self._out.append(last)
                data = b"".join(self._out)
                self._out.clear()
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.cancel_scope.cancel()
                    return
                if last is not None:
                    return
        finally:
            self._written.set()

    async def _notifier(self) -> None:
        while True:
            try:
                events = await self._store.events()
            except trio.EndOfChannel:
                return
            self.send(rpc.Events(events))

    async def _mover(self) -> None:
        while True:
            try:
                moved = await self._store.moved()
            except trio.EndOfChannel:
                return
            for client_id in moved:
                self.send(rpc.ClientMoved(client_id))

    async def _asker(self) -> None:
        while True:
            try:
                ask_id, client_id, op, query = await self._store.admin_asks()
            except trio.EndOfChannel:
                return
            self.send(rpc.AdminAsk(ask_id, client_id, op, query))

    async def _heartbeat(self) -> None:
        leases = self._server.store.leases
        while True:
            await trio.sleep(self._server.heartbeat_s)
            silent = leases.silent_for(self.node)
            if silent > leases.lease_s:
                LOGGER.warning("RPC connection closed: the gateway node was silent for %.1f s", silent,
                               extra={"ctx": {"node": self.node}})
                self.cancel_scope.cancel()
                return
            self.send(rpc.Heartbeat())


@final
class RpcServer:
    """Serves one store node to any number of remote nodes.

    Args:
        store: the open store node (its leases say how long a node's lease outlives its last frame: told to it in
            the Welcome).
        access: who may connect and what they may do (store/rpc/access.py); default: everyone, trusted.
    """

    def __init__(self, store: StoreNode, *, access: StoreAccess | None = None) -> None:
        self.store = store
        self.heartbeat_s = store.leases.lease_s / rpc.HEARTBEATS_PER_LEASE
        self.access = access or StoreAccess()
        self.store_id = secrets.token_hex(8)  # leases of an earlier store process are not this one's
        self._connections: dict[str, _Connection] = {}
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
                if hello.node.startswith(rpc.REPLICA_PREFIX):
                    await self._serve_replica(stream, decoder, hello.node.removeprefix(rpc.REPLICA_PREFIX), peer)
                    return
                if hello.node.startswith(rpc.READER_PREFIX):
                    replication = self.store.replication
                    await serve_reader(stream, decoder, hello.node.removeprefix(rpc.READER_PREFIX), peer,
                                       self.store.read_log, epoch=replication.epoch if replication else 0,
                                       store_id=self.store_id)
                    return
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
        """The peer the Hello's credentials admit (store/rpc/access.py); None after refusing it with an Error frame
        (after the authenticator's brute-force delay)."""
        def refused(verdict: Verdict) -> None:
            self._refused(verdict.why, peer, node=hello.node, username=hello.username)

        return await admit_hello(self.access, stream, hello, peer.rpartition(":")[0] or peer, refused)

    async def _serve(self, stream: trio.SocketStream, decoder: rpc.FrameDecoder, node: str, peer: str,
                     admitted: Peer, hello: rpc.Hello) -> None:
        old = self._connections.get(node)
        if old is not None:  # the node reconnected before its old connection was seen to end: that one is stale
            LOGGER.warning("gateway node reconnected: closing its previous connection",
                           extra={"ctx": {"node": node, "peer": peer}})
            old.cancel_scope.cancel()
            await old.closed.wait()
        # A lease of an earlier store process (a restart) is adopted: its clients stay the node's.
        leases = self.store.leases
        epoch, resumed = leases.connected(node, hello.epoch, adopt=hello.store_id != self.store_id)
        resumed = resumed or not hello.epoch  # a first connection has nothing to resume
        connection = self._connections[node] = _Connection(self, stream, decoder, node, admitted, epoch)
        LOGGER.info("gateway node connected" if admitted.trusted else "back-end client connected",
                    extra={"ctx": {"node": node, "peer": peer, "epoch": epoch, "resumed": resumed}})
        if not resumed:
            LOGGER.warning("gateway node came back after its lease ended: it must drop the clients of that lease",
                           extra={"ctx": {"node": node, "ended_epoch": hello.epoch, "epoch": epoch}})
        try:
            connection.send(rpc.Welcome(rpc.PROTOCOL_VERSION, node, self.heartbeat_s, leases.lease_s,
                                        self.store_id, epoch, resumed, self.store.max_record_bytes))
            await connection.run()
        finally:
            connection.close()
            leases.disconnected(node)
            if self._connections.get(node) is connection:
                del self._connections[node]
            connection.closed.set()
            LOGGER.info("gateway node disconnected", extra={"ctx": {"node": node, "peer": peer}})

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The server's own tasks while it serves (until cancelled): the store's stall watch, started before any
        lease of a remote node can end, and the statistics line."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.store.leases.stalls.run)
            nursery.start_soon(_log_statistics, self)
            task_status.started()

    async def _serve_replica(self, stream: trio.SocketStream, decoder: rpc.FrameDecoder, name: str,
                             peer: str) -> None:
        """Serve a replica's fetches (store/replica/leader.py), one at a time, until it goes. It takes no lease and
        is attached to nothing. Not a replicated leader: ``NOT_LEADER``; anything but a ``Fetch``: refused."""
        replication = self.store.replication
        if replication is None:
            await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.NOT_LEADER, "")))
            return
        LOGGER.info("replica connected", extra={"ctx": {"replica": name, "peer": peer}})
        welcome = rpc.Welcome(rpc.PROTOCOL_VERSION, rpc.REPLICA_PREFIX + name, self.heartbeat_s,
                              self.store.leases.lease_s, self.store_id, replication.epoch)
        await stream.send_all(rpc.encode(welcome))
        try:
            while (message := await next_message(stream, decoder)) is not None:
                if type(message) is not rpc.Fetch:
                    why = f"{type(message).__name__} is not for a replica connection"
                    LOGGER.warning("replica connection closed: %s", why, extra={"ctx": {"replica": name}})
                    await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.PROTOCOL, why)))
                    return
                try:
                    answer = await replication.fetch(name, message.epoch, message.last_epoch, message.offset,
                                                     message.held, min(message.max_bytes, MAX_PULL_BYTES),
                                                     message.min_bytes, message.max_wait_ms / 1000)
                except LeaderFenced:  # it follows a later epoch: this store does not lead it
                    await stream.send_all(rpc.encode(rpc.Error(message.id, rpc.ErrorKind.NOT_LEADER, "")))
                    return
                except Exception as exc:
                    error = error_frame(message.id, exc)
                    if error.kind is rpc.ErrorKind.INTERNAL:
                        LOGGER.error("fetch failed: %r", exc, exc_info=exc, extra={"ctx": {"replica": name}})
                    await stream.send_all(rpc.encode(error))
                    continue
                await stream.send_all(rpc.encode(rpc.Frames(message.id, answer.epoch, answer.data, answer.confirm,
                                                            answer.epochs, answer.truncate_to,
                                                            answer.end, answer.min_offset)))
        except rpc.RpcProtocolError as exc:
            LOGGER.warning("replica connection closed: %s", exc, extra={"ctx": {"replica": name}})
            with trio.move_on_after(1.0):
                await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.PROTOCOL, str(exc))))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            LOGGER.info("replica disconnected", extra={"ctx": {"replica": name, "peer": peer}})

    def figures(self) -> dict[str, Any]:
        """The notify routing, lease and replication figures an operator watches (the periodic log line)."""
        notify = self.store.router.statistics()
        leases = self.store.leases.statistics()
        return {"notify_sent": notify.sent, "notify_suppressed": notify.suppressed,
                "notify_unrouted": notify.unrouted, "nodes": sorted(self._connections),
                "clients_placed": leases.clients, "wills_held": leases.wills_held, "wills_fired": leases.wills_fired,
                "sessions_expired": leases.sessions_expired,
                "consumer_groups": [(g.group, g.queue, g.members, g.committed, g.unacked)
                                    for g in self.store.groups.statistics()],
                **({"replication": self.store.replication.figures()} if self.store.replication else {})}


async def serve_rpc(
    store: StoreNode,
    host: str,
    port: int,
    *,
    access: StoreAccess | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``store`` over the RPC on ``host:port`` until cancelled: an unreplicated store, one serving phase of
    its listener (store/rpc/front.py) for ever.

    ``task_status.started`` receives the listeners (port 0 picks a free port: read it from them).
    ``access`` (who may connect, store/rpc/access.py; default: everyone, trusted): see ``RpcServer``.
    """
    front = RpcFront()
    async with trio.open_nursery() as nursery:
        await nursery.start(front.serving, RpcServer(store, access=access))
        listeners = await nursery.start(front.serve, host, port)
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
