"""The connection of a ``RemoteStore`` (store/rpc/client.py) to a store node: one TCP connection at a time to the
address its resolver gives, and everything that makes it cheap and safe to use.

- pipelined: every call gets a request id and waits for its own answer; any
  number are in flight at once;
- batched: appends, pulls, offset commits and QoS 2 releases that callers make while earlier
  ones of their kind are in flight travel together in the next request (one
  frame, one store-side CommitLog write or thread hand-off), so the cost per
  message is not a round trip;
- reconnecting: when the connection breaks, calls in flight and new calls
  raise ``StoreUnavailable`` (a ``ConnectionError``: an append is then not
  acknowledged to any device; ``NotSent`` for those that never left this node, which may be made again)
  while the connection asks its resolver for the store's address again and
  reconnects with backoff. The resolver is a callable returning where to try next: a fixed
  address (``fixed``), or the replicas of a replicated store in turn (``Addresses``);
- following the leader: a replica that does not lead answers the Hello with ``NOT_LEADER`` naming the leader
  (``NotLeader``, never fatal); the next attempt goes there, at once unless it was itself a redirection
  (replicas naming each other during an election: then with backoff). One log line per leader change;
- leased: each Hello names the store process and lease epoch this node held (``store_id``, ``epoch``), and the
  Welcome says whether the lease still holds. What the node must tell the store again on a new connection
  (its watches, its clients with their wills) and what the store pushes (events, moved clients, admin asks)
  are the ``LinkListener``'s: the ``RemoteStore``.

Resource handling: ``StoreConnection.run`` owns each link and its tasks, and closes the link's stream when it
breaks or the run is cancelled.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any, Protocol, final

import trio

from store.api import (DelayedCapExceeded, InvalidOffset, LeaderFenced, LeaseLost, LogFullError, NewMessage,
                       NotLeader, OffsetExpired, PullRequest, PullResult, Record, RecordTooLarge, StoreUnavailable,
                       TopicError)
from store.log.record import decode_record
from store.rpc import wire as rpc
from store.rpc.access import AccessDenied
from store.stalls import StallWatch

__all__ = ["Addresses", "Link", "LinkListener", "NotSent", "Resolver", "StoreConnection", "StoreRpcError", "decoded",
           "exception_of", "fixed", "resolver_of"]

LOGGER = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024
"""One ``receive_some`` reads up to this much: a burst of answers and events is decoded in one wake-up."""

CONNECT_TIMEOUT_S = 5.0
"""One connection attempt (TCP connect and handshake) gives up after this."""

RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 2.0
REPLICATED_RECONNECT_MAX_S = 0.25
"""The longest wait between attempts when the store is a replicated group (several addresses): while a new leader
is elected the replicas answer at once (``NOT_LEADER``, naming none yet), so asking again often costs little and
finds the new leader within a quarter of a second of its election, where the single store's 2 s would add up to
2 s to every failover."""
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

READ_AHEAD_MAX = 64
"""Reads made in advance kept at once (each at most a pull's byte budget, 1 MiB by default): enough for the
sessions draining backlogs on a node at the same time; the oldest is dropped first."""

STALLED_LEASES = 6
"""The client gives up on a store whose connection lives but which has said nothing for this many of its leases.
A store that stalls (a GC or swap stall, a paused VM, an fsync that blocks its loop) and runs again within them
finds the client, its calls waiting and its node's devices as it left them (the store does not count its own
stall against the node's lease, store/stalls.py): a broken link would have failed the calls and dropped their
devices. A store host that vanished is noticed sooner, by TCP (``TCP_USER_TIMEOUT``: a lease)."""


PROBE_SILENT_HEARTBEATS = 2
"""A replicated store's client asks the other replicas who leads once its link has been silent for this many of the
store's heartbeats: a leader frozen or cut off is replaced within an etcd lease, long before ``STALLED_LEASES``
would give up on it, and its followers name the new leader (or the new leader welcomes the probe)."""


class NotSent(StoreUnavailable):
    """A call that never left this node: there was no link, or the link broke before the call was sent. It cannot
    have taken effect at the store, so it may be made again on the next link (``RemoteStore`` does, for
    ``failover_wait_s``); a call that was sent and whose answer was lost raises plain ``StoreUnavailable``."""


class StoreRpcError(OSError):
    """The store refused the connection (protocol version, malformed frames) or failed a call with a bug.

    An ``OSError``, so the gateway treats it like a failed write: nothing is acknowledged.
    """


_BY_MESSAGE: dict[rpc.ErrorKind, Callable[[str], Exception]] = {
    rpc.ErrorKind.DENIED: AccessDenied,
    rpc.ErrorKind.FENCED: LeaseLost,
    rpc.ErrorKind.LEADER_FENCED: LeaderFenced,
    rpc.ErrorKind.RECORD_TOO_LARGE: RecordTooLarge,
    rpc.ErrorKind.TOPIC: TopicError,
    rpc.ErrorKind.VALUE: ValueError,
    rpc.ErrorKind.DELAYED_CAP: DelayedCapExceeded,
    rpc.ErrorKind.LOG_FULL: lambda message: LogFullError(errno.ENOSPC, message),
    rpc.ErrorKind.OS: OSError,
    rpc.ErrorKind.NOT_LEADER: NotLeader,
}
"""The wire errors whose exception is made from the message alone."""


def exception_of(error: rpc.Error) -> Exception:
    """The exception the local store would have raised for a wire error."""
    kind = error.kind
    made = _BY_MESSAGE.get(kind)
    if made is not None:
        return made(error.message)
    if kind is rpc.ErrorKind.EXPIRED:  # the message is OffsetExpired's: the offset first, the log's minimum last
        numbers = [int(n) for n in re.findall(r"\d+", error.message)]
        return OffsetExpired(numbers[0], numbers[-1]) if numbers else LookupError(error.message)
    if kind is rpc.ErrorKind.INVALID_OFFSET:  # InvalidOffset's message: "offset <offset>: <reason>"
        found = re.fullmatch(r"offset (-?\d+): (.*)", error.message, re.DOTALL)
        return InvalidOffset(int(found[1]), found[2]) if found else ValueError(error.message)
    return StoreRpcError(f"store: {error.kind.value}: {error.message}")


Handler = Callable[[Any], None]
"""What waits for an answer: called once with the answer message or with the exception that replaces it."""


@final
class Call:
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
class Batcher:
    """Calls of one kind made while ``BATCHES_IN_FLIGHT`` requests of it are in flight share the next request.

    Args:
        link: the connection the requests go out on.
        make: ``make(request_id, items) -> request`` for a batch of items.
        split: ``split(answer, calls)`` hands each call its part of an answer.
        weight: an item's bytes against ``budget`` (a batch always takes at least one item).
        counts: ``[calls, requests]`` of this kind, kept by the client across links.
    """

    def __init__(self, link: Link, make: Callable[[int, list[Any]], Any],
                 split: Callable[[Any, list[tuple[Any, Call]]], None],
                 weight: Callable[[Any], int], budget: int, counts: list[int]) -> None:
        self._link = link
        self._counts = counts
        self._make = make
        self._split = split
        self._weight = weight
        self._budget = budget
        self._waiting: list[tuple[Any, Call]] = []
        self._in_flight = 0
        self._wakeup = trio.Event()

    async def submit(self, item: Any) -> Any:
        """``item``'s result. A caller cancelled while its item waits takes it back (never sent); once it was sent,
        the cancellation waits for the answer (or the link's end): a write the caller gave up on must not reach
        the store after it (a publisher whose connection closed resends it on its next one: an append still
        travelling then would store it twice)."""
        call = self.enqueue(item)
        try:
            return await call.wait()
        except trio.Cancelled:
            entry = next((entry for entry in self._waiting if entry[1] is call), None)
            if entry is not None:
                self._waiting.remove(entry)
            else:
                with trio.CancelScope(shield=True):
                    await call.done.wait()  # bounded: answered, or failed when the link breaks
            raise

    def enqueue(self, item: Any) -> Call:
        """Add ``item`` to the next batch; its result comes in the returned call.

        On a link that broke, the call fails at once: the link's closing runs
        ``fail_all`` once, and the client keeps the link until it is closed, so
        a call made in between would otherwise wait for ever.
        """
        call = Call()
        if self._link.broken:
            call.fail(NotSent("the connection to the store broke"))
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

            def answered(answer: Any, batch: list[tuple[Any, Call]] = batch) -> None:
                self._in_flight -= 1
                self._wakeup.set()
                if isinstance(answer, BaseException):
                    for _, call in batch:
                        call.fail(answer)
                elif type(answer) is rpc.Error:
                    error = exception_of(answer)
                    for _, call in batch:
                        call.fail(error)
                else:
                    self._split(answer, batch)

            try:
                self._link.request(lambda rid: self._make(rid, [item for item, _ in batch]), answered)
            except rpc.RpcProtocolError as exc:  # larger than a frame: these callers fail, the link goes on
                answered(ValueError(str(exc)))


@final
class Link:
    """One live connection to the store: its answers in waiting, its batchers, its writer."""

    def __init__(self, connection: StoreConnection, stream: trio.SocketStream, decoder: rpc.FrameDecoder,
                 welcome: rpc.Welcome) -> None:
        self.stream = stream
        self.decoder = decoder
        self.cancel_scope = trio.CancelScope()
        self.broken = False  # set as the link starts closing: a request made after that would never be answered
        self.epoch = welcome.epoch  # the lease this connection serves
        self._listener = connection.listener
        self._ids = connection.ids
        self._pending: dict[int, Handler] = {}
        self._out: list[bytes] = []
        self._out_ready = trio.Event()
        self._watch_deltas: dict[str, int] = {}
        self._last_received = trio.current_time()
        self._heartbeat_s = welcome.heartbeat_s
        self._lease_s = welcome.lease_s
        self._silent_max_s = welcome.lease_s * STALLED_LEASES  # silence this long means the store is stuck
        self._stalls = StallWatch("gateway node")  # this process's own stalls: past the lease, its lease may have ended
        counts = connection.batch_counts
        self.appends = {durable: Batcher(self, lambda rid, groups, d=durable: rpc.AppendRequest(rid, groups, d),
                                          _split_appends, _group_bytes, APPEND_BATCH_BYTES, counts["append"])
                        for durable in (None, True, False)}
        self.pulls = Batcher(self, lambda rid, reads: rpc.Pull(rid, [r for group in reads for r in group]),
                              _split_pulls, _reads_bytes, PULL_BATCH_BYTES, counts["pull"])
        self.commits = Batcher(self, _merge_commits, _split_done, lambda item: 64 * len(item), 1 << 20,
                                counts["commit"])
        self.releases = Batcher(self, lambda rid, items: rpc.ReleaseAwaiting(rid, [f for fl in items for f in fl]),
                                 _split_done, lambda item: 64 * len(item), 1 << 20, counts["release"])
        self.ahead: dict[tuple[str, int], tuple[PullRequest, Call]] = {}  # (queue, offset) -> read in advance
        self._ahead_counts = connection.ahead_counts

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
            raise NotSent("the connection to the store broke")
        rid = next(self._ids)
        frame = rpc.encode(make(rid))
        self._pending[rid] = handler
        self._out.append(frame)
        self._out_ready.set()

    async def call(self, make: Callable[[int], Any]) -> Any:
        """One request, one answer (an ``Error`` answer is raised as the local store's exception)."""
        call = Call()
        self.request(make, call.set)
        answer = await call.wait()
        if isinstance(answer, BaseException):
            raise answer
        if type(answer) is rpc.Error:
            raise exception_of(answer)
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
            unsent = NotSent("the connection to the store broke")
            for batcher in (*self.appends.values(), self.pulls, self.commits, self.releases):
                batcher.fail_all(unsent)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _reader(self) -> None:
        decoder = self.decoder
        pushed = self._listener.pushed
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
            if kind is rpc.Events or kind is rpc.ClientMoved or kind is rpc.AdminAsk:
                pushed(message)
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

    @property
    def heartbeat_s(self) -> float:
        return self._heartbeat_s

    def silent_s(self) -> float:
        """Seconds since the store's last frame on this link."""
        return trio.current_time() - self._last_received

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


def _split_appends(answer: rpc.Appended, batch: list[tuple[Any, Call]]) -> None:
    for index, (_, call) in enumerate(batch):
        error = answer.errors.get(index)
        if error is not None:
            call.fail(exception_of(error))
        else:
            call.set(answer.positions[index])


def decoded(records: rpc.RawRecords) -> PullResult[Record]:
    """A read as the store sent it (records as stored, a batch record whole), decoded here, each record once: the
    store's CPU is every gateway's."""
    batches = records.batches
    if not batches:
        return PullResult([(qoff, decode_record(raw, 0, log_offset)) for qoff, log_offset, raw in records.entries],
                          records.next_offset, records.expired)
    messages: list[tuple[int, Record]] = []
    for index, (qoff, log_offset, raw) in enumerate(records.entries):
        served = batches.get(index)
        if served is None:
            messages.append((qoff, decode_record(raw, 0, log_offset)))
        else:
            first, stop = served
            messages.extend(zip(range(qoff + first, qoff + stop), decode_record(raw, 0, log_offset, first, stop).messages))
    return PullResult(messages, records.next_offset, records.expired)


def _split_pulls(answer: rpc.Pulled, batch: list[tuple[Any, Call]]) -> None:
    start = 0
    results = answer.results
    for reads, call in batch:
        mine = results[start : start + len(reads)]
        start += len(reads)
        call.set([decoded(r) for r in mine])


def _merge_commits(rid: int, items: list[dict[str, dict[str, int]]]) -> rpc.CommitOffsets:
    merged: dict[str, dict[str, int]] = {}
    for commits in items:  # in call order: a later commit of the same owner and queue wins
        for owner, offsets in commits.items():
            merged.setdefault(owner, {}).update(offsets)
    return rpc.CommitOffsets(rid, merged)


def _split_done(answer: rpc.Done, batch: list[tuple[Any, Call]]) -> None:
    for _, call in batch:
        call.set(None)


Resolver = Callable[[], tuple[str, int]]
"""Where to try the store next: ``(host, port)``. Asked before each connection attempt that is not a redirection."""


def fixed(host: str, port: int) -> Resolver:
    """The resolver of a store that stays at ``host:port``."""
    return lambda: (host, port)


@final
class Addresses:
    """The resolver of a replicated store: its replicas' addresses, one after another, round and round.

    A replica that does not lead names the leader, and the connection goes there next (``StoreConnection``):
    the list only has to hold one live replica.
    """

    def __init__(self, addresses: Sequence[tuple[str, int]]) -> None:
        if not addresses:
            raise ValueError("no store address")
        self._addresses = list(addresses)
        self._next = 0

    @classmethod
    def parse(cls, text: str) -> Addresses:
        """A comma-separated list of ``HOST:PORT``.

        Raises:
            ValueError: an item is not ``HOST:PORT``.
        """
        return cls(rpc.parse_addresses(text))

    def __len__(self) -> int:
        return len(self._addresses)

    def others(self, address: str) -> list[tuple[str, int]]:
        """Every address but ``address`` (``host:port``)."""
        return [(host, port) for host, port in self._addresses if f"{host}:{port}" != address]

    def __call__(self) -> tuple[str, int]:
        address = self._addresses[self._next]
        self._next = (self._next + 1) % len(self._addresses)
        return address


def resolver_of(host: str, port: int | None) -> Resolver:
    """The resolver of ``host:port``, or of the comma-separated ``HOST:PORT`` list ``host`` when ``port`` is None.

    Raises:
        ValueError: ``host`` is not such a list.
    """
    return fixed(host, port) if port is not None else Addresses.parse(host)


class LinkListener(Protocol):
    """What a ``StoreConnection`` hands to the ``StoreApi`` mapping over it (``RemoteStore``)."""

    def welcomed(self, link: Link, welcome: rpc.Welcome, ended: int) -> None:
        """A new link's Welcome (``ended``: the lease epoch held before it, 0 on the first): queue on ``link`` what
        the store must know again before any call (watches, connected clients)."""
        ...

    async def reconnected(self, link: Link) -> None:
        """A link after the first is up: catch up on what may have been missed while there was none."""
        ...

    def pushed(self, message: rpc.Events | rpc.ClientMoved | rpc.AdminAsk) -> None:
        """A message the store sent unasked."""
        ...


@final
class StoreConnection:
    """One node's connection to the store, through any number of links in turn (see the module docstring).

    Args:
        resolver: where the store is (asked again before each attempt).
        node: this node's name at the store.
        credentials: ``(token, username, password)``, sent in every Hello (store/rpc/access.py).
        listener: the ``RemoteStore`` over it.
    """

    def __init__(self, resolver: Resolver, node: str, credentials: tuple[str, str | None, bytes | None],
                 listener: LinkListener) -> None:
        self.resolver = resolver
        self.node = node
        self.listener = listener
        self._next_address: tuple[str, int] | None = resolver()  # where the next attempt goes (else: resolver)
        self._next_redirected = False  # whether it goes there because a replica that does not lead said so
        self._redirected = False  # whether the last attempt did
        self.address = "{}:{}".format(*self._next_address)  # the address last connected to, or tried
        self.leader = ""  # the store (leader) address last connected to or named by a replica; "": none yet
        replicated = isinstance(resolver, Addresses) and len(resolver) > 1
        self._max_backoff_s = REPLICATED_RECONNECT_MAX_S if replicated else RECONNECT_MAX_S
        self.ids = count(1)
        self.link: Link | None = None
        self.store_id = ""  # the store process and lease epoch this node holds (sent in each Hello)
        self.epoch = 0
        self.max_record_bytes = 0  # the store's record size limit, as its last Welcome said (0: not said)
        self.connects = 0
        self.down_since: float | None = None  # trio time the last link broke, while there is none after it
        self.batch_counts: dict[str, list[int]] = {"append": [0, 0], "pull": [0, 0], "commit": [0, 0],
                                                   "release": [0, 0]}
        self.ahead_counts = [0, 0]  # reads in advance: used, made
        self._credentials = credentials
        self._connected = trio.Event()
        self._link_up = trio.Event()  # set and replaced at each successful handshake (wait_reconnected)

    def require(self) -> Link:
        """The live link.

        Raises:
            NotSent: there is none now.
        """
        link = self.link
        if link is None:
            raise NotSent(f"not connected to the store at {self.address}")
        return link

    async def wait_reconnected(self, connects: int) -> None:
        """Return once a connection newer than the ``connects``-th is up (not one still closing)."""
        while True:
            up = self._link_up  # taken before the check: a handshake after it sets this one
            link = self.link
            if self.connects > connects and link is not None and not link.broken:
                return
            await up.wait()

    async def wait_connected(self) -> None:
        """Return once there is a link (at once if there is)."""
        while self.link is None:
            await self._connected.wait()

    async def wait_available(self) -> None:
        """Return once a link that is not breaking is up (at once if one is)."""
        while True:
            up = self._link_up  # taken before the check: a handshake after it sets this one
            link = self.link
            if link is not None and not link.broken:
                return
            await up.wait()

    async def run(self, timeout_s: float | None, task_status: trio.TaskStatus[None]) -> None:
        """Connect, serve the link until it breaks, reconnect with backoff; forever (until cancelled).

        ``task_status.started()`` once the first link is up.

        A replica that does not lead (``NotLeader``) sends the next attempt to the leader it names (at once, unless
        that attempt was a redirection already): never fatal, not even on the first connection.

        Raises:
            StoreUnavailable: no first connection within ``timeout_s`` (None: retry forever).
            StoreRpcError: the store refused the first handshake.
        """
        first_deadline = trio.current_time() + timeout_s if timeout_s is not None else float("inf")
        backoff = RECONNECT_MIN_S
        failures = 0
        while True:
            try:
                link = await self._open_link()
            except NotLeader as exc:  # never fatal: the next attempt goes to the leader it names
                if self._redirect(exc.leader):
                    continue
                link = None
            except StoreRpcError:
                if not self.connects:
                    raise
                link = None
            except OSError as exc:  # refused, unreachable, timed out
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    LOGGER.warning("store not reachable: %r", exc,
                                   extra={"ctx": {"store": self.address, "attempts": failures}})
                link = None
            if link is None:
                if not self.connects and trio.current_time() + backoff > first_deadline:
                    raise StoreUnavailable(f"no connection to the store at {self.address} within {timeout_s} s")
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            backoff = RECONNECT_MIN_S
            failures = 0
            self._leader_is(self.address, announce=bool(self.leader))
            self.connects += 1
            reconnected = self.connects > 1
            self.link = link
            self.down_since = None
            self._connected.set()
            self._link_up.set()
            self._link_up = trio.Event()
            LOGGER.info("connected to the store", extra={"ctx": {"store": self.address, "node": self.node,
                                                                 "reconnect": reconnected}})
            if not reconnected:
                task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_link, link)
                if reconnected:
                    nursery.start_soon(self.listener.reconnected, link)
                if isinstance(self.resolver, Addresses) and len(self.resolver) > 1:
                    nursery.start_soon(self._leave_when_replaced, link)
            self.link = None
            self._connected = trio.Event()

    def _redirect(self, leader: str) -> bool:
        """Send the next attempt to ``leader``, the address a replica that does not lead named (empty: it knows
        none now: the next attempt asks the resolver, after the backoff). Whether to try at once: yes, unless
        the refused attempt was itself a redirection (replicas naming each other while an election settles:
        then the usual backoff)."""
        try:
            address = rpc.parse_address(leader) if leader else None
        except ValueError:
            LOGGER.warning("a store replica named a leader that is not HOST:PORT: ignored",
                           extra={"ctx": {"store": self.address, "leader": leader}})
            address = None
        if address is None:
            return False
        self._leader_is(leader, announce=True)
        self._next_address = address
        self._next_redirected = True
        return not self._redirected

    async def _leave_when_replaced(self, link: Link) -> None:
        """While ``link`` is silent (its store frozen or cut off), ask the other replicas who leads; when one names
        another leader (or leads itself), break the link and connect there: the calls in flight on it fail (their
        outcome unknown), those not sent yet wait for the new link (``NotSent``)."""
        assert isinstance(self.resolver, Addresses)
        while not link.broken:
            await trio.sleep(link.heartbeat_s)
            if link.silent_s() < PROBE_SILENT_HEARTBEATS * link.heartbeat_s:
                continue
            for host, port in self.resolver.others(self.address):
                leader = await self._probe(host, port)
                if leader and leader != self.address and not link.broken:
                    self._redirect(leader)  # the next attempt goes there, at once: the link ends normally
                    LOGGER.warning("store connection closed: the store was silent and another replica leads",
                                   extra={"ctx": {"store": self.address, "leader": leader,
                                                  "silent_s": round(link.silent_s(), 3)}})
                    link.cancel_scope.cancel()
                    return

    async def _probe(self, host: str, port: int) -> str:
        """Who the replica at ``host:port`` says leads (``host:port``; itself when it welcomes this node; empty
        when it does not answer or knows none). The probe's connection is closed at once."""
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                return ""
            async with stream:
                try:
                    answer, _ = await self._hello(stream)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, rpc.RpcProtocolError):
                    return ""
            if type(answer) is rpc.Welcome:
                return f"{host}:{port}"
            if type(answer) is rpc.Error and answer.kind is rpc.ErrorKind.NOT_LEADER:
                return answer.message
        return ""

    async def _hello(self, stream: trio.SocketStream) -> tuple[Any, rpc.FrameDecoder]:
        """Send this node's Hello on ``stream``; the store's first answer (``Welcome``, an ``Error``, or
        ``NEED_DATA`` when it closed first) and the decoder that read it."""
        await stream.send_all(rpc.encode(rpc.Hello(rpc.PROTOCOL_VERSION, self.node, *self._credentials,
                                                   self.store_id, self.epoch)))
        decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        answer = decoder.next_message()
        while answer is rpc.NEED_DATA and not decoder.eof:
            decoder.receive_data(await stream.receive_some(RECEIVE_BYTES))
            answer = decoder.next_message()
        return answer, decoder

    def _leader_is(self, address: str, *, announce: bool) -> None:
        """Note the store's leader address; one log line per change when ``announce``."""
        if address != self.leader:
            self.leader = address
            if announce:
                LOGGER.info("store leader is now %s", address, extra={"ctx": {"node": self.node}})

    async def _run_link(self, link: Link) -> None:
        try:
            await link.run()
        finally:
            self.link = None
            self.down_since = trio.current_time()

    async def _open_link(self) -> Link:
        """Connect to where the resolver says the store is and shake hands; the listener re-registers this node's
        watches and clients on the new link.

        Raises:
            OSError: no connection, or the store did not answer the Hello in time.
            NotLeader: the replica there does not lead.
            StoreRpcError: the store refused the Hello.
        """
        address, self._next_address = self._next_address, None
        self._redirected, self._next_redirected = self._next_redirected, False
        host, port = address or self.resolver()
        self.address = f"{host}:{port}"
        with trio.move_on_after(CONNECT_TIMEOUT_S) as attempt:
            stream = await trio.open_tcp_stream(host, port)
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
                answer, decoder = await self._hello(stream)
            except BaseException as exc:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):  # not OSErrors
                    raise ConnectionResetError(f"the store connection broke during the handshake: {exc}") from exc
                if isinstance(exc, rpc.RpcProtocolError):
                    raise StoreRpcError(f"the store's answer to the Hello is not the RPC: {exc}") from exc
                raise
        if attempt.cancelled_caught:
            raise TimeoutError(f"the store at {self.address} did not answer within {CONNECT_TIMEOUT_S} s")
        if type(answer) is not rpc.Welcome:
            await stream.aclose()
            if type(answer) is rpc.Error and answer.kind is rpc.ErrorKind.NOT_LEADER:
                raise NotLeader(answer.message)
            if type(answer) is rpc.Error:
                LOGGER.error("the store refused this node: %s: %s", answer.kind.value, answer.message)
                raise StoreRpcError(f"the store refused the connection: {answer.kind.value}: {answer.message}")
            raise ConnectionResetError("the store closed the connection during the handshake")
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: a vanished store host breaks the link within a lease
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(answer.lease_s * 1000)))
        ended = self.epoch
        self.store_id, self.epoch = answer.store_id, answer.epoch
        self.max_record_bytes = answer.max_record_bytes
        link = Link(self, stream, decoder, answer)
        self.listener.welcomed(link, answer, ended)
        return link
