"""``RemoteStore``: the ``StoreApi`` of a cluster gateway and of back-end clients, over the store node's RPC.

A gateway node in cluster mode is written against ``store.api.StoreApi`` exactly like the embedded one; this
implementation maps each call to its RPC request over one ``StoreConnection`` (store/rpc/connection.py: the
pipelining, batching and reconnecting, to the address a resolver gives):

- never without waiting: ``append_nowait`` and ``pull_nowait`` always raise ``trio.WouldBlock`` (each is a
  round trip); the awaiting forms are the ones to use;
- across reconnects: on reconnecting the client registers its watches and its connected clients with their
  wills again (``Reattach``) and posts one event per watched queue at its current head, so every local session
  pulls whatever it may have missed;
- through a failover (a store restart, a new leader): a call that could not be sent (``NotSent``: no link, or
  the link broke before it left) waits for the next link until ``failover_wait_s`` after the link broke, and is
  made there; so does an idempotent call that was sent and not answered (a read, an offset commit, a session
  save, a QoS 2 release: made twice, the store holds what it holds after one). Past that wait, or sent and not
  idempotent (an append: stored twice if made again), a call raises ``StoreUnavailable`` as without the wait;
- fenced: the client carries the lease epoch of each of its clients (the lease its node held when the
  client connected) and names it in every write made for the client. If the lease ended meanwhile (the
  process was frozen, or cut off, for longer than the lease), the store says so in the Welcome: the clients
  of the ended lease are reported through :meth:`moved` and not registered again, and the store refuses
  their writes (``LeaseLost``).

Back-end producers and consumers (store/clients/) use the same client: ``RemoteStore.connect(host, port)``
then ``append`` (or ``append_groups``), ``join``, ``claim``, ``ack``, ``leave``.

Resource handling: ``connect`` is an async context manager that owns the
connection and its tasks; leaving it closes both, and ``events`` then ends.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, final

import trio

from notify import EventMailbox
from store.api import (MAIN_LOG, MAX_ATTEMPTS, AdminOp, DelayedPage, Flow, LeaseLost, LogSpan, NewMessage, Popped,
                       Position, Positions, PullRequest, PullResult, Record, StoreStatistics, StoreUnavailable)
from store.log.record import decode_record
from store.rpc import wire as rpc
from store.rpc.connection import (Link, NotSent, Resolver, StoreConnection, StoreRpcError, decoded, exception_of,
                                  resolver_of)
from store.tasks import background

__all__ = ["RemoteStore", "RemoteStoreStatistics", "StoreRpcError", "default_node_name"]

LOGGER = logging.getLogger(__name__)

READ_AHEAD_WINDOWS = 3
"""After a full read, the next windows of the same size read in advance: enough that the store reads one while the
client decodes another and its caller delivers a third (a read's offsets are contiguous unless retention cut a gap;
a window that does not start where the next pull does is dropped unused)."""

STATISTICS_LOG_S = 60.0
"""How often ``log_statistics`` logs the node's notify figures."""

T = TypeVar("T")


def _refusal(error: rpc.Error) -> ValueError:
    """A filter's refusal in an ``ActivateAll`` answer, as the local store gives it (a ``TopicError`` or
    ``ValueError``); any other error is raised (the store never answers one per filter)."""
    exc = exception_of(error)
    if not isinstance(exc, ValueError):
        raise exc
    return exc


def default_node_name() -> str:
    """A gateway node name unique per process: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


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

    def __init__(self, resolver: Resolver, node: str, *, token: str = "", username: str | None = None,
                 password: bytes | None = None, failover_wait_s: float = 0.0) -> None:
        self.node = node
        self._failover_wait_s = failover_wait_s
        self._failover_waits = 0  # calls waiting for a link now
        self._connection = StoreConnection(resolver, node, (token, username, password), self)
        self._mailbox = EventMailbox()
        self._watched: dict[str, int] = {}  # queue -> local sessions on it (sent again after a reconnect)
        self._clients: dict[str, _Client] = {}  # client id -> its lease and will (sent again after a reconnect)
        self._moved = EventMailbox()  # {client id: 0} of the clients that are not this node's any more
        self._asks_in, self._asks_out = trio.open_memory_channel[tuple[int, str, AdminOp, bytes]](math.inf)  # admin asks
        self._events_received = 0

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, host: str = "", port: int | None = None, *, resolver: Resolver | None = None, node: str | None = None,
        timeout_s: float | None = 30.0, token: str = "", username: str | None = None,
        password: bytes | str | None = None, failover_wait_s: float = 0.0,
    ) -> AsyncIterator[RemoteStore]:
        """Connect to the store at ``host:port`` (or wherever ``resolver`` says it is, asked again at each
        reconnect) and keep connected until the block exits.

        Without ``port``, ``host`` is a comma-separated list of ``HOST:PORT``: the replicas of a replicated store
        (store/rpc/connection.py, ``Addresses``: tried in turn, and a replica that does not lead redirects to the
        leader).

        Args:
            node: this client's node name, as the store routes events and places clients
                (default: ``default_node_name()``); unique among the store's clients.
            timeout_s: give up if the first connection does not succeed within this (None: retry forever).
            token: the store's ``store.token``: a gateway node's credential (store/rpc/access.py).
            username, password: a back-end client's credentials, when the store has a password file.
            failover_wait_s: how long a call that could not be sent (or an idempotent one whose answer was lost)
                waits for the next link, counted from when the link broke (the module docstring); 0: it fails at
                once.

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the handshake (another protocol version).
            ValueError: ``host`` is not a list of ``HOST:PORT`` (without ``port``).
        """
        if isinstance(password, str):
            password = password.encode()
        client = cls(resolver or resolver_of(host, port), node or default_node_name(), token=token, username=username,
                     password=password, failover_wait_s=failover_wait_s)
        try:
            async with background(lambda task_status: client._connection.run(timeout_s, task_status)):
                yield client
        finally:
            client._mailbox.close()
            client._moved.close()
            client._asks_in.close()

    @property
    def connected(self) -> bool:
        return self._connection.link is not None

    @property
    def address(self) -> str:
        """``host:port`` of the store this client is connected to (or last tried)."""
        return self._connection.address

    @property
    def epoch(self) -> int:
        """The lease epoch this node holds at the store (0 before the first connection)."""
        return self._connection.epoch

    @property
    def max_record_bytes(self) -> int:
        """The store's ``commitlog.max_record_bytes``, as it said when this node connected (0: not said)."""
        return self._connection.max_record_bytes

    def _require_link(self) -> Link:
        return self._connection.require()

    def _epoch_of(self, client_id: str) -> int:
        """The lease epoch a write for ``client_id`` names (0: this connection's: a client not registered here)."""
        client = self._clients.get(client_id)
        return client.epoch if client is not None else 0

    def _stale(self, epoch: int, link: Link) -> bool:
        """Whether ``epoch`` is an ended lease of this node's (its writes are refused)."""
        return epoch != 0 and epoch != link.epoch

    def _refuse_stale(self, epoch: int, link: Link) -> None:
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
        await self._connection.wait_reconnected(connects)

    async def wait_connected(self) -> None:
        """Return once the client is connected (at once if it is)."""
        await self._connection.wait_connected()

    async def wait_available(self) -> None:
        """Return once a connection that is not breaking is up (at once if one is)."""
        await self._connection.wait_available()

    # --- messages ---------------------------------------------------------------------------

    def append_nowait(self, messages: Sequence[NewMessage]) -> Positions:
        """Always raises ``trio.WouldBlock``: an append is a round trip to the store node."""
        raise trio.WouldBlock

    async def _through_failover(self, attempt: Callable[[Link], Awaitable[T]], *, idempotent: bool = False) -> T:
        """``attempt(link)`` on the live link; made again on the next link (a store restart, a new leader) when it
        was not sent (``NotSent``: the store it never reached cannot have done it) or, ``idempotent``, when it was
        sent and its answer was lost (the store holds the same after doing it twice). The wait for that link ends
        ``failover_wait_s`` after the link broke: then, or sent and not idempotent, the call raises
        ``StoreUnavailable`` as it would without the wait."""
        while True:
            try:
                return await attempt(self._require_link())
            except StoreUnavailable as exc:
                if not (isinstance(exc, NotSent) or idempotent and type(exc) is StoreUnavailable):
                    raise
                down_since = self._connection.down_since
                deadline = (trio.current_time() if down_since is None else down_since) + self._failover_wait_s
                if trio.current_time() >= deadline:
                    raise
                await self._wait_link(deadline)

    async def _wait_link(self, deadline: float) -> None:
        """Wait for a link until ``deadline``; the first of the calls waiting at once logs it."""
        if not self._failover_waits:
            LOGGER.warning("store calls wait for the store connection", extra={"ctx": {
                "node": self.node, "store": self._connection.address, "failover_wait_s": self._failover_wait_s}})
        self._failover_waits += 1
        try:
            with trio.move_on_at(deadline):
                await self._connection.wait_available()
        finally:
            self._failover_waits -= 1

    async def _call(self, make: Callable[[int], Any], *, idempotent: bool = False) -> Any:
        """One request through a failover (:meth:`_through_failover`); its answer."""
        return await self._through_failover(lambda link: link.call(make), idempotent=idempotent)

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     batch: bool = False) -> Positions:
        """See ``StoreApi.append``. Through a failover only when not sent: an append sent and not answered may be
        stored, and made again it could be stored twice (``StoreUnavailable``: the device is told it was not).
        A ``batch`` is a request of its own (its caller batched already)."""
        group = list(messages)
        if batch and group:
            return await self._append_batch(group, durable)

        async def attempt(link: Link) -> Positions:
            if not group:
                return Positions(MAIN_LOG, [])
            self._refuse_stale(self._epoch_of(group[0].client_id), link)  # a connection's appends: one publisher
            return await link.appends[durable].submit(group)

        return await self._through_failover(attempt)

    async def _append_batch(self, group: list[NewMessage], durable: bool | None) -> Positions:
        """``append(batch=True)``: one request, its one group a batch record; raises what refused it."""
        (result,) = await self.append_groups([group], durable=durable, batched=[True])
        if isinstance(result, Exception):
            raise result
        return result

    async def append_groups(self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None,
                            batched: Sequence[bool] = ()) -> list[Positions | Exception]:
        """Append groups of messages in one request and one CommitLog write, each group all or nothing and failing
        alone (back-end producers, store/clients/producer.py, which batch by themselves: this skips the client's
        own batching); ``batched[i]``: group i is one batch record (``append(batch=True)``).

        Returns, per group, its positions or the exception that refused it
        (``RecordTooLarge``, ``AccessDenied`` for a topic the ACL does not allow).

        Raises:
            StoreUnavailable: the connection broke (the messages may or may not be appended).
            OSError: the write failed; none was appended.
            ValueError: the request exceeds the RPC frame limit (nothing was sent).
        """
        if not groups:
            self._require_link()
            return []
        sent = [list(group) for group in groups]
        try:
            answer = await self._call(lambda rid: rpc.AppendRequest(
                rid, sent, durable, batched=[i for i, batch in enumerate(batched) if batch]))
        except rpc.RpcProtocolError as exc:
            raise ValueError(str(exc)) from None
        errors = answer.errors
        return [exception_of(errors[i]) if i in errors else answer.positions[i] for i in range(len(sent))]

    def pull_nowait(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """Always raises ``trio.WouldBlock``: a read is a round trip to the store node."""
        raise trio.WouldBlock

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """The reads, batched with other callers'; a read that comes back full starts the next one in advance.

        Reading ahead overlaps the store's next reads with the caller's work on
        this one (a session delivering a batch, then pulling the next): without
        it a backlog drains at one round trip per pull batch. Idempotent through a failover: a read changes
        nothing, and the new leader holds every record a pull returned (they were below the confirm offset).
        """
        return await self._through_failover(lambda link: self._pull(link, requests), idempotent=True)

    async def _pull(self, link: Link, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
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

    def max_offsets_nowait(self, queues: Sequence[str]) -> list[int]:
        """Always raises ``trio.WouldBlock``: the store's queues are a round trip away."""
        raise trio.WouldBlock

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        answer = await self._call(lambda rid: rpc.MaxOffsets(rid, list(queues)), idempotent=True)
        return answer.offsets

    async def retained(self, filter: str) -> list[Record]:
        answer = await self._call(lambda rid: rpc.GetRetained(rid, filter), idempotent=True)
        return [decode_record(raw, 0, log_offset) for log_offset, raw in answer.records]

    async def retained_all(self, filters: Sequence[str]) -> list[list[Record]]:
        return [await self.retained(filter) for filter in filters]  # one request each: the wire has no batch form

    async def read_log(self, start: Position, max_bytes: int) -> LogSpan:
        answer = await self._call(lambda rid: rpc.ReadLog(rid, start, max_bytes), idempotent=True)
        return answer.span

    async def statistics(self) -> StoreStatistics:
        answer = await self._call(lambda rid: rpc.GetStatistics(rid), idempotent=True)
        return answer.stats

    # --- delayed messages --------------------------------------------------------------------

    async def delayed_list(self, *, topic: str = "", client_id: str = "", after: int = 0,
                           limit: int = 100) -> DelayedPage:
        answer = await self._call(lambda rid: rpc.ListDelayed(rid, topic, client_id, after, limit), idempotent=True)
        return answer.page

    async def delayed_cancel(self, position: Position) -> bool:
        # Not idempotent: made again after a lost answer, it would say "not pending" of what it cancelled.
        answer = await self._call(lambda rid: rpc.CancelDelayed(rid, position))
        return answer.value

    # --- subscriptions and offsets ----------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        answer = await self._call(lambda rid: rpc.Activate(rid, queue, holder))
        return answer.value

    async def activate_all(self, queues: Sequence[str], holder: str) -> list[int | ValueError]:
        answer = await self._call(lambda rid: rpc.ActivateAll(rid, list(queues), holder))
        return [start if isinstance(start, int) else _refusal(start) for start in answer.starts]

    async def release(self, queue: str, holder: str) -> bool:
        async def attempt(link: Link) -> bool:
            epoch = self._epoch_of(holder)
            self._refuse_stale(epoch, link)
            return (await link.call(lambda rid: rpc.Release(rid, queue, holder, epoch))).value

        return await self._through_failover(attempt)

    async def get_offsets(self, owner: str) -> dict[str, int]:
        answer = await self._call(lambda rid: rpc.GetOffsets(rid, owner), idempotent=True)
        return answer.value

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        """The commits of clients of this node's lease go in one batched request; those of clients of an ended
        lease are not sent: ``LeaseLost`` once the others are written. Idempotent through a failover: the same
        positions committed twice are the same commit (the store never moves an offset back)."""
        await self._through_failover(lambda link: self._commit_offsets(link, commits), idempotent=True)

    async def _commit_offsets(self, link: Link, commits: Mapping[str, Mapping[str, int]]) -> None:
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
        if self._connection.link is not None:
            self._connection.link.watch(queue, 1)

    def unwatch(self, queue: str) -> None:
        left = self._watched.get(queue, 0) - 1
        if left < 0:
            return
        if left:
            self._watched[queue] = left
        else:
            del self._watched[queue]
        if self._connection.link is not None:
            self._connection.link.watch(queue, -1)

    async def events(self) -> dict[str, int]:
        return await self._mailbox.get()

    def events_nowait(self) -> dict[str, int]:
        return self._mailbox.get_nowait()

    # --- consumer groups and shared subscriptions --------------------------------------------

    async def join(self, group: str, queue: str, member: str, *, start: str = "latest", at: int = 0) -> int:
        answer = await self._call(lambda rid: rpc.Join(rid, group, queue, member, start, at))
        return answer.value

    async def claim(self, group: str, queue: str, member: str, max_count: int, *, max_bytes: int = 1 << 20,
                    wait_s: float = 0.0) -> PullResult[Record]:
        wait_ms = max(0, int(wait_s * 1000))
        answer = await self._call(lambda rid: rpc.Claim(rid, group, queue, max_count, max_bytes, wait_ms, member))
        return decoded(answer.result)

    async def ack(self, group: str, queue: str, member: str, offsets: Sequence[int] = (), *, below: int = 0,
                  ranges: Sequence[tuple[int, int]] = ()) -> int:
        answer = await self._call(lambda rid: rpc.Ack(rid, group, queue, list(offsets), member, below, list(ranges)))
        return answer.value

    async def leave(self, group: str, queue: str, member: str) -> None:
        await self._call(lambda rid: rpc.Leave(rid, group, queue, member))

    # --- POP consumption ------------------------------------------------------------------------

    async def pop(self, group: str, queue: str, member: str, max_count: int, *, invisible_s: float,
                  wait_s: float = 0.0, max_attempts: int = MAX_ATTEMPTS, max_bytes: int = 1 << 20,
                  start: str = "latest", at: int = 0) -> list[Popped]:
        invisible_ms, wait_ms = max(1, int(invisible_s * 1000)) if invisible_s > 0 else 0, max(0, int(wait_s * 1000))
        answer = await self._call(lambda rid: rpc.Pop(rid, group, queue, max_count, invisible_ms, wait_ms,
                                                      max_attempts, max_bytes, member, start, at))
        return [Popped(handle, attempt, offset, record) for (handle, attempt), (offset, record)
                in zip(answer.handles, decoded(answer.result).messages, strict=True)]

    async def pop_ack(self, handles: Sequence[str]) -> list[bool]:
        answer = await self._call(lambda rid: rpc.PopAck(rid, list(handles)))
        return answer.acked

    async def change_invisible(self, handle: str, invisible_s: float) -> str | None:
        if invisible_s < 0:
            raise ValueError(f"an invisible time must not be negative, not {invisible_s}")
        answer = await self._call(lambda rid: rpc.ChangeInvisible(rid, handle, int(invisible_s * 1000)))
        return answer.handle

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None = None, will_delay_s: int = 0) -> bytes | None:
        """See ``StoreApi.open_session``; through a failover only when not sent (a CONNECT then waits for the next
        link, rather than being refused Server unavailable at once)."""
        async def attempt(link: Link) -> bytes | None:
            self._clients[client_id] = _Client(link.epoch, expiry_s, will, will_delay_s)
            try:
                answer = await link.call(lambda rid: rpc.OpenSession(rid, client_id, clean_start, expiry_s, will,
                                                                  will_delay_s))
            except BaseException:
                self._clients.pop(client_id, None)
                raise
            return answer.value

        return await self._through_failover(attempt)

    async def close_session(self, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        """See ``StoreApi.close_session``; through a failover only when not sent (closed twice, a session whose
        client connected again elsewhere meanwhile could be closed)."""
        client = self._clients.pop(client_id, None)
        epoch = client.epoch if client is not None else 0

        async def attempt(link: Link) -> None:
            self._refuse_stale(epoch, link)
            await link.call(lambda rid: rpc.CloseSession(rid, client_id, expiry_s, will_delay_s, epoch))

        await self._through_failover(attempt)

    async def save_session(self, client_id: str, blob: bytes) -> None:
        """See ``StoreApi.save_session``. Idempotent through a failover: a ``SessionSaved`` record replaces the
        blob whole, so the same blob saved twice leaves the same session."""
        async def attempt(link: Link) -> None:
            epoch = self._epoch_of(client_id)
            self._refuse_stale(epoch, link)
            await link.call(lambda rid: rpc.SaveSession(rid, client_id, blob, epoch))

        await self._through_failover(attempt, idempotent=True)

    async def patch_session(self, client_id: str, parts: Mapping[str, bytes]) -> None:
        """See ``StoreApi.patch_session``. Idempotent through a failover: a part replaces its key whole."""
        async def attempt(link: Link) -> None:
            epoch = self._epoch_of(client_id)
            self._refuse_stale(epoch, link)
            await link.call(lambda rid: rpc.PatchSession(rid, client_id, dict(parts), epoch))

        await self._through_failover(attempt, idempotent=True)

    async def load_session(self, client_id: str) -> bytes | None:
        answer = await self._call(lambda rid: rpc.LoadSession(rid, client_id), idempotent=True)
        return answer.value

    async def end_session(self, client_id: str) -> bool:
        answer = await self._call(lambda rid: rpc.EndSession(rid, client_id))
        return answer.value

    async def sessions(self) -> list[str]:
        answer = await self._call(lambda rid: rpc.ListSessions(rid), idempotent=True)
        return answer.names

    async def awaiting_release(self, client_id: str) -> dict[int, Position]:
        answer = await self._call(lambda rid: rpc.GetAwaiting(rid, client_id), idempotent=True)
        return answer.flows

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """See ``StoreApi.release_awaiting``. Idempotent through a failover (store/awaiting.py): a release of a flow
        at an offset marks it released at that offset unless it holds a later one, so made again it changes
        nothing; the PUBCOMP waits for the new leader to have recorded it."""
        if not flows:
            return
        group = list(flows)

        async def attempt(link: Link) -> None:
            self._refuse_stale(self._epoch_of(group[0].client_id), link)  # one connection's releases: one client
            await link.releases.submit(group)

        await self._through_failover(attempt, idempotent=True)

    async def moved(self) -> list[str]:
        return list(await self._moved.get())

    # --- administration across nodes -------------------------------------------------------

    async def admin_call(self, client_id: str, op: AdminOp) -> bytes | None:
        answer = await self._call(lambda rid: rpc.AdminCall(rid, client_id, op))
        return answer.value

    async def admin_call_all(self, op: AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        answer = await self._call(lambda rid: rpc.AdminCallAll(rid, op, query))
        return answer.answers, answer.missing

    async def admin_asks(self) -> tuple[int, str, AdminOp, bytes]:
        return await self._asks_out.receive()

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """Answer the ask ``ask_id`` (lost if the connection it came on broke: the asker got an error)."""
        if self._connection.link is not None:
            self._connection.link.send(rpc.AdminAnswer(ask_id, value))

    # --- the client's own figures -------------------------------------------------------

    def client_statistics(self) -> RemoteStoreStatistics:
        connection = self._connection
        return RemoteStoreStatistics(connection.link is not None, connection.connects, self._events_received,
                                     len(self._watched), len(self._clients),
                                     {kind: (calls, requests) for kind, (calls, requests)
                                      in connection.batch_counts.items()},
                                     (connection.ahead_counts[0], connection.ahead_counts[1]))

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

    # --- the connection's listener -------------------------------------------------------

    def welcomed(self, link: Link, welcome: rpc.Welcome, ended: int) -> None:
        """Queue on the new link this node's watches and the clients of the lease it holds (with their wills); the
        clients of a lease that ended (``ended``, when the Welcome says it did not resume) are reported moved."""
        if not welcome.resumed and ended:
            gone = [client_id for client_id, client in self._clients.items() if client.epoch != welcome.epoch]
            LOGGER.warning("store lease lost: this node was away longer than its lease; the clients it had are "
                           "closed without a will or a write", extra={"ctx": {
                               "node": self.node, "ended_epoch": ended, "epoch": welcome.epoch,
                               "clients": len(gone)}})
            if gone:  # their entries stay, with the ended epoch: the store refuses what is still written for them
                self._moved.post(dict.fromkeys(gone, 0))
        if self._watched:
            link.send(rpc.Watch(dict(self._watched)))
        resumed = welcome.resumed or not ended
        for client_id, client in self._clients.items():
            if resumed and client.epoch in (ended, welcome.epoch):  # the resumed (or adopted) lease's clients, again
                client.epoch = welcome.epoch
                link.send(rpc.Reattach(client_id, client.expiry_s, client.will, client.will_delay_s, welcome.epoch))

    async def reconnected(self, link: Link) -> None:
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

    def pushed(self, message: rpc.Events | rpc.ClientMoved | rpc.AdminAsk) -> None:
        if type(message) is rpc.Events:
            self._events_received += len(message.events)
            self._mailbox.post(message.events)
        elif type(message) is rpc.ClientMoved:
            self._moved.post({message.client_id: 0})
        else:
            self._asks_in.send_nowait((message.id, message.client_id, message.op, message.query))
