"""The dispatcher: the only index writer, feeding new CommitLog records to the light queues in order.

One cursor (the light queues' checkpoint) moves through the CommitLog. Each
step scans a large chunk of records, indexes all of them in one RocksDB write
batch (entries, max offsets, checkpoint: ``LightQueues.index``) and only then
tells the listener (notify) which queues have news. The queues of a record come
from the record itself (its topic and its target-queues section, fixed at
append time), so re-dispatch after a crash writes the same entries again.

The core is synchronous (:meth:`Dispatcher.step`, which :meth:`Dispatcher.dispatch_once` runs with the
listener call for callers without trio); :meth:`Dispatcher.run`
drives it from trio, running each step in a worker thread and sleeping on a
wake-up that the appender pulls after each append.

Every ``FLUSH_BYTES`` or ``FLUSH_INTERVAL_S`` the index and the other derived parts are flushed (made durable with
their checkpoints, so a restart re-dispatches little). A flush holds the steps only while it takes its checkpoint
(a memtable switch per RocksDB family); RocksDB writes the memtables while dispatch goes on (``Dispatcher._flush``
says what a flush promises, and what a crash during one leaves).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, final

import trio

from lightqueue.queues import TOPIC_IDS, LightQueues
from retain.store import RetainedStore
from store.awaiting import AwaitingRelease
from store.control import (ACTIVATIONS, KIND_PREFIX, Activated, ActivatedRun, Control, ControlError, QueueBases,
                           RetainedKept, decode_control)
from store.log.commitlog import SKIPPED, CommitLog, ScanResult
from store.log.errors import OffsetExpired
from store.log.recent import RecentRecords
from store.log.record import FLAG_BATCH, FLAG_CONTROL, FLAG_RETAIN, CorruptRecord, Record, encode_message
from store.restate import restate

__all__ = ["ControlApplier", "DispatchBatch", "DispatchStopped", "Dispatcher", "DispatcherStatistics"]

LOGGER = logging.getLogger(__name__)

MiB = 1024 * 1024

SCAN_BYTES = 4 * MiB
"""One dispatch step reads this much of the log: large enough to amortise the
write batch, small enough that a step (and a notify round) stays in the tens of ms."""

FLUSH_INTERVAL_S = 30.0
FLUSH_BYTES = 64 * MiB
"""Flush the index memtable after this much time or CommitLog data dispatched,
whichever comes first: re-dispatch after a crash never covers more than that."""

INLINE_BYTES = 256 * 1024
"""A step over at most this much, all of it in memory, runs in the trio thread (``Dispatcher.run``)."""

MAX_LAG = 4 * MiB
"""Appends wait (``wait_lag``) while more than this much of the log is not indexed yet. Ingest can outrun
dispatch (they share one interpreter); unbounded, the lag grows past the records kept in memory, dispatch
falls back to reading the log back, and every message then costs more than it did when it was accepted."""

FALLBACK_WAKE_S = 1.0
"""The run loop also looks for new records this often, in case a wake-up was missed (appends from another process)."""

Listener = Callable[[dict[str, int]], None]


@final
class DispatchStopped(ConnectionError):
    """Dispatch stopped (its node closes) below the offset a caller waits for: nothing will index it here. A
    replicated leader that was fenced closes with records its followers never confirmed, which dispatch never
    reaches: a wait for them must end with the node, or a shielded task waiting (a session's end) holds the node
    open for ever (its replica never follows again)."""


_RETAINED_KEPT = KIND_PREFIX + "retained_kept"
"""The topic field of a ``RetainedKept`` control record: the retained store applies it, in ``_retain``."""

_QUEUE_BASES = KIND_PREFIX + "queue_bases"
"""The topic field of a ``QueueBases`` control record: taken by a dispatch that starts at a cut log (``_seed``)."""


class ControlApplier(Protocol):
    """A part of the store whose state is derived from control records (store/control.py).

    Dispatch calls :meth:`apply` for every control record at or past :attr:`checkpoint`, in log order and
    between the messages it indexes (a record appended after an activation is indexed after it is applied), in
    the dispatcher's thread under its lock. Applying must be idempotent: after a crash dispatch runs again from
    the lowest checkpoint of all its parts. A flush comes in two calls (``Dispatcher._flush``): :meth:`flush`
    runs under the lock once the CommitLog is flushed up to ``offset`` (so derived state never runs ahead of
    what the log keeps) and takes the state at ``offset`` for persisting, quickly (a memtable switched, a
    checkpoint handed to a thread); :meth:`settle` runs outside the lock, while dispatch applies the next
    records, and returns once that state is on disk, :attr:`checkpoint` then at ``offset``. Dispatch applies no
    record at or past the log's confirm offset (the replicas hold the records below it).

    :meth:`rewind` runs when the log lost or dropped its records from ``log_end`` on (a follower's truncate,
    ``Dispatcher.truncate``; or, on open, a checkpoint past the log's end after an OS crash), in the
    dispatcher's thread under its lock: afterwards no state made by a record at or past ``log_end`` may remain,
    and the checkpoint must be at most ``log_end``; dispatch then applies the records from the lowest
    checkpoint again, and the records appended next reuse those offsets. An applier that keeps history (what
    each record changed) undoes the records past ``log_end``; one that keeps none may reset itself to an
    earlier state it can rebuild (its state as of an older checkpoint, or empty with checkpoint 0 while the log
    still starts at 0) and let dispatch re-apply from there.
    """

    @property
    def checkpoint(self) -> int:
        """Every control record below this CommitLog offset is applied (durably)."""
        ...

    def apply(self, record: Record, control: Control) -> None:
        """Apply one control record (``record.offset`` is its CommitLog offset)."""
        ...

    def flush(self, offset: int) -> None:
        """Take what was applied below ``offset`` (every record applied so far) for persisting with the checkpoint
        ``offset``, without waiting for the disk: dispatch holds its lock meanwhile."""
        ...

    def settle(self) -> None:
        """Return once what the last :meth:`flush` took is on disk, and move :attr:`checkpoint` to its offset."""
        ...

    def restate(self) -> Iterable[Control]:
        """Control records that restate this part's live state as it is now (every session blob, every held
        filter...): appended before retention deletes the records that made it, so the log alone still holds it."""
        ...

    def rewind(self, log_end: int) -> None:
        """The log ends at ``log_end`` (a power loss took its tail, or a follower truncated it): state made by records
        at or past it goes, and the checkpoint ends at or below ``log_end``; an applier that keeps no history may reset
        itself to an earlier checkpoint and let dispatch apply again."""
        ...


class ActivationsApplier(ControlApplier, Protocol):
    """An applier that takes a run of activation records (``Activated``, ``ActivatedRun``: consecutive in the log)
    in one call, as one write: 50 sessions subscribing at once append hundreds of them in a row (issue 31). No
    other part applies them, so a run applied by it ahead of the others' turns leaves every part's state as in log
    order."""

    def apply_activations(self, run: Sequence[tuple[Record, Activated | ActivatedRun]]) -> None:
        """Apply the run, each record as :meth:`apply` would."""
        ...


class EarlyCheckpoint(ControlApplier, Protocol):
    """An applier that asks for a checkpoint of its own before dispatch's flush interval (the timer, store/timer/:
    the ends it keeps in memory until its next checkpoint grew large) and makes the CommitLog durable up to that
    checkpoint itself before writing it: dispatch then has it alone take its state at the dispatched offset, without
    fsyncing the log under its lock or switching the index's memtables (the whole flush, every 10 s of firing,
    held every message waiting to be indexed and made RocksDB write and compact small tables)."""

    def flush_wanted(self) -> bool:
        """Whether it wants its checkpoint now."""
        ...


@final
class _Failing:
    """Whether :meth:`Dispatcher.run`'s steps, or its flushes, fail: logged once when they start failing (they are
    retried every ``FALLBACK_WAKE_S``) and once when one succeeds again."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.failing = False

    def failed(self, exc: Exception, ctx: dict[str, int]) -> None:
        if not self.failing:
            self.failing = True
            LOGGER.error("%s failed; retrying every %s s until it succeeds: %r", self._what, FALLBACK_WAKE_S, exc,
                         extra={"ctx": ctx})

    def succeeded(self, ctx: dict[str, int]) -> None:
        if self.failing:
            self.failing = False
            LOGGER.warning("%s works again", self._what, extra={"ctx": ctx})


@dataclass(frozen=True, slots=True)
class DispatchBatch:
    """One dispatch step: records ``[from_offset, next_offset)`` of the CommitLog, indexed."""

    from_offset: int
    next_offset: int
    records: int
    max_offsets: dict[str, int]  # queue name -> new max offset, for every queue that got entries


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    dispatched_offset: int
    flushed_offset: int  # dispatched offset at the last index flush: a crash re-dispatches from here at worst
    written_offset: int
    lag: int  # CommitLog bytes written but not yet indexed
    batches: int
    records: int
    expired_skips: int  # times retention deleted records before they were dispatched
    from_memory: int  # records indexed from the recent records kept in memory, without reading the log


@final
class Dispatcher:
    """Indexes new CommitLog records into the light queues, in order, and reports progress.

    Args:
        log: the CommitLog to read.
        queues: the light queues to index into (the dispatcher is their only index writer).
        listener: called with ``{queue name: new max offset}`` after each batch
            commits (in the trio thread when driven by :meth:`run`).
        scan_bytes: CommitLog bytes per dispatch step.
        retained: the retained messages to keep up to date (records with RETAIN
            set), or None. They keep their own checkpoint: after a crash the
            dispatcher starts from the lower of the two and feeds each only
            what it has not applied.
        recent: the records this process appended last (store/log/recent.py):
            a step that starts at one of them indexes the run that follows
            from memory instead of scanning the log.
        awaiting: the inbound QoS 2 flows awaiting PUBREL (store/awaiting.py), derived from the
            records that carry a packet id, or None. Like ``retained`` it keeps its own checkpoint.
        flush_bytes, flush_interval_s: flush the index memtable after this much
            CommitLog data dispatched or this much time (bounds re-dispatch after a crash).
        room: whether the data disk has room for a memtable flush (store/space.py: RocksDB
            refuses every write after one failed for lack of space); None: always.
        early: the part of ``appliers`` that asks for a checkpoint of its own before ``flush_interval_s``
            (``EarlyCheckpoint``: the timer, store/timer/, when
            the state it keeps in memory until its next checkpoint grew large); None: never.
        activations: the part that applies activation records (the light queues' controls,
            store/queuecontrol.py), given each run of them in one call; the first of the parts, before
            ``appliers`` (the others, each record in log order).

    On construction the dispatcher registers ``queues.on_retention`` as a
    retention listener of the log and catches the index up with the log: it
    drops entries past the log's end (CommitLog data lost in an OS crash) and
    applies retention that ran while the index was closed.

    Resource handling: the caller owns ``log`` and ``queues`` (and their database).
    """

    def __init__(
        self,
        log: CommitLog,
        queues: LightQueues,
        listener: Listener | None = None,
        *,
        retained: RetainedStore | None = None,
        recent: RecentRecords | None = None,
        awaiting: AwaitingRelease | None = None,
        scan_bytes: int = SCAN_BYTES,
        flush_bytes: int = FLUSH_BYTES,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        room: Callable[[], bool] | None = None,
        appliers: Sequence[ControlApplier] = (),
        early: EarlyCheckpoint | None = None,
        activations: ActivationsApplier | None = None,
    ) -> None:
        self._log = log
        self._activations = activations
        self._appliers: tuple[ControlApplier, ...] = \
            tuple(appliers) if activations is None else (activations, *appliers)
        self._room = room
        self._early = early
        self._queues = queues
        self._listener = listener
        self._retained = retained
        self._awaiting = awaiting
        self._recent = recent
        self._scan_bytes = scan_bytes
        self._flush_bytes = flush_bytes
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()  # one step at a time, whoever calls it (``dispatch_now`` only if it is free)
        self._flushing = threading.Lock()  # one flush at a time; truncate, start_at and close wait for it (before _lock)
        self._rewound: dict[str, int] = {}  # what was past the log's end on open, for recover()'s log line
        if queues.checkpoint > log.written_offset:
            self._rewound["checkpoint_from"] = queues.checkpoint
            queues.rewind(log.written_offset)
        if retained is not None and retained.checkpoint > log.written_offset:
            self._rewound["retained_checkpoint_from"] = retained.checkpoint
            self._rewound["retained_dropped"] = retained.rewind(log.written_offset)
        if awaiting is not None:
            awaiting.rewind(log.written_offset)
        for applier in self._appliers:
            applier.rewind(log.written_offset)
        if queues.retained_offset < log.min_offset:
            queues.on_retention(log.min_offset)
        log.add_retention_listener(queues.on_retention)
        if self._appliers:  # their live state is appended again before retention deletes what made it
            log.add_retention_prelude(partial(restate, log, self))
        start = min([queues.checkpoint, *(part.checkpoint for part in (retained, awaiting) if part is not None),
                     *(applier.checkpoint for applier in self._appliers)])
        self._offset = max(start, log.min_offset)
        self._flushed_offset = self._offset
        # An empty index over a log retention cut numbers its queues as the original did (``_seed``) first.
        self._seeding = log.min_offset > 0 and queues.checkpoint <= log.min_offset \
            and queues.statistics().next_queue_id == TOPIC_IDS
        self._seek = log.min_offset  # where ``_seed`` looks next
        self._bases: list[QueueBases] = []
        self._unflushed = 0
        self._flushed_at = time.monotonic()
        self._batches = 0
        self._records = 0
        self._expired_skips = 0
        self._from_memory = 0
        self._wakeup = trio.Event()
        self._progress = trio.Event()
        self._stopped = False  # run ended: what it did not index waits in vain
        self._steps = _Failing("dispatch")
        self._flushes = _Failing("index flush")
        self._flush_asked = trio.Event()  # run's flusher task flushes when set (``_ask_flush``)
        self._unannounced: dict[str, int] = {}  # max offsets of the steps caught_up took, for run to announce
        self._unannounced_to: int | None = None  # where those steps ended (None: there are none)
        self._unannounced_lock = threading.Lock()  # not the step lock: the trio thread takes it at every turn

    @property
    def recent(self) -> RecentRecords | None:
        """The records it reads from memory first (None: it scans the log): a replica adds what it copies."""
        return self._recent

    @property
    def dispatched_offset(self) -> int:
        """Every record below this CommitLog offset is indexed."""
        return self._offset

    @property
    def lag(self) -> int:
        """CommitLog bytes written but not yet indexed (the dispatch lag metric)."""
        return max(0, self._log.written_offset - self._offset)

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(self._offset, self._flushed_offset, self._log.written_offset, self.lag,
                                    self._batches, self._records, self._expired_skips, self._from_memory)

    def recover(self) -> dict[str, Any]:
        """Index the whole log and say what was past its end; call once, before :meth:`run` and before anyone
        consumes (``open_store`` does, in a worker thread, and logs what this returns).

        After a power loss under the async flush policy the log may end before what RocksDB kept: if the memtable
        was flushed meanwhile, the index checkpoint, queue max offsets and retained messages (the constructor drops
        those). Consumer offsets and filter activations are control records, applied in log order and persisted
        only after the log: they are never past its end (a memtable RocksDB flushed by itself is rewound by the
        appliers). Records appended from now on reuse the lost offsets and must not be skipped.

        Returns:
            what was past the end, as log fields (empty when nothing was): ``log_end``, the checkpoints
            it came from, retained messages dropped.
        """
        while self._step(self._scan_bytes) is not None:
            pass
        if self._seeding:  # the whole log is here and has no numbering for its cut (cut by an older version)
            LOGGER.warning("no queue numbering for the log's cut: its queues are numbered from 0 here",
                           extra={"ctx": {"cut": self._log.min_offset}})
            self._seeding = False
            while self._step(self._scan_bytes) is not None:
                pass
        log_end = self._log.written_offset
        found: dict[str, Any] = dict(self._rewound)
        self._rewound = {}
        if self._retained is not None:  # also those written with the WAL (admin) past a checkpoint that was not
            dropped = self._retained.rewind(log_end) + found.pop("retained_dropped", 0)
            if dropped:
                found["retained_dropped"] = dropped
        return {"log_end": log_end, **found} if found else {}

    @contextmanager
    def caught_up(self) -> Iterator[int]:
        """Hold dispatch still with every record below the log's confirm offset applied: yields that offset (the
        written end without replicas). Appends and confirms may go on meanwhile (store/restate.py checks the end
        again when it appends). The steps it takes in the caller's thread are announced by :meth:`run` at its
        next turn (within ``FALLBACK_WAKE_S``)."""
        while True:
            while (batch := self._step(self._scan_bytes)) is not None:
                self._leave_announce(batch)
            with self._lock:
                end = self._log.confirm_offset
                if self._offset >= end:
                    yield end
                    return

    def dispatch_once(self, max_bytes: int | None = None) -> DispatchBatch | None:
        """One turn of :meth:`run` for callers without its task (repair, the index benchmark, tests): the same
        :meth:`step` and listener call, here in the caller's thread.

        Returns:
            the batch, or None when there was nothing new to index.
        """
        batch = self.step(max_bytes or self._scan_bytes)
        self._announce(batch)
        return batch

    def step(self, max_bytes: int, *, flush: bool = True) -> DispatchBatch | None:
        """Index the next chunk of records (about ``max_bytes``), then flush the index when due (``flush``:
        else the caller does, in another thread). Synchronous: :meth:`run` calls it in a worker thread, or in
        the trio thread for a small step in memory."""
        batch = self._step(max_bytes)
        if flush and (self._flush_due() or self._early_due()):
            self._flush_idle()
        return batch

    def _leave_announce(self, batch: DispatchBatch) -> None:
        """Leave a step taken outside :meth:`run`'s turn for its next turn to announce (``_with_unannounced``)."""
        with self._unannounced_lock:
            self._unannounced.update(batch.max_offsets)
            self._unannounced_to = batch.next_offset

    def _with_unannounced(self, batch: DispatchBatch | None) -> DispatchBatch | None:
        """``batch`` with the steps :meth:`caught_up` took since the last turn of :meth:`run` (None: neither)."""
        if self._unannounced_to is None:  # read without the lock: one set meanwhile is taken at the next turn
            return batch
        with self._unannounced_lock:
            events, self._unannounced = self._unannounced, {}
            next_offset, self._unannounced_to = self._unannounced_to, None
        if batch is None:
            return DispatchBatch(next_offset, next_offset, 0, events)
        for queue, max_offset in batch.max_offsets.items():
            events[queue] = max(max_offset, events.get(queue, 0))
        return DispatchBatch(batch.from_offset, batch.next_offset, batch.records, events)

    def _announce(self, batch: DispatchBatch | None) -> None:
        """Tell the listener the queues' new maxima (in the trio thread when :meth:`run` runs)."""
        if batch is not None and batch.max_offsets and self._listener is not None:
            self._listener(batch.max_offsets)

    def _step(self, max_bytes: int) -> DispatchBatch | None:
        with self._lock:
            return self._locked_step(max_bytes)

    def _locked_step(self, max_bytes: int) -> DispatchBatch | None:
        """:meth:`_step` with the step lock held."""
        log = self._log
        start = self._offset
        if start >= log.confirm_offset or self._seeding and not self._seed():
            return None
        try:
            scan = self._read(start, max_bytes)
        except OffsetExpired as exc:
            # Retention outran dispatch: those records are gone; queue offsets continue from here.
            LOGGER.error("records expired before they were dispatched",
                         extra={"ctx": {"from": start, "min_offset": exc.min_offset}})
            self._expired_skips += 1
            start = exc.min_offset
            scan = log.scan(start, max_bytes, log.confirm_offset)
        if scan.next_offset == start:
            return None
        if self._retained is not None:
            self._retain(scan)
        if self._awaiting is not None:
            flows = [rec for rec in scan.records if rec.packet_id]
            if flows:
                self._awaiting.apply(flows, scan.next_offset)
        # After a crash the retained family may be behind the index: a batch
        # the index already has is fed to retain only.
        max_offsets = self._index(scan.records, scan.next_offset)
        self._offset = scan.next_offset
        self._batches += 1
        self._records += len(scan.records)
        self._unflushed += scan.next_offset - start
        return DispatchBatch(start, scan.next_offset, len(scan.records), max_offsets)

    def _index(self, records: list[Record], next_offset: int) -> dict[str, int]:
        """Index the messages of a scanned batch and apply its control records, in log order: the messages
        before a control record are indexed (with the checkpoint at the control record) before it is applied.
        Control records in a row cost no index write between them (the parts that apply them keep their own
        checkpoints). Returns the queues' new max offsets."""
        queues = self._queues
        max_offsets: dict[str, int] = {}
        first = 0
        run: list[tuple[Record, Activated | ActivatedRun]] = []  # consecutive activations not applied yet
        for i, record in enumerate(records):
            if not record.flags & FLAG_CONTROL:
                continue
            if i > first:
                self._apply_run(run)  # before the messages after it are indexed
                if record.offset > queues.checkpoint:  # no messages before it: no index write
                    max_offsets.update(queues.index(records[first:i], record.offset))
            first = i + 1
            control = self._control(record)
            if isinstance(control, ACTIVATIONS) and self._activations is not None:
                run.append((record, control))
            elif control is not None:
                self._apply_run(run)
                self._apply(record, control)
        self._apply_run(run)
        if next_offset > queues.checkpoint:
            max_offsets.update(queues.index(records[first:] if first else records, next_offset))
        return max_offsets

    def _apply(self, record: Record, control: Control) -> None:
        """Apply one control record to every part that has not applied it yet."""
        for applier in self._appliers:
            if record.offset >= applier.checkpoint:
                applier.apply(record, control)

    def _apply_run(self, run: list[tuple[Record, Activated | ActivatedRun]]) -> None:
        """Apply a run of activation records (emptied): in one call to ``activations``, one record at a time to
        the others."""
        if not run:
            return
        for applier in self._appliers:
            todo = [each for each in run if each[0].offset >= applier.checkpoint]
            if not todo:
                continue
            if applier is self._activations:
                self._activations.apply_activations(todo)
            else:
                for record, control in todo:
                    applier.apply(record, control)
        run.clear()

    @staticmethod
    def _control(record: Record) -> Control | None:
        """The control a control record carries; None (logged) when its body does not decode."""
        try:
            return decode_control(record)
        except ControlError as exc:  # it passed its CRC: written by another version, or a bug; never stall on it
            LOGGER.error("control record skipped: %s", exc, extra={"ctx": {"offset": record.offset}})
            return None

    def restated(self, cut: int, chunk_bytes: int) -> list[Control]:
        """The live state of every part, as control records (blocking): each applier's ``restate()``, every
        retained message (``RetainedKept``) and the topic queues' numbering at ``cut`` (``QueueBases``, in
        records of about ``chunk_bytes``). Call with dispatch caught up to the log's end (:meth:`caught_up`)."""
        controls: list[Control] = [control for applier in self._appliers for control in applier.restate()]
        if self._retained is not None:
            controls += [RetainedKept(topic, offset, record) for topic, offset, record in self._retained.kept()]
        next_id, bases = self._queues.bases(cut)
        chunks: list[list[tuple[str, int, int]]] = [[]]
        size = 0
        for base in bases:
            if chunks[-1] and size + len(base[0]) > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(base)
            size += len(base[0]) + 20
        controls += [QueueBases(cut, next_id, chunk, i < len(chunks) - 1) for i, chunk in enumerate(chunks)]
        return controls

    def _seed(self) -> bool:
        """A dispatch that starts an empty index at a cut log (``_seeding``) first takes the queues' numbering
        where the log was cut (the ``QueueBases`` records the cut's restatement appended further on), so its
        queue offsets and ids are the original's: True once done. It reads the confirmed log from where its last
        look stopped; False while the records are not there yet (a new replica copying the log). Hold the lock."""
        log, cut = self._log, self._log.min_offset
        while self._seek < log.confirm_offset:
            try:
                scan = log.scan(self._seek, self._scan_bytes, log.confirm_offset)
            except OffsetExpired:
                break
            for record in scan.records:
                found = record.flags & FLAG_CONTROL and record.topic == _QUEUE_BASES
                bases = self._control(record) if found else None
                if isinstance(bases, QueueBases) and bases.cut == cut:
                    self._bases.append(bases)
                    if not bases.more:
                        return self._seeded()
            if scan.next_offset == self._seek:
                break
            self._seek = scan.next_offset
        return False

    def _try_seed(self) -> bool:
        """:meth:`_seed` under the lock (the run loop's look while the numbering has not arrived)."""
        with self._lock:
            return not self._seeding or self._seed()

    def _seeded(self) -> bool:
        """Number the queues as the ``QueueBases`` found say, and dispatch normally from now on."""
        self._queues.seed(self._bases[0].next_id, (base for part in self._bases for base in part.queues))
        LOGGER.info("queue numbering taken from the restatement at the log's cut", extra={"ctx": {
            "cut": self._log.min_offset, "queues": sum(len(part.queues) for part in self._bases)}})
        self._seeding, self._bases = False, []
        return True

    def _read(self, start: int, max_bytes: int) -> ScanResult:
        """The records from ``start`` up to the confirm offset: from memory when they are still there, else
        scanned from the log. The confirm offset is read after the records: without replicas it is the written
        offset, which the records appended meanwhile moved, and it only grows."""
        if self._recent is not None and start >= self._log.min_offset:
            records, next_offset = self._recent.run(self._log.next_record_offset(start), max_bytes)
            end = self._log.confirm_offset
            if next_offset > end:  # replicas have not confirmed them all yet
                records = [record for record in records if record.offset < end]
                next_offset = end
            if records:
                self._from_memory += len(records)
                return ScanResult(records, next_offset, ())
        return self._log.scan(start, max_bytes, self._log.confirm_offset)

    def _retain(self, scan: ScanResult) -> None:
        """Apply the retained updates of a scanned batch (an empty payload deletes the topic's message).

        A batch without retained records writes nothing: the family's checkpoint
        moves with the next batch that has some, and before every flush. Its
        writes skip the WAL, so a checkpoint is durable only once flushed anyway;
        writing it per batch cost a RocksDB write per dispatch step.
        """
        updates: list[tuple[str, int, bytes | None, int | None]] = []
        for rec in scan.records:
            if rec.flags & FLAG_RETAIN:
                updates.append((rec.topic, rec.offset, self._retained_copy(rec) if rec.payload else None, None))
            elif rec.flags & FLAG_BATCH:  # its retained messages, as records of their own at their positions
                updates += [(m.topic, m.offset, encode_message(m) if m.payload else None, None)
                            for m in rec.messages if m.flags & FLAG_RETAIN]
            elif rec.flags & FLAG_CONTROL and rec.topic == _RETAINED_KEPT:
                kept = self._control(rec)
                if isinstance(kept, RetainedKept):  # a restatement, in log order with the messages around it
                    updates.append((kept.topic, kept.offset, kept.record, rec.offset))
        if updates:
            self._retained.apply([u for u in updates if u[2] != SKIPPED], scan.next_offset)

    def _retained_copy(self, rec: Record) -> bytes:
        """The record's bytes for the retained store; ``SKIPPED`` if they went bad since the scan checked them
        (the log reported it): the topic keeps its previous retained message."""
        try:
            return self._log.read_bytes(rec.offset, rec.size)
        except CorruptRecord:
            return SKIPPED

    def _flush(self) -> None:
        """Persist what dispatch derived up to its offset: the index and every part, each with its checkpoint at
        that offset. Hold ``_flushing`` and not the step lock: the steps go on but for the short middle part.

        A flush takes its checkpoint X (the dispatched offset) under the step lock, and:

        1. the CommitLog is fsynced up to X or further before anything derived at X can reach the disk: first
           outside the lock (dispatch goes on), then, under it, what dispatch indexed during that fsync;
        2. under the lock (:meth:`_take`), each part takes its state at X: every RocksDB family writes its
           checkpoint X and switches its memtable, which RocksDB then writes as one table file holding exactly
           the writes made before X, none of a later step; the timer takes its checkpoint for its own thread;
        3. outside the lock (:meth:`_settle`), it waits until all of that is on disk, and only then records X as
           flushed (``flushed_offset``, each part's ``checkpoint``).

        Afterwards the log is durable up to X at least, and the index and every part up to their checkpoint X.
        A crash during a flush leaves each part on disk at its previous checkpoint or at X (a table file is
        installed whole), never between: after a process crash the log has lost nothing, and an open dispatches
        from the lowest checkpoint again, writing the same state. After a power loss the log keeps its flushed
        part: before step 1 ends nothing at X is on disk, after it the log keeps X. So no part is ever past the
        log's end because of a flush; only a memtable RocksDB writes on its own (a full one, or retention's flush,
        both with later steps' writes) can be, and the rewind on open (the constructor, :meth:`recover`) undoes
        it, as before.
        """
        if self._log.flushed_offset < self._offset:
            self._log.flush()
        with self._lock:
            offset = self._take()
        try:
            self._settle()
        except BaseException:
            with self._lock:
                self._unflushed += offset - self._flushed_offset  # due again
            raise
        self._flushed_offset = offset

    def _take(self) -> int:
        """Steps 1 and 2 of :meth:`_flush` (hold the step lock): the log fsynced up to the dispatched offset, every
        part's state at that offset taken for persisting. Returns the offset."""
        offset = self._offset
        if self._log.flushed_offset < offset:  # what dispatch indexed during the fsync outside the lock
            self._log.flush()
        if self._retained is not None:
            self._retained.apply((), offset)  # the checkpoint of the batches without retained records
            self._retained.flush(wait=False)
        if self._awaiting is not None:
            self._awaiting.apply((), offset)  # the checkpoint of the batches without QoS 2 records
            self._awaiting.collect(offset)
            self._awaiting.flush(wait=False)
        for applier in self._appliers:
            applier.flush(offset)
        self._queues.flush(wait=False)
        self._unflushed = 0
        self._flushed_at = time.monotonic()
        return offset

    def _settle(self) -> None:
        """Step 3 of :meth:`_flush` (not under the step lock): wait until what :meth:`_take` took is on disk."""
        if self._retained is not None:
            self._retained.settle()
        if self._awaiting is not None:
            self._awaiting.settle()
        for applier in self._appliers:
            applier.settle()
        self._queues.settle()

    def truncate(self, offset: int) -> None:
        """Cut the CommitLog at ``offset`` (``CommitLog.truncate``: a follower drops what its leader does not
        have) and rewind everything derived from the records past it: the index, the retained messages, the QoS 2 flows, the control appliers and the records kept in
        memory. Blocking (run it in a worker thread); dispatch waits meanwhile.

        The log is cut first: a crash after it leaves derived state past the log's end, which the next open
        rewinds (this constructor and :meth:`recover`), as after an OS crash.
        """
        with self._flushing, self._lock:
            self._log.truncate(offset)
            if self._recent is not None:
                self._recent.drop_from(offset)
            self._queues.rewind(offset)
            if self._retained is not None:
                self._retained.rewind(offset)
            if self._awaiting is not None:
                self._awaiting.rewind(offset)
            for applier in self._appliers:
                applier.rewind(offset)
            start = min([self._queues.checkpoint, self._offset, offset,
                         *(part.checkpoint for part in (self._retained, self._awaiting) if part is not None),
                         *(applier.checkpoint for applier in self._appliers)])
            self._offset = max(start, self._log.min_offset)
            self._flushed_offset = min(self._flushed_offset, self._offset)

    def start_at(self, offset: int) -> None:
        """Begin the empty log at ``offset`` (``CommitLog.start_at``: a new replica joining a leader whose retention
        deleted what is below) and dispatch from there. Blocking (run it in a worker thread)."""
        with self._flushing, self._lock:
            self._log.start_at(offset)
            self._queues.on_retention(offset)
            self._offset = self._flushed_offset = self._seek = offset
            self._seeding = self._queues.statistics().next_queue_id == TOPIC_IDS

    def _flush_due(self) -> bool:
        return bool(self._unflushed) and (self._unflushed >= self._flush_bytes
                                          or time.monotonic() - self._flushed_at >= self._flush_interval_s) \
            and (self._room is None or self._room())

    def _early_due(self) -> bool:
        return self._early is not None and self._early.flush_wanted() and (self._room is None or self._room())

    def _flush_idle(self) -> None:
        """The flush after steps that made it due, or when traffic stopped; none while one runs (in another
        thread: it takes what is dispatched when it takes its checkpoint, and what comes after is due next)."""
        if not self._flushing.acquire(blocking=False):
            return
        try:
            if self._unflushed and not self._flush_due() and self._early_due():
                self._flush_early()
            elif self._unflushed:
                self._flush()
        finally:
            self._flushing.release()

    def _flush_early(self) -> None:
        """The checkpoint of ``early`` alone (:class:`EarlyCheckpoint`): it takes its state at the dispatched offset
        under the step lock, which it holds that long only, and makes the log durable up to there itself before
        writing it; the index and the other parts keep their checkpoints until their flush. After a crash dispatch
        applies from the lowest checkpoint again, each part the records at or past its own. Hold ``_flushing``."""
        assert self._early is not None
        with self._lock:
            self._early.flush(self._offset)
        self._early.settle()

    def _ask_flush(self) -> None:
        """Have :meth:`run`'s flusher task flush if a flush is due. Call from the trio thread."""
        if self._flush_due() or self._early_due():
            self._flush_asked.set()

    # -- trio --------------------------------------------------------------------

    def wake(self) -> None:
        """New records were appended: dispatch them now. Call from the trio thread."""
        self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch while there are new records, otherwise sleep until :meth:`wake`.

        A step over a few records still in memory (``recent``) runs right here
        in the trio thread: a hand-off to a worker thread and back costs more
        than indexing them, and is where a message's latency went at moderate
        rates. Larger steps and steps that read the log run in a worker thread,
        and so do flushes, in a task of their own (:meth:`_flush_when_asked`):
        the steps go on while RocksDB writes a flush's memtables. The listener
        and the waiters of :meth:`wait_dispatched` are served in the trio thread
        after each step. Runs until cancelled; then the waiters of what it did not index are told
        (``DispatchStopped``).
        """
        self._stopped = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flush_when_asked)
                task_status.started()
                while True:
                    self._wakeup = trio.Event()
                    try:
                        batch = await self._run_once()
                    except Exception as exc:  # RocksDB refused a write (a full disk...): retry, never end the node
                        self._steps.failed(exc, {"dispatched_offset": self._offset})
                        await trio.sleep(FALLBACK_WAKE_S)
                        continue
                    self._steps.succeeded({"dispatched_offset": self._offset})
                    self._announced(batch)
        finally:
            self._stopped = True  # its waiters raise DispatchStopped from now on
            self._progress.set()
            self._progress = trio.Event()

    async def _flush_when_asked(self) -> None:
        """:meth:`run`'s flusher task: each flush asked for (``_ask_flush``: after a step that made one due, and
        at least every ``FALLBACK_WAKE_S``) in a worker thread; a failed one is logged and tried again."""
        while True:
            await self._flush_asked.wait()
            self._flush_asked = trio.Event()
            try:
                await trio.to_thread.run_sync(self._flush_idle)
            except Exception as exc:  # RocksDB could not write (a full disk...): the next turn asks again
                self._flushes.failed(exc, {"flushed_offset": self._flushed_offset})
                await trio.sleep(FALLBACK_WAKE_S)
                continue
            self._flushes.succeeded({"flushed_offset": self._flushed_offset})

    def _announced(self, batch: DispatchBatch | None) -> None:
        """End a turn in the trio thread: announce ``batch`` with the steps :meth:`caught_up` took, and wake the
        waiters of :meth:`wait_dispatched` and :meth:`wait_lag`."""
        batch = self._with_unannounced(batch)
        if batch is None:
            return
        self._announce(batch)
        self._progress.set()
        self._progress = trio.Event()

    def dispatch_now(self) -> None:
        """New records were appended: index them in the caller's step if that is a small step in memory (as
        :meth:`run` would do inline) and no other step runs; else, and after any failure, leave them to :meth:`run`.
        Call from the trio thread.

        A turn of :meth:`run` comes one scheduling round after the append, and at a fan-in's load a round of the
        event loop is a whole read round of the gateway (hundreds of PUBLISHes, tens of ms): a QoS 1 message's
        way from its append to its subscriber took one such round for dispatch and another for its news. Done
        here, the news reach the listener (the gateway's mailbox) in the step that appended the records.
        """
        if self._seeding or self._steps.failing or self._offset >= self._log.confirm_offset or not self._inline() \
                or not self._lock.acquire(blocking=False):  # a worker thread steps, or a flush takes its checkpoint
            self.wake()
            return
        try:
            batch = self._locked_step(INLINE_BYTES)
        except Exception:  # run() steps again, logs the failure and retries
            self.wake()
            return
        finally:
            self._lock.release()
        self._announced(batch)
        self._ask_flush()
        if self._offset < self._log.confirm_offset:
            self.wake()

    async def _run_once(self) -> DispatchBatch | None:
        """One turn of :meth:`run`: a step (or a wait for records), and the flush it made due asked for."""
        if self._offset >= self._log.confirm_offset or self._seeding and not await trio.to_thread.run_sync(
                self._try_seed):
            with trio.move_on_after(FALLBACK_WAKE_S):
                await self._wakeup.wait()
            self._ask_flush()
            return None
        if self._inline() and self._lock.acquire(blocking=False):  # else a flush holds it: never wait in trio's thread
            try:
                batch = self._locked_step(INLINE_BYTES)
            finally:
                self._lock.release()
            if self._offset < self._log.confirm_offset:
                await trio.lowlevel.checkpoint()  # more to index: let the others run between steps
        else:
            batch = await trio.to_thread.run_sync(self._step, self._scan_bytes)
        self._ask_flush()
        return batch

    def _inline(self) -> bool:
        """Is the next step small and in memory?"""
        recent = self._recent
        return (recent is not None and self._log.confirm_offset - self._offset <= INLINE_BYTES
                and recent.get(self._offset) is not None)

    async def wait_lag(self, max_lag: int = MAX_LAG) -> None:
        """Return once at most ``max_lag`` bytes of the log wait for dispatch (needs :meth:`run`): appenders
        call it first, so the log does not grow faster than the index.

        Raises:
            DispatchStopped: :meth:`run` ended first.
        """
        while self._log.written_offset - self._offset > max_lag:
            self._check_running()
            await self._progress.wait()

    async def wait_dispatched(self, offset: int) -> None:
        """Return once every record below CommitLog offset ``offset`` is indexed (needs :meth:`run`).

        Raises:
            DispatchStopped: :meth:`run` ended first.
        """
        while self._offset < offset:
            self._check_running()
            await self._progress.wait()

    def _check_running(self) -> None:
        if self._stopped:
            raise DispatchStopped(f"dispatch stopped at offset {self._offset}: the store node closes")

    def close(self) -> None:
        """Flush what was dispatched, so a restart does not re-dispatch it; not on a full disk (a failed flush
        would leave RocksDB refusing writes, and the next start re-dispatches from the last checkpoint anyway)."""
        if self._room is not None and not self._room():
            LOGGER.warning("index not flushed at shutdown: the data disk is full; the next start re-indexes "
                           "from the last flushed checkpoint", extra={"ctx": {"checkpoint": self._flushed_offset}})
            return
        with self._flushing:
            self._flush()
