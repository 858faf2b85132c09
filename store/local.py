"""The store-client interface: everything a gateway node asks of the store, in one place.

This is the seam between the two deployment shapes (docs/architecture.md): the
embedded node talks to the ``StoreNode`` in its own process through
``LocalStoreClient``; a cluster gateway talks to a store node process through
an RPC implementation of the same ``StoreClient`` protocol. The gateway is
written against the protocol only, so it behaves the same in both shapes.

The calls are batched where a gateway has many of a kind at once (appends from
many connections, pulls of many queues, offset commits of many sessions): one
call, one thread hand-off here, one round trip over the RPC.

Notify: a gateway node says which queues its sessions read (``watch`` /
``unwatch``, reference counted like the router's registrations) and takes the
merged ``{queue: max offset}`` events routed to it from ``events``.

Leases (cluster mode, store/leases.py): the writes a node makes for one of its
clients take the ``epoch`` of the lease the client was accepted under
(``StoreClient.epoch`` then; None: now). Once that lease has ended the store
refuses them (``store.leases.LeaseLost``), so a node that was frozen past its
lease cannot write over what the client's newer connection did elsewhere. The
embedded store has one node and no leases: it takes and ignores the epochs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, final

import trio

from lightqueue.queues import PullResult
from notify import EventMailbox
from store.awaiting import Flow
from store.node import StoreNode
from store.log.record import Record, decode_record

__all__ = ["LocalStoreClient", "LogSpan", "NewMessage", "PullRequest", "StoreClient", "StoreStatistics"]

NewMessage = tuple[str, bytes, Mapping[str, Any]]
"""(topic, payload, optional record fields of :func:`store.log.record.encode_record`: ``client_id``, ``qos``,
``retain``, ``properties``, ``born_ms``, ``packet_id``; the store reads these six keys and no others)."""


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class PullRequest:
    """Read up to ``max_count`` messages (and about ``max_bytes``) of ``queue`` from queue offset ``from_offset``."""

    queue: str
    from_offset: int
    max_count: int = 32
    max_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """The store's figures an operator watches (metrics, ``$SYS``, the admin API)."""

    written_offset: int  # CommitLog end: bytes appended since the log began
    flushed_offset: int  # everything below is on disk
    dispatched_offset: int  # everything below is indexed
    log_bytes: int  # bytes of records the CommitLog still holds (retention keeps it bounded)
    queue_ids: int  # light-queue ids allocated so far
    active_filters: int  # wildcard filters being indexed
    retained: int  # retained messages
    notify_sent: int  # events routed to gateway nodes
    notify_suppressed: int  # node-events not sent because the node had no session on the queue
    notify_by_node: Mapping[str, int] = field(default_factory=dict)  # attached node -> events routed to it
    corrupt_records: int = 0  # corrupt CommitLog records found and skipped since the store started (each once)
    disk_full: bool = False  # the data disk is full: new messages are refused until space frees

    @property
    def dispatch_lag(self) -> int:
        """Bytes appended and not indexed yet."""
        return self.written_offset - self.dispatched_offset


class StoreClient(Protocol):
    """What a gateway node needs from the store, embedded or remote."""

    node: str  # this gateway node's name, as the store routes events to it

    @property
    def epoch(self) -> int:
        """The lease epoch this node holds now (constant for the embedded store)."""
        ...

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     epoch: int | None = None) -> list[int]:
        """Append messages in one write with their target queues fixed now; returns their CommitLog offsets.

        Returns once they are appended (and on disk when ``durable``, or when
        the flush policy is sync and ``durable`` is None).

        Raises:
            store.log.record.RecordTooLarge: a message exceeds the record size limit (nothing is appended).
            OSError: the write failed (``LogFullError`` when the disk is full); nothing is acknowledged.
            store.leases.LeaseLost: ``epoch`` has ended; nothing is appended.
        """
        ...

    def append_now(self, messages: Sequence[NewMessage]) -> list[int] | None:
        """:meth:`append` (not durable) done before returning, if the store can without waiting; else None,
        with nothing appended: the caller awaits :meth:`append`. Raises as :meth:`append`."""
        ...

    def can_append_now(self) -> bool:
        """Whether :meth:`append_now` would append at this moment (it may still raise): a caller that gathers
        appends for one ``append_now`` call does not gather them in vain."""
        ...

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """The results of several queue reads, in request order."""
        ...

    def pull_now(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]] | None:
        """:meth:`pull` done before returning, if the reads are small and local; else None: the caller awaits
        :meth:`pull`. Saves the reader of news at the head (the queue cache) a task switch per event."""
        ...

    async def activate(self, queue: str, holder: str) -> int:
        """Hold the queue's filter for ``holder``; returns the queue offset the subscription starts at.

        Raises:
            lightqueue.topics.TopicError: not a valid topic filter.
            ValueError: the queue id space is exhausted.
        """
        ...

    async def release(self, queue: str, holder: str, *, epoch: int | None = None) -> bool:
        """Stop holding the queue's filter; True if ``holder`` held it."""
        ...

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        """The next queue offset of each queue (0 for a queue never written)."""
        ...

    async def get_offsets(self, owner: str) -> dict[str, int]:
        """``{queue: next offset}`` committed by ``owner`` (a client id or a group name)."""
        ...

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]], *, epoch: int | None = None) -> None:
        """Store ``{owner: {queue: next offset}}`` durably, all owners in one write."""
        ...

    async def delete_owner(self, owner: str, *, epoch: int | None = None) -> None:
        """Forget an owner's offsets and release its filters (session expiry)."""
        ...

    async def retained(self, filter: str) -> list[Record]:
        """The retained messages whose topics match ``filter``."""
        ...

    async def save_session(self, client_id: str, blob: bytes, *, epoch: int | None = None) -> None:
        """Keep a session blob durably."""
        ...

    async def load_session(self, client_id: str) -> bytes | None:
        """The blob last saved for ``client_id``, or None."""
        ...

    async def drop_session(self, client_id: str, *, epoch: int | None = None) -> None:
        """Forget the blob of ``client_id`` and its inbound QoS 2 flows (its session ended)."""
        ...

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        """``{packet id: CommitLog offset}`` of the client's inbound QoS 2 messages stored and awaiting PUBREL.

        Derived from the records (a QoS 2 record carries its packet id): complete
        for everything appended before the call.
        """
        ...

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """Mark inbound QoS 2 flows released; returns once that is on disk (fsynced), so PUBCOMP may go out."""
        ...

    def watch(self, queue: str) -> None:
        """One more local session reads ``queue``: route its events here (reference counted)."""
        ...

    def unwatch(self, queue: str) -> None:
        """One local session fewer reads ``queue``."""
        ...

    async def events(self) -> dict[str, int]:
        """Wait for and take the merged ``{queue: max offset}`` events routed to this node.

        Raises:
            trio.EndOfChannel: the client is closed.
        """
        ...

    async def statistics(self) -> StoreStatistics:
        """The store's current figures."""
        ...

    async def read_log(self, offset: int, max_bytes: int) -> LogSpan:
        """The log's raw bytes from the record boundary ``offset`` (``CommitLog.read_span``), up to the
        flushed offset: for readers that frame records themselves (Spark executors over the RPC).
        ``max_bytes`` 0 returns only the log's bounds (``flushed``, ``min_offset``), for any ``offset``.

        Raises:
            store.log.errors.OffsetExpired: ``offset`` is below the log's minimum (retention).
            store.log.errors.InvalidOffset: ``offset`` is beyond the flushed offset.
        """
        ...

    async def hold_will(self, client_id: str, message: NewMessage, delay_s: float, *, epoch: int | None = None) -> None:
        """``client_id`` is connected here with this will: if this node dies, the store publishes it.

        The store appends it ``delay_s`` after this node's lease ends (store/leases.py),
        unless the client's session resumes first. Replaces any will held for the client.
        """
        ...

    async def drop_will(self, client_id: str, *, epoch: int | None = None) -> None:
        """The will of ``client_id`` must not fire from the store (normal DISCONNECT, or published here)."""
        ...

    def present(self, client_id: str, *, epoch: int | None = None) -> None:
        """``client_id`` connected to this node: another node that has it hears of it (:meth:`moved` there)."""
        ...

    def absent(self, client_id: str, *, epoch: int | None = None) -> None:
        """``client_id`` is gone from this node: no connection, no will waiting here."""
        ...

    async def moved(self) -> list[str]:
        """The next clients of this node that connected to another node (their sessions resumed there)."""
        ...

    async def fenced(self) -> int:
        """Wait until this node learns that its lease ended (it was away longer than the lease); the ended epoch.

        Every client accepted under that epoch is no longer this node's: close
        them without writing anything for them (the store refuses such writes).
        """
        ...

    async def wait_available(self) -> None:
        """Return once calls can reach the store (at once when they can)."""
        ...

    async def admin_call(self, client_id: str, op: str) -> bytes | None:
        """Have the node ``client_id`` is connected to run admin ``op`` (``store.rpc.wire.AdminOp``); its answer as
        JSON bytes, or None when the client is connected to no other node."""
        ...

    async def admin_call_all(self, op: str, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Have every other node that has clients run list ``op`` with ``query``: (their JSON answers by node name,
        the nodes that did not answer)."""
        ...

    async def admin_asks(self) -> tuple[int, str, str, bytes]:
        """The next admin call of another node about a client of this one, or a list call:
        ``(ask id, client id, op, query)``."""
        ...

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """Answer an admin ask with JSON bytes, or None when the client is not connected here."""
        ...


INLINE_PULL = 64
"""Pulls of at most this many messages in all (a queue cache's fill at moderate rates) run in the trio thread:
an index scan over the memtable and records kept in memory cost less than a hand-off to a worker thread.
Larger pulls run there too when their records are kept in memory (``StoreNode.in_memory``): a worker
thread runs Python only while it holds the GIL, so it took nothing off the loop and added hand-offs (a
fan-in's queue cache fills with thousands of messages a step; bench fanin QoS 0 gained about 5%)."""


@final
class LocalStoreClient:
    """The embedded node's store client: direct calls on a ``StoreNode`` in this process.

    Short, in-memory calls run in the trio thread; RocksDB scans, CommitLog
    reads and WAL writes go to a worker thread, one hand-off per batch.

    Resource handling: attaches ``node`` to the store's notify on creation;
    :meth:`close` detaches it (its ``events`` then end).
    """

    epoch = 0
    """No leases: the embedded gateway and its store live and die together."""

    def __init__(self, store: StoreNode, node: str = "local") -> None:
        self.store = store
        self.node = node
        self._mailbox: EventMailbox = store.attach(node)

    def close(self) -> None:
        self.store.detach(self.node)

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     epoch: int | None = None) -> list[int]:
        return await self.store.append_many(messages, durable=durable)

    def append_now(self, messages: Sequence[NewMessage]) -> list[int] | None:
        return self.store.append_now(messages)

    def can_append_now(self) -> bool:
        return self.store.can_append_now()

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        results = self.pull_now(requests)
        if results is not None:
            await trio.lowlevel.checkpoint()
            return results
        return await trio.to_thread.run_sync(self._pull, requests)

    def pull_now(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]] | None:
        if sum(r.max_count for r in requests) <= INLINE_PULL or all(
                self.store.in_memory(r.queue, r.from_offset) for r in requests):
            return self._pull(requests)
        return None

    def _pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        read = self.store.read
        return [read(r.queue, r.from_offset, r.max_count, r.max_bytes) for r in requests]

    async def activate(self, queue: str, holder: str) -> int:
        self.store.space.check()  # RocksDB writes (WAL) must not meet a full disk: store/space.py
        return await self.store.dispatcher.activate(queue, holder)

    async def release(self, queue: str, holder: str, *, epoch: int | None = None) -> bool:
        self.store.space.check()
        return await self.store.dispatcher.release(queue, holder)

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        max_offset = self.store.queues.max_offset
        return [max_offset(queue) for queue in queues]

    async def get_offsets(self, owner: str) -> dict[str, int]:
        return await trio.to_thread.run_sync(self.store.queues.get_offsets, owner)

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]], *, epoch: int | None = None) -> None:
        self.store.space.check()
        await trio.to_thread.run_sync(self._commit, commits)

    def _commit(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        commit = self.store.queues.commit_offsets
        for owner, offsets in commits.items():
            commit(owner, offsets)

    async def delete_owner(self, owner: str, *, epoch: int | None = None) -> None:
        await trio.to_thread.run_sync(self._delete_owner, owner)

    def _delete_owner(self, owner: str) -> None:
        queues = self.store.queues
        if queues.held_by(owner) or queues.get_offsets(owner):  # nothing to delete, nothing to write
            self.store.space.check()
            queues.delete_owner(owner)

    async def retained(self, filter: str) -> list[Record]:
        found = await trio.to_thread.run_sync(self.store.retained.lookup, filter)
        return [decode_record(r.record, 0, r.log_offset) for r in found]

    async def save_session(self, client_id: str, blob: bytes, *, epoch: int | None = None) -> None:
        await trio.to_thread.run_sync(self.store.save_session, client_id, blob)

    async def load_session(self, client_id: str) -> bytes | None:
        return await trio.to_thread.run_sync(self.store.load_session, client_id)

    async def drop_session(self, client_id: str, *, epoch: int | None = None) -> None:
        await trio.to_thread.run_sync(self.store.drop_session, client_id)
        await self.store.drop_awaiting(client_id)

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        return await self.store.awaiting_release(client_id)

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        await self.store.release_awaiting(flows)

    def watch(self, queue: str) -> None:
        self.store.router.register(self.node, queue)

    def unwatch(self, queue: str) -> None:
        self.store.router.unregister(self.node, queue)

    async def events(self) -> dict[str, int]:
        return await self._mailbox.get()

    async def statistics(self) -> StoreStatistics:
        return store_statistics(self.store)

    async def read_log(self, offset: int, max_bytes: int) -> LogSpan:
        return await trio.to_thread.run_sync(read_log_span, self.store, offset, max_bytes)

    async def hold_will(self, client_id: str, message: NewMessage, delay_s: float, *, epoch: int | None = None) -> None:
        """A no-op: the embedded gateway and its store live and die together, and the gateway fires wills itself."""

    async def drop_will(self, client_id: str, *, epoch: int | None = None) -> None:
        """A no-op, as :meth:`hold_will`."""

    def present(self, client_id: str, *, epoch: int | None = None) -> None:
        """A no-op: with one gateway node, a client never connects to another."""

    def absent(self, client_id: str, *, epoch: int | None = None) -> None:
        """A no-op, as :meth:`present`."""

    async def moved(self) -> list[str]:
        """Never returns, as :meth:`present`."""
        await trio.sleep_forever()

    async def fenced(self) -> int:
        """Never returns: no leases (see :attr:`epoch`)."""
        await trio.sleep_forever()

    async def wait_available(self) -> None:
        """Returns at once: the store is in this process."""
        await trio.lowlevel.checkpoint()

    async def admin_call(self, client_id: str, op: str) -> bytes | None:
        """None: with one gateway node, a client is connected here or nowhere."""
        await trio.lowlevel.checkpoint()
        return None

    async def admin_call_all(self, op: str, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Nothing: with one gateway node, there is no other node to ask."""
        await trio.lowlevel.checkpoint()
        return {}, []

    async def admin_asks(self) -> tuple[int, str, str, bytes]:
        """Never returns, as :meth:`admin_call`."""
        await trio.sleep_forever()

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """A no-op: no ask ever comes (:meth:`admin_asks`)."""


MAX_READ_LOG_BYTES = 16 * 1024 * 1024
"""A ``read_log`` returns at most this much, so an RPC answer stays far below the frame limit."""


@dataclass(frozen=True, slots=True)
class LogSpan:
    """The answer of ``read_log``: the log's bytes from ``start`` to at most ``data_end`` (see
    ``CommitLog.read_span``), and the log's current flushed and minimum offsets."""

    start: int
    data: bytes
    data_end: int
    flushed: int
    min_offset: int


def read_log_span(store: StoreNode, offset: int, max_bytes: int) -> LogSpan:
    """``read_log`` on a store node in this process (the RPC server answers with the same).

    ``max_bytes`` 0 asks for the log's bounds only: any ``offset`` is accepted and nothing is read."""
    log = store.log.log
    if max_bytes <= 0:
        return LogSpan(offset, b"", offset, log.flushed_offset, log.min_offset)
    start, data, data_end = log.read_span(offset, max(0, min(max_bytes, MAX_READ_LOG_BYTES)))
    return LogSpan(start, data, data_end, log.flushed_offset, log.min_offset)


def store_statistics(store: StoreNode) -> StoreStatistics:
    """The figures of a store node in this process (the RPC server answers with the same)."""
    log = store.log.log
    queues = store.queues.statistics()
    stats = log.statistics()
    notify = store.router.statistics()
    return StoreStatistics(
        written_offset=stats.written_offset,
        flushed_offset=stats.flushed_offset,
        dispatched_offset=store.dispatcher.dispatched_offset,
        log_bytes=stats.written_offset - stats.min_offset,
        queue_ids=queues.next_queue_id,
        active_filters=queues.active_filters,
        retained=store.retained.count,
        notify_sent=sum(notify.sent.values()),
        notify_suppressed=notify.suppressed,
        notify_by_node=notify.sent,
        corrupt_records=stats.corrupt_records,
        disk_full=store.disk_full,
    )
