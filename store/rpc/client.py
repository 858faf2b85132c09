"""``RemoteStore``: the ``StoreApi`` of a cluster gateway and of back-end clients, over the store node's RPC.

A gateway node in cluster mode is written against ``store.api.StoreApi`` exactly like the embedded one; this
implementation sends each call to a ``lightgate store`` process (store/rpc/server.py) over one TCP connection:

- pipelined: every call gets a request id and waits for its own answer; any
  number are in flight at once;
- batched: appends, pulls, offset commits and QoS 2 releases that callers make while earlier
  ones of their kind are in flight travel together in the next request (one
  frame, one store-side CommitLog write or thread hand-off), so the cost per
  message is not a round trip;
- never without waiting: ``append_nowait`` and ``pull_nowait`` always raise ``trio.WouldBlock`` (each is a
  round trip); the awaiting forms are the ones to use;
- reconnecting: when the connection breaks, calls in flight and new calls
  raise ``StoreUnavailable`` (a ``ConnectionError``: an append is then not
  acknowledged to any device) while the client reconnects with backoff; on
  reconnecting it registers its watches and its connected clients with their wills again (``Reattach``)
  and posts one event per watched queue at its current head, so every local session pulls
  whatever it may have missed;
- fenced: the client carries the lease epoch of each of its clients (the lease its node held when the
  client connected) and names it in every write made for the client. If the lease ended meanwhile (the
  process was frozen, or cut off, for longer than the lease), the store says so in the Welcome: the clients
  of the ended lease are reported through :meth:`moved` and not registered again, and the store refuses
  their writes (``LeaseLost``).

Back-end producers and consumers (store/clients/) use the same client: ``RemoteStore.connect(host, port)``
then ``append`` (or ``append_each``), ``join``, ``claim``, ``ack``, ``leave``.

Resource handling: ``connect`` is an async context manager that owns the
connection and its tasks; leaving it closes both, and ``events`` then ends.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any, final

import trio

from lightqueue.topics import TopicError
from notify import EventMailbox
from store.api import (MAIN_LOG, AdminOp, Flow, LeaseLost, LogSpan, NewMessage, Position, Positions, PullRequest,
                       PullResult, StoreStatistics, StoreUnavailable)
from store.log.errors import LogFullError, OffsetExpired
from store.log.record import Record, RecordTooLarge, decode_record
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied
from store.stalls import StallWatch
from store.tasks import background

__all__ = ["RemoteStore", "RemoteStoreStatistics", "StoreRpcError", "default_node_name"]

LOGGER = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024
"""One ``receive_some`` reads up to this much: a burst of answers and events is decoded in one wake-up."""

CONNECT_TIMEOUT_S = 5.0
"""One connection attempt (TCP connect and handshake) gives up after this."""

RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 2.0
"""Reconnect backoff: doubling from the minimum to the maximum; the maximum bounds how long devices wait
after a store restart for appends to be accepted again."""

BATCHES_IN_FLIGHT = 2
"""Batched requests of one kind in flight at once: one being answered while the next fills. One would leave the
store idle for a round trip per batch; more splits the waiting calls into smaller batches."""

APPEND_BATCH_BYTES = 4 * 1024 * 1024
"""An append request carries about this many payload bytes at most (and always one caller's group), far below
the frame limit."""

PULL_BATCH_BYTES = 16 * 1024 * 1024
"""The byte budgets of the reads in one pull request add up to at most this (a read counts at least
``PULL_READ_MIN_BYTES``: it may return one record above its budget), so an answer stays far below the frame limit."""

PULL_READ_MIN_BYTES = 1024 * 1024
"""What a read counts against ``PULL_BATCH_BYTES`` at least: the default maximum record size."""

READ_AHEAD_WINDOWS = 3
"""After a full read, the next windows of the same size read in advance: enough that the store reads one while the
client decodes another and its caller delivers a third (a read's offsets are contiguous unless retention cut a gap;
a window that does not start where the next pull does is dropped unused)."""

READ_AHEAD_MAX = 64
"""Reads made in advance kept at once (each at most a pull's byte budget, 1 MiB by default): enough for the
sessions draining backlogs on a node at the same time; the oldest is dropped first."""

STATISTICS_LOG_S = 60.0
"""How often ``log_statistics`` logs the node's notify figures."""

STALLED_LEASES = 6
"""The client gives up on a store whose connection lives but which has said nothing for this many of its leases.
A store that stalls (a GC or swap stall, a paused VM, an fsync that blocks its loop) and runs again within them
finds the client, its calls waiting and its node's devices as it left them (the store does not count its own
stall against the node's lease, store/stalls.py): a broken link would have failed the calls and dropped their
devices. A store host that vanished is noticed sooner, by TCP (``TCP_USER_TIMEOUT``: a lease)."""


class StoreRpcError(OSError):
    """The store refused the connection (protocol version, malformed frames) or failed a call with a bug.

    An ``OSError``, so the gateway treats it like a failed write: nothing is acknowledged.
    """


def default_node_name() -> str:
    """A gateway node name unique per process: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _exception(error: rpc.Error) -> Exception:
    """The exception the local store would have raised for a wire error."""
    kind = error.kind
    if kind is rpc.ErrorKind.DENIED:
        return AccessDenied(error.message)
    if kind is rpc.ErrorKind.FENCED:
        return LeaseLost(error.message)
    if kind is rpc.ErrorKind.RECORD_TOO_LARGE:
        return RecordTooLarge(error.message)
    if kind is rpc.ErrorKind.EXPIRED:  # the message is OffsetExpired's: the offset first, the log's minimum last
        numbers = [int(n) for n in re.findall(r"\d+", error.message)]
        return OffsetExpired(numbers[0], numbers[-1]) if numbers else LookupError(error.message)
    if kind is rpc.ErrorKind.TOPIC:
        return TopicError(error.message)
    if kind is rpc.ErrorKind.VALUE:
        return ValueError(error.message)
    if kind is rpc.ErrorKind.LOG_FULL:
        return LogFullError(errno.ENOSPC, error.message)
    if kind is rpc.ErrorKind.OS:
        return OSError(error.message)
    return StoreRpcError(f"store: {error.kind.value}: {error.message}")


Handler = Callable[[Any], None]
"""What waits for an answer: called once with the answer message or with the exception that replaces it."""


@final
class _Call:
    """One caller waiting for its result."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def set(self, result: Any) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    async def wait(self) -> Any:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@final
class _Batcher:
    """Calls of one kind made while ``BATCHES_IN_FLIGHT`` requests of it are in flight share the next request.

    Args:
        link: the connection the requests go out on.
        make: ``make(request_id, items) -> request`` for a batch of items.
        split: ``split(answer, calls)`` hands each call its part of an answer.
        weight: an item's bytes against ``budget`` (a batch always takes at least one item).
        counts: ``[calls, requests]`` of this kind, kept by the client across links.
    """

    def __init__(self, link: _Link, make: Callable[[int, list[Any]], Any],
                 split: Callable[[Any, list[tuple[Any, _Call]]], None],
                 weight: Callable[[Any], int], budget: int, counts: list[int]) -> None:
        self._link = link
        self._counts = counts
        self._make = make
        self._split = split
        self._weight = weight
        self._budget = budget
        self._waiting: list[tuple[Any, _Call]] = []
        self._in_flight = 0
        self._wakeup = trio.Event()

    async def submit(self, item: Any) -> Any:
        return await self.enqueue(item).wait()

    def enqueue(self, item: Any) -> _Call:
        """Add ``item`` to the next batch; its result comes in the returned call.

        On a link that broke, the call fails at once: the link's closing runs
        ``fail_all`` once, and the client keeps the link until it is closed, so
        a call made in between would otherwise wait for ever.
        """
        call = _Call()
        if self._link.broken:
            call.fail(StoreUnavailable("the connection to the store broke"))
            return call
        self._waiting.append((item, call))
        self._wakeup.set()
        return call

    def fail_all(self, error: BaseException) -> None:
        for _, call in self._waiting:
            call.fail(error)
        self._waiting.clear()

    async def run(self) -> None:
        """Send batches whenever calls wait and a request slot is free (runs as long as the link)."""
        while True:
            if not self._waiting or self._in_flight >= BATCHES_IN_FLIGHT:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            taken = 1
            size = self._weight(self._waiting[0][0])
            while taken < len(self._waiting):
                size += self._weight(self._waiting[taken][0])
                if size > self._budget:
                    break
                taken += 1
            batch = self._waiting[:taken]
            del self._waiting[:taken]
            self._in_flight += 1
            self._counts[0] += taken
            self._counts[1] += 1

            def answered(answer: Any, batch: list[tuple[Any, _Call]] = batch) -> None:
                self._in_flight -= 1
                self._wakeup.set()
                if isinstance(answer, BaseException):
                    for _, call in batch:
                        call.fail(answer)
                elif type(answer) is rpc.Error:
                    error = _exception(answer)
                    for _, call in batch:
                        call.fail(error)
                else:
                    self._split(answer, batch)

            try:
                self._link.request(lambda rid: self._make(rid, [item for item, _ in batch]), answered)
            except rpc.RpcProtocolError as exc:  # larger than a frame: these callers fail, the link goes on
                answered(ValueError(str(exc)))


@final
class _Link:
    """One live connection to the store: its answers in waiting, its batchers, its writer."""

    def __init__(self, client: RemoteStore, stream: trio.SocketStream, decoder: rpc.FrameDecoder,
                 welcome: rpc.Welcome) -> None:
        self.stream = stream
        self.decoder = decoder
        self.cancel_scope = trio.CancelScope()
        self.broken = False  # set as the link starts closing: a request made after that would never be answered
        self.epoch = welcome.epoch  # the lease this connection serves
        self._client = client
        self._ids = client._ids
        self._pending: dict[int, Handler] = {}
        self._out: list[bytes] = []
        self._out_ready = trio.Event()
        self._watch_deltas: dict[str, int] = {}
        self._last_received = trio.current_time()
        self._heartbeat_s = welcome.heartbeat_s
        self._lease_s = welcome.lease_s
        self._silent_max_s = welcome.lease_s * STALLED_LEASES  # silence this long means the store is stuck
        self._stalls = StallWatch("gateway node")  # this process's own stalls: past the lease, its lease may have ended
        counts = client._batch_counts
        self.appends = {durable: _Batcher(self, lambda rid, groups, d=durable: rpc.AppendRequest(rid, groups, d),
                                          _split_appends, _group_bytes, APPEND_BATCH_BYTES, counts["append"])
                        for durable in (None, True, False)}
        self.pulls = _Batcher(self, lambda rid, reads: rpc.Pull(rid, [r for group in reads for r in group]),
                              _split_pulls, _reads_bytes, PULL_BATCH_BYTES, counts["pull"])
        self.commits = _Batcher(self, _merge_commits, _split_done, lambda item: 64 * len(item), 1 << 20,
                                counts["commit"])
        self.releases = _Batcher(self, lambda rid, items: rpc.ReleaseAwaiting(rid, [f for fl in items for f in fl]),
                                 _split_done, lambda item: 64 * len(item), 1 << 20, counts["release"])
        self.ahead: dict[tuple[str, int], tuple[PullRequest, _Call]] = {}  # (queue, offset) -> read in advance
        self._ahead_counts = client._ahead_counts

    # --- reading ahead --------------------------------------------------------------------

    def read_ahead(self, request: PullRequest) -> None:
        """Read ``request`` now, for the pull that will likely ask for it (oldest read-ahead dropped beyond the cap)."""
        key = (request.queue, request.from_offset)
        if key in self.ahead:
            return
        if len(self.ahead) >= READ_AHEAD_MAX:
            del self.ahead[next(iter(self.ahead))]
        self.ahead[key] = (request, self.pulls.enqueue([request]))
        self._ahead_counts[1] += 1

    async def take_ahead(self, request: PullRequest) -> PullResult[Record] | None:
        """The answer to ``request`` from a read made in advance, or None when there is none that is exact.

        Exact: it started at the same offset, with the same byte budget, and
        holds at least ``request.max_count`` messages (the entries of a queue
        below its head never change; a shorter read may have stopped at a head
        that has moved since).
        """
        found = self.ahead.pop((request.queue, request.from_offset), None)
        if found is None:
            return None
        early, call = found
        if early.max_bytes != request.max_bytes or early.max_count < request.max_count:
            return None
        try:
            (result,) = await call.wait()
        except OSError:
            return None
        messages = result.messages
        if len(messages) < request.max_count:
            return None
        self._ahead_counts[0] += 1
        if len(messages) == request.max_count:
            return result
        return PullResult(messages[: request.max_count], messages[request.max_count][0], result.expired)

    # --- sending ------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        self._out.append(rpc.encode(message))
        self._out_ready.set()

    def watch(self, queue: str, delta: int) -> None:
        deltas = self._watch_deltas
        deltas[queue] = deltas.get(queue, 0) + delta
        self._out_ready.set()

    def request(self, make: Callable[[int], Any], handler: Handler) -> None:
        """Send ``make(request_id)``; ``handler`` gets the answer, or ``StoreUnavailable`` if the link breaks first."""
        if self.broken:
            raise StoreUnavailable("the connection to the store broke")
        rid = next(self._ids)
        frame = rpc.encode(make(rid))
        self._pending[rid] = handler
        self._out.append(frame)
        self._out_ready.set()

    async def call(self, make: Callable[[int], Any]) -> Any:
        """One request, one answer (an ``Error`` answer is raised as the local store's exception)."""
        call = _Call()
        self.request(make, call.set)
        answer = await call.wait()
        if isinstance(answer, BaseException):
            raise answer
        if type(answer) is rpc.Error:
            raise _exception(answer)
        return answer

    # --- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Read, write, heartbeat and batch until the connection breaks; then fail everything waiting."""
        try:
            with self.cancel_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._heartbeat)
                    nursery.start_soon(self._stalls.run)
                    for batcher in (*self.appends.values(), self.pulls, self.commits, self.releases):
                        nursery.start_soon(batcher.run)
                    await self._reader()
                    nursery.cancel_scope.cancel()
        finally:
            self.broken = True
            error = StoreUnavailable("the connection to the store broke")
            pending, self._pending = self._pending, {}
            for handler in pending.values():
                handler(error)
            for batcher in (*self.appends.values(), self.pulls, self.commits, self.releases):
                batcher.fail_all(error)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _reader(self) -> None:
        decoder = self.decoder
        client = self._client
        while True:
            try:
                message = decoder.next_message()
            except rpc.RpcProtocolError as exc:
                LOGGER.error("store connection closed: %s", exc)
                return
            if message is rpc.NEED_DATA:
                if decoder.eof:
                    LOGGER.warning("the store closed the connection")
                    return
                try:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    LOGGER.warning("store connection lost: %r", exc)
                    return
                if self._away():
                    return
                decoder.receive_data(data)
                self._last_received = trio.current_time()
                continue
            kind = type(message)
            if kind is rpc.Events:
                client._received(message.events)
            elif kind is rpc.ClientMoved:
                client._moved.post({message.client_id: 0})
            elif kind is rpc.AdminAsk:
                client._asks_in.send_nowait((message.id, message.client_id, message.op, message.query))
            elif kind is rpc.Heartbeat:
                pass
            elif kind is rpc.Error and message.id == 0:
                LOGGER.error("the store closed the connection: %s: %s", message.kind.value, message.message)
                return
            else:
                handler = self._pending.pop(message.id, None)
                if handler is not None:  # else its caller was cancelled
                    handler(message)

    def _away(self) -> bool:
        """Whether this process stalled (its loop did not run) for longer than its lease since the store's last
        frame: the store may have ended the lease meanwhile, so what it sent before may be stale (a client
        moved away, then its lease ended). The link is dropped unread; the next Welcome says whether the lease
        still holds."""
        now = trio.current_time()
        if now - self._last_received <= self._lease_s or self._stalls.awake_since() <= self._last_received:
            return False
        LOGGER.warning("this node stalled for longer than its store lease: reconnecting to learn whether the lease"
                       " ended", extra={"ctx": {"silent_s": round(now - self._last_received, 3)}})
        return True

    async def _writer(self) -> None:
        while True:
            if not self._out and not self._watch_deltas:
                self._out_ready = trio.Event()
                await self._out_ready.wait()
                continue
            frames = self._out
            self._out = []
            if self._watch_deltas:  # ahead of what was queued after the watch calls: routing first
                deltas = {queue: delta for queue, delta in self._watch_deltas.items() if delta}
                self._watch_deltas = {}
                if deltas:
                    frames.insert(0, rpc.encode(rpc.Watch(deltas)))
            try:
                await self.stream.send_all(b"".join(frames))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                LOGGER.warning("store connection lost: %r", exc)
                self.cancel_scope.cancel()
                return

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(self._heartbeat_s)
            silent = trio.current_time() - self._last_received
            if silent > self._silent_max_s:
                LOGGER.warning("store connection closed: the store was silent for %.1f s", silent)
                self.cancel_scope.cancel()
                return
            self.send(rpc.Heartbeat())


def _group_bytes(group: list[NewMessage]) -> int:
    return sum(len(m.payload) + len(m.topic) + len(m.properties) + 64 for m in group)


def _reads_bytes(reads: list[PullRequest]) -> int:
    return sum(max(r.max_bytes, PULL_READ_MIN_BYTES) for r in reads)


def _split_appends(answer: rpc.Appended, batch: list[tuple[Any, _Call]]) -> None:
    for index, (_, call) in enumerate(batch):
        error = answer.errors.get(index)
        if error is not None:
            call.fail(_exception(error))
        else:
            call.set(answer.positions[index])


def _decoded(records: rpc.RawRecords) -> PullResult[Record]:
    """A read as the store sent it (records as stored), decoded here: the store's CPU is every gateway's."""
    return PullResult([(qoff, decode_record(raw, 0, log_offset)) for qoff, log_offset, raw in records.entries],
                      records.next_offset, records.expired)


def _split_pulls(answer: rpc.Pulled, batch: list[tuple[Any, _Call]]) -> None:
    start = 0
    results = answer.results
    for reads, call in batch:
        mine = results[start : start + len(reads)]
        start += len(reads)
        call.set([_decoded(r) for r in mine])


def _merge_commits(rid: int, items: list[dict[str, dict[str, int]]]) -> rpc.CommitOffsets:
    merged: dict[str, dict[str, int]] = {}
    for commits in items:  # in call order: a later commit of the same owner and queue wins
        for owner, offsets in commits.items():
            merged.setdefault(owner, {}).update(offsets)
    return rpc.CommitOffsets(rid, merged)


def _split_done(answer: rpc.Done, batch: list[tuple[Any, _Call]]) -> None:
    for _, call in batch:
        call.set(None)


@dataclass(frozen=True, slots=True)
class RemoteStoreStatistics:
    """The client's own figures (the store's are ``statistics()``)."""

    connected: bool
    connects: int  # successful handshakes, the first included
    events_received: int  # queue events the store routed to this node
    watched_queues: int
    clients: int  # connected clients registered at the store (with their wills)
    batches: dict[str, tuple[int, int]]  # "append" / "pull" / "commit" / "release" -> (calls, requests they took)
    read_ahead: tuple[int, int]  # pulls answered by a read made in advance, reads made in advance


@dataclass(slots=True)
class _Client:
    """A connected client of this node, as the store knows it: sent again after a reconnect."""

    epoch: int  # the lease it was accepted under: its writes name it
    expiry_s: int
    will: NewMessage | None
    will_delay_s: int


@final
class RemoteStore:
    """The ``StoreApi`` of a store node process (see the module docstring). Create it with :meth:`connect`."""

    def __init__(self, host: str, port: int, node: str, *, token: str = "", username: str | None = None,
                 password: bytes | None = None) -> None:
        self.host = host
        self.port = port
        self.node = node
        self._credentials = (token, username, password)  # sent in every Hello (store/rpc/access.py)
        self._ids = count(1)
        self._link: _Link | None = None
        self._mailbox = EventMailbox()
        self._watched: dict[str, int] = {}  # queue -> local sessions on it (sent again after a reconnect)
        self._clients: dict[str, _Client] = {}  # client id -> its lease and will (sent again after a reconnect)
        self._moved = EventMailbox()  # {client id: 0} of the clients that are not this node's any more
        self._store_id = ""  # the store process and lease epoch this node holds (sent in each Hello)
        self._epoch = 0
        self._asks_in, self._asks_out = trio.open_memory_channel[tuple[int, str, AdminOp, bytes]](math.inf)  # admin asks
        self._connected = trio.Event()
        self._link_up = trio.Event()  # set and replaced at each successful handshake (wait_reconnected)
        self._connects = 0
        self._events_received = 0
        self._batch_counts: dict[str, list[int]] = {"append": [0, 0], "pull": [0, 0], "commit": [0, 0],
                                                    "release": [0, 0]}
        self._ahead_counts = [0, 0]  # reads in advance: used, made
        self._fenced_writes = 0  # writes refused because their client's lease had ended

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, host: str, port: int, *, node: str | None = None, timeout_s: float | None = 30.0, token: str = "",
        username: str | None = None, password: bytes | str | None = None,
    ) -> AsyncIterator[RemoteStore]:
        """Connect to the store at ``host:port`` and keep connected until the block exits.

        Args:
            node: this client's node name, as the store routes events and places clients
                (default: ``default_node_name()``); unique among the store's clients.
            timeout_s: give up if the first connection does not succeed within this (None: retry forever).
            token: the store's ``store.token``: a gateway node's credential (store/rpc/access.py).
            username, password: a back-end client's credentials, when the store has a password file.

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the handshake (another protocol version).
        """
        if isinstance(password, str):
            password = password.encode()
        client = cls(host, port, node or default_node_name(), token=token, username=username, password=password)
        try:
            async with background(lambda task_status: client._supervise(timeout_s, task_status)):
                yield client
        finally:
            client._mailbox.close()
            client._moved.close()
            client._asks_in.close()

    @property
    def connected(self) -> bool:
        return self._link is not None

    @property
    def epoch(self) -> int:
        """The lease epoch this node holds at the store (0 before the first connection)."""
        return self._epoch

    def _require_link(self) -> _Link:
        link = self._link
        if link is None:
            raise StoreUnavailable(f"not connected to the store at {self.host}:{self.port}")
        return link

    def _epoch_of(self, client_id: str) -> int:
        """The lease epoch a write for ``client_id`` names (0: this connection's: a client not registered here)."""
        client = self._clients.get(client_id)
        return client.epoch if client is not None else 0

    def _stale(self, epoch: int, link: _Link) -> bool:
        """Whether ``epoch`` is an ended lease of this node's (its writes are refused)."""
        return epoch != 0 and epoch != link.epoch

    def _refuse_stale(self, epoch: int, link: _Link) -> None:
        """Refuse here, as the store would (``LeaseLost``), a write for a client of an ended lease: the node sends
        nothing more for the clients it had then (docs/cluster.md, "Fencing"); the store's check stays for what
        was sent before the node knew."""
        if self._stale(epoch, link):
            raise LeaseLost(f"lease {epoch} of node {self.node} has ended (the node holds lease {link.epoch} now)")

    async def wait_reconnected(self, connects: int) -> None:
        """Return once a connection newer than the ``connects``-th (``client_statistics().connects``) is up.

        What a caller whose call raised ``StoreUnavailable`` waits for: unlike
        :meth:`wait_connected`, it does not return while the broken link is still closing.
        """
        while True:
            up = self._link_up  # taken before the check: a handshake after it sets this one
            link = self._link
            if self._connects > connects and link is not None and not link.broken:
                return
            await up.wait()

    async def wait_connected(self) -> None:
        """Return once the client is connected (at once if it is)."""
        while self._link is None:
            await self._connected.wait()

    async def wait_available(self) -> None:
        """Return once a connection that is not breaking is up (at once if one is)."""
        while True:
            up = self._link_up  # taken before the check: a handshake after it sets this one
            link = self._link
            if link is not None and not link.broken:
                return
            await up.wait()

    # --- messages ---------------------------------------------------------------------------

    def append_nowait(self, messages: Sequence[NewMessage]) -> Positions:
        """Always raises ``trio.WouldBlock``: an append is a round trip to the store node."""
        raise trio.WouldBlock

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None) -> Positions:
        link = self._require_link()
        if not messages:
            return Positions(MAIN_LOG, [])
        group = list(messages)
        self._refuse_stale(self._epoch_of(group[0].client_id), link)  # a connection's appends: one publisher
        return await link.appends[durable].submit(group)

    async def append_each(self, messages: Sequence[NewMessage], *, durable: bool | None = None
                          ) -> list[Position | Exception]:
        """Append messages in one request and one CommitLog write, each one failing alone (back-end producers,
        store/clients/producer.py, which batch by themselves: this skips the client's own batching).

        Returns, per message, its position or the exception that refused it
        (``RecordTooLarge``, ``AccessDenied`` for a topic the ACL does not allow).

        Raises:
            StoreUnavailable: the connection broke (the messages may or may not be appended).
            OSError: the write failed; none was appended.
            ValueError: the request exceeds the RPC frame limit (nothing was sent).
        """
        link = self._require_link()
        if not messages:
            return []
        groups = [[m] for m in messages]
        try:
            answer = await link.call(lambda rid: rpc.AppendRequest(rid, groups, durable))
        except rpc.RpcProtocolError as exc:
            raise ValueError(str(exc)) from None
        errors = answer.errors
        return [_exception(errors[i]) if i in errors else answer.positions[i][0] for i in range(len(groups))]

    def pull_nowait(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """Always raises ``trio.WouldBlock``: a read is a round trip to the store node."""
        raise trio.WouldBlock

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """The reads, batched with other callers'; a read that comes back full starts the next one in advance.

        Reading ahead overlaps the store's next reads with the caller's work on
        this one (a session delivering a batch, then pulling the next): without
        it a backlog drains at one round trip per pull batch.
        """
        link = self._require_link()
        if not requests:
            return []
        early = [await link.take_ahead(r) if link.ahead else None for r in requests]
        reads = [r for r, result in zip(requests, early) if result is None]
        fresh = iter(await link.pulls.submit(reads) if reads else ())
        results = [result if result is not None else next(fresh) for result in early]
        for request, result in zip(requests, results):
            count = request.max_count
            if len(result.messages) >= count:  # a backlog: the next windows are at the offsets that follow
                for window in range(READ_AHEAD_WINDOWS):
                    link.read_ahead(PullRequest(request.queue, result.next_offset + window * count, count,
                                                request.max_bytes))
        return results

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        answer = await self._require_link().call(lambda rid: rpc.MaxOffsets(rid, list(queues)))
        return answer.offsets

    async def retained(self, filter: str) -> list[Record]:
        answer = await self._require_link().call(lambda rid: rpc.GetRetained(rid, filter))
        return [decode_record(raw, 0, log_offset) for log_offset, raw in answer.records]

    async def read_log(self, start: Position, max_bytes: int) -> LogSpan:
        answer = await self._require_link().call(lambda rid: rpc.ReadLog(rid, start, max_bytes))
        return answer.span

    async def statistics(self) -> StoreStatistics:
        answer = await self._require_link().call(lambda rid: rpc.GetStatistics(rid))
        return answer.stats

    # --- subscriptions and offsets ----------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        answer = await self._require_link().call(lambda rid: rpc.Activate(rid, queue, holder))
        return answer.value

    async def release(self, queue: str, holder: str) -> bool:
        link = self._require_link()
        epoch = self._epoch_of(holder)
        self._refuse_stale(epoch, link)
        answer = await link.call(lambda rid: rpc.Release(rid, queue, holder, epoch))
        return answer.value

    async def get_offsets(self, owner: str) -> dict[str, int]:
        answer = await self._require_link().call(lambda rid: rpc.GetOffsets(rid, owner))
        return answer.value

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        """The commits of clients of this node's lease go in one batched request; those of clients of an ended
        lease are not sent: ``LeaseLost`` once the others are written."""
        link = self._require_link()
        current: dict[str, dict[str, int]] = {}
        stale: list[int] = []
        for owner, offsets in commits.items():
            epoch = self._epoch_of(owner)
            if self._stale(epoch, link):
                stale.append(epoch)
            else:
                current[owner] = dict(offsets)
        if current:
            await link.commits.submit(current)
        if stale:
            self._refuse_stale(stale[0], link)

    def watch(self, queue: str) -> None:
        self._watched[queue] = self._watched.get(queue, 0) + 1
        if self._link is not None:
            self._link.watch(queue, 1)

    def unwatch(self, queue: str) -> None:
        left = self._watched.get(queue, 0) - 1
        if left < 0:
            return
        if left:
            self._watched[queue] = left
        else:
            del self._watched[queue]
        if self._link is not None:
            self._link.watch(queue, -1)

    async def events(self) -> dict[str, int]:
        return await self._mailbox.get()

    # --- consumer groups and shared subscriptions --------------------------------------------

    async def join(self, group: str, queue: str, member: str, *, start: str = "latest", at: int = 0) -> int:
        answer = await self._require_link().call(lambda rid: rpc.Join(rid, group, queue, member, start, at))
        return answer.value

    async def claim(self, group: str, queue: str, member: str, max_count: int, *, max_bytes: int = 1 << 20,
                    wait_s: float = 0.0) -> PullResult[Record]:
        wait_ms = max(0, int(wait_s * 1000))
        answer = await self._require_link().call(
            lambda rid: rpc.Claim(rid, group, queue, max_count, max_bytes, wait_ms, member))
        return _decoded(answer.result)

    async def ack(self, group: str, queue: str, member: str, offsets: Sequence[int] = (), *, below: int = 0) -> int:
        answer = await self._require_link().call(
            lambda rid: rpc.Ack(rid, group, queue, list(offsets), member, below))
        return answer.value

    async def leave(self, group: str, queue: str, member: str, *, unsubscribe: bool = False) -> None:
        await self._require_link().call(lambda rid: rpc.Leave(rid, group, queue, member, unsubscribe))

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None = None, will_delay_s: int = 0) -> bytes | None:
        link = self._require_link()
        self._clients[client_id] = _Client(link.epoch, expiry_s, will, will_delay_s)
        try:
            answer = await link.call(lambda rid: rpc.OpenSession(rid, client_id, clean_start, expiry_s, will,
                                                              will_delay_s))
        except BaseException:
            self._clients.pop(client_id, None)
            raise
        return answer.value

    async def close_session(self, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        client = self._clients.pop(client_id, None)
        epoch = client.epoch if client is not None else 0
        link = self._require_link()
        self._refuse_stale(epoch, link)
        await link.call(lambda rid: rpc.CloseSession(rid, client_id, expiry_s, will_delay_s, epoch))

    async def save_session(self, client_id: str, blob: bytes) -> None:
        link = self._require_link()
        epoch = self._epoch_of(client_id)
        self._refuse_stale(epoch, link)
        await link.call(lambda rid: rpc.SaveSession(rid, client_id, blob, epoch))

    async def load_session(self, client_id: str) -> bytes | None:
        answer = await self._require_link().call(lambda rid: rpc.LoadSession(rid, client_id))
        return answer.value

    async def end_session(self, client_id: str) -> bool:
        answer = await self._require_link().call(lambda rid: rpc.EndSession(rid, client_id))
        return answer.value

    async def sessions(self) -> list[str]:
        answer = await self._require_link().call(lambda rid: rpc.ListSessions(rid))
        return answer.names

    async def awaiting_release(self, client_id: str) -> dict[int, Position]:
        answer = await self._require_link().call(lambda rid: rpc.GetAwaiting(rid, client_id))
        return answer.flows

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        if not flows:
            return
        link = self._require_link()
        self._refuse_stale(self._epoch_of(flows[0].client_id), link)  # one connection's releases: one client
        await link.releases.submit(list(flows))

    async def moved(self) -> list[str]:
        return list(await self._moved.get())

    # --- administration across nodes -------------------------------------------------------

    async def admin_call(self, client_id: str, op: AdminOp) -> bytes | None:
        answer = await self._require_link().call(lambda rid: rpc.AdminCall(rid, client_id, op))
        return answer.value

    async def admin_call_all(self, op: AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        answer = await self._require_link().call(lambda rid: rpc.AdminCallAll(rid, op, query))
        return answer.answers, answer.missing

    async def admin_asks(self) -> tuple[int, str, AdminOp, bytes]:
        return await self._asks_out.receive()

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """Answer the ask ``ask_id`` (lost if the connection it came on broke: the asker got an error)."""
        if self._link is not None:
            self._link.send(rpc.AdminAnswer(ask_id, value))

    # --- the client's own figures -------------------------------------------------------

    def client_statistics(self) -> RemoteStoreStatistics:
        return RemoteStoreStatistics(self._link is not None, self._connects, self._events_received,
                                     len(self._watched), len(self._clients),
                                     {kind: (calls, requests) for kind, (calls, requests) in self._batch_counts.items()},
                                     (self._ahead_counts[0], self._ahead_counts[1]))

    async def log_statistics(self, interval_s: float = STATISTICS_LOG_S) -> None:
        """Log this node's notify figures every ``interval_s`` until cancelled: events routed here and suppressed."""
        while True:
            await trio.sleep(interval_s)
            mine = self.client_statistics()
            ctx: dict[str, Any] = {"node": self.node, "events_received": mine.events_received,
                                   "watched_queues": mine.watched_queues, "connected": mine.connected}
            if mine.connected:
                try:
                    store = await self.statistics()
                except OSError:
                    pass
                else:
                    ctx["store_events_sent_here"] = store.notify_by_node.get(self.node, 0)
                    ctx["store_events_suppressed"] = store.notify_suppressed
            LOGGER.info("store client statistics", extra={"ctx": ctx})

    # --- connection -----------------------------------------------------------------------

    def _received(self, events: dict[str, int]) -> None:
        self._events_received += len(events)
        self._mailbox.post(events)

    async def _supervise(self, timeout_s: float | None, task_status: trio.TaskStatus[None]) -> None:
        """Connect, serve the link until it breaks, reconnect with backoff; forever (until cancelled)."""
        first_deadline = trio.current_time() + timeout_s if timeout_s is not None else float("inf")
        backoff = RECONNECT_MIN_S
        failures = 0
        while True:
            try:
                link = await self._open_link()
            except StoreRpcError:
                if not self._connects:
                    raise
                link = None
            except OSError as exc:  # refused, unreachable, timed out
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    LOGGER.warning("store not reachable: %r", exc,
                                   extra={"ctx": {"store": f"{self.host}:{self.port}", "attempts": failures}})
                link = None
            if link is None:
                if not self._connects and trio.current_time() + backoff > first_deadline:
                    raise StoreUnavailable(f"no connection to the store at {self.host}:{self.port} "
                                           f"within {timeout_s} s")
                await trio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            backoff = RECONNECT_MIN_S
            failures = 0
            self._connects += 1
            reconnected = self._connects > 1
            self._link = link
            self._connected.set()
            self._link_up.set()
            self._link_up = trio.Event()
            LOGGER.info("connected to the store", extra={"ctx": {"store": f"{self.host}:{self.port}",
                                                                 "node": self.node, "reconnect": reconnected}})
            if not reconnected:
                task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_link, link)
                if reconnected:
                    nursery.start_soon(self._resync, link)
            self._link = None
            self._connected = trio.Event()

    async def _run_link(self, link: _Link) -> None:
        try:
            await link.run()
        finally:
            self._link = None

    async def _open_link(self) -> _Link:
        """Connect and shake hands; re-register this node's watches and wills on the new link.

        Raises:
            OSError: no connection, or the store did not answer the Hello in time.
            StoreRpcError: the store refused the Hello.
        """
        with trio.move_on_after(CONNECT_TIMEOUT_S) as attempt:
            stream = await trio.open_tcp_stream(self.host, self.port)
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
                await stream.send_all(rpc.encode(rpc.Hello(rpc.PROTOCOL_VERSION, self.node, *self._credentials,
                                                           self._store_id, self._epoch)))
                decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
                answer = decoder.next_message()
                while answer is rpc.NEED_DATA and not decoder.eof:
                    decoder.receive_data(await stream.receive_some(RECEIVE_BYTES))
                    answer = decoder.next_message()
            except BaseException as exc:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):  # not OSErrors
                    raise ConnectionResetError(f"the store connection broke during the handshake: {exc}") from exc
                if isinstance(exc, rpc.RpcProtocolError):
                    raise StoreRpcError(f"the store's answer to the Hello is not the RPC: {exc}") from exc
                raise
        if attempt.cancelled_caught:
            raise TimeoutError(f"the store at {self.host}:{self.port} did not answer within {CONNECT_TIMEOUT_S} s")
        if type(answer) is not rpc.Welcome:
            await stream.aclose()
            if type(answer) is rpc.Error:
                LOGGER.error("the store refused this node: %s: %s", answer.kind.value, answer.message)
                raise StoreRpcError(f"the store refused the connection: {answer.kind.value}: {answer.message}")
            raise ConnectionResetError("the store closed the connection during the handshake")
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: a vanished store host breaks the link within a lease
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(answer.lease_s * 1000)))
        ended = self._epoch
        self._store_id, self._epoch = answer.store_id, answer.epoch
        if not answer.resumed and ended:
            gone = [client_id for client_id, client in self._clients.items() if client.epoch != answer.epoch]
            LOGGER.warning("store lease lost: this node was away longer than its lease; the clients it had are "
                           "closed without a will or a write", extra={"ctx": {
                               "node": self.node, "ended_epoch": ended, "epoch": answer.epoch,
                               "clients": len(gone)}})
            if gone:  # their entries stay, with the ended epoch: the store refuses what is still written for them
                self._moved.post(dict.fromkeys(gone, 0))
        link = _Link(self, stream, decoder, answer)
        if self._watched:
            link.send(rpc.Watch(dict(self._watched)))
        resumed = answer.resumed or not ended
        for client_id, client in self._clients.items():
            if resumed and client.epoch in (ended, answer.epoch):  # the resumed (or adopted) lease's clients, again
                client.epoch = answer.epoch
                link.send(rpc.Reattach(client_id, client.expiry_s, client.will, client.will_delay_s, answer.epoch))
        return link

    async def _resync(self, link: _Link) -> None:
        """After a reconnect: one event per watched queue at its head, so every local session pulls to it."""
        queues = list(self._watched)
        if not queues:
            return
        try:
            heads = (await link.call(lambda rid: rpc.MaxOffsets(rid, queues))).offsets
        except OSError as exc:
            LOGGER.warning("resync after reconnecting failed: %r", exc)
            return
        self._mailbox.post(dict(zip(queues, heads)))
