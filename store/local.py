"""``LocalStore``: the ``StoreApi`` of a store node in this process.

The embedded gateway uses it, and the RPC server runs every request of a remote node through one of its own
(store/rpc/server.py), so a cluster gateway gets exactly the embedded one's behaviour. Besides ``StoreApi`` it
has the few forms of the same calls that the server needs to serve many remote nodes well (``append_groups``:
several callers' appends in one write; ``pull_raw``, ``claim_raw``, ``retained_raw``: records as stored, which the
remote side decodes; ``reattach``): the server reaches the store node through them only. Short, in-memory calls
run in the trio thread; RocksDB scans, CommitLog reads and WAL writes go to a worker thread, one hand-off per
batch. The node has one CommitLog, ``MAIN_LOG``: the positions the seam carries are turned into its offsets here
(a position of another log is an ``InvalidOffset``).

Resource handling: a ``LocalStore`` attaches its node to the store on creation (events, client notices and
admin asks are routed to it); :meth:`close` detaches it (its ``events`` and ``moved`` then end). With ``lease``
(the embedded gateway) the node also takes a lease that lasts as long as the process: it is never given up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, final

import trio

from store.api import (MAIN_LOG, MAX_ATTEMPTS, AdminOp, DelayedPage, Flow, LogSpan, NewMessage, Popped, Position,
                       Positions, PullRequest, PullResult, StoreStatistics)
from store.attached import admin_call, admin_call_all
from store.groups import DECODED, WHOLE, Member, Stored
from store.log.errors import InvalidOffset
from store.log.record import Record, decode_record
from store.node import StoreNode

__all__ = ["INLINE_PULL", "LocalStore", "offset_in_log"]

LOGGER = logging.getLogger(__name__)

INLINE_PULL = 64
"""Pulls of at most this many messages in all (a queue cache's fill at moderate rates) run in the trio thread:
an index scan over the memtable and records kept in memory cost less than a hand-off to a worker thread.
Larger pulls run there too when their records are kept in memory (``StoreNode.in_memory``): a worker
thread runs Python only while it holds the GIL, so it took nothing off the loop and added hand-offs (a
fan-in's queue cache fills with thousands of messages a step; bench fanin QoS 0 gained about 5%)."""


T = TypeVar("T")


def _read_each(read: Callable[[str, int, int, int], PullResult[T]], requests: Sequence[PullRequest]
               ) -> list[PullResult[T]]:
    """``read`` (``StoreNode.read`` or ``read_raw``) of each request, in order."""
    return [read(r.queue, r.from_offset, r.max_count, r.max_bytes) for r in requests]
def offset_in_log(position: Position) -> int:
    """The offset in the node's log of ``position``.

    Raises:
        InvalidOffset: the position is of another log (the node has only ``MAIN_LOG``).
    """
    if position.log != MAIN_LOG:
        raise InvalidOffset(position.offset, f"no log {position.log} in this store (it has log {MAIN_LOG})")
    return position.offset


@final
class LocalStore:
    """The ``StoreApi`` over a ``StoreNode`` in this process (see the module docstring).

    Args:
        store: the open store node.
        node: this node's name at the store.
        lease: take a lease for the life of the process (the embedded gateway); the RPC server's connections
            hold their node's lease themselves (store/rpc/server.py).
    """

    def __init__(self, store: StoreNode, node: str = "local", *, lease: bool = False) -> None:
        self.store = store
        self.node = node
        self._attachment = store.attach(node)
        if lease:
            store.leases.connected(node)

    def close(self) -> None:
        self.store.detach(self.node)

    @property
    def max_record_bytes(self) -> int:
        """The store's ``commitlog.max_record_bytes`` (``RemoteStore`` has it from the store's Welcome)."""
        return self.store.max_record_bytes

    # --- messages ---------------------------------------------------------------------------

    def append_nowait(self, messages: Sequence[NewMessage]) -> Positions:
        return Positions(MAIN_LOG, self.store.append_nowait(messages))

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     batch: bool = False) -> Positions:
        return Positions(MAIN_LOG, await self.store.append(messages, durable=durable, batch=batch))

    def pull_nowait(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        store = self.store
        if sum(r.max_count for r in requests) > INLINE_PULL and not all(
                store.in_memory(r.queue, r.from_offset) for r in requests):
            raise trio.WouldBlock
        return self._pull(requests)

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        try:
            results = self.pull_nowait(requests)
        except trio.WouldBlock:
            return await trio.to_thread.run_sync(self._pull, requests)
        await trio.lowlevel.checkpoint()
        return results

    def _pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        return _read_each(self.store.read, requests)

    # --- the RPC server's forms: several callers at once, records as stored -------------------

    async def append_groups(self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None,
                            batched: Sequence[bool] = ()) -> list[Positions | ValueError]:
        """:meth:`append` of several callers' messages in one CommitLog write (``StoreNode.append_groups``): per
        group its positions, or the ``ValueError`` that kept that group (only) out; ``batched[i]``: group i is
        one batch record. The form ``RemoteStore`` has too: a back-end producer (store/clients/producer.py)
        appends through either."""
        results = await self.store.append_groups(groups, durable=durable, batched=batched)
        return [result if isinstance(result, ValueError) else Positions(MAIN_LOG, result) for result in results]

    async def pull_raw(self, requests: Sequence[PullRequest]) -> list[PullResult[Stored]]:
        """:meth:`pull` with each record as stored (``store.groups.Stored``: a batch record whole), undecoded: the
        remote side decodes (the store's CPU is the one every gateway shares). Always in a worker thread."""
        return await trio.to_thread.run_sync(_read_each, self.store.read_raw, requests)

    async def retained_raw(self, filter: str) -> list[tuple[int, bytes]]:
        """:meth:`retained` as ``(log offset, record bytes as stored)``."""
        found = await trio.to_thread.run_sync(self.store.retained.lookup, filter)
        return [(r.log_offset, r.record) for r in found]

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        return self.max_offsets_nowait(queues)

    def max_offsets_nowait(self, queues: Sequence[str]) -> list[int]:
        max_offset = self.store.queues.max_offset
        return [max_offset(queue) for queue in queues]

    async def retained(self, filter: str) -> list[Record]:
        return [decode_record(data, 0, log_offset) for log_offset, data in await self.retained_raw(filter)]

    async def retained_all(self, filters: Sequence[str]) -> list[list[Record]]:
        """The tree is matched here (in memory); a worker thread reads the records only when one matched: a
        SUBSCRIBE whose filters hold no retained message, the usual case, costs no thread hop."""
        retained = self.store.retained
        matched = retained.match_all(filters)
        if not any(matched):
            await trio.lowlevel.checkpoint()
            return [[] for _ in filters]
        found = await trio.to_thread.run_sync(lambda: [retained.read(each) for each in matched])
        return [[decode_record(r.record, 0, r.log_offset) for r in each] for each in found]

    async def read_log(self, start: Position, max_bytes: int) -> LogSpan:
        return await trio.to_thread.run_sync(self.store.read_log, offset_in_log(start), max_bytes)

    async def statistics(self) -> StoreStatistics:
        return self.store.statistics()

    # --- delayed messages --------------------------------------------------------------------

    async def delayed_list(self, *, topic: str = "", client_id: str = "", after: int = 0,
                           limit: int = 100) -> DelayedPage:
        return await self.store.delayed.page(topic, client_id, after, limit)

    async def delayed_cancel(self, position: Position, *, check: Callable[[str], None] | None = None) -> bool:
        """``StoreApi.delayed_cancel``; ``check(topic)`` raises when the caller may not cancel a message of that
        real topic (the RPC server's back-end clients: their ACL's publish rules)."""
        if position.log != MAIN_LOG:
            return False  # no such log here, so no such message
        return await self.store.delayed.cancel(position.offset, check)

    # --- subscriptions and offsets ----------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        return await self.store.activate(queue, holder)

    async def activate_all(self, queues: Sequence[str], holder: str) -> list[int | ValueError]:
        return await self.store.activate_all(queues, holder)

    async def release(self, queue: str, holder: str) -> bool:
        return await self.store.release(queue, holder)

    async def get_offsets(self, owner: str) -> dict[str, int]:
        return await trio.to_thread.run_sync(self.store.queues.get_offsets, owner)

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        await self.store.commit_offsets(commits)

    def watch(self, queue: str) -> None:
        self.store.router.register(self.node, queue)

    def unwatch(self, queue: str) -> None:
        self.store.router.unregister(self.node, queue)

    async def events(self) -> dict[str, int]:
        return await self._attachment.events.get()

    def events_nowait(self) -> dict[str, int]:
        return self._attachment.events.get_nowait()

    # --- consumer groups and shared subscriptions --------------------------------------------

    def _member(self, member: str) -> Member:
        return self.node, member

    async def join(self, group: str, queue: str, member: str, *, start: str = "latest", at: int = 0) -> int:
        return await self.store.groups.join(self._member(member), group, queue, start, at)

    async def claim(self, group: str, queue: str, member: str, max_count: int, *, max_bytes: int = 1 << 20,
                    wait_s: float = 0.0) -> PullResult[Record]:
        return await self.store.groups.claim(self._member(member), group, queue, max_count, max_bytes, wait_s,
                                             DECODED)

    async def claim_raw(self, group: str, queue: str, member: str, max_count: int, *, max_bytes: int = 1 << 20,
                        wait_s: float = 0.0) -> PullResult[Stored]:
        """:meth:`claim` with each record as stored (``store.groups.Stored``: a batch record whole, the RPC
        server's form)."""
        return await self.store.groups.claim(self._member(member), group, queue, max_count, max_bytes, wait_s,
                                             WHOLE)

    async def ack(self, group: str, queue: str, member: str, offsets: Sequence[int] = (), *, below: int = 0,
                  ranges: Sequence[tuple[int, int]] = ()) -> int:
        return await self.store.groups.ack(self._member(member), group, queue, offsets, below, ranges)

    async def leave(self, group: str, queue: str, member: str) -> None:
        await self.store.groups.leave(self._member(member), group, queue)

    # --- POP consumption ------------------------------------------------------------------------

    async def pop(self, group: str, queue: str, member: str, max_count: int, *, invisible_s: float,
                  wait_s: float = 0.0, max_attempts: int = MAX_ATTEMPTS, max_bytes: int = 1 << 20,
                  start: str = "latest", at: int = 0) -> list[Popped]:
        entries, handles = await self.store.pops.pop(member, group, queue, max_count, invisible_s, wait_s,
                                                     max_attempts, max_bytes, start, at, DECODED)
        return [Popped(handle, attempt, offset, record)
                for (handle, attempt), (offset, record) in zip(handles, entries, strict=True)]

    async def pop_raw(self, group: str, queue: str, member: str, max_count: int, *, invisible_s: float,
                      wait_s: float = 0.0, max_attempts: int = MAX_ATTEMPTS, max_bytes: int = 1 << 20,
                      start: str = "latest", at: int = 0) -> tuple[list[tuple[int, Stored]], list[tuple[str, int]]]:
        """:meth:`pop` with each record as stored (``store.groups.Stored``: a batch record whole, the RPC server's
        form), and per message, in order, its ``(receipt handle, attempt)``."""
        return await self.store.pops.pop(member, group, queue, max_count, invisible_s, wait_s, max_attempts,
                                         max_bytes, start, at, WHOLE)

    async def pop_ack(self, handles: Sequence[str]) -> list[bool]:
        return await self.store.pops.ack(handles)

    async def change_invisible(self, handle: str, invisible_s: float) -> str | None:
        return await self.store.pops.change_invisible(handle, invisible_s)

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None = None, will_delay_s: int = 0) -> bytes | None:
        return await self.store.sessions.open_session(self.node, client_id, clean_start=clean_start,
                                                      expiry_s=expiry_s, will=will, will_delay_s=will_delay_s)

    async def close_session(self, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        await self.store.sessions.close_session(self.node, client_id, expiry_s=expiry_s, will_delay_s=will_delay_s)

    async def save_session(self, client_id: str, blob: bytes) -> None:
        # A client connected elsewhere or nowhere: only an update of a session the store still keeps.
        only_existing = self.store.leases.where(client_id) != self.node
        if not await self.store.sessions.save_session(client_id, blob, only_existing=only_existing):
            LOGGER.info("session save dropped: the session ended before it was written",
                        extra={"ctx": {"client_id": client_id, "node": self.node}})

    async def patch_session(self, client_id: str, parts: Mapping[str, bytes]) -> None:
        await self.store.sessions.patch_session(client_id, dict(parts))

    async def load_session(self, client_id: str) -> bytes | None:
        return await self.store.sessions.load_session(client_id)

    async def end_session(self, client_id: str) -> bool:
        return await self.store.sessions.end_session(client_id)

    async def sessions(self) -> list[str]:
        return await self.store.sessions.session_ids()

    async def awaiting_release(self, client_id: str) -> dict[int, Position]:
        awaiting = await self.store.sessions.awaiting_release(client_id)
        return {pid: Position(MAIN_LOG, offset) for pid, offset in awaiting.items()}

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        await self.store.sessions.release_awaiting([(flow.client_id, flow.packet_id, offset_in_log(flow.position))
                                                    for flow in flows])

    async def moved(self) -> list[str]:
        return list(await self._attachment.moved.get())

    def reattach(self, client_id: str, *, expiry_s: int, will: NewMessage | None, will_delay_s: int) -> None:
        """This node still has ``client_id`` connected, with that will: it says so again after reconnecting (the
        RPC server's ``Reattach``; ``Leases.reattach``)."""
        self.store.leases.reattach(self.node, client_id, expiry_s=expiry_s, will=will, will_delay_s=will_delay_s)

    async def wait_available(self) -> None:
        await trio.lowlevel.checkpoint()  # the store is in this process: always

    # --- administration across nodes -------------------------------------------------------

    async def admin_call(self, client_id: str, op: AdminOp) -> bytes | None:
        store = self.store
        return await admin_call(store.attached, store.leases.where(client_id), self.node, client_id, op)

    async def admin_call_all(self, op: AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        store = self.store
        return await admin_call_all(store.attached, store.leases.nodes_with_clients(), self.node, op, query)

    async def admin_asks(self) -> tuple[int, str, AdminOp, bytes]:
        return await self._attachment.asks.receive()

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        self._attachment.answer(ask_id, value)
