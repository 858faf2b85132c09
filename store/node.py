"""The store node: one CommitLog, one RocksDB index, one dispatcher, and what they do for the attached nodes.

``open_store`` wires the parts in the order their ownership requires (the
CommitLog outlives the dispatcher that reads it; the database outlives the
light queues) and tears them down in reverse, flushing each, so a clean
shutdown leaves nothing to recover or re-dispatch. ``lightgate store`` serves it over the RPC
(gateway/app/store_node.py); ``lightgate serve`` embeds it (gateway/app/embedded.py).

Messages become records here, and only here (``StoreNode._encode``): the store's one encoder.

The client-keyed part (session blobs, presence, wills, expiry, inbound QoS 2 flows) is ``StoreNode.sessions``
(store/sessions.py); its state is derived from control records (store/control.py) that dispatch applies, like
the light queues' index. At its first start over data written before control records existed, ``open_store``
restates the session blobs, client ledger and QoS 2 releases found there as control records, once.

Nodes attach to it (``attach``): the embedded gateway as ``"local"``, each RPC
connection under its node's name. After each dispatch batch the node routes
``{queue: max offset}`` through its ``NotifyRouter`` to the mailbox of every
attached node with a session on the queue; it also tells a node which of its
clients moved away (store/attached.py, where admin calls about a client are forwarded to the node it is
connected to).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Sequence, final

import trio

from lightqueue.queues import LightQueues, PullResult
from notify import NotifyRouter
from retain.store import RetainedStore
from store.api import (MAIN_LOG, DelayedCapExceeded, LogSpan, MessageChain, NewMessage, PayloadRun, StoreStatistics,
                       TimerStatistics, any_delayed, batch_room, batchable)
from store.attached import Attachment
from store.awaiting import AwaitingRelease
from store.control import (ClientClosed, Committed, Control, Delayed, Released, SessionSaved, activated_runs,
                           encode_all, encode_control)
from store.dispatch import MAX_LAG, SCAN_BYTES, Dispatcher, Listener
from store.groups import GroupCoordinator, Stored, messages_of, served, stored
from store.leases import LEASE_S
from store.ledger import ClientLedger
from store.log.aio import AsyncCommitLog, LatencyBuckets
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.errors import FULL_ERRNOS, LogFullError, StartupError
from store.log.recent import RecentRecords
from store.log.record import (FLAG_BATCH, Record, RecordTooLarge, decode_record, fit_batches, new_batch, new_batch_of,
                              new_record, now_ms)
from store.pop.applier import PopApplier
from store.pop.pops import PopCoordinator
from store.queuecontrol import QueueControls
from store.rocks import open_db
from store.sessions import SessionBlobs, Sessions
from store.space import DiskSpace
from store.tasks import background
from store.timer.applier import WINDOW_S, TimerApplier
from store.timer.dequeue import Dequeue
from store.timer.pending import PendingDelayed
from store.usage import process_usage

if TYPE_CHECKING:
    from store.replica.leader import Replication

LOGGER = logging.getLogger(__name__)

__all__ = ["SessionExpiry", "SessionFixer", "StoreNode", "decode", "log_span", "open_follower", "open_store", "raw"]


@final
class StoreNode:
    """The parts of a running store node, and what they do together for the nodes attached to it.

    ``log`` appends and reads, ``queues`` activates filters and pulls, ``dispatcher`` indexes new records and
    says when they are indexed, ``leases`` keeps the attached nodes' leases and their clients' presence, wills
    and expiry (store/leases.py), ``groups`` arbitrates consumer groups and shared subscriptions
    (store/groups.py), ``pops`` serves POP consumption (store/pop/). ``store.local.LocalStore`` is the ``StoreApi``
    over it.
    """

    def __init__(self, data: Path, log: AsyncCommitLog, queues: LightQueues, dispatcher: Dispatcher,
                 blobs: SessionBlobs, retained: RetainedStore, recent: RecentRecords, space: DiskSpace,
                 awaiting: AwaitingRelease, nursery: trio.Nursery, lease_s: float, timers: TimerApplier,
                 pops: PopApplier) -> None:
        self.data = data
        self.log = log
        self.queues = queues
        self.dispatcher = dispatcher
        self.retained = retained  # kept up to date by the dispatcher; looked up at subscribe time
        self.recent = recent  # the last appended records, decoded: dispatch and pulls at the head read them here
        self.space = space  # free space on the data disk: appends and RocksDB writes are refused while it is short
        self.awaiting = awaiting  # inbound QoS 2 flows awaiting PUBREL, kept up to date by the dispatcher
        self.timers = timers  # delayed messages pending (store/timer/), kept up to date by the dispatcher
        self.timer_max_pending = 0  # delayed messages a client may have pending (0: no cap)
        self.timer_lateness: LatencyBuckets | None = None  # the dequeue step's (open_store sets it)
        # pending delayed messages, listed and cancelled by operators and publishers
        self.delayed = PendingDelayed(timers, log.log, self.append_control, dispatcher.wait_dispatched)
        self.router = NotifyRouter()
        self.attached: dict[str, Attachment] = {}  # attached node -> what is routed to it
        self.groups = GroupCoordinator(self)
        self.pops = PopCoordinator(self, pops, self._poke)  # POP consumption (store/pop/)
        # The next id a first activation of a wildcard filter may take: ids given out but not applied yet count,
        # so two new filters never get one id without waiting for each other's record to be applied.
        self._next_filter_id = 0
        self.sessions = Sessions(  # the client-keyed part (store/sessions.py)
            blobs, awaiting, log.log, dispatcher, append=self.append, append_control=self.append_control,
            owns=self._owns, on_moved=self.moved, nursery=nursery, lease_s=lease_s)
        self.leases = self.sessions.leases
        self.replication: Replication | None = None  # leading a replicated group: acknowledgements wait for it

    @property
    def disk_full(self) -> bool:
        """Whether new messages are refused because the data disk is full."""
        return self.space.full

    @property
    def max_record_bytes(self) -> int:
        """``commitlog.max_record_bytes``: no record, a batch record included, is larger."""
        return self.log.log.config.max_record_bytes

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

    def _poke(self, queue: str) -> None:
        """Messages of ``queue`` came back to a POP group (revived): the nodes with sessions on it and the pops
        waiting on it are told, as of news."""
        self.route({queue: self.queues.max_offset(queue)})

    def route(self, events: Mapping[str, int]) -> None:
        """The dispatcher's listener (trio thread): post each attached node the events of its queues, and wake
        the group claims waiting on them."""
        for name, mine in self.router.route(events).items():
            attachment = self.attached.get(name)
            if attachment is not None:
                attachment.events.post(mine)
        self.groups.wake(events)
        self.pops.wake(events)

    def moved(self, node: str, client_id: str) -> None:
        """``client_id`` connected elsewhere: ``node`` is told it is not its client any more."""
        attachment = self.attached.get(node)
        if attachment is not None:
            attachment.moved.post({client_id: 0})

    # --- appends ----------------------------------------------------------------------------

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     batch: bool = False) -> list[int]:
        """Append messages in one CommitLog write with their target queues fixed now, and wake the dispatcher.

        Returns their CommitLog positions once appended (and durable, if ``durable`` or the flush policy is sync).
        ``batch``: the messages (all of one topic) go in one batch record (store/log/record.py, ``FLAG_BATCH``).

        Raises:
            ValueError: a message does not encode (``RecordTooLarge`` included: a batch over the record limit), or
                a batch is not of one topic, holds a delayed message or a QoS 2 packet id; nothing was appended.
            OSError: the write failed (``LogFullError``: the disk is full); nothing was appended.
        """
        (result,) = await self.append_groups([messages], durable=durable, batched=[batch])
        if isinstance(result, ValueError):
            raise result
        return result

    async def append_groups(
        self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None, batched: Sequence[bool] = ()
    ) -> list[list[int] | ValueError]:
        """Append the messages of several callers in one CommitLog write: the RPC server's batches.

        Returns, per group, its positions, or the ``ValueError`` (``RecordTooLarge``
        included) that one of its messages raised when encoded: such a group is
        not appended at all and its neighbours are (the all-or-nothing of
        :meth:`append`, per caller). ``batched[i]``: group i goes in one batch record (:meth:`append`).
        Waits first while dispatch lags (``Dispatcher.wait_lag``).

        Raises:
            OSError: the write failed; no group was appended.
        """
        if self.timer_max_pending and any(m.deliver_at_ms for group in groups for m in group):
            await self.dispatcher.wait_dispatched(self.log.log.written_offset)  # the cap counts every append before
        now = now_ms()
        encoded: list[list[tuple[bytes, Record]] | ValueError] = []
        for i, messages in enumerate(groups):
            try:
                encoded.append(self._batch(messages, now) if i < len(batched) and batched[i] and messages
                               else self._encode(messages, now))
            except ValueError as exc:
                encoded.append(exc)
        made = [pair for group in encoded if not isinstance(group, ValueError) for pair in group]
        await self.dispatcher.wait_lag()
        offsets = await self._write([raw for raw, _ in made], durable) if made else []
        self._appended(made, offsets)
        if offsets and self.replication is not None:
            await self.replication.wait_acked(offsets[-1] + made[-1][1].size)
        results: list[list[int] | ValueError] = []
        start = 0
        for group in encoded:
            if isinstance(group, ValueError):
                results.append(group)
            else:
                results.append(_positions(group, offsets[start : start + len(group)]))
                start += len(group)
        return results

    def append_nowait(self, messages: Sequence[NewMessage]) -> list[int]:
        """:meth:`append` (not durable) before returning, when nothing needs waiting for.

        Under the async flush policy an append is a copy into the page cache;
        doing it in the caller's step saves a gateway connection a task switch
        per publish.

        Raises:
            trio.WouldBlock: it must wait: the sync policy (the fsync), dispatch lags (``Dispatcher.wait_lag``), or
                a replicated leader's acks wait for followers (or it may not acknowledge); nothing was appended.
            ValueError: a message does not encode (``RecordTooLarge`` included); nothing was appended.
            OSError: the write failed; nothing was appended.
        """
        replication = self.replication
        if self.log.log.config.flush == "sync" or self.dispatcher.lag > MAX_LAG or \
                (replication is not None and not replication.acks_at_once()) or \
                any_delayed(messages):  # a delayed one: its client's cap counts what dispatch applied
            raise trio.WouldBlock
        now = now_ms()
        made = self._encode_runs(messages, now)
        self.space.check(recent_ok=True)
        try:
            offsets = self.log.log.append_stamped([raw for raw, _ in made], now)
        except LogFullError as exc:
            self.space.refused(exc)
            raise
        self.space.cleared()
        self._appended(made, offsets)
        return _positions(made, offsets)

    async def append_control(self, controls: Sequence[Control], *, durable: bool | None = None,
                             applied: bool = True, messages: Sequence[NewMessage] = (), batch: bool = False) -> int:
        """Append control records (store/control.py) in one CommitLog write and return once dispatch has applied
        them: what they say is then both stored (as the flush policy, or ``durable``, promises) and readable.
        ``applied`` False: return once stored (state nobody reads before the next start: the client ledger).
        ``messages`` go first in the same write (the timer's fired messages with the record that ends them);
        ``batch``: each run of consecutive same-topic messages as batch records (:meth:`_encode_runs`).

        Returns:
            the CommitLog offset just past the last of them.

        Raises:
            ValueError: one does not encode (``RecordTooLarge``: a session blob over the record limit).
            OSError: the write failed (``LogFullError``: the disk is full); nothing was appended.
        """
        return (await self.write_controls(controls, durable=durable, applied=applied, messages=messages,
                                          batch=batch))[-1]

    async def write_controls(self, controls: Sequence[Control], *, durable: bool | None = None,
                             applied: bool = True, messages: Sequence[NewMessage] = (),
                             batch: bool = False) -> list[int]:
        """:meth:`append_control`, returning the CommitLog offset of each record (``messages`` first), then the
        offset just past the last: a control record's own offset is its identity (a POP checkpoint's)."""
        now = now_ms()
        made = (self._encode_runs if batch else self._encode)(messages, now) + \
            encode_all(controls, now, self.log.log.config.max_record_bytes)
        self.space.check()  # not only the log's room: what dispatch derives from them is written to RocksDB
        offsets = await self._write([raw for raw, _ in made], durable)
        self._appended(made, offsets)
        end = offsets[-1] + made[-1][1].size
        if self.replication is not None:
            await self.replication.wait_acked(end)
        if applied:
            await self.dispatcher.wait_dispatched(end)
        return [*offsets, end]

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
        added: dict[str, int] = {}  # delayed messages of each client in this append
        return [self._delayed(m, now, max_size, added) if m.deliver_at_ms else
                new_record(m.topic, m.payload, now, m.client_id, m.qos, m.retain, m.properties, targets(m.topic),
                           m.born_ms or None, max_size, m.packet_id) for m in messages]

    def _encode_runs(self, messages: Sequence[NewMessage], now: int) -> list[tuple[bytes, Record]]:
        """:meth:`_encode`, with each run of consecutive same-topic QoS 0 and 1 messages (not retained,
        ``batchable``) as batch records: a gateway's read round, where a flooding publisher's read is hundreds of
        PUBLISHes to its one topic (their records, index entries and pulls were most of the store's share of a
        fan-in). The log order stays the read order, and the messages of one append share the store timestamp
        and its one CommitLog write either way, so no subscriber can tell, and a PUBACK (sent once the write
        returns) promises what it did; retained and QoS 2 messages (an MQTT publisher's carry their packet id)
        stay records of their own.
        """
        if isinstance(messages, MessageChain):
            return self._encode_chain(messages, now)
        max_size = self.log.log.config.max_record_bytes
        if len(messages) > 1 and messages[0].topic == messages[-1].topic:
            # A flooding publisher's read, the round's only one: its messages alike but for payload and born time
            # (a few passes in C, ``PayloadRun.of``) are one run, checked whole, not message by message (that walk
            # was a fifth of this method's instructions per message, its records' encoding included).
            run = PayloadRun.of(messages)
            if run is not None and run.like.qos < 2 and not run.like.retain and run.batchable(max_size):
                return self._batch(run, now)
        made: list[tuple[bytes, Record]] = []
        singles: list[NewMessage] = []  # the messages since the last run, encoded together
        start = 0
        count = len(messages)
        while start < count:
            first = messages[start]
            end = start + 1
            if first.qos < 2 and not first.retain:
                topic = first.topic
                room = batch_room(topic, max_size)
                if batchable(first, room):
                    while end < count and (m := messages[end]).topic == topic and m.qos < 2 and not m.retain \
                            and batchable(m, room):
                        end += 1
            if end - start > 1:
                if singles:
                    made += self._encode(singles, now)
                    singles = []
                made += self._batch(messages[start:end], now)
            else:
                singles.append(first)
            start = end
        if singles:
            made += self._encode(singles, now)
        return made

    def _encode_chain(self, chain: MessageChain, now: int) -> list[tuple[bytes, Record]]:
        """:meth:`_encode_runs` of a gateway's read round: each ``PayloadRun`` part that may be batched (a read's
        QoS 0 messages that repeat one another, not retained) is its batch records without a ``NewMessage`` per
        message; the parts between runs are encoded together as any messages are."""
        made: list[tuple[bytes, Record]] = []
        plain: list[NewMessage] = []  # the parts since the last run
        max_size = self.log.log.config.max_record_bytes
        for part in chain.parts:
            if isinstance(part, PayloadRun) and part.like.qos < 2 and not part.like.retain and \
                    part.batchable(max_size):
                if plain:
                    made += self._encode_runs(plain, now)
                    plain = []
                made += self._batch(part, now)
            else:
                plain += part
        if plain:
            made += self._encode_runs(plain, now)
        return made

    def _batch(self, messages: Sequence[NewMessage], now: int) -> list[tuple[bytes, Record]]:
        """The batch records of ``messages`` (``append(batch=True)``), their target queues fixed now: as few as
        ``commitlog.max_record_bytes`` allows (a caller need not know the limit to batch), compressed as
        ``commitlog.batch_compression`` says. A ``PayloadRun`` (or messages alike: ``PayloadRun.of``) that fits
        one record is packed whole (``new_batch_of``), without a message per payload.

        Raises:
            ValueError: they are not all of one topic, one is delayed, or a record does not encode
                (``RecordTooLarge``: a message too large for a record of its own).
        """
        config = self.log.log.config
        max_size, compress = config.max_record_bytes, config.batch_compression == "zstd"
        run = messages if isinstance(messages, PayloadRun) else PayloadRun.of(messages)
        if run is not None and not run.like.deliver_at_ms:
            like = run.like
            queues = self.queues.targets(like.topic)
            try:  # one record, packed without a message per payload (a run too large for one is cut below)
                return [new_batch_of(like.topic, like, run.payloads, now, queues, max_size, compress=compress,
                                     borns=run.borns)]
            except RecordTooLarge:
                messages = list(messages)
        topic = messages[0].topic
        if any(m.topic != topic or m.deliver_at_ms for m in messages):
            raise ValueError("a batch record holds messages of one topic, none of them delayed")
        queues = self.queues.targets(topic)
        return [new_batch(topic, run, now, queues, max_size, compress=compress)
                for run in fit_batches(topic, messages, queues, max_size)]

    def _delayed(self, m: NewMessage, now: int, max_size: int, added: dict[str, int]) -> tuple[bytes, Record]:
        """The ``Delayed`` record of a delayed message, once its client's cap allows it (counted from what dispatch
        applied, plus the ``added`` delayed messages of this append; :meth:`append_groups` waits for dispatch first,
        and appends of the same client in flight at the same moment may pass it by their number).

        Raises:
            DelayedCapExceeded: the client would pass ``timer_max_pending``.
        """
        if self.timer_max_pending:
            added[m.client_id] = count = added.get(m.client_id, 0) + 1
            if self.timers.pending_of(m.client_id) + count > self.timer_max_pending:
                raise DelayedCapExceeded(f"client {m.client_id!r} has {self.timer_max_pending} delayed messages "
                                         "pending already")
        return encode_control(Delayed(m.client_id, m.topic, m.deliver_at_ms, m.payload, m.qos, m.retain, m.properties,
                                      m.born_ms or now), now, max_size, m.packet_id)

    def _appended(self, made: list[tuple[bytes, Record]], offsets: list[int]) -> None:
        """Keep the appended records in memory with their offsets, and dispatch them (now if they are few)."""
        records = []
        for (_, record), offset in zip(made, offsets):
            record.place(offset)
            records.append(record)
        self.recent.add(records)
        self.dispatcher.dispatch_now()
        if self.replication is not None:
            self.replication.appended()

    # --- reads ------------------------------------------------------------------------------

    def read(self, queue: str, from_offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> PullResult[Record]:
        """Messages of a queue from a queue offset: an index scan, then the records kept in ``recent``, the rest
        read from the CommitLog (blocking: keep it out of the trio thread unless it is small)."""
        return self.queues.pull(queue, from_offset, max_count, max_bytes, self.log.log, decode, self.recent.get,
                                messages_of)

    def read_raw(self, queue: str, from_offset: int, max_count: int, max_bytes: int) -> PullResult[Stored]:
        """:meth:`read` with each record as stored (``store.groups.Stored``), a batch record whole and undecoded
        (the RPC sends them so; its clients decode: the store's CPU is the one every gateway shares). Blocking."""
        return self.queues.pull(queue, from_offset, max_count, max_bytes, self.log.log, stored, whole=served)

    def in_memory(self, queue: str, from_offset: int) -> bool:
        """Whether a read of ``queue`` from ``from_offset`` finds its records in ``recent`` (an index lookup):
        such a read costs Python time only, which a worker thread would not take off the event loop. So does a read
        at the queue's head (a new subscription's first read): it finds nothing."""
        queues = self.queues
        if from_offset >= queues.max_offset(queue):
            return True
        oldest = self.recent.oldest
        if oldest is None:
            return False
        log_offset = queues.log_offset(queue, from_offset)
        return log_offset is not None and log_offset >= oldest

    def read_log(self, offset: int, max_bytes: int) -> LogSpan:
        """``StoreApi.read_log`` (blocking): see :func:`log_span`."""
        return log_span(self.log.log, offset, max_bytes)

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
            replication=self.replication.statistics() if self.replication is not None else None,
            log_writes=stats.appended_batches,
            pops=self.pops.statistics(),
        )

    def _timer_statistics(self) -> TimerStatistics:
        timers = self.timers
        late = self.timer_lateness
        return TimerStatistics(timers.pending, timers.scheduled, timers.fired, timers.rolled,
                               late.bounds if late else (), list(late.counts) if late else [0],
                               late.sum_s if late else 0.0, timers.cancelled)

    # --- subscriptions and offsets ----------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        """``holder`` holds filter ``queue``: an activation record (with the filter's queue id, chosen here),
        appended and applied. Returns the subscription's exact start: the queue offset of the first entry after
        the record (every message appended after this returns lists the filter, if it is a wildcard's).

        Raises:
            TopicError: the filter is not a valid MQTT topic filter.
            ValueError: the filter's queue id does not fit a target-queues section.
        """
        start = (await self.activate_all([queue], holder))[0]
        if isinstance(start, ValueError):
            raise start
        return start

    async def activate_all(self, queues: Sequence[str], holder: str) -> list[int | ValueError]:
        """:meth:`activate` of each of ``queues``: one ``ActivatedRun`` record of them all (more only past the
        record size limit), applied together (a SUBSCRIBE's filters, or a connection's SUBSCRIBEs read together,
        cost one record, one write and one wait for dispatch, not one each). Each gets its start, or the
        ``TopicError``/``ValueError`` that refused it alone.

        Raises:
            LogFullError: the disk is full (``append_control`` looks); none of them was appended.
        """
        # A new wildcard filter takes the next id not given out: first activations go to the log together (they
        # went one at a time, a log write and its dispatch each, so 25,000 new filters took a minute), and an id
        # given to a record that ends up holder-only (two first activations of one filter: the first applied
        # wins) is skipped, never reused.
        results, self._next_filter_id = self.queues.filter_ids(queues, self._next_filter_id)
        activations = [(queue, qid) for queue, qid in zip(queues, results) if not isinstance(qid, ValueError)]
        if not activations:
            return results
        end = await self.append_control(activated_runs(holder, activations,
                                                       self.log.log.config.max_record_bytes // 2))
        starts = self.queues.starts([queue for queue, _ in activations], end)
        if len(starts) == len(results):
            return [*starts]
        found = iter(starts)
        return [start if isinstance(start, ValueError) else next(found) for start in results]

    async def release(self, queue: str, holder: str) -> bool:
        """``holder`` no longer holds ``queue``: a ``Released`` record, appended and applied (its offset on the
        queue goes; the last holder of a wildcard filter ends its indexing). False if it did not hold it."""
        self.space.check()
        if holder not in await trio.to_thread.run_sync(self.queues.holders, queue):
            return False
        await self.append_control([Released(queue, holder)])  # applied in log order: the last holder's ends it
        return True

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]], *, applied: bool = True) -> None:
        """``{owner: {queue: next offset}}`` as ``Committed`` records in one write, applied on return (``applied``
        False: stored, as the flush policy promises; dispatch applies them in its next step); offsets never move
        back.

        Raises:
            ValueError: an offset is negative.
        """
        for owner, offsets in commits.items():
            for name, offset in offsets.items():
                if offset < 0:
                    raise ValueError(f"offset for queue {name!r} must not be negative, not {offset}")
        controls = [Committed(owner, dict(offsets)) for owner, offsets in commits.items() if offsets]
        if controls:
            self.space.check()
            await self.append_control(controls, applied=applied)

    async def caught_up(self) -> None:
        """Return once dispatch has applied every record written so far (a reader of derived state that must see
        the writes :meth:`commit_offsets` did not wait to see applied)."""
        await self.dispatcher.wait_dispatched(self.log.log.written_offset)

    def _owns(self, owner: str) -> bool:
        """Whether ``owner`` holds filters or has offsets, which its ``SessionEnded`` drops (blocking)."""
        queues = self.queues
        return bool(queues.held_by(owner) or queues.get_offsets(owner))


MAX_READ_LOG_BYTES = 16 * 1024 * 1024
"""A ``read_log`` returns at most this much, so an RPC answer stays far below the frame limit."""


def log_span(log: CommitLog, offset: int, max_bytes: int) -> LogSpan:
    """``StoreApi.read_log`` over ``log`` (blocking), a leader's or a follower's (store/rpc/reader.py): ``max_bytes``
    0 asks for the log's bounds only, for any ``offset``. Its ``flushed`` bound is the log's published offset
    (flushed, and confirmed by the replicas) as it was before the read: an empty span then always means the reader
    is at that bound, never that a confirm landing during the read moved the bound past bytes it did not get."""
    published = log.published_offset  # before the read: a bound that moved after it would promise bytes not sent
    if max_bytes <= 0:
        return LogSpan(MAIN_LOG, offset, b"", offset, published, log.min_offset)
    start, data, data_end = log.read_span(offset, max(0, min(max_bytes, MAX_READ_LOG_BYTES)))
    return LogSpan(MAIN_LOG, start, data, data_end, published, log.min_offset)


def decode(raw: bytes, offset: int) -> Record:
    """A record as stored (``LightQueues.pull``'s ``decode``), at its CommitLog offset."""
    return decode_record(raw, 0, offset)


def _positions(made: list[tuple[bytes, Record]], offsets: list[int]) -> list[int]:
    """The positions of an append's messages: a record's offset, or each message's of a batch record."""
    if not any(record.flags & FLAG_BATCH for _, record in made):
        return offsets
    positions: list[int] = []
    for (_, record), offset in zip(made, offsets):
        if record.flags & FLAG_BATCH:
            positions.extend(range(offset, offset + len(record.messages)))
        else:
            positions.append(offset)
    return positions


SessionFixer = Callable[[bytes, Callable[[str], int]], "bytes | None"]
"""``fix(blob, max_offset)``: the session blob with its queue positions pulled back to ``max_offset(queue)``, or
None when none is past it. Given by the layer that owns the blob format (gateway/mqtt/session.py)."""

SessionExpiry = Callable[[bytes], int]
"""``expiry_of(blob)``: the Session Expiry Interval a session blob was saved with (0: unreadable). Given by the layer
that owns the blob format (gateway/mqtt/session.py)."""


@dataclass(slots=True)
class _Parts:
    """What a store node and a follower both open over a data directory: the log, the index and every part
    dispatch derives from the log."""

    log: AsyncCommitLog
    queues: LightQueues
    retained: RetainedStore
    recent: RecentRecords
    space: DiskSpace
    awaiting: AwaitingRelease
    controls: QueueControls
    blobs: SessionBlobs
    ledger: ClientLedger
    delayed: TimerApplier
    pops: PopApplier
    dispatcher: Dispatcher


@asynccontextmanager
async def _open_parts(data: Path, config: CommitLogConfig, on_dispatched: Listener,
                      timer_window_s: int) -> AsyncIterator[_Parts]:
    """Open the log and the index under ``data`` and the parts derived from them; close them in reverse on exit
    (the dispatcher flushed, so a clean shutdown leaves nothing to re-dispatch)."""
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
            recent = RecentRecords()
            space = DiskSpace(data)
            awaiting = AwaitingRelease(db)
            controls = QueueControls(queues)
            blobs = SessionBlobs(db)
            delayed = TimerApplier(data / "timer", timer_window_s, alog.log)
            opened.callback(delayed.close)
            alog.log.add_retention_guard(delayed.may_delete)
            ledger = ClientLedger(db)
            pops = PopApplier(db)
            dispatcher = Dispatcher(alog.log, queues, on_dispatched, retained=retained, recent=recent,
                                    awaiting=awaiting, room=space.has_room,
                                    activations=controls, appliers=[blobs, ledger, awaiting.controls, delayed, pops],
                                    early=delayed)
            try:
                yield _Parts(alog, queues, retained, recent, space, awaiting, controls, blobs, ledger, delayed, pops,
                             dispatcher)
            finally:
                with trio.CancelScope(shield=True):  # a cancelled node (SIGTERM) still shuts down cleanly
                    await trio.to_thread.run_sync(dispatcher.close)
                blobs.close()  # a family handle keeps the database open
                pops.close()
                ledger.close()
                retained.close()
                awaiting.close()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(db.close)


@asynccontextmanager
async def open_store(
    data: Path, config: CommitLogConfig, listener: Listener | None = None, tier: Mapping[str, Any] | None = None, *,
    fix_session: SessionFixer | None = None, session_expiry: SessionExpiry | None = None, lease_s: float = LEASE_S,
    timer_window_s: int = WINDOW_S, timer_max_pending: int = 0, replication: Replication | None = None
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
    ``replication``: the node leads a replicated group (store/replica/leader.py): every acknowledging path waits
    for ``Replication.wait_acked``. The confirm offset is held: for a promoted follower (``replication.confirmed``)
    from before recovery, at the offset its last leader confirmed, so the old epoch's tail only it has is neither
    dispatched nor served before the ISR holds it (a subscriber never sees a message the next leader may lack); else
    from the end of the startup appends on (they restate or fix the leader's own state, which its log already
    implies, so they are confirmed by it alone and reach the followers like any record).

    Resource handling: everything opened here is closed here, in reverse order,
    when the block exits (the index memtable and the CommitLog are flushed).
    """
    nodes: list[StoreNode] = []

    def on_dispatched(events: dict[str, int]) -> None:
        nodes[0].route(events)
        if listener is not None:
            listener(events)

    async with _open_parts(data, config, on_dispatched, timer_window_s) as parts:
        alog, dispatcher, queues, blobs = parts.log, parts.dispatcher, parts.queues, parts.blobs
        try:
            if replication is not None and replication.confirmed is not None:  # a promoted follower: see above
                alog.log.hold_confirm(replication.confirmed)
            await trio.to_thread.run_sync(_recover, alog.log, dispatcher, queues, blobs, fix_session)
            await trio.to_thread.run_sync(_restate_legacy, alog.log, dispatcher, parts.controls, blobs, parts.ledger,
                                          parts.awaiting)
            if session_expiry is not None:
                await trio.to_thread.run_sync(_unrecorded, alog.log, dispatcher, blobs, parts.ledger, session_expiry)
            clients = await trio.to_thread.run_sync(parts.ledger.entries)
        except Exception as exc:
            raise _startup_error(data, exc) from exc
        try:
            async with trio.open_nursery() as timers:  # leases, wills, session expiry: they end with the node
                node = StoreNode(data, alog, queues, dispatcher, blobs, parts.retained, parts.recent, parts.space,
                                 parts.awaiting, timers, lease_s, parts.delayed, parts.pops)
                nodes.append(node)
                node.timer_max_pending = timer_max_pending
                node.leases.restore(clients)  # expiries and wills pending when the store stopped
                dequeue = Dequeue(parts.delayed, alog.log, partial(_append_fired, node), node.delayed.lock)
                node.timer_lateness = dequeue.lateness
                async with AsyncExitStack() as running:
                    if replication is not None:
                        replication.bind(alog, dispatcher.wake)
                        node.replication = replication
                        await running.enter_async_context(background(replication.run))
                    await running.enter_async_context(background(dispatcher.run))
                    await running.enter_async_context(background(partial(_watch_space, parts.space)))
                    await running.enter_async_context(background(dequeue.run))
                    await running.enter_async_context(background(node.pops.run_revive))
                    if tier is not None and tier.get("tier.uri"):
                        try:
                            from store.tier import TierConfig, TierConverter, run_tier
                        except ImportError as exc:  # the base install has no pyarrow
                            raise StartupError(f"cannot start: tier.uri is set, and the tier needs the tier "
                                               f"extra (pip install 'lightgate[tier]'): {exc}") from exc

                        converter = TierConverter(alog.log, TierConfig.from_settings(tier),
                                                  _leading(replication))
                        await running.enter_async_context(background(partial(run_tier, converter)))
                    yield node
                timers.cancel_scope.cancel()
        finally:
            for node in nodes:
                for name in tuple(node.attached):
                    node.detach(name)


@asynccontextmanager
async def open_follower(data: Path, config: CommitLogConfig, *,
                        timer_window_s: int = WINDOW_S) -> AsyncIterator[tuple[AsyncCommitLog, Dispatcher]]:
    """Open ``data`` as a replica that follows a leader (store/replica/follower.py): the log, the index and
    dispatch up to the confirm offset the leader sends, so the derived state stays warm for a promotion.

    It appends nothing: no recovery fixes, no restatement, no leases, wills, expiry or timer dequeue, no tier, no
    retention of its own (its restatement prelude appends): it deletes what its leader deleted, when the leader's
    answers say (``CommitLog.delete_before``), so its log is byte for byte the leader's. The directory reopens
    with ``open_store`` after a promotion.
    """
    follower_config = dataclasses.replace(config, retention_check_interval_s=0)
    async with _open_parts(data, follower_config, lambda events: None, timer_window_s) as parts:
        # What it had dispatched was confirmed when it did; the rest waits for the leader's confirm offset.
        parts.log.log.hold_confirm(parts.dispatcher.dispatched_offset)
        async with background(parts.dispatcher.run):
            yield parts.log, parts.dispatcher


def _leading(replication: Replication | None) -> Callable[[], bool]:
    """Whether this node may act as the only writer of what the replicas share (the tier): an unreplicated node
    always; a replicated leader while it is not fenced and its leader lease is valid (callable from any thread)."""
    if replication is None:
        return lambda: True
    return lambda: not replication.fenced and replication.controller.leader_lease_valid()


async def _append_fired(node: StoreNode, controls: Sequence[Control], messages: Sequence[NewMessage],
                        batch: bool) -> int:
    return await node.append_control(controls, messages=messages, batch=batch)


SPACE_PROBE_S = 1.0
"""While the disk is full, its free space is looked at this often, so that the end of the episode is logged (and
the metric cleared) even when no client tries to publish."""


async def _watch_space(space: DiskSpace, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        await trio.sleep(SPACE_PROBE_S)
        if space.full:
            space.has_room()


def _recover(log: CommitLog, dispatcher: Dispatcher, queues: LightQueues, blobs: SessionBlobs,
             fix_session: SessionFixer | None) -> None:
    """Before anyone consumes: index the whole log and pull back every position past its end (sessions
    included: their fixed blobs are saved again), so that nothing appended from now on is skipped; one WARNING
    line says what moved."""
    found = dispatcher.recover()
    if not found:
        return
    if fix_session is not None:
        fixed: list[Control] = []
        for client_id, blob in blobs.items():
            new = fix_session(blob, queues.max_offset)
            if new is not None:
                fixed.append(SessionSaved(client_id, new))
        _append_at_start(log, dispatcher, fixed)
        found["sessions"] = len(fixed)
    LOGGER.warning("positions past the end of the recovered CommitLog were pulled back to it (records lost in a"
                   " power loss or OS crash under the async flush policy); nothing appended from now on is skipped",
                   extra={"ctx": found})


def _restate_legacy(log: CommitLog, dispatcher: Dispatcher, queues: QueueControls, blobs: SessionBlobs,
                    ledger: ClientLedger, awaiting: AwaitingRelease) -> None:
    """Data written before control records existed (filter holders and consumer offsets, session blobs, client
    ledger entries and QoS 2 releases that no record makes): restate them as control records, once, so that the log
    alone holds them (blocking)."""
    legacy: list[Any] = [queues] if not queues.restated else []
    legacy += [part for part in (blobs, ledger) if part.legacy]
    if awaiting.legacy:
        legacy.append(awaiting.controls)
    controls = [control for part in legacy for control in part.restate()]
    if not controls:
        return
    _append_at_start(log, dispatcher, controls)  # a crash before the next flush restates them again: harmless
    LOGGER.info("session state stored before control records restated as control records",
                extra={"ctx": {"records": len(controls)}})


def _unrecorded(log: CommitLog, dispatcher: Dispatcher, blobs: SessionBlobs, ledger: ClientLedger,
                expiry_of: SessionExpiry) -> None:
    """The session blobs without a ledger entry, each recorded as closed now with the expiry it was saved with:
    their clients' closes were never recorded, and now is the earliest time the store can vouch for (blocking)."""
    known = ledger.entries()
    closed_ms = now_ms()
    found: list[Control] = []
    for client_id in blobs.ids():  # the keys alone: after the first start almost every one has its entry
        if client_id in known:
            continue
        blob = blobs.get(client_id)
        expiry_s = expiry_of(blob) if blob is not None else 0
        if expiry_s:  # 0: unreadable (resuming it reports that); a blob is never saved with expiry 0
            found.append(ClientClosed(client_id, "", expiry_s, None, 0, closed_ms))
    if found:
        _append_at_start(log, dispatcher, found)
        LOGGER.info("stored sessions without a client ledger entry expire from this start",
                    extra={"ctx": {"sessions": len(found)}})


def _append_at_start(log: CommitLog, dispatcher: Dispatcher, controls: Sequence[Control]) -> None:
    """Append control records durably before the node serves, and apply them (blocking; dispatch is not
    running yet)."""
    if not controls:
        return
    made = encode_all(controls, now_ms(), log.config.max_record_bytes)
    log.append_batch([raw for raw, _ in made])
    log.flush()
    while dispatcher.step(SCAN_BYTES, flush=False) is not None:
        pass


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
