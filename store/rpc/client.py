"""``RemoteStoreClient``: the ``StoreClient`` of a cluster gateway, over the store node's RPC.

A gateway node in cluster mode is written against ``store.local.StoreClient``
exactly like the embedded one; this implementation sends each call to a
``lightgate store`` process (store/rpc/server.py) over one TCP connection:

- pipelined: every call gets a request id and waits for its own answer; any
  number are in flight at once;
- batched: appends, pulls and offset commits that callers make while earlier
  ones of their kind are in flight travel together in the next request (one
  frame, one store-side CommitLog write or thread hand-off), so the cost per
  message is not a round trip;
- reconnecting: when the connection breaks, calls in flight and new calls
  raise ``StoreUnavailable`` (a ``ConnectionError``: an append is then not
  acknowledged to any device) while the client reconnects with backoff; on
  reconnecting it registers its watches and held wills again and posts one
  event per watched queue at its current head, so every local session pulls
  whatever it may have missed;
- fenced: the client names its lease (store/leases.py) in each Hello. If the
  lease ended meanwhile (the process was frozen, or cut off, for longer than
  the lease), the store says so in the Welcome: the client registers none of
  its clients or wills again, takes the new epoch, and reports the ended one
  through :meth:`fenced`. Writes made for a client accepted under the ended
  epoch (the ``epoch`` argument of appends, commits, session writes, releases,
  presence and wills) carry it, and the store refuses them (``LeaseLost``).

The API is reusable outside the gateway (server-side producers and
consumers, docs/cluster.md): ``RemoteStoreClient.connect(host, port)`` then
``append``, ``pull``, ``commit_offsets``, ``get_offsets``, ``activate``,
``release``, ``max_offsets``, ``watch`` and ``events``.

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

from lightqueue.queues import PullResult
from lightqueue.topics import TopicError
from notify import EventMailbox
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied
from store.awaiting import Flow
from store.local import LogSpan, NewMessage, PullRequest, StoreStatistics
from store.log.errors import LogFullError, OffsetExpired
from store.leases import LeaseLost
from store.log.record import Record, RecordTooLarge, decode_record
from store.tasks import background

__all__ = ["LeaseLost", "RemoteStoreClient", "RemoteStoreStatistics", "StoreRpcError", "StoreUnavailable",
           "default_node_name"]

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


class StoreUnavailable(ConnectionError):
    """The store node cannot be reached now (not connected, or the connection broke during the call).

    The call may or may not have taken effect at the store; appends are not acknowledged to devices.
    """


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


def to_wire(message: NewMessage) -> rpc.WireMessage:
    """A message to append, as the RPC carries it.

    Raises:
        TypeError: its fields are not the record fields the RPC carries
            (client_id, qos, retain, properties, born_ms, packet_id).
    """
    topic, payload, fields = message
    try:
        return rpc.WireMessage(topic, payload, **fields)
    except TypeError:
        raise TypeError(f"record fields {sorted(fields)} are not all carried by the store RPC "
                        "(client_id, qos, retain, properties, born_ms, packet_id)") from None


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

    def __init__(self, client: RemoteStoreClient, stream: trio.SocketStream, decoder: rpc.FrameDecoder,
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
        self._lease_s = welcome.lease_s  # the store's: silence this long means the store is gone
        counts = client._batch_counts
        self.appends = {durable: _Batcher(self, lambda rid, groups, d=durable: rpc.AppendRequest(rid, groups, d),
                                          _split_appends, _group_bytes, APPEND_BATCH_BYTES, counts["append"])
                        for durable in (None, True, False)}
        self.pulls = _Batcher(self, lambda rid, reads: rpc.PullRequest(rid, [r for group in reads for r in group]),
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
        read = rpc.QueueRead(request.queue, request.from_offset, request.max_count, request.max_bytes)
        self.ahead[key] = (request, self.pulls.enqueue([read]))
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
                decoder.receive_data(data)
                self._last_received = trio.current_time()
                continue
            kind = type(message)
            if kind is rpc.Events:
                client._received(message.events)
            elif kind is rpc.ClientMoved:
                client._moved.post({message.client_id: 0})
            elif kind is rpc.AdminAsk:
                client._asks_in.send_nowait((message.id, message.client_id, message.op.value, message.query))
            elif kind is rpc.Heartbeat:
                pass
            elif kind is rpc.Error and message.id == 0:
                LOGGER.error("the store closed the connection: %s: %s", message.kind.value, message.message)
                return
            else:
                handler = self._pending.pop(message.id, None)
                if handler is not None:  # else its caller was cancelled
                    handler(message)

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
            if silent > self._lease_s:
                LOGGER.warning("store connection closed: the store was silent for %.1f s", silent)
                self.cancel_scope.cancel()
                return
            self.send(rpc.Heartbeat())


def _group_bytes(group: list[rpc.WireMessage]) -> int:
    return sum(len(m.payload) + len(m.topic) + len(m.properties) + 64 for m in group)


def _reads_bytes(reads: list[rpc.QueueRead]) -> int:
    return sum(max(r.max_bytes, PULL_READ_MIN_BYTES) for r in reads)


def _split_appends(answer: rpc.Appended, batch: list[tuple[Any, _Call]]) -> None:
    for index, (_, call) in enumerate(batch):
        error = answer.errors.get(index)
        if error is not None:
            call.fail(_exception(error))
        else:
            call.set(answer.offsets[index])


def _split_pulls(answer: rpc.Pulled, batch: list[tuple[Any, _Call]]) -> None:
    start = 0
    results = answer.results
    for reads, call in batch:
        mine = results[start : start + len(reads)]
        start += len(reads)
        call.set([PullResult([(qoff, decode_record(raw, 0, log_offset)) for qoff, log_offset, raw in r.entries],
                             r.next_offset, r.expired) for r in mine])


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
    wills_held: int
    batches: dict[str, tuple[int, int]]  # "append" / "pull" / "commit" / "release" -> (calls, requests they took)
    read_ahead: tuple[int, int]  # pulls answered by a read made in advance, reads made in advance


@final
class RemoteStoreClient:
    """A ``StoreClient`` that talks to a store node process (see the module docstring).

    Create it with :meth:`connect`.
    """

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
        self._wills: dict[str, tuple[rpc.WireMessage, float]] = {}  # client id -> will held at the store
        self._present: set[str] = set()  # clients this node has (sent again after a reconnect)
        self._moved = EventMailbox()  # {client id: 0} of the clients that connected to another node
        self._store_id = ""  # the store process and lease epoch this node holds (sent in each Hello)
        self._epoch = 0
        self._fences_in, self._fences_out = trio.open_memory_channel[int](math.inf)  # ended epochs
        self._asks_in, self._asks_out = trio.open_memory_channel[tuple[int, str, str, bytes]](math.inf)  # admin asks
        self._connected = trio.Event()
        self._link_up = trio.Event()  # set and replaced at each successful handshake (wait_reconnected)
        self._connects = 0
        self._events_received = 0
        self._batch_counts: dict[str, list[int]] = {"append": [0, 0], "pull": [0, 0], "commit": [0, 0],
                                                    "release": [0, 0]}
        self._ahead_counts = [0, 0]  # reads in advance: used, made

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, host: str, port: int, *, node: str | None = None, timeout_s: float | None = 30.0, token: str = "",
        username: str | None = None, password: bytes | str | None = None,
    ) -> AsyncIterator[RemoteStoreClient]:
        """Connect to the store at ``host:port`` and keep connected until the block exits.

        Args:
            node: this client's node name, as the store routes events and holds wills
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
            client._fences_in.close()
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

    # --- StoreClient --------------------------------------------------------------------

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     epoch: int | None = None) -> list[int]:
        link = self._require_link()
        group = [to_wire(m) for m in messages]
        if not group:
            return []
        if epoch is not None and epoch != link.epoch:  # an ended lease's: alone, for the store to refuse
            return (await link.call(lambda rid: rpc.AppendRequest(rid, [group], durable, epoch))).offsets[0]
        return await link.appends[durable].submit(group)

    def append_now(self, messages: Sequence[NewMessage]) -> list[int] | None:
        """Always None: an append is a round trip to the store node."""
        return None

    def can_append_now(self) -> bool:
        """Never, as :meth:`append_now`."""
        return False

    def pull_now(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]] | None:
        """Always None: a read is a round trip to the store node."""
        return None

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
        reads = [rpc.QueueRead(r.queue, r.from_offset, r.max_count, r.max_bytes)
                 for r, result in zip(requests, early) if result is None]
        fresh = iter(await link.pulls.submit(reads) if reads else ())
        results = [result if result is not None else next(fresh) for result in early]
        for request, result in zip(requests, results):
            count = request.max_count
            if len(result.messages) >= count:  # a backlog: the next windows are at the offsets that follow
                for window in range(READ_AHEAD_WINDOWS):
                    link.read_ahead(PullRequest(request.queue, result.next_offset + window * count, count,
                                                request.max_bytes))
        return results

    async def activate(self, queue: str, holder: str) -> int:
        answer = await self._require_link().call(lambda rid: rpc.Activate(rid, queue, holder))
        return answer.value

    async def release(self, queue: str, holder: str, *, epoch: int | None = None) -> bool:
        answer = await self._require_link().call(lambda rid: rpc.Release(rid, queue, holder, epoch or 0))
        return answer.value

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        answer = await self._require_link().call(lambda rid: rpc.MaxOffsets(rid, list(queues)))
        return answer.offsets

    async def get_offsets(self, owner: str) -> dict[str, int]:
        answer = await self._require_link().call(lambda rid: rpc.GetOffsets(rid, owner))
        return answer.value

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]], *, epoch: int | None = None) -> None:
        link = self._require_link()
        if not commits:
            return
        copy = {owner: dict(offsets) for owner, offsets in commits.items()}
        if epoch is not None and epoch != link.epoch:  # an ended lease's: alone, for the store to refuse
            await link.call(lambda rid: rpc.CommitOffsets(rid, copy, epoch))
            return
        await link.commits.submit(copy)

    async def delete_owner(self, owner: str, *, epoch: int | None = None) -> None:
        await self._require_link().call(lambda rid: rpc.DeleteOwner(rid, owner, epoch or 0))

    async def retained(self, filter: str) -> list[Record]:
        answer = await self._require_link().call(lambda rid: rpc.GetRetained(rid, filter))
        return [decode_record(raw, 0, log_offset) for log_offset, raw in answer.records]

    async def save_session(self, client_id: str, blob: bytes, *, epoch: int | None = None) -> None:
        await self._require_link().call(lambda rid: rpc.SaveSession(rid, client_id, blob, epoch or 0))

    async def load_session(self, client_id: str) -> bytes | None:
        answer = await self._require_link().call(lambda rid: rpc.LoadSession(rid, client_id))
        return answer.value

    async def drop_session(self, client_id: str, *, epoch: int | None = None) -> None:
        await self._require_link().call(lambda rid: rpc.DropSession(rid, client_id, epoch or 0))

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        answer = await self._require_link().call(lambda rid: rpc.GetAwaiting(rid, client_id))
        return answer.flows

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        if flows:
            await self._require_link().releases.submit([tuple(flow) for flow in flows])

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

    async def statistics(self) -> StoreStatistics:
        answer = await self._require_link().call(rpc.GetStatistics)
        s = answer.stats
        return StoreStatistics(s.written_offset, s.flushed_offset, s.dispatched_offset, s.log_bytes, s.queue_ids,
                               s.active_filters, s.retained, s.notify_sent, s.notify_suppressed, s.notify_by_node,
                               s.corrupt_records, s.disk_full)

    async def read_log(self, offset: int, max_bytes: int) -> LogSpan:
        answer = await self._require_link().call(lambda rid: rpc.ReadLog(rid, offset, max_bytes))
        return LogSpan(answer.start, answer.data, answer.data_end, answer.flushed, answer.min_offset)

    def _current(self, epoch: int | None) -> bool:
        """Whether a write for a client accepted under ``epoch`` (None: now) is of this node's lease: only those
        are kept for registering again after a reconnect (the store ignores the others)."""
        return epoch is None or epoch == self._epoch

    async def hold_will(self, client_id: str, message: NewMessage, delay_s: float, *, epoch: int | None = None) -> None:
        wire = to_wire(message)
        if self._current(epoch):
            self._wills[client_id] = (wire, delay_s)
        if self._link is not None:
            self._link.send(rpc.HoldWill(client_id, wire, delay_s, epoch or 0))

    async def drop_will(self, client_id: str, *, epoch: int | None = None) -> None:
        if self._current(epoch):
            self._wills.pop(client_id, None)
        if self._link is not None:
            self._link.send(rpc.DropWill(client_id, epoch or 0))

    def present(self, client_id: str, *, epoch: int | None = None) -> None:
        if self._current(epoch):
            self._present.add(client_id)
        if self._link is not None:
            self._link.send(rpc.Present(client_id, epoch or 0))

    def absent(self, client_id: str, *, epoch: int | None = None) -> None:
        if self._current(epoch):
            self._present.discard(client_id)
        if self._link is not None:
            self._link.send(rpc.Absent(client_id, epoch or 0))

    async def moved(self) -> list[str]:
        return list(await self._moved.get())

    async def fenced(self) -> int:
        """Wait until the store says this node's lease ended (on a reconnect); the ended epoch.

        Raises:
            trio.EndOfChannel: the client is closed.
        """
        return await self._fences_out.receive()

    async def admin_call(self, client_id: str, op: str) -> bytes | None:
        """Have the node ``client_id`` is connected to run admin ``op`` (``rpc.AdminOp``); its JSON answer, or
        None when the client is connected to no other node.

        Raises:
            OSError: that node did not answer in time (``StoreUnavailable``: the store is not reachable).
        """
        answer = await self._require_link().call(lambda rid: rpc.AdminCall(rid, client_id, rpc.AdminOp(op)))
        return answer.value

    async def admin_call_all(self, op: str, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Have every other node that has clients run list ``op`` (``rpc.AdminOp``) with ``query``: (their JSON
        answers by node name, the nodes that did not answer in time).

        Raises:
            OSError: the store did not answer (``StoreUnavailable``: it is not reachable).
        """
        answer = await self._require_link().call(lambda rid: rpc.AdminCallAll(rid, rpc.AdminOp(op), query))
        return answer.answers, answer.missing

    async def admin_asks(self) -> tuple[int, str, str, bytes]:
        """The next admin call another node made about a client of this one, or a list call:
        ``(ask id, client id, op, query)``.

        Raises:
            trio.EndOfChannel: the client is closed.
        """
        return await self._asks_out.receive()

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """Answer the ask ``ask_id`` (lost if the connection it came on broke: the asker got an error)."""
        if self._link is not None:
            self._link.send(rpc.AdminAnswer(ask_id, value))

    # --- back-end producers and consumers (store/clients/producer.py, store/clients/consumer.py) ---------

    async def append_each(self, messages: Sequence[NewMessage], *, durable: bool | None = None
                          ) -> list[int | Exception]:
        """Append messages in one request and one CommitLog write, each one failing alone.

        Returns, per message, its CommitLog offset or the exception that refused it
        (``RecordTooLarge``, ``AccessDenied`` for a topic the ACL does not allow);
        the producer batches by itself, so this skips the client's own batching.

        Raises:
            StoreUnavailable: the connection broke (the messages may or may not be appended).
            OSError: the write failed; none was appended.
            ValueError: the request exceeds the RPC frame limit (nothing was sent).
        """
        link = self._require_link()
        if not messages:
            return []
        groups = [[to_wire(m)] for m in messages]
        try:
            answer = await link.call(lambda rid: rpc.AppendRequest(rid, groups, durable))
        except rpc.RpcProtocolError as exc:
            raise ValueError(str(exc)) from None
        errors = answer.errors
        return [_exception(errors[i]) if i in errors else answer.offsets[i][0] for i in range(len(groups))]

    async def join(self, group: str, filter: str, start: str = "earliest", at: int = 0) -> int:
        """Join consumer group ``group`` on the queue of ``filter`` (store/groups.py); returns its committed offset.

        Raises:
            AccessDenied: the ACL does not let this client subscribe to ``filter``.
            TopicError, ValueError: a bad filter, group name or start.
        """
        answer = await self._require_link().call(lambda rid: rpc.Join(rid, group, filter, start, at))
        return answer.value

    async def claim(self, group: str, filter: str, max_count: int, max_bytes: int, wait_s: float
                    ) -> list[tuple[int, Record]]:
        """``(queue offset, record)`` of messages now this client's in the group (empty if none came in ``wait_s``)."""
        wait_ms = max(0, int(wait_s * 1000))
        answer = await self._require_link().call(
            lambda rid: rpc.Claim(rid, group, filter, max_count, max_bytes, wait_ms))
        return [(qoff, decode_record(raw, 0, log_offset)) for qoff, log_offset, raw in answer.entries]

    async def ack(self, group: str, filter: str, offsets: Sequence[int]) -> int:
        """The claimed ``offsets`` are processed; returns the group's committed offset (durable)."""
        answer = await self._require_link().call(lambda rid: rpc.Ack(rid, group, filter, list(offsets)))
        return answer.value

    async def leave(self, group: str, filter: str) -> None:
        """Leave the group: offsets claimed and not acknowledged go to its other members."""
        await self._require_link().call(lambda rid: rpc.Leave(rid, group, filter))

    # --- the client's own figures -------------------------------------------------------

    def client_statistics(self) -> RemoteStoreStatistics:
        return RemoteStoreStatistics(self._link is not None, self._connects, self._events_received,
                                     len(self._watched), len(self._wills),
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
        ended = self._epoch
        self._store_id, self._epoch = answer.store_id, answer.epoch
        if not answer.resumed and ended:
            LOGGER.warning("store lease lost: this node was away longer than its lease; the clients it had are "
                           "closed without a will or a write", extra={"ctx": {
                               "node": self.node, "ended_epoch": ended, "epoch": answer.epoch,
                               "clients": len(self._present), "wills": len(self._wills)}})
            self._present.clear()
            self._wills.clear()
            self._fences_in.send_nowait(ended)
        link = _Link(self, stream, decoder, answer)
        if self._watched:
            link.send(rpc.Watch(dict(self._watched)))
        for client_id in self._present:  # first: a client placed elsewhere meanwhile is not re-registered
            link.send(rpc.Present(client_id, answer.epoch, again=True))
        for client_id, (wire, delay_s) in self._wills.items():
            link.send(rpc.HoldWill(client_id, wire, delay_s, answer.epoch, again=True))
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
