"""The store node: one CommitLog, one RocksDB index, one dispatcher, and what they do for the attached nodes.

``open_store`` wires the parts in the order their ownership requires (the
CommitLog outlives the dispatcher that reads it; the database outlives the
light queues) and tears them down in reverse, flushing each, so a clean
shutdown leaves nothing to recover or re-dispatch. ``lightgate store`` serves it over the RPC
(gateway/app/store_node.py); ``lightgate serve`` embeds it (gateway/app/embedded.py).

Messages become records here, and only here (``StoreNode._encode``): the store's one encoder.

The node keeps the gateway's persistent session state as opaque blobs in the
column family ``sessions``: the store knows nothing of MQTT, it only makes the
blobs durable. It owns the sessions' lifecycle all the same (store/leases.py):
where each client is connected, its will, its expiry, and ending a session
(blob, offsets, held filters, QoS 2 flows, shared subscriptions); the client
ledger (store/ledger.py, column family ``clients``) keeps that lifecycle across
restarts, re-armed by ``open_store`` before anyone is served. The one piece
of session state it derives itself is which inbound QoS 2 flows await PUBREL
(``awaiting``, store/awaiting.py): from the packet ids the records carry, so
that "stored" and "awaits PUBREL" are one durable fact.

Nodes attach to it (``attach``): the embedded gateway as ``"local"``, each RPC
connection under its node's name. After each dispatch batch the node routes
``{queue: max offset}`` through its ``NotifyRouter`` to the mailbox of every
attached node with a session on the queue; it also tells a node which of its
clients moved away, and forwards admin calls about a client to the node it is
connected to.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from itertools import count
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Sequence, final

import rocksdict
import trio

from lightqueue.queues import LightQueues, PullResult
from notify import EventMailbox, NotifyRouter
from retain.store import RetainedStore
from store.api import AdminOp, DelayedCapExceeded, Flow, LogSpan, NewMessage, StoreStatistics, TimerStatistics
from store.awaiting import AwaitingRelease
from store.control import Control, Delayed, encode_all, encode_control
from store.dispatch import MAX_LAG, Dispatcher, Listener
from store.groups import GroupCoordinator
from store.leases import LEASE_S, Leases
from store.ledger import ClientEntry, ClientLedger
from store.log.aio import AsyncCommitLog, LatencyBuckets
from store.log.commitlog import CommitLogConfig
from store.log.errors import FULL_ERRNOS, LogFullError, StartupError
from store.log.recent import RecentRecords
from store.log.record import Record, decode_record, new_record, now_ms
from store.rocks import open_db, open_family
from store.space import DiskSpace
from store.tasks import background
from store.timer.applier import WINDOW_S, TimerApplier
from store.timer.dequeue import Dequeue
from store.usage import process_usage

LOGGER = logging.getLogger(__name__)

__all__ = ["ADMIN_TIMEOUT_S", "Attachment", "SESSIONS_FAMILY", "SessionExpiry", "SessionFixer", "StoreNode", "decode",
           "open_store", "raw"]

SESSIONS_FAMILY = "sessions"
"""Its own column family: the light queues own every key of the default family, and session
blobs are written with the WAL (they have no other source), unlike the index batches."""


@final
class Attachment:
    """What the store routes to one attached node: its events, its clients that moved away, admin asks.

    Resource handling: :meth:`close` ends the node's ``events`` and ``moved`` (``trio.EndOfChannel``) and fails
    the asks it has not answered.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.events = EventMailbox()
        self.moved = EventMailbox()  # {client id: 0}: clients not this node's any more
        self._asks_in, self.asks = trio.open_memory_channel[tuple[int, str, AdminOp, bytes]](math.inf)
        self._pending: dict[int, _Ask] = {}  # asks sent to this node, by id
        self._ask_ids = count(1)

    def close(self) -> None:
        self.events.close()
        self.moved.close()
        self._asks_in.close()
        for ask in self._pending.values():
            ask.value = OSError(f"the gateway node {self.name} went away before answering")
            ask.done.set()

    async def ask(self, client_id: str, op: AdminOp, query: bytes = b"") -> bytes | None:
        """Ask this node to run admin ``op`` about its client ``client_id`` (or list op ``op`` with ``query``) and
        wait for its answer.

        Raises:
            OSError: the node did not answer within ``ADMIN_TIMEOUT_S``, or went away.
        """
        ask_id = next(self._ask_ids)
        ask = self._pending[ask_id] = _Ask()
        try:
            try:
                self._asks_in.send_nowait((ask_id, client_id, op, query))
            except trio.ClosedResourceError:
                raise OSError(f"the gateway node {self.name} went away") from None
            with trio.move_on_after(ADMIN_TIMEOUT_S):
                await ask.done.wait()
        finally:
            del self._pending[ask_id]
        if not ask.done.is_set():
            raise OSError(f"the gateway node {self.name} did not answer within {ADMIN_TIMEOUT_S} s")
        if isinstance(ask.value, OSError):
            raise ask.value
        return ask.value

    def answer(self, ask_id: int, value: bytes | None) -> None:
        """The node's answer to ask ``ask_id`` (dropped if it came too late)."""
        ask = self._pending.get(ask_id)
        if ask is not None:
            ask.value = value
            ask.done.set()


@final
class _Ask:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: bytes | None | OSError = None


ADMIN_TIMEOUT_S = 20.0
"""How long an admin call waits for the answer of the node a client is connected to (a disconnect waits up to
15 s for the client's connection to close)."""


@final
class StoreNode:
    """The parts of a running store node, and what they do together for the nodes attached to it.

    ``log`` appends and reads, ``queues`` activates filters and pulls, ``dispatcher`` indexes new records and
    says when they are indexed, ``leases`` keeps the attached nodes' leases and their clients' presence, wills
    and expiry (store/leases.py), ``groups`` arbitrates consumer groups and shared subscriptions
    (store/groups.py). ``store.local.LocalStore`` is the ``StoreApi`` over it.
    """

    def __init__(self, data: Path, log: AsyncCommitLog, queues: LightQueues, dispatcher: Dispatcher,
                 sessions: rocksdict.Rdict, retained: RetainedStore, recent: RecentRecords, space: DiskSpace,
                 awaiting: AwaitingRelease, ledger: ClientLedger, nursery: trio.Nursery, lease_s: float,
                 timers: TimerApplier) -> None:
        self.data = data
        self.log = log
        self.queues = queues
        self.dispatcher = dispatcher
        self.sessions = sessions  # the SESSIONS_FAMILY column family: client id (UTF-8) -> session blob
        self._session_lock = threading.Lock()  # saves and drops run in worker threads
        self.retained = retained  # kept up to date by the dispatcher; looked up at subscribe time
        self.recent = recent  # the last appended records, decoded: dispatch and pulls at the head read them here
        self.space = space  # free space on the data disk: appends and RocksDB writes are refused while it is short
        self.awaiting = awaiting  # inbound QoS 2 flows awaiting PUBREL, kept up to date by the dispatcher
        self.timers = timers  # delayed messages pending (store/timer/), kept up to date by the dispatcher
        self.timer_max_pending = 0  # delayed messages a client may have pending (0: no cap)
        self.timer_lateness: LatencyBuckets | None = None  # the dequeue step's (open_store sets it)
        self.router = NotifyRouter()
        self.attached: dict[str, Attachment] = {}  # attached node -> what is routed to it
        self.leases = Leases(nursery, lease_s, append=self.append, end_session=self._end_session,
                             on_moved=self._moved, ledger=ledger)
        self.groups = GroupCoordinator(self, self._poke)

    @property
    def disk_full(self) -> bool:
        """Whether new messages are refused because the data disk is full."""
        return self.space.full

    # --- attached nodes ---------------------------------------------------------------------

    def attach(self, name: str) -> Attachment:
        """Start routing to node ``name`` (its ``watch``es say which queues it reads).

        Raises:
            ValueError: a node of that name is attached already.
        """
        if name in self.attached:
            raise ValueError(f"a gateway node named {name!r} is attached already")
        attachment = self.attached[name] = Attachment(name)
        return attachment

    def detach(self, name: str) -> None:
        """Stop routing to ``name``: forget its registrations, close its mailboxes, and its group members leave
        (idempotent). Its lease and clients are the leases' business (they outlive a connection)."""
        attachment = self.attached.pop(name, None)
        if attachment is not None:
            attachment.close()
        self.router.drop_node(name)
        self.groups.leave_node(name)

    def route(self, events: Mapping[str, int]) -> None:
        """The dispatcher's listener (trio thread): post each attached node the events of its queues, and wake
        the group claims waiting on them."""
        for name, mine in self.router.route(events).items():
            attachment = self.attached.get(name)
            if attachment is not None:
                attachment.events.post(mine)
        self.groups.wake(events)

    def _poke(self, queue: str) -> None:
        """Offsets of ``queue`` were handed back to a group: the nodes with sessions on it pull."""
        self.route({queue: self.queues.max_offset(queue)})

    def _moved(self, node: str, client_id: str) -> None:
        attachment = self.attached.get(node)
        if attachment is not None:
            attachment.moved.post({client_id: 0})

    async def admin_call(self, node: str, client_id: str, op: AdminOp) -> bytes | None:
        """Run admin ``op`` on the node ``client_id`` is connected to, for ``node``'s admin API; None when it is
        present on no other attached node (``node`` answers from what it has).

        Raises:
            OSError: that node did not answer in time, or went away.
        """
        owner = self.leases.where(client_id)
        attachment = self.attached.get(owner) if owner is not None and owner != node else None
        if attachment is None:
            await trio.lowlevel.checkpoint()
            return None
        return await attachment.ask(client_id, op)

    async def admin_call_all(self, node: str, op: AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Run list ``op`` at once on every other attached node that has clients, for ``node``'s admin API:
        (the answers by node name, the nodes that did not answer in time or went away)."""
        answers: dict[str, bytes] = {}
        missing: list[str] = []

        async def ask(name: str, attachment: Attachment) -> None:
            try:
                answer = await attachment.ask("", op, query)
            except OSError:
                missing.append(name)
                return
            if answer is not None:
                answers[name] = answer

        async with trio.open_nursery() as nursery:
            for name in sorted(self.leases.nodes_with_clients() - {node}):
                attachment = self.attached.get(name)
                if attachment is not None:
                    nursery.start_soon(ask, name, attachment)
        return answers, sorted(missing)

    # --- appends ----------------------------------------------------------------------------

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None) -> list[int]:
        """Append messages in one CommitLog write with their target queues fixed now, and wake the dispatcher.

        Returns their CommitLog offsets once appended (and durable, if ``durable`` or the flush policy is sync).

        Raises:
            ValueError: a message does not encode (``RecordTooLarge`` included); nothing was appended.
            OSError: the write failed (``LogFullError``: the disk is full); nothing was appended.
        """
        (result,) = await self.append_groups([messages], durable=durable)
        if isinstance(result, ValueError):
            raise result
        return result

    async def append_groups(
        self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None
    ) -> list[list[int] | ValueError]:
        """Append the messages of several callers in one CommitLog write: the RPC server's batches.

        Returns, per group, its offsets, or the ``ValueError`` (``RecordTooLarge``
        included) that one of its messages raised when encoded: such a group is
        not appended at all and its neighbours are (the all-or-nothing of
        :meth:`append`, per caller). Waits first while dispatch lags (``Dispatcher.wait_lag``).

        Raises:
            OSError: the write failed; no group was appended.
        """
        if self.timer_max_pending and any(m.deliver_at_ms for group in groups for m in group):
            await self.dispatcher.wait_dispatched(self.log.log.written_offset)  # the cap counts every append before
        now = now_ms()
        encoded: list[list[tuple[bytes, Record]] | ValueError] = []
        for messages in groups:
            try:
                encoded.append(self._encode(messages, now))
            except ValueError as exc:
                encoded.append(exc)
        made = [pair for group in encoded if not isinstance(group, ValueError) for pair in group]
        await self.dispatcher.wait_lag()
        offsets = await self._write([raw for raw, _ in made], durable) if made else []
        self._appended(made, offsets)
        results: list[list[int] | ValueError] = []
        start = 0
        for group in encoded:
            if isinstance(group, ValueError):
                results.append(group)
            else:
                results.append(offsets[start : start + len(group)])
                start += len(group)
        return results

    def append_nowait(self, messages: Sequence[NewMessage]) -> list[int]:
        """:meth:`append` (not durable) before returning, when nothing needs waiting for.

        Under the async flush policy an append is a copy into the page cache;
        doing it in the caller's step saves a gateway connection a task switch
        per publish.

        Raises:
            trio.WouldBlock: it must wait: the sync policy (the fsync), or dispatch lags (``Dispatcher.wait_lag``);
                nothing was appended.
            ValueError: a message does not encode (``RecordTooLarge`` included); nothing was appended.
            OSError: the write failed; nothing was appended.
        """
        if self.log.log.config.flush == "sync" or self.dispatcher.lag > MAX_LAG or \
                any(m.deliver_at_ms for m in messages):  # a delayed one: its client's cap counts what dispatch applied
            raise trio.WouldBlock
        now = now_ms()
        made = self._encode(messages, now)
        self.space.check(recent_ok=True)
        try:
            offsets = self.log.log.append_stamped([raw for raw, _ in made], now)
        except LogFullError as exc:
            self.space.refused(exc)
            raise
        self.space.cleared()
        self._appended(made, offsets)
        return offsets

    async def append_control(self, controls: Sequence[Control], *, durable: bool | None = None,
                             messages: Sequence[NewMessage] = ()) -> int:
        """Append control records (store/control.py) in one CommitLog write and return once dispatch has applied
        them: what they say is then both stored (as the flush policy, or ``durable``, promises) and readable.
        ``messages`` go first in the same write (the timer's fired messages with the record that ends them).

        Returns:
            the CommitLog offset just past the last of them.

        Raises:
            ValueError: one does not encode (``RecordTooLarge``: a session blob over the record limit).
            OSError: the write failed (``LogFullError``: the disk is full); nothing was appended.
        """
        now = now_ms()
        made = self._encode(messages, now) + encode_all(controls, now, self.log.log.config.max_record_bytes)
        offsets = await self._write([raw for raw, _ in made], durable)
        self._appended(made, offsets)
        end = offsets[-1] + made[-1][1].size
        await self.dispatcher.wait_dispatched(end)
        return end

    async def _write(self, records: list[bytes], durable: bool | None) -> list[int]:
        """Append ``records`` unless the disk is short of space; either way the full-disk state follows.

        Raises:
            LogFullError: the disk is full (logged once per episode by ``space``).
        """
        self.space.check(recent_ok=True)
        try:
            offsets = await self.log.append_batch(records, durable=durable)
        except LogFullError as exc:
            self.space.refused(exc)
            raise
        self.space.cleared()
        return offsets

    def _encode(self, messages: Sequence[NewMessage], now: int) -> list[tuple[bytes, Record]]:
        """The records of ``messages`` with their target queues fixed now (raises ValueError as ``new_record``):
        the one place messages become records. A delayed message (``deliver_at_ms``) becomes a ``Delayed``
        control record, which the timer keeps until it is due (store/timer/)."""
        max_size = self.log.log.config.max_record_bytes
        targets = self.queues.targets
        if self.timer_max_pending:
            self._check_delayed_cap(messages)
        return [encode_control(Delayed(m.client_id, m.topic, m.deliver_at_ms, m.payload, m.qos, m.retain, m.properties,
                                       m.born_ms or now), now, max_size, m.packet_id) if m.deliver_at_ms else
                new_record(m.topic, m.payload, now, m.client_id, m.qos, m.retain, m.properties, targets(m.topic),
                           m.born_ms or None, max_size, m.packet_id) for m in messages]

    def _check_delayed_cap(self, messages: Sequence[NewMessage]) -> None:
        """Raises DelayedCapExceeded when a client of ``messages`` would pass ``timer_max_pending``, counted from
        what dispatch applied (:meth:`append_groups` waits for it first; appends of the same client in flight at
        the same moment may pass it by their number)."""
        added: dict[str, int] = {}
        for m in messages:
            if m.deliver_at_ms:
                added[m.client_id] = added.get(m.client_id, 0) + 1
                if self.timers.pending_of(m.client_id) + added[m.client_id] > self.timer_max_pending:
                    raise DelayedCapExceeded(f"client {m.client_id!r} has {self.timer_max_pending} delayed messages "
                                             "pending already")

    def _appended(self, made: list[tuple[bytes, Record]], offsets: list[int]) -> None:
        """Keep the appended records in memory with their offsets, and wake dispatch."""
        records = []
        for (_, record), offset in zip(made, offsets):
            record.offset = offset
            records.append(record)
        self.recent.add(records)
        self.dispatcher.wake()

    # --- reads ------------------------------------------------------------------------------

    def read(self, queue: str, from_offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> PullResult[Record]:
        """Messages of a queue from a queue offset: an index scan, then the records kept in ``recent``, the rest
        read from the CommitLog (blocking: keep it out of the trio thread unless it is small)."""
        return self.queues.pull(queue, from_offset, max_count, max_bytes, self.log.log, decode, self.recent.get)

    def read_raw(self, queue: str, from_offset: int, max_count: int, max_bytes: int) -> PullResult[tuple[int, bytes]]:
        """:meth:`read` with each record as ``(log offset, bytes as stored)``, undecoded (the RPC sends them so;
        its clients decode: the store's CPU is the one every gateway shares). Blocking."""
        return self.queues.pull(queue, from_offset, max_count, max_bytes, self.log.log, raw)

    def in_memory(self, queue: str, from_offset: int) -> bool:
        """Whether a read of ``queue`` from ``from_offset`` finds its records in ``recent`` (an index lookup):
        such a read costs Python time only, which a worker thread would not take off the event loop."""
        oldest = self.recent.oldest
        if oldest is None:
            return False
        log_offset = self.queues.log_offset(queue, from_offset)
        return log_offset is not None and log_offset >= oldest

    def read_log(self, offset: int, max_bytes: int) -> LogSpan:
        """``StoreApi.read_log`` (blocking): ``max_bytes`` 0 asks for the log's bounds only, for any ``offset``.
        Its ``flushed`` bound is the log's published offset: flushed and confirmed by the replicas."""
        log = self.log.log
        if max_bytes <= 0:
            return LogSpan(offset, b"", offset, log.published_offset, log.min_offset)
        start, data, data_end = log.read_span(offset, max(0, min(max_bytes, MAX_READ_LOG_BYTES)))
        return LogSpan(start, data, data_end, log.published_offset, log.min_offset)

    def statistics(self) -> StoreStatistics:
        """The store's current figures."""
        log = self.log.log
        queues = self.queues.statistics()
        stats = log.statistics()
        notify = self.router.statistics()
        return StoreStatistics(
            written_offset=stats.written_offset,
            flushed_offset=stats.flushed_offset,
            dispatched_offset=self.dispatcher.dispatched_offset,
            log_bytes=stats.written_offset - stats.min_offset,
            queue_ids=queues.next_queue_id,
            active_filters=queues.active_filters,
            retained=self.retained.count,
            notify_sent=sum(notify.sent.values()),
            notify_suppressed=notify.suppressed,
            notify_by_node=dict(notify.sent),
            corrupt_records=stats.corrupt_records,
            disk_full=self.disk_full,
            process=process_usage(),
            timers=self._timer_statistics(),
        )

    def _timer_statistics(self) -> TimerStatistics:
        timers = self.timers
        late = self.timer_lateness
        return TimerStatistics(timers.pending, timers.scheduled, timers.fired, timers.rolled,
                               late.bounds if late else (), list(late.counts) if late else [0],
                               late.sum_s if late else 0.0)

    # --- subscriptions and offsets ----------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        self.space.check()  # RocksDB writes (WAL) must not meet a full disk: store/space.py
        return await self.dispatcher.activate(queue, holder)

    async def release(self, queue: str, holder: str) -> bool:
        self.space.check()
        return await self.dispatcher.release(queue, holder)

    def commit_offsets(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        """(blocking) ``{owner: {queue: next offset}}`` in one durable write each; offsets never move back."""
        self.space.check()
        commit = self.queues.commit_offsets
        for owner, offsets in commits.items():
            commit(owner, offsets)

    # --- sessions ---------------------------------------------------------------------------

    async def open_session(self, node: str, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None, will_delay_s: int) -> bytes | None:
        """``StoreApi.open_session`` for ``node``: place the client there, then its stored session (None: new).

        Raises:
            LogFullError: a clean start meets a full data disk (nothing was deleted).
        """
        due = self.leases.open(node, client_id, expiry_s=expiry_s, will=will, will_delay_s=will_delay_s,
                               clean_start=clean_start)
        if due is not None:  # the old session's delayed will, due as the clean start ends its session
            await self._publish_due(client_id, due)
        blob = None if clean_start else await trio.to_thread.run_sync(self.load_session, client_id)
        if blob is None:  # whatever a session that is gone left (offsets, QoS 2 flows) goes, or the clean start's
            await self._end_session(client_id)
        return blob

    async def close_session(self, node: str, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        """``StoreApi.close_session`` for ``node``: ignored once the client is present elsewhere."""
        if self.leases.close(node, client_id, expiry_s=expiry_s, will_delay_s=will_delay_s) and not expiry_s:
            try:
                await self._end_session(client_id)
            except LogFullError:  # the client is not present any more: a retried close would find nothing to end
                self.leases.end_when_room(client_id)
            else:
                self.leases.session_ended(client_id)

    async def end_session(self, client_id: str) -> bool:
        """``StoreApi.end_session``: an operator ends a session now; False when there was none."""
        due = self.leases.ended(client_id)
        if due is not None:
            await self._publish_due(client_id, due)
        return await self._end_session(client_id) or due is not None

    async def _publish_due(self, client_id: str, will: NewMessage) -> None:
        try:
            await self.append([will])
        except (OSError, ValueError) as exc:  # a full disk included: the session's end must not wait for room
            LOGGER.error("will not published: %r", exc, extra={"ctx": {"client_id": client_id}})
        else:
            LOGGER.info("will published: its session ended", extra={"ctx": {"client_id": client_id}})

    async def _end_session(self, client_id: str) -> bool:
        """Forget a session: its blob first (on a full disk it stays whole: ``LogFullError``), its inbound QoS 2
        flows, its shared subscriptions, its offsets and held filters. True if anything of it was stored."""
        existed = await trio.to_thread.run_sync(self.drop_session, client_id)
        existed = await self.drop_awaiting(client_id) or existed
        await self.groups.drop_subscriber(client_id)
        return await trio.to_thread.run_sync(self._delete_owner, client_id) or existed

    def _delete_owner(self, owner: str) -> bool:
        queues = self.queues
        if not (queues.held_by(owner) or queues.get_offsets(owner)):  # nothing to delete, nothing to write
            return False
        self.space.check()
        queues.delete_owner(owner)
        return True

    def save_session(self, client_id: str, blob: bytes, *, only_existing: bool = False) -> bool:
        """Keep a session blob durably (WAL write): it must survive a process crash as written, and under the
        ``sync`` flush policy a power loss too (fsynced): a QoS 2 subscriber's PUBREL waits for it.

        ``only_existing``: write only over a blob kept now (the save of a client no longer connected, which a
        full disk delayed, must not bring back a session that ended meanwhile). False when nothing was written.

        Raises:
            LogFullError: the data disk is short of space (RocksDB is not asked: ``store.space``).
        """
        key = client_id.encode()
        with self._session_lock:  # an end between the check and the write would be undone by it
            if only_existing and self.sessions.get(key) is None:
                return False
            self.space.check()
            self.sessions.put(key, blob, self._session_writes())
        return True

    def load_session(self, client_id: str) -> bytes | None:
        """The blob last saved for ``client_id``, or None."""
        return self.sessions.get(client_id.encode())

    def session_ids(self) -> list[str]:
        """The client ids of the stored session blobs (blocking: a scan of the family)."""
        return [key.decode() for key in self.sessions.keys()]

    def drop_session(self, client_id: str) -> bool:
        """Forget the blob of ``client_id``; False if there was none (clean-start connects write nothing).

        Raises LogFullError as :meth:`save_session`.
        """
        key = client_id.encode()
        with self._session_lock:
            if self.sessions.get(key) is None:
                return False
            self.space.check()
            self.sessions.delete(key, self._session_writes())
        return True

    def _session_writes(self) -> rocksdict.WriteOptions:
        return _SYNCED if self.log.log.config.flush == "sync" else _WAL

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        """``{packet id: CommitLog offset}`` of the client's inbound QoS 2 messages stored and not released,
        once dispatch has passed everything appended before the call."""
        await self.dispatcher.wait_dispatched(self.log.log.written_offset)
        return self.awaiting.awaiting(client_id)

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """Mark inbound QoS 2 flows released, durably (fsynced), in one write: their PUBCOMPs may go out.

        Raises LogFullError as :meth:`save_session`.
        """
        self.space.check()
        await trio.to_thread.run_sync(self.awaiting.release, flows)

    async def drop_awaiting(self, client_id: str) -> bool:
        """Forget the client's inbound QoS 2 flows (its session ended), the ones being dispatched included;
        False if it had none."""
        await self.dispatcher.wait_dispatched(self.log.log.written_offset)
        if not self.awaiting.awaiting(client_id):  # most clients (every clean start) have none: no thread, no write
            return False
        self.space.check()
        await trio.to_thread.run_sync(self.awaiting.drop, client_id)
        return True


MAX_READ_LOG_BYTES = 16 * 1024 * 1024
"""A ``read_log`` returns at most this much, so an RPC answer stays far below the frame limit."""


_WAL = rocksdict.WriteOptions()  # session blobs have no other source: write them through the WAL
_SYNCED = rocksdict.WriteOptions()
_SYNCED.sync = True  # ... and under the sync flush policy fsync it


def decode(raw: bytes, offset: int) -> Record:
    """A record as stored (``LightQueues.pull``'s ``decode``), at its CommitLog offset."""
    return decode_record(raw, 0, offset)


def raw(data: bytes, offset: int) -> tuple[int, bytes]:
    """A record left as stored, with its CommitLog offset (``LightQueues.pull``'s ``decode`` for the RPC)."""
    return offset, data


SessionFixer = Callable[[bytes, Callable[[str], int]], "bytes | None"]
"""``fix(blob, max_offset)``: the session blob with its queue positions pulled back to ``max_offset(queue)``, or
None when none is past it. Given by the layer that owns the blob format (gateway/mqtt/session.py)."""

SessionExpiry = Callable[[bytes], int]
"""``expiry_of(blob)``: the Session Expiry Interval a session blob was saved with (0: unreadable). Given by the layer
that owns the blob format (gateway/mqtt/session.py)."""


@asynccontextmanager
async def open_store(
    data: Path, config: CommitLogConfig, listener: Listener | None = None, tier: Mapping[str, Any] | None = None, *,
    fix_session: SessionFixer | None = None, session_expiry: SessionExpiry | None = None, lease_s: float = LEASE_S,
    timer_window_s: int = WINDOW_S, timer_max_pending: int = 0
) -> AsyncIterator[StoreNode]:
    """Open the CommitLog and the index under ``data``, run flushing, retention and dispatch.

    ``listener``, if given, hears every dispatch batch's events too (after they are routed).
    ``tier``: the flat settings; when ``tier.uri`` is set, the Parquet tier converter of sealed segments runs too
    (store/tier.py; imported only then, as it loads pyarrow).
    ``fix_session``: after a power loss cost the log records that positions in RocksDB point past
    (``Dispatcher.recover``), every session blob is passed through it before anyone consumes.
    ``session_expiry``: a session blob the client ledger has no entry for (kept before the ledger existed, or an
    entry a power loss took) is asked its expiry and counts as closed at this start (store/ledger.py); None: such a
    session never expires until its client connects again.
    ``lease_s``: how long a cluster gateway's lease outlives its last frame (store/leases.py).
    ``timer_window_s``: the slots of the timer wheel (store/timer/): delayed messages due further out roll.
    ``timer_max_pending``: delayed messages a client may have pending (``DelayedCapExceeded``); 0: no cap.

    Resource handling: everything opened here is closed here, in reverse order,
    when the block exits (the index memtable and the CommitLog are flushed).
    """
    data.mkdir(parents=True, exist_ok=True)
    async with AsyncExitStack() as opened:
        try:
            alog = await opened.enter_async_context(AsyncCommitLog.open(data / "commitlog", config))
            db = await trio.to_thread.run_sync(open_db, data / "index")
        except Exception as exc:  # rocksdict raises plain Exceptions ("IO error: ...", "Corruption: ...")
            raise _startup_error(data, exc) from exc
        try:
            try:  # RocksDB opens a table whose blocks are damaged, and fails on the first read of one
                queues = LightQueues(db)
                retained = RetainedStore(db)
            except Exception as exc:
                raise _startup_error(data, exc) from exc
            nodes: list[StoreNode] = []

            def on_dispatched(events: dict[str, int]) -> None:
                nodes[0].route(events)
                if listener is not None:
                    listener(events)

            recent = RecentRecords()
            space = DiskSpace(data)
            awaiting = AwaitingRelease(db)
            delayed = TimerApplier(data / "timer", timer_window_s)
            opened.callback(delayed.close)
            alog.log.add_retention_guard(delayed.may_delete)
            dispatcher = Dispatcher(alog.log, queues, on_dispatched, retained=retained, recent=recent,
                                    awaiting=awaiting, room=space.has_room, appliers=[delayed])
            sessions = open_family(db, SESSIONS_FAMILY)
            ledger = ClientLedger(db)
            try:
                await trio.to_thread.run_sync(_recover, dispatcher, queues, sessions, fix_session)
                clients = await trio.to_thread.run_sync(ledger.entries)
                if session_expiry is not None:
                    clients |= await trio.to_thread.run_sync(_unrecorded, sessions, ledger, clients, session_expiry)
            except Exception as exc:
                raise _startup_error(data, exc) from exc
            try:
                async with trio.open_nursery() as timers:  # leases, wills, session expiry: they end with the node
                    node = StoreNode(data, alog, queues, dispatcher, sessions, retained, recent, space, awaiting,
                                     ledger, timers, lease_s, delayed)
                    nodes.append(node)
                    node.timer_max_pending = timer_max_pending
                    node.leases.restore(clients)  # expiries and wills pending when the store stopped
                    dequeue = Dequeue(delayed, alog.log, partial(_append_fired, node))
                    node.timer_lateness = dequeue.lateness
                    async with background(dispatcher.run), background(partial(_watch_space, space)), \
                            background(dequeue.run):
                        if tier is not None and tier.get("tier.uri"):
                            try:
                                from store.tier import TierConfig, TierConverter, run_tier
                            except ImportError as exc:  # the base install has no pyarrow
                                raise StartupError(f"cannot start: tier.uri is set, and the tier needs the tier "
                                                   f"extra (pip install 'lightgate[tier]'): {exc}") from exc

                            converter = TierConverter(alog.log, TierConfig.from_settings(tier))
                            async with background(partial(run_tier, converter)):
                                yield node
                        else:
                            yield node
                    timers.cancel_scope.cancel()
            finally:
                for node in nodes:
                    for name in tuple(node.attached):
                        node.detach(name)
                with trio.CancelScope(shield=True):  # a cancelled node (SIGTERM) still shuts down cleanly
                    await trio.to_thread.run_sync(dispatcher.close)
                sessions.close()  # a family handle keeps the database open
                ledger.close()
                retained.close()
                awaiting.close()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(db.close)


async def _append_fired(node: StoreNode, controls: Sequence[Control], messages: Sequence[NewMessage]) -> int:
    return await node.append_control(controls, messages=messages)


SPACE_PROBE_S = 1.0
"""While the disk is full, its free space is looked at this often, so that the end of the episode is logged (and
the metric cleared) even when no client tries to publish."""


async def _watch_space(space: DiskSpace, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        await trio.sleep(SPACE_PROBE_S)
        if space.full:
            space.has_room()


def _recover(dispatcher: Dispatcher, queues: LightQueues, sessions: rocksdict.Rdict,
             fix_session: SessionFixer | None) -> None:
    """Before anyone consumes: index the whole log and pull back every position past its end (sessions
    included), so that nothing appended from now on is skipped; one WARNING line says what moved."""
    found = dispatcher.recover()
    if not found:
        return
    if fix_session is not None:
        fixed = 0
        for key, blob in sessions.items():
            new = fix_session(blob, queues.max_offset)
            if new is not None:
                sessions.put(key, new, _WAL)
                fixed += 1
        found["sessions"] = fixed
    LOGGER.warning("positions past the end of the recovered CommitLog were pulled back to it (records lost in a"
                   " power loss or OS crash under the async flush policy); nothing appended from now on is skipped",
                   extra={"ctx": found})


def _unrecorded(sessions: rocksdict.Rdict, ledger: ClientLedger, known: Mapping[str, ClientEntry],
                expiry_of: SessionExpiry) -> dict[str, ClientEntry]:
    """The session blobs without a ledger entry, each written as closed now with the expiry it was saved with:
    their clients' closes were never recorded, and now is the earliest time the store can vouch for (blocking)."""
    found = {}
    closed_ms = now_ms()
    for key in sessions.keys():  # the keys alone: after the first start almost every one has its entry
        client_id = key.decode()
        if client_id in known:
            continue
        expiry_s = expiry_of(sessions[key])
        if expiry_s:  # 0: unreadable (resuming it reports that); a blob is never saved with expiry 0
            found[client_id] = entry = ClientEntry("", expiry_s, closed_ms=closed_ms)
            ledger.put(client_id, entry)
    if found:
        LOGGER.info("stored sessions without a client ledger entry expire from this start",
                    extra={"ctx": {"sessions": len(found)}})
    return found


def _startup_error(data: Path, exc: Exception) -> Exception:
    """The one line an operator needs when the store cannot open its data (``StartupError``), or ``exc`` itself
    when it is something else (a bug, a locked directory: its own message says so)."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS) or "No space left" in text:
        return StartupError(f"cannot start: the data disk under {data} is full ({text}); free space there "
                            "(nothing stored is lost) and start again")
    if not isinstance(exc, OSError) and any(word in text for word in ("Corruption", "CURRENT", "MANIFEST")):
        return StartupError(f"cannot start: the index database {data / 'index'} is damaged ({text}); stop every "
                            f"process using {data}, run `lightgate repair --data {data}` and start again "
                            "(docs/storage.md, \"Repair\")")
    return exc
