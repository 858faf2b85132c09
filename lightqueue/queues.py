"""Light queues in RocksDB: queue ids, index entries, active filters, pulls, offsets, retention.

A light queue is a name (a topic, or a filter such as ``a/+/c`` or ``a/#``)
mapped to a compact id, and a sequence of index entries ``(id, queue offset) ->
(CommitLog offset, size, store ms)``, stored as runs (one key per queue per
dispatch batch, lightqueue/keys.py); the message itself lives once in the
CommitLog. Queues are created by their first entry and cost nothing else.

Where a record goes (decided by the appender and dispatcher together):

- its exact-topic queue, named by the topic;
- its first-level queue ``<first level>/#``, the queue of that filter, which is
  implicitly always active (server-side consumers read it like a classic topic);
- every other active wildcard filter whose queue id is listed in the record's
  target-queues section (:meth:`LightQueues.targets` computes it at append
  time) and that is active at the record's offset.

Durability: everything here is derived from the CommitLog. Index batches (entries, max offsets, dispatch
checkpoint) and the state that control records make (store/control.py: filter activations with their queue ids,
holders, consumer offsets, applied by store/queuecontrol.py through :meth:`activate`, :meth:`release`,
:meth:`commit_offsets` and :meth:`delete_owner`) are written without the WAL, so whatever a crash leaves is a
consistent prefix of dispatch that re-dispatch from the checkpoints extends identically. Retention writes with the
WAL after flushing the memtable, so its range deletes never sit on top of writes a crash could still lose.

Queue ids: a wildcard filter's id is chosen by the writer of its activation record (:meth:`filter_id`, from
``1`` up, below 2^32 as the target-queues section needs) and written in the record; topic and first-level queues
(never named by id in a record) get theirs from dispatch, from ``TOPIC_IDS`` (2^32) up. The two ranges never meet,
so every copy of the log derives the same filter ids whatever ids its topic queues got. A listed id is indexed only
if it is the id of a filter active at the record's offset (activated at or before it, in log order); an id whose
filter is gone is skipped. See docs/storage.md, "Light-queue index (RocksDB)".

Concurrency: one dispatcher thread calls :meth:`index` and applies control records; other threads may pull at the
same time. Changes to queue state are serialised by one lock. :meth:`targets` is meant for the appender's thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar, final

import msgspec
import rocksdict

from lightqueue import keys
from lightqueue.filters import FilterIndex
from lightqueue.memtable import MemtableFlush
from lightqueue.results import PullResult
from lightqueue.sized import ENTRY_OVERHEAD, SizedCache
from lightqueue.targets import MAX_QUEUE_ID, encode_queues
from lightqueue.topics import first_level_queue, is_wildcard, validate_filter

__all__ = ["TOPIC_IDS", "IndexRecord", "LightQueues", "LightQueuesStatistics", "LogReader", "PullResult"]

T = TypeVar("T")

TARGET_CACHE_SIZE = 65_536
"""Topics whose target section is cached; per-device topics can be millions, hot ones are far fewer."""

TARGET_CACHE_BYTES = 16 * 1024 * 1024
"""The same cache in bytes, topics included: what 65,536 topics of ~100 bytes take. Topics are client input (up to
65,535 bytes each): bounded by count alone, 6,000 long topics held 390 MB here."""

QUEUE_CACHE_SIZE = 262_144
"""Queue states (id, max offset) kept in memory; a miss costs two point reads, a state ~200 bytes."""

QUEUE_CACHE_BYTES = 64 * 1024 * 1024
"""The same cache in bytes, queue names included (a queue is named by its topic, so by client input too)."""

QUEUE_STATE_BYTES = 200
"""Bytes one cached queue state costs (the object and its key prefix), for the byte bound."""

ABSENT_NAMES = 65_536
ABSENT_BYTES = 8 * 1024 * 1024
"""Names found to have no queue (:meth:`LightQueues.starts`) that are remembered, all forgotten at once past either
bound (names are client input: up to 65,535 bytes each): a new subscription to a topic nobody published to read the
database twice for a name that is not there (its start, then the node's head of its queue; issue 31: 25,000 of
them), now once."""

TOPIC_IDS = MAX_QUEUE_ID + 1
"""The first id of a topic or first-level queue; filter ids are below it (docs/storage.md, "Queue ids")."""

SWEEP_CHUNK = 1024
"""Queues examined per lock hold during retention, so dispatch is never stalled for long."""

_EMPTY = b""


class LogReader(Protocol):
    """What the light queues need from the CommitLog (store.log.commitlog.CommitLog provides it)."""

    @property
    def min_offset(self) -> int:
        """The first offset still readable; retention moves it up."""
        ...

    def read_many(self, locations: Sequence[tuple[int, int]]) -> list[bytes | None]:
        """The raw records at ``(offset, size)`` locations, in order; None for one that has expired, ``b""``
        for one that is corrupt (the reader reported it; it is skipped, never served)."""
        ...


class IndexRecord(Protocol):
    """The fields of a decoded record that indexing needs (store.log.record.Record has them)."""

    offset: int
    size: int
    store_ms: int
    topic: str
    queues: tuple[int, ...]  # queue ids of the target-queues section
    batch_count: int  # a batch record's messages (one entry, that many queue offsets); 0 for a single record


@dataclass(frozen=True, slots=True)
class LightQueuesStatistics:
    active_filters: int  # wildcard filters in the trie (implicit `a/#` and exact filters excluded)
    checkpoint: int  # CommitLog offset dispatched up to
    next_queue_id: int  # of topic queues (from TOPIC_IDS)
    next_filter_id: int
    cached_queues: int
    cached_targets: int
    entries_indexed: int  # since this process opened the index
    queues_removed: int  # by release or retention, since open


class _Filter(msgspec.Struct, frozen=True, gc=False, eq=False):
    """An active wildcard filter: its name, its queue id and the CommitLog offset it is active since.

    This and ``_Queue`` hold only strings, bytes and numbers, so they are left out of the garbage collector's
    walks (``gc=False``): one of each per wildcard filter held, 50,000 for 50 sessions of 1,000 (issue 31)."""

    name: str
    qid: int
    since: int


class _Queue(msgspec.Struct, gc=False, eq=False):
    """In-memory state of one queue; ``max`` is the next queue offset to write."""

    qid: int
    prefix: bytes
    max: int


def _new_queue(qid: int, max_offset: int) -> _Queue:
    return _Queue(qid, keys.entry_prefix(qid), max_offset)


@final
class _Slot:
    """One queue's share of an index batch: the packed entries it gets, from its max offset on (20-byte
    ``keys.ENTRY`` for a single record, 24-byte ``keys.BATCH_ENTRY`` for a batch record)."""

    __slots__ = ("state", "entries", "end")

    def __init__(self, state: _Queue) -> None:
        self.state = state
        self.entries: list[bytes] = []
        self.end = state.max  # the queue's max offset once the batch is written (set by write)

    def write(self, put: Callable[[bytes, bytes], None]) -> None:
        """Put the entries as runs of at most ``keys.RUN_ENTRIES`` (a batch run for batch records' entries), and
        the new max offset."""
        state, entries, width = self.state, self.entries, keys.ENTRY.size
        qoff = state.max
        if sum(map(len, entries)) == width * len(entries):  # single records only: the layout before batches
            for i in range(0, len(entries), keys.RUN_ENTRIES):
                put(state.prefix + (qoff + i).to_bytes(8, "big"), b"".join(entries[i:i + keys.RUN_ENTRIES]))
            qoff += len(entries)
        else:
            for run in _runs_of(entries):
                value = b"".join(run) if len(run[0]) == width else keys.BATCH_RUN + b"".join(run)
                put(state.prefix + qoff.to_bytes(8, "big"), value)
                qoff += keys.run_span(value)
        self.end = qoff
        put(keys.max_key(state.qid), keys.U64.pack(qoff))


def _runs_of(entries: list[bytes]) -> Iterator[list[bytes]]:
    """Consecutive entries of one width, at most ``keys.RUN_ENTRIES`` each: the runs a slot writes."""
    run: list[bytes] = []
    for entry in entries:
        if run and (len(entry) != len(run[0]) or len(run) == keys.RUN_ENTRIES):
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


def is_implicit(filter: str) -> bool:
    """Is this the first-level queue of some topic (``a/#``), indexed whether or not anyone holds it?"""
    return filter.endswith("/#") and filter.count("/") == 1 and filter[0] not in "+#"


@final
class LightQueues:
    """The light-queue index over one RocksDB database.

    Args:
        db: a raw-mode Rdict (store.rocks.open_db).
        sync: fsync the WAL on the writes that use it (retention, the one-time split of an older index's queue
            ids). False survives a process crash; True also a power loss.

    Resource handling: the caller owns ``db`` and closes it after this object
    is no longer used.
    """

    def __init__(self, db: rocksdict.Rdict, *, sync: bool = False) -> None:
        self._db = db
        self._lock = threading.Lock()
        self._wal = rocksdict.WriteOptions()
        self._wal.sync = sync
        self._no_wal = rocksdict.WriteOptions()
        self._no_wal.disable_wal = True
        self._memtable = MemtableFlush()
        self._queues: SizedCache[str, _Queue] = _queue_cache()
        # Names without a queue, found so under the lock; a queue made under a name takes it out (_cache).
        self._absent: dict[str, None] = {}
        self._absent_bytes = 0
        self._targets: SizedCache[str, bytes] = _target_cache()
        self._filters = FilterIndex()
        self._active: dict[str, _Filter] = {}  # by filter name
        self._active_ids: dict[int, _Filter] = {}  # the same, by queue id
        self._entries_indexed = 0
        self._queues_removed = 0
        self._checkpoint = self._u64(keys.CHECKPOINT, 0)
        self._retained = self._u64(keys.RETAINED, 0)
        raw = db.get(keys.APPLIED)
        self._applied = keys.U64.unpack(raw)[0] if raw else None
        self._next_id = self._u64(keys.NEXT_ID, TOPIC_IDS)
        self._next_filter_id = self._u64(keys.NEXT_FILTER_ID, 1)
        if self._next_id < TOPIC_IDS:  # an index from before the split: filters go on from its ids, topics above
            self._next_filter_id = max(self._next_filter_id, self._next_id)
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.put(keys.NEXT_FILTER_ID, keys.U64.pack(self._next_filter_id))
            batch.put(keys.NEXT_ID, keys.U64.pack(TOPIC_IDS))
            db.write(batch, self._wal)
            self._next_id = TOPIC_IDS
        for key, value in self._scan(b"A"):
            name = key[1:].decode()
            state = self._load(name)
            if state is None:
                raise RuntimeError(f"active filter {name!r} has no queue id: the index database is inconsistent")
            self._add_active(_Filter(name, state.qid, keys.U64.unpack(value)[0]))

    # -- queue names -----------------------------------------------------------------

    def queue_id(self, name: str) -> int:
        """The id of a queue, allocated on first use (a topic queue's, like dispatch's first entry; no WAL)."""
        state = self._load(name)
        if state is not None:
            return state.qid
        with self._lock:
            batch = rocksdict.WriteBatch(raw_mode=True)
            state = self._state(name) or self._allocate(name, batch)
            self._write(batch, None)
            return state.qid

    def queue_name(self, qid: int) -> str | None:
        raw = self._db.get(keys.id_key(qid))
        return raw.decode() if raw is not None else None

    def max_offset(self, name: str) -> int:
        """The queue offset the next entry will get (0 for a queue that does not exist)."""
        state = self._load(name)
        return state.max if state is not None else 0

    def min_offset(self, name: str) -> int:
        """The first queue offset still stored (retention moves it up)."""
        state = self._load(name)
        return self._min(state.qid) if state is not None else 0

    def log_offset(self, name: str, qoff: int) -> int | None:
        """The CommitLog offset queue offset ``qoff`` points at; None if that entry is not stored."""
        state = self._load(name)
        entry = self._entry(state.qid, qoff) if state is not None else None
        return entry[0] if entry is not None else None

    def offset_at(self, name: str, log_offset: int) -> int:
        """The queue offset of the first entry at or after CommitLog offset ``log_offset``.

        This is the exact start of a subscription activated when the CommitLog
        ended at ``log_offset``, once dispatch has passed that point (the max
        offset if no later entry exists yet).
        """
        (start,) = self.starts([name], log_offset)
        return start

    def starts(self, names: Sequence[str], log_offset: int) -> list[int]:
        """:meth:`offset_at` of each name (the starts of a run of activations), under the lock: a name found to
        have no queue is remembered as such until a queue is made under it, so the reads of its max offset that
        follow (the node's head of a new subscription's queue) read nothing (``ABSENT_NAMES``)."""
        cached, absent = self._queues.get, self._absent
        starts: list[int] = []
        with self._lock:
            for name in names:
                state = cached(name)
                if state is None:
                    if name in absent:
                        starts.append(0)
                        continue
                    state = self._read(name)
                    if state is None:
                        self._remember_absent(name)
                        starts.append(0)
                        continue
                    self._cache(name, state)
                # nothing ever indexed (a new wildcard's queue): no min offset to read
                starts.append(self._first_at_or_after(state.qid, self._min(state.qid), state.max, log_offset)
                              if state.max else 0)
        return starts

    def _remember_absent(self, name: str) -> None:
        """``name`` has no queue (found so under the lock, which every maker of a queue holds). Hold the lock."""
        cost = len(name) + ENTRY_OVERHEAD
        self._absent_bytes += cost
        if len(self._absent) >= ABSENT_NAMES or self._absent_bytes > ABSENT_BYTES:
            self._absent.clear()
            self._absent_bytes = cost
        self._absent[name] = None

    def offset_at_time(self, name: str, ms: int) -> int:
        """The queue offset of the first entry stored at or after ``ms`` (ms since the epoch).

        Where a consumer group that starts "from a timestamp" begins: a binary
        search over the entries' store times, which follow the CommitLog order
        (the store stamps records as it appends them). Returns the max offset
        when every entry is older, the min offset when none is (0 for an
        unknown queue). An entry retention removed mid-search counts as older.
        """
        state = self._load(name)
        if state is None:
            return 0
        qid = state.qid
        low, high = self._min(qid), state.max
        while low < high:
            mid = (low + high) // 2
            entry = self._entry(qid, mid)
            if entry is not None and entry[2] >= ms:
                high = mid
            else:
                low = mid + 1
        return low

    # -- targets and filters -------------------------------------------------------

    def targets(self, topic: str) -> bytes:
        """The encoded target-queues section for a record on ``topic`` (``b""`` if none).

        The queue ids of the active wildcard filters matching the topic, except
        the implicit first-level filter (``a/#`` for ``a/...``), which dispatch
        always indexes. Never allocates: a filter's id exists from its
        activation. The topic must be valid (lightqueue.topics.validate_topic).
        Cached per topic.
        """
        cache = self._targets
        section = cache.get(topic)
        if section is None:
            found = self._filters.match(topic)
            if found:
                active = self._active
                # .get: a filter released since the match is no longer listed (dispatch would skip it).
                section = encode_queues(f.qid for f in map(active.get, found) if f is not None)
            else:
                section = _EMPTY
            cache.put(topic, section)
        return section

    def filter_id(self, filter: str) -> int:
        """The queue id an activation record for ``filter`` carries, as things stand: an active wildcard
        filter's own id, else the next filter id; 0 for an exact filter or ``a/#`` (never listed in a record).

        Raises:
            TopicError: the filter is not a valid MQTT topic filter.
            ValueError: the id does not fit a target-queues section (2^32 - 1 filter ids were given out).
        """
        (qid,), _ = self.filter_ids([filter], 0)
        if isinstance(qid, ValueError):
            raise qid
        return qid

    def filter_ids(self, filters: Sequence[str], given: int) -> tuple[list[int | ValueError], int]:
        """:meth:`filter_id` of each filter, for activation records written together, and the next id to give.

        The caller (store/node.py) gives each first activation an id no other was given, applied or not, so two
        filters never get one id: a new wildcard filter's is from ``given`` up (the next id not given out yet) or
        the next filter id, whichever is higher, and a filter twice in ``filters`` gets one; an active filter's
        id is never given to another, even once released. A filter refused gets its error in its place
        (``TopicError``, or ``ValueError``: its id would not fit a target-queues section).
        """
        active = self._active
        fresh: dict[str, int] = {}
        next_id = max(self._next_filter_id, given)
        ids: list[int | ValueError] = []
        for filter in filters:
            try:
                validate_filter(filter)
            except ValueError as exc:  # TopicError
                ids.append(exc)
                continue
            if not is_wildcard(filter) or is_implicit(filter):
                ids.append(0)
                continue
            known = active.get(filter)
            qid = known.qid if known is not None else fresh.get(filter)
            if qid is None:
                if next_id > MAX_QUEUE_ID:
                    ids.append(ValueError(f"queue id {next_id} of filter {filter!r} does not fit a target-queues "
                                          "section"))
                    continue
                qid = fresh[filter] = next_id
                next_id += 1
            ids.append(qid)
        return ids, next_id

    def is_active(self, filter: str) -> bool:
        """Is ``filter`` a wildcard filter being indexed (implicit first-level filters excluded)?"""
        return filter in self._active

    def activate(self, filter: str, holder: str, since: int, qid: int | None = None, *,
                 applied: int | None = None) -> int:
        """Apply an activation: ``holder`` (a session or consumer group) holds ``filter``.

        The first holder of a wildcard filter starts its indexing under queue id ``qid`` (None: :meth:`filter_id`):
        every record at or after CommitLog offset ``since`` (the activation record's) that lists the id is
        indexed into the filter's queue, and :meth:`targets` lists it from now on. An active filter keeps its id
        and its start. Exact filters and ``a/#`` are always indexed; holding them keeps their queues from being
        removed. Written without the WAL (derived state); ``applied``: the control checkpoint to write with it.

        Returns:
            the queue's current max offset.

        Raises:
            TopicError: the filter is not a valid MQTT topic filter.
            ValueError: ``qid`` is not a filter id (0, or from the topic queues' range).
        """
        (offset,) = self._activate_all([(filter, holder, since, qid)], applied, raise_errors=True)
        assert isinstance(offset, int)
        return offset

    def activate_all(self, activations: Sequence[tuple[str, str, int, int | None]], *, applied: int
                     ) -> list[ValueError | None]:
        """:meth:`activate` of each ``(filter, holder, since, qid)``, in order, in one write (a run of activation
        records: 50 sessions subscribing at once made one RocksDB write per record, issue 31). One that
        :meth:`activate` would refuse is skipped alone: its error is in its place of the answer (None: applied)."""
        return [None if isinstance(r, int) else r for r in self._activate_all(activations, applied)]

    def _activate_all(self, activations: Sequence[tuple[str, str, int, int | None]], applied: int | None, *,
                      raise_errors: bool = False) -> list[int | ValueError]:
        """Each activation's error, or its max offset (``raise_errors``: :meth:`activate`; else 0); the in-memory
        state changes once the batch is written."""
        with self._lock:
            batch = self._batch(applied)
            started: dict[str, _Filter] = {}  # first activations of this batch
            next_filter_id = self._next_filter_id
            answers: list[int | ValueError] = []
            last_holder: str | None = None
            holding: Callable[[str], tuple[bytes, bytes]]  # last_holder's (a str: set by the first)
            for filter, holder, since, qid in activations:
                if holder != last_holder:  # a run's activations are one holder's
                    holding, last_holder = keys.holding_keys(holder), holder
                try:
                    next_filter_id = self._activate_into(batch, filter, holding, since, qid, started, next_filter_id)
                except ValueError as exc:  # TopicError included
                    if raise_errors:
                        raise
                    answers.append(exc)
                    continue
                answers.append(0)
            if next_filter_id != self._next_filter_id:
                batch.put(keys.NEXT_FILTER_ID, keys.U64.pack(next_filter_id))
            try:
                self._write(batch, applied)
            except Exception:
                self._reset_cache()
                raise
            self._next_filter_id = next_filter_id
            for active in started.values():
                self._add_active(active)
            if started:
                self._targets = _target_cache()
            if not raise_errors:  # activate_all answers applied or not: no max offset to read (a RocksDB get each)
                return answers
            return [a if isinstance(a, ValueError) else self.max_offset(f) for (f, *_), a in zip(activations, answers)]

    def _activate_into(self, batch: rocksdict.WriteBatch, filter: str, holding: Callable[[str], tuple[bytes, bytes]],
                       since: int, qid: int | None, started: dict[str, _Filter], next_filter_id: int) -> int:
        """One activation's writes into ``batch`` (``holding``: its holder's ``keys.holding_keys``), none when it
        raises; a filter indexed from now on goes into ``started``. Returns the next filter id after it. Hold the
        lock."""
        validate_filter(filter)
        first = is_wildcard(filter) and not is_implicit(filter) and filter not in self._active \
            and filter not in started
        if first:
            qid = next_filter_id if qid is None else qid
            if not 0 < qid <= MAX_QUEUE_ID:
                raise ValueError(f"{qid} is not a filter's queue id (1 to {MAX_QUEUE_ID})")
        holder_key, held_by_key = holding(filter)
        batch.put(holder_key, _EMPTY)
        batch.put(held_by_key, _EMPTY)
        if not first:
            return next_filter_id
        assert qid is not None
        state = self._state(filter)
        if state is not None and state.qid != qid:  # an older queue of that name (offsets on it): replaced
            self._remove(filter, state, batch)
            state = None
        if state is None:
            self._cache(filter, _new_queue(qid, 0))
            batch.put(keys.name_key(filter), keys.U64.pack(qid))
            batch.put(keys.id_key(qid), filter.encode())
        next_filter_id = max(next_filter_id, qid + 1)  # written once for the batch (_activate_all)
        batch.put(keys.active_key(filter), keys.U64.pack(since))
        started[filter] = _Filter(filter, qid, since)
        return next_filter_id

    def release(self, filter: str, holder: str, *, applied: int | None = None) -> bool:
        """Apply a release: ``holder`` stops holding ``filter`` (written without the WAL).

        The holder's offset on the filter's queue goes too. When the last holder
        of a wildcard filter goes, the filter stops being indexed and its queue
        (entries, offsets, id) is deleted.

        Returns:
            True if the holder held the filter.
        """
        with self._lock:
            return self._release(filter, holder, self._batch(applied), applied)

    def _release(self, filter: str, holder: str, batch: rocksdict.WriteBatch, applied: int | None) -> bool:
        """:meth:`release` with the lock held, into ``batch`` (written here, with what it held before)."""
        key = keys.holder_key(filter, holder)
        if self._db.get(key) is None:
            self._write(batch, applied)
            return False
        batch.delete(key)
        batch.delete(keys.held_by_key(holder, filter))
        state = self._state(filter)
        if state is not None:
            batch.delete(keys.offset_key(holder, state.qid))
            batch.delete(keys.ref_key(state.qid, holder))
        last = not any(k != key for k, _ in self._scan(keys.holder_prefix(filter), limit=2))
        if not (last and filter in self._active):
            self._write(batch, applied)
            return True
        batch.delete(keys.active_key(filter))
        if state is not None:
            self._remove(filter, state, batch)  # the whole queue and its id: listed, it is skipped
        self._write(batch, applied)
        self._filters.remove(filter)
        self._targets = _target_cache()
        gone = self._active.pop(filter)  # after the trie: nothing new lists it, and dispatch skips the rest
        del self._active_ids[gone.qid]
        return True

    def holders(self, filter: str) -> list[str]:
        """Who holds a filter (empty: the filter is not active)."""
        prefix = keys.holder_prefix(filter)
        return [k[len(prefix):].decode() for k, _ in self._scan(prefix)]

    def held_by(self, holder: str) -> list[str]:
        """The filters a holder holds."""
        prefix = keys.held_by_prefix(holder)
        return [k[len(prefix):].decode() for k, _ in self._scan(prefix)]

    def active_filters(self) -> Iterator[str]:
        """The wildcard filters being indexed (implicit first-level filters excluded)."""
        return iter(self._filters)

    # -- dispatch ------------------------------------------------------------------

    @property
    def checkpoint(self) -> int:
        """The CommitLog offset dispatched up to: re-dispatch after a restart starts here."""
        return self._checkpoint

    def index(self, records: Iterable[IndexRecord], next_log_offset: int) -> dict[str, int]:
        """Index records (in CommitLog order) and move the checkpoint to ``next_log_offset``.

        One write batch (no WAL) holds every entry, every touched queue's new
        max offset, the new queue ids (from ``TOPIC_IDS`` up) and the checkpoint. A queue's entries of the batch are written as runs
        (``keys.RUN_ENTRIES``), one key per run. Records below the checkpoint
        were indexed before and are skipped, so indexing is idempotent.

        Returns:
            ``{queue name: new max offset}`` for every queue that got entries.
        """
        pack_entry, pack_batch = keys.ENTRY.pack, keys.BATCH_ENTRY.pack
        with self._lock:
            checkpoint = self._checkpoint
            if next_log_offset < checkpoint:
                raise ValueError(f"checkpoint cannot move back from {checkpoint} to {next_log_offset}")
            batch = rocksdict.WriteBatch(raw_mode=True)
            put = batch.put
            touched: dict[str, _Slot] = {}
            routes: dict[tuple[str, tuple[int, ...]], list[list[bytes]]] = {}  # (topic, section) -> entry lists
            count = 0
            for rec in records:
                offset = rec.offset
                if offset < checkpoint:
                    continue
                batched = rec.batch_count
                value = pack_batch(offset, rec.size, rec.store_ms, batched) if batched else \
                    pack_entry(offset, rec.size, rec.store_ms)
                route = routes.get((rec.topic, rec.queues))
                if route is None:
                    route, stable = self._route(rec.topic, rec.queues, offset, checkpoint, touched, batch)
                    if stable:
                        routes[(rec.topic, rec.queues)] = route
                for entries in route:
                    entries.append(value)
                count += len(route)
            put(keys.CHECKPOINT, keys.U64.pack(next_log_offset))
            for slot in touched.values():
                slot.write(put)
            try:
                self._db.write(batch, self._no_wal)
            except Exception:
                self._reset_cache()  # states allocated above may not exist in the database
                raise
            moved = {name: slot.end for name, slot in touched.items()}
            for slot in touched.values():
                slot.state.max = slot.end
            self._checkpoint = next_log_offset
            self._entries_indexed += count
        return moved

    def _route(
        self,
        topic: str,
        section: tuple[int, ...],
        offset: int,
        checkpoint: int,
        touched: dict[str, _Slot],
        batch: rocksdict.WriteBatch,
    ) -> tuple[list[list[bytes]], bool]:
        """The entry lists (of the queues' slots) a record at ``offset`` goes to, and whether
        every record of the batch with this topic and section goes to the same ones (no filter
        listed in the section was activated inside the batch).

        A listed id goes in if it is an active filter's and the filter is active
        since ``offset`` or before; the id of a released filter has no queue any
        more and is skipped (a re-activated filter has a new id)."""
        names = [topic, first_level_queue(topic)]
        stable = True
        active_ids = self._active_ids
        for qid in section:
            active = active_ids.get(qid)
            if active is not None:
                if active.since <= offset:
                    names.append(active.name)
                stable = stable and active.since <= checkpoint
        route = []
        for name in names:
            slot = touched.get(name)
            if slot is None:
                slot = touched[name] = _Slot(self._state(name) or self._allocate(name, batch))
            route.append(slot.entries)
        return route, stable

    def flush(self, *, wait: bool = True) -> None:
        """Persist the memtable (index batches included) so a restart re-dispatches little. ``wait=False``: only
        switch it, so it holds exactly the writes made so far (dispatch does, under its lock), and let
        :meth:`settle` wait until it is written (outside the lock: dispatch goes on meanwhile)."""
        self._memtable.flush(self._db, wait=wait)

    def settle(self) -> None:
        """Return once the memtable :meth:`flush` switched is on disk."""
        self._memtable.wait(self._db)

    # -- pulls and consumer offsets --------------------------------------------------

    def pull(
        self,
        name: str,
        from_offset: int,
        max_count: int,
        max_bytes: int,
        log: LogReader,
        decode: Callable[[bytes, int], T],
        cached: Callable[[int], T | None] | None = None,
        unpack: Callable[[T], Sequence[T]] | None = None,
        whole: Callable[[T, int, int], T] | None = None,
    ) -> PullResult[T]:
        """Read up to ``max_count`` messages of a queue, starting at queue offset ``from_offset``.

        Stops before the message that would bring the total above
        ``max_bytes``, but always returns at least one message when one is
        there, so a large message cannot block a queue. An offset below the
        queue's minimum (or pointing at records retention deleted) jumps ahead
        and sets ``expired``; an offset at or beyond the head returns nothing.

        Args:
            decode: ``decode(raw_record, log_offset)`` turns the record bytes
                into the caller's message type (store.log.record.decode_record).
            cached: ``cached(log_offset)``, the message if the caller holds it
                decoded already (None: read it). The rest are read from the log
                in one call.
            unpack: ``unpack(value)``, the messages of a batch record that ``decode`` or ``cached`` gave (in
                order: message i at queue offset base + i). Pulls of a queue holding batch records need it or
                ``whole``.
            whole: ``whole(value, first, stop)``, a batch record's messages ``first`` to ``stop - 1`` as one value,
                at the queue offset of message ``first``: the record is served whole, never unpacked here (the
                index entry gives its count; the RPC sends a batch so and its client decodes it).

        A batch record's entry counts its whole size against ``max_bytes`` and serves its messages from
        ``from_offset`` (or its base) up to ``max_count``; the next pull starts inside it if it was cut.
        """
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"max_count and max_bytes must be positive, not {max_count} and {max_bytes}")
        state = self._load(name)
        if state is None:
            return PullResult([], from_offset, False)
        expired = False
        low = self._min(state.qid)
        if from_offset < low:
            from_offset, expired = low, True
        head = state.max
        if from_offset >= head:
            return PullResult([], from_offset, expired)
        log_min = log.min_offset
        found: list[tuple[int, int, int, int, int]] = []  # (queue offset, log offset, size, base or -1, stop)
        total = 0
        next_offset = from_offset
        end = min(head, from_offset + max_count)
        width = keys.ENTRY.size
        full = batched = False
        for first, run in self._runs(state.qid, from_offset, end):
            if keys.is_batch_run(run):  # each entry a batch record: its messages from next_offset on
                batched = True
                for base, log_offset, size, _store_ms, count in keys.run_entries(first, run):
                    stop = min(base + count, end)
                    if stop <= next_offset or base >= end:
                        continue  # before from_offset, or past the pull's end
                    if max(base, from_offset) != next_offset:
                        expired = True  # retention range-deleted entries since we read the minimum
                    if log_offset < log_min:
                        expired = True
                    elif found and total + size > max_bytes:
                        full = True
                        break
                    else:
                        found.append((max(base, next_offset), log_offset, size, base, stop))
                        total += size
                    next_offset = stop
            else:  # single records: the entries from from_offset to end, unpacked at once
                skip = max(0, from_offset - first)
                qoff = first + skip
                if qoff != next_offset:
                    expired = True  # retention range-deleted entries since we read the minimum
                for log_offset, size, _store_ms in keys.ENTRY.iter_unpack(run[skip * width:(end - first) * width]):
                    if log_offset < log_min:
                        expired = True
                    else:
                        if found and total + size > max_bytes:
                            full = True
                            break
                        found.append((qoff, log_offset, size, -1, 0))
                        total += size
                    qoff += 1
                next_offset = qoff  # past the run's last entry, or at the entry that did not fit
            if full:
                break
        values: list[T | None] = [None] * len(found)
        if cached is not None:
            values = list(map(cached, [entry[1] for entry in found]))
        missing = [i for i, value in enumerate(values) if value is None]
        if missing:
            raws = log.read_many([found[i][1:3] for i in missing])
            for i, raw in zip(missing, raws):
                if raw is None:  # retention deleted the segment since we looked at log_min
                    expired = True
                elif raw:  # b"": corrupt, skipped like a filtered message (its offset is passed)
                    values[i] = decode(raw, found[i][1])
        if not batched:
            return PullResult([(entry[0], value) for entry, value in zip(found, values) if value is not None],
                              next_offset, expired)
        messages: list[tuple[int, T]] = []
        if whole is not None:
            for (qoff, _, _, base, stop), value in zip(found, values):
                if value is not None:
                    messages.append((qoff, value if base < 0 else whole(value, qoff - base, stop - base)))
            return PullResult(messages, next_offset, expired)
        if unpack is None:
            raise ValueError(f"queue {name!r} holds batch records: its pulls need an unpack")
        for (qoff, _, _, base, stop), value in zip(found, values):
            if value is None:
                continue
            if base < 0:
                messages.append((qoff, value))
                continue
            inside = unpack(value)
            first, last = qoff - base, min(len(inside), stop - base)
            messages += zip(range(qoff, base + last), inside[first:last])  # in C: a claim's cost per message
        return PullResult(messages, next_offset, expired)

    def commit_offsets(self, owner: str, offsets: Mapping[str, int], *, applied: int | None = None) -> None:
        """Apply a commit: ``owner``'s next offsets for several queues, in one write (no WAL: derived state).

        ``owner`` is an opaque string (a session's client id, a consumer group's
        name): callers keep the two apart, e.g. with a prefix. An offset never
        moves back: one below the stored offset of its queue is left out (a
        connection taken over by another node may commit after its successor).
        A queue that does not exist yet gets its id (a topic queue's) here.
        """
        for name, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"offset for queue {name!r} must not be negative, not {offset}")
        with self._lock:
            batch = self._batch(applied)
            for name, offset in offsets.items():
                state = self._state(name)
                if state is not None:
                    stored = self._db.get(keys.offset_key(owner, state.qid))
                    if stored is not None and keys.U64.unpack(stored)[0] >= offset:
                        continue
                state = state or self._allocate(name, batch)
                batch.put(keys.offset_key(owner, state.qid), keys.U64.pack(offset))
                batch.put(keys.ref_key(state.qid, owner), _EMPTY)
            try:
                self._write(batch, applied)
            except Exception:
                self._reset_cache()  # ids allocated above may not exist in the database
                raise

    def get_offsets(self, owner: str) -> dict[str, int]:
        """``{queue name: next offset}`` committed by ``owner``."""
        prefix = keys.offset_prefix(owner)
        result = {}
        for key, value in self._scan(prefix):
            name = self.queue_name(keys.U64.unpack_from(key, len(prefix))[0])
            if name is not None:
                result[name] = keys.U64.unpack(value)[0]
        return result

    def delete_owner(self, owner: str, *, applied: int | None = None) -> None:
        """Apply a session's end: the owner's filters are released and its offsets go (no WAL: derived state)."""
        with self._lock:
            for filter in self.held_by(owner):
                self._release(filter, owner, self._batch(None), None)
            prefix = keys.offset_prefix(owner)
            batch = self._batch(applied)
            for key, _ in self._scan(prefix):
                batch.delete(key)
                batch.delete(keys.ref_key(keys.U64.unpack_from(key, len(prefix))[0], owner))
            self._write(batch, applied)

    # -- control records -------------------------------------------------------------

    @property
    def applied(self) -> int | None:
        """Every control record below this CommitLog offset is applied (None: no control record ever was: an
        index written before control records, whose holders and offsets the store restates once)."""
        return self._applied

    def mark_applied(self, offset: int) -> None:
        """Move the control checkpoint to ``offset`` (no WAL: persisted by the next :meth:`flush`)."""
        with self._lock:
            self._write(self._batch(offset), offset)

    def holdings(self) -> Iterator[tuple[str, str, int]]:
        """Every held filter as ``(filter, holder, queue id)`` (0 for exact filters and ``a/#``): what
        activation records restate."""
        for key, _ in self._scan(b"H"):
            size = keys.U16.unpack_from(key, 1)[0]
            filter = key[3:3 + size].decode()
            active = self._active.get(filter)
            yield filter, key[3 + size:].decode(), active.qid if active is not None else 0

    def owners(self) -> Iterator[str]:
        """Every owner with a committed offset."""
        last = None
        for key, _ in self._scan(b"O"):
            owner = key[3:-8].decode()
            if owner != last:
                yield owner
                last = owner

    def forget_controls(self, log_end: int) -> None:
        """Undo what control records made, for dispatch to apply them again from the log's start: the log
        ends at ``log_end`` before the control checkpoint (what the records past it made cannot be told apart).

        Holders, offsets and activations go, and the control checkpoint goes to 0; a filter active since
        ``log_end`` or later goes whole (its activation record is lost), the others keep their queue, which
        their activation record, applied again, finds with its id.
        """
        with self._lock:
            batch = rocksdict.WriteBatch(raw_mode=True)
            for active in list(self._active.values()):
                if active.since >= log_end:
                    state = self._state(active.name)
                    if state is not None:
                        self._remove(active.name, state, batch)
            for prefix in (b"A", b"H", b"h", b"O", b"R"):
                batch.delete_range(prefix, keys.prefix_end(prefix))
            batch.put(keys.APPLIED, keys.U64.pack(0))
            self._db.write(batch, self._wal)
            self._applied = 0
            self._active.clear()
            self._active_ids.clear()
            self._filters = FilterIndex()
            self._targets = _target_cache()

    # -- retention -----------------------------------------------------------------

    def on_retention(self, min_log_offset: int) -> None:
        """The CommitLog now starts at ``min_log_offset``: drop the entries that point below it.

        Each queue's minimum offset advances past its expired entries (one
        range delete per queue), and queues left empty that nobody holds or has
        an offset on are removed, ids included. Runs in chunks of queues, taking
        the lock for each, so dispatch keeps going.
        """
        def expire(name: str, state: _Queue, low: int, batch: rocksdict.WriteBatch) -> None:
            if low < state.max:
                new_low = self._first_at_or_after(state.qid, low, state.max, min_log_offset)
                if new_low > low:
                    # The run holding new_low stays whole (pulls skip its entries below the minimum); runs
                    # kept so by earlier passes go now, hence the range from the queue's first key.
                    run = self._run_at(state.qid, new_low)
                    cut = new_low if run is None else run[0]
                    batch.delete_range(keys.entry_key(state.qid, 0), keys.entry_key(state.qid, cut))
                    batch.put(keys.min_key(state.qid), keys.U64.pack(new_low))
                    low = new_low
            if low == state.max and not self._referenced(name, state.qid):
                self._remove(name, state, batch)

        self._sweep(expire)
        self._db.put(keys.RETAINED, keys.U64.pack(min_log_offset), self._wal)
        self._retained = min_log_offset

    def bases(self, cut: int) -> tuple[int, list[tuple[str, int, int]]]:
        """The numbering of the topic queues as a log cut at CommitLog offset ``cut`` implies: the next topic id,
        and ``(name, id, queue offset of the first entry at or after cut)`` of every topic queue that keeps
        entries past it or is referenced (retention removes the others). Blocking; call with dispatch held."""
        found = []
        for key, value in self._scan(b"Q"):
            qid = keys.U64.unpack_from(key, 1)[0]
            name = value.decode()
            state = self._load(name)
            if qid < TOPIC_IDS or state is None or state.qid != qid:
                continue
            base = self._first_at_or_after(qid, self._min(qid), state.max, cut)
            if base < state.max or self._referenced(name, qid):
                found.append((name, qid, base))
        return self._next_id, found

    def seed(self, next_id: int, bases: Iterable[tuple[str, int, int]]) -> None:
        """Number the topic queues of an empty index as :meth:`bases` of the original said: each queue exists
        with its id, and its entries start at its base; topic ids go on from ``next_id``."""
        with self._lock:
            batch = rocksdict.WriteBatch(raw_mode=True)
            for name, qid, base in bases:
                batch.put(keys.name_key(name), keys.U64.pack(qid))
                batch.put(keys.id_key(qid), name.encode())
                batch.put(keys.max_key(qid), keys.U64.pack(base))
                if base:
                    batch.put(keys.min_key(qid), keys.U64.pack(base))
            self._next_id = max(self._next_id, next_id)
            batch.put(keys.NEXT_ID, keys.U64.pack(self._next_id))
            self._db.write(batch, self._wal)
            self._queues.clear()
            self._absent.clear()
            self._absent_bytes = 0

    @property
    def retained_offset(self) -> int:
        """The CommitLog minimum offset the last completed :meth:`on_retention` applied."""
        return self._retained

    def rewind(self, log_end: int) -> None:
        """The CommitLog ends at ``log_end``, before the checkpoint: drop entries past it.

        Only after losing CommitLog data that the index had seen (an OS crash
        under the async flush policy, a follower's truncate): the dispatcher then re-indexes from the end.

        The ids given to topics first seen in the dropped records go too: topic ids come from one counter in
        dispatch order, so the queues left with no entry at all (never any, none deleted by retention) whose
        ids are above every other topic queue's are those topics; they are removed and the counter goes back
        to the lowest of them. The records appended next then get the ids a copy of the log that never had
        the dropped records gives them (a truncated follower numbers as its leader does).
        """
        kept = [TOPIC_IDS - 1]  # the highest id of a topic queue that stays
        emptied: list[tuple[str, _Queue]] = []

        def cut(name: str, state: _Queue, low: int, batch: rocksdict.WriteBatch) -> None:
            new_max = self._first_at_or_after(state.qid, low, state.max, log_end)
            if state.qid >= TOPIC_IDS:
                if new_max == low == 0:
                    emptied.append((name, state))
                else:
                    kept[0] = max(kept[0], state.qid)
            if new_max < state.max:
                run = self._run_at(state.qid, new_max)
                if run is not None and run[0] < new_max:  # a run across the cut keeps its entries before it
                    batch.put(keys.entry_key(state.qid, run[0]), keys.cut_run(run[0], run[1], new_max))
                batch.delete_range(keys.entry_key(state.qid, new_max), keys.entry_key(state.qid, state.max))
                batch.put(keys.max_key(state.qid), keys.U64.pack(new_max))
                state.max = new_max

        self._sweep(cut)
        with self._lock:
            batch = rocksdict.WriteBatch(raw_mode=True)
            forgotten = [(name, state) for name, state in emptied if state.qid > kept[0]]
            for name, state in forgotten:
                self._remove(name, state, batch)
            if forgotten:
                self._next_id = min(state.qid for _, state in forgotten)
                batch.put(keys.NEXT_ID, keys.U64.pack(self._next_id))
            if log_end < self._checkpoint:
                batch.put(keys.CHECKPOINT, keys.U64.pack(log_end))
                self._checkpoint = log_end
            if not batch.is_empty():
                self._db.write(batch, self._wal)

    def statistics(self) -> LightQueuesStatistics:
        return LightQueuesStatistics(
            active_filters=len(self._filters),
            checkpoint=self._checkpoint,
            next_queue_id=self._next_id,
            next_filter_id=self._next_filter_id,
            cached_queues=len(self._queues),
            cached_targets=len(self._targets),
            entries_indexed=self._entries_indexed,
            queues_removed=self._queues_removed,
        )

    # -- internals -----------------------------------------------------------------

    def _load(self, name: str) -> _Queue | None:
        """A queue's state, from memory (a name known to have none included) or the database, without caching it
        (any thread)."""
        state = self._queues.get(name)
        if state is not None:
            return state
        if name in self._absent:
            return None
        return self._read(name)

    def _read(self, name: str) -> _Queue | None:
        """A queue's state from the database (any thread)."""
        raw = self._db.get(keys.name_key(name))
        if raw is None:
            return None
        qid = keys.U64.unpack(raw)[0]
        raw = self._db.get(keys.max_key(qid))
        return _new_queue(qid, keys.U64.unpack(raw)[0] if raw else 0)

    def _state(self, name: str) -> _Queue | None:
        """Like :meth:`_load`, caching the state. Hold the lock: only writers may cache,
        or a reader could cache a max offset that a concurrent batch has just passed."""
        state = self._queues.get(name)
        if state is not None:
            return state
        state = self._load(name)
        return self._cache(name, state) if state is not None else None

    def _reset_cache(self) -> None:
        """Forget cached queue states and re-read the id counters: after a failed write. Hold the lock."""
        self._queues.clear()
        self._absent.clear()
        self._absent_bytes = 0
        self._next_id = self._u64(keys.NEXT_ID, TOPIC_IDS)
        self._next_filter_id = self._u64(keys.NEXT_FILTER_ID, 1)

    def _u64(self, key: bytes, default: int) -> int:
        raw = self._db.get(key)
        return keys.U64.unpack(raw)[0] if raw else default

    def _batch(self, applied: int | None) -> rocksdict.WriteBatch:
        """A write batch that moves the control checkpoint to ``applied`` (None: leaves it)."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        if applied is not None:
            batch.put(keys.APPLIED, keys.U64.pack(applied))
        return batch

    def _write(self, batch: rocksdict.WriteBatch, applied: int | None) -> None:
        """Write derived state (no WAL) and note the control checkpoint it carries."""
        if not batch.is_empty():
            self._db.write(batch, self._no_wal)
        if applied is not None:
            self._applied = applied

    def _cache(self, name: str, state: _Queue) -> _Queue:
        """Keep a queue's state in memory (a new queue's included: its name is no longer absent). Hold the lock."""
        self._queues.put(name, state)
        self._absent.pop(name, None)
        return state

    def _allocate(self, name: str, batch: rocksdict.WriteBatch) -> _Queue:
        """A new topic queue id (``TOPIC_IDS`` and up), its name mapping added to ``batch``. Hold the lock."""
        qid = self._next_id
        self._next_id = qid + 1
        batch.put(keys.NEXT_ID, keys.U64.pack(qid + 1))
        batch.put(keys.name_key(name), keys.U64.pack(qid))
        batch.put(keys.id_key(qid), name.encode())
        return self._cache(name, _new_queue(qid, 0))

    def _add_active(self, active: _Filter) -> None:
        """Start indexing a filter: its id first, so a record that lists the id finds it active."""
        self._active[active.name] = active
        self._active_ids[active.qid] = active
        self._filters.add(active.name)

    def _min(self, qid: int) -> int:
        raw = self._db.get(keys.min_key(qid))
        return keys.U64.unpack(raw)[0] if raw else 0

    def _first_at_or_after(self, qid: int, low: int, high: int, log_offset: int) -> int:
        """Binary search in [low, high) for the first entry pointing at or after ``log_offset``.

        The ends are tried first: usually nothing (retention) or nothing
        recent (a new subscription) is past ``log_offset``.
        """
        if low < high:
            entry = self._entry(qid, low)
            if entry is not None and entry[0] >= log_offset:
                return low
            entry = self._entry(qid, high - 1)
            if entry is None or entry[0] < log_offset:
                return high
        while low < high:
            mid = (low + high) // 2
            entry = self._entry(qid, mid)
            if entry is not None and entry[0] >= log_offset:
                high = mid
            else:
                low = mid + 1
        return low

    def _entry(self, qid: int, qoff: int) -> tuple[int, int, int] | None:
        """The entry at queue offset ``qoff``: (log position, size, store ms); None if it is not stored. A message
        of a batch record is at the record's offset + its index, and has the record's size and store ms."""
        found = self._run_at(qid, qoff)
        if found is None:
            return None
        first, run = found
        if not keys.is_batch_run(run):
            return keys.ENTRY.unpack_from(run, (qoff - first) * keys.ENTRY.size)
        for base, log_offset, size, store_ms, count in keys.run_entries(first, run):
            if qoff < base + count:
                return log_offset + qoff - base, size, store_ms
        return None

    def _run_at(self, qid: int, qoff: int) -> tuple[int, bytes] | None:
        """The run holding queue offset ``qoff``: (its first queue offset, its entries); None if none does."""
        for first, run in self._runs(qid, qoff, qoff + 1):
            return (first, run) if first <= qoff < first + keys.run_span(run) else None
        return None

    def _runs(self, qid: int, from_offset: int, end: int) -> Iterator[tuple[int, bytes]]:
        """The runs holding the stored entries in [from_offset, end), in order: (first queue offset, entries).
        The first may start before from_offset; a gap between runs is where retention deleted entries."""
        opts = rocksdict.ReadOptions()
        opts.set_iterate_upper_bound(keys.entry_key(qid, end))
        it = self._db.iter(opts)
        start = keys.entry_key(qid, from_offset)
        it.seek_for_prev(start)  # the run holding from_offset starts at or before it
        if not it.valid() or not it.key().startswith(start[:9]):  # none: the previous queue's last run
            it.seek(start)
        while it.valid():
            yield int.from_bytes(it.key()[9:], "big"), it.value()
            it.next()

    def _referenced(self, name: str, qid: int) -> bool:
        for _ in self._scan(keys.holder_prefix(name), limit=1):
            return True
        for _ in self._scan(keys.ref_prefix(qid), limit=1):
            return True
        return False

    def _remove(self, name: str, state: _Queue, batch: rocksdict.WriteBatch) -> None:
        """Delete a queue: entries, metadata, id, and the offsets owners have on it. Hold the lock."""
        qid = state.qid
        batch.delete_range(keys.entry_prefix(qid), keys.prefix_end(keys.entry_prefix(qid)))
        for key in (keys.name_key(name), keys.id_key(qid), keys.max_key(qid), keys.min_key(qid)):
            batch.delete(key)
        ref = keys.ref_prefix(qid)
        for key, _ in self._scan(ref):
            owner = key[len(ref):].decode()
            batch.delete(key)
            batch.delete(keys.offset_key(owner, qid))
        self._queues.pop(name)
        self._queues_removed += 1

    def _sweep(self, visit: Callable[[str, _Queue, int, rocksdict.WriteBatch], None]) -> None:
        """Run ``visit(name, state, min offset, batch)`` over every queue, a chunk per lock hold.

        The memtable is flushed first, so the WAL'd batches written here never
        sit on top of index writes a crash could still lose.
        """
        self._db.flush()
        iterator = self._scan(b"Q")
        done = False
        while not done:
            with self._lock:
                batch = rocksdict.WriteBatch(raw_mode=True)
                for _ in range(SWEEP_CHUNK):
                    item = next(iterator, None)
                    if item is None:
                        done = True
                        break
                    qid = keys.U64.unpack_from(item[0], 1)[0]
                    name = item[1].decode()
                    state = self._load(name)
                    if state is None or state.qid != qid:
                        continue  # removed since the scan started
                    visit(name, state, self._min(qid), batch)
                if not batch.is_empty():
                    self._db.write(batch, self._wal)

    def _scan(
        self, prefix: bytes, start: bytes | None = None, end: bytes | None = None, limit: int | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys with ``prefix`` (from ``start``, before ``end``) and their values, in key order."""
        opts = rocksdict.ReadOptions()
        opts.set_iterate_upper_bound(end if end is not None else keys.prefix_end(prefix))
        it = self._db.iter(opts)
        it.seek(start if start is not None else prefix)
        n = 0
        while it.valid() and (limit is None or n < limit):
            yield it.key(), it.value()
            it.next()
            n += 1
        if not it.valid():
            it.status()  # raises the iterator's error: a damaged block must not read as the end of the keys


def _target_cache() -> SizedCache[str, bytes]:
    return SizedCache(TARGET_CACHE_SIZE, TARGET_CACHE_BYTES)


def _queue_cache() -> SizedCache[str, _Queue]:
    return SizedCache(QUEUE_CACHE_SIZE, QUEUE_CACHE_BYTES, lambda state: QUEUE_STATE_BYTES)
