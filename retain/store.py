"""Retained messages: the latest message per topic, kept in RocksDB, found by filter at subscribe time.

Retained messages must outlive CommitLog retention, so each one is a full copy
of its encoded CommitLog record (opaque bytes here) in the column family
``retain``: key = the topic's UTF-8 bytes, value = u64 big-endian CommitLog
offset + record bytes. In memory, a :class:`~retain.tree.TopicTree` knows
which topics exist (and their offsets); a lookup matches the filter in the
tree and multi-gets only the matches.

Updates come from the dispatcher, one write batch (no WAL) per dispatch step
that has retained records (:meth:`RetainedStore.apply`: :meth:`RetainedStore.stage`
adds them to the batch, it is written, then :meth:`RetainedStore.commit_staged`
updates the tree). The latest CommitLog
offset wins, and records below the family's checkpoint were applied before, so
feeding the same records again (re-dispatch) changes nothing, not even for a
moment (a replayed put cannot resurrect a message deleted after it).

Crash safety: without the WAL, RocksDB flushes each column family on its own
(the database does not use atomic flush, and ``Rdict.flush`` flushes one
family), so after a crash the ``retain`` family may be behind the light
queues' checkpoint. The family therefore keeps its own checkpoint (key ``b""``,
which no topic can have), staged with :meth:`RetainedStore.stage_checkpoint` in
every dispatch batch: after a restart the dispatcher must feed retained
updates again from :attr:`RetainedStore.checkpoint` when it is below its own.
See docs/storage.md, "Retained messages".
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence, final

import rocksdict

from lightqueue.memtable import MemtableFlush
from lightqueue.topics import validate_filter, validate_topic
from retain.tree import TopicTree

__all__ = ["CHECKPOINT_KEY", "RETAIN_FAMILY", "Retained", "RetainedStatistics", "RetainedStore"]

RETAIN_FAMILY = "retain"
"""Its own column family: the light queues own every key of the default family."""

CHECKPOINT_KEY = b""
"""Where the family keeps its checkpoint: topic names are at least one character, so no topic collides."""

_U64 = struct.Struct(">Q")
_NO_WAL = rocksdict.WriteOptions()
_NO_WAL.disable_wal = True  # dispatch batches: the CommitLog re-produces them after a crash
_MAX_OFFSET = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Retained:
    """A retained message: its topic, its CommitLog offset and the encoded CommitLog record."""

    topic: str
    log_offset: int
    record: bytes


@dataclass(frozen=True, slots=True)
class RetainedStatistics:
    topics: int  # topics with a retained message
    nodes: int  # nodes of the topic tree
    checkpoint: int  # retained updates of every record below this CommitLog offset are applied
    lookups: int
    nodes_visited: int  # tree nodes stepped into by lookups (and iter_topics), summed
    records_read: int  # retained values read by lookups, summed
    staged: int  # updates added to dispatch batches
    stale: int  # updates ignored: below the checkpoint, or the topic already holds that offset or a later one


@final
class RetainedStore:
    """The retained messages of one node, over the ``retain`` column family of its RocksDB.

    Args:
        db: the node's raw-mode Rdict (store.rocks.open_db); the family is
            created on first use and scanned to build the topic tree.
        sync: fsync the WAL on the direct writes (:meth:`set`, :meth:`delete`,
            :meth:`rewind`). False survives a process crash; True also a power loss.

    Concurrency: one thread (the dispatcher's) stages and commits; lookups and
    direct writes may come from any thread.

    Resource handling: the caller owns ``db``. Call :meth:`close` before
    closing it: the family handles held here keep the database open.
    """

    def __init__(self, db: rocksdict.Rdict, *, sync: bool = False) -> None:
        if RETAIN_FAMILY in rocksdict.Rdict.list_cf(db.path()):
            family = db.get_column_family(RETAIN_FAMILY)
        else:
            family = db.create_column_family(RETAIN_FAMILY, rocksdict.Options(raw_mode=True))
        self._family: rocksdict.Rdict | None = family
        self._memtable = MemtableFlush()
        self._handle: rocksdict.ColumnFamily | None = db.get_column_family_handle(RETAIN_FAMILY)
        self._db = db
        self._wal = rocksdict.WriteOptions()
        self._wal.sync = sync
        self._lock = threading.Lock()  # guards the tree and the counters
        self._tree = TopicTree()
        self._checkpoint = 0
        self._pending: dict[str, int | None] = {}  # topic -> staged offset, None for a staged delete
        self._pending_checkpoint: int | None = None
        self._staged_into: rocksdict.WriteBatch | None = None
        self._lookups = 0
        self._records_read = 0
        self._staged = 0
        self._stale = 0
        it = family.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            if key == CHECKPOINT_KEY:
                self._checkpoint = _U64.unpack(it.value())[0]
            else:
                self._tree.set(key.decode(), _U64.unpack_from(it.value())[0])
            it.next()
        del it  # an iterator also keeps the database open

    @property
    def count(self) -> int:
        """How many topics hold a retained message."""
        return len(self._tree)

    @property
    def checkpoint(self) -> int:
        """Retained updates of every CommitLog record below this offset have been applied.

        Read after a restart: what the family lost in a crash lies above it, so
        the dispatcher feeds retained updates again from here.
        """
        return self._checkpoint

    # -- dispatch ------------------------------------------------------------------

    def stage(self, batch: rocksdict.WriteBatch, topic: str, log_offset: int, record: bytes | None,
              at: int | None = None) -> bool:
        """Add a retained update to the dispatcher's write batch (written without the WAL).

        Call once per retained record, in CommitLog order, then write the batch
        and call :meth:`commit_staged` (or :meth:`discard_staged` if the write
        failed). A record below :attr:`checkpoint` was applied before
        (re-dispatch) and is ignored; otherwise the update applies only if the
        topic holds no retained message or an older one (latest offset wins).

        Args:
            batch: the dispatch batch; every call until the commit must use the same one.
            topic: the record's topic name.
            log_offset: the record's CommitLog offset.
            record: the encoded CommitLog record, or None when the payload is
                empty (which deletes the topic's retained message).
            at: the CommitLog offset of the record that carries the update, when it is not the message's own (a
                restatement of a retained message before retention deletes its record): the checkpoint is
                compared with it, the topic's current offset with ``log_offset``.

        Returns:
            True if the batch got the update, False if it was ignored.

        Raises:
            TopicError: the topic is not a valid topic name.
            ValueError: bad offset or empty record; or another batch is still staged.
        """
        _check_update(topic, log_offset, record)
        handle = self._staging(batch)[1]
        pending = self._pending  # only the dispatcher's thread touches it
        with self._lock:
            current = pending[topic] if topic in pending else self._tree.get(topic)
            if (log_offset if at is None else at) < self._checkpoint or (current is not None and log_offset <= current):
                self._stale += 1
                return False
            if current is None and record is None:
                return False  # nothing retained, nothing to delete
            self._staged += 1
        key = topic.encode()
        if record is None:
            batch.delete(key, handle)
        else:
            batch.put(key, _U64.pack(log_offset) + record, handle)
        pending[topic] = None if record is None else log_offset
        self._staged_into = batch
        return True

    def stage_checkpoint(self, batch: rocksdict.WriteBatch, next_log_offset: int) -> None:
        """Record in the dispatch batch that every record below ``next_log_offset`` has been staged.

        Call with every dispatch batch that has retained records, and before
        every :meth:`flush` (batches without any may leave it behind until
        then), so a crash can only lose what lies above the checkpoint. A
        checkpoint below the current one (re-dispatch) is ignored.

        Raises:
            ValueError: a negative offset, or another batch is still staged.
        """
        if not 0 <= next_log_offset <= _MAX_OFFSET:
            raise ValueError(f"next_log_offset must be between 0 and 2**64 - 1, not {next_log_offset}")
        handle = self._staging(batch)[1]
        if next_log_offset <= max(self._checkpoint, self._pending_checkpoint or 0):
            return
        batch.put(CHECKPOINT_KEY, _U64.pack(next_log_offset), handle)
        self._pending_checkpoint = next_log_offset
        self._staged_into = batch

    def commit_staged(self) -> int:
        """The dispatch batch was written: make its staged updates visible to lookups.

        Returns:
            the number of retained updates applied.
        """
        pending = self._pending
        with self._lock:
            for topic, offset in pending.items():
                if offset is None:
                    self._tree.remove(topic)
                else:
                    self._tree.set(topic, offset)
            if self._pending_checkpoint is not None:
                self._checkpoint = self._pending_checkpoint
        self.discard_staged()
        return len(pending)

    def apply(self, updates: Iterable[tuple[str, int, bytes | None, int | None]], next_log_offset: int) -> int:
        """Stage one dispatch batch's retained updates, write them (no WAL), then commit them.

        For a dispatcher that writes retained updates in their own batch, next
        to (not inside) its index batch: the family's own checkpoint makes that
        safe, since a crash can only lose what lies above it. ``updates`` are
        ``(topic, log offset, record or None, at)`` in CommitLog order, as for :meth:`stage`.

        Returns:
            the number of retained updates applied.
        """
        batch = rocksdict.WriteBatch(raw_mode=True)
        try:
            for topic, log_offset, record, at in updates:
                self.stage(batch, topic, log_offset, record, at)
            self.stage_checkpoint(batch, next_log_offset)
            if not batch.is_empty():
                self._db.write(batch, _NO_WAL)
        except BaseException:
            self.discard_staged()
            raise
        return self.commit_staged()

    def discard_staged(self) -> None:
        """The dispatch batch was not written: forget what was staged into it."""
        self._pending = {}
        self._pending_checkpoint = None
        self._staged_into = None

    def kept(self) -> Iterator[tuple[str, int, bytes]]:
        """Every retained message as stored: ``(topic, CommitLog offset, record bytes)`` (blocking: a scan of the
        family), for the restatement before retention deletes their records (store/restate.py)."""
        family, _ = self._open()
        for key, value in family.items():
            if key != CHECKPOINT_KEY:
                yield key.decode(), _U64.unpack_from(value)[0], value[_U64.size:]

    def flush(self, *, wait: bool = True) -> None:
        """Persist the family's memtable (call it before the light queues flush theirs); ``wait=False``: only
        switch it, and let :meth:`settle` wait until it is written (``LightQueues.flush``).

        Keeps the family's durable checkpoint close to the light queues', so a
        restart feeds few records again.
        """
        self._memtable.flush(self._open()[0], wait=wait)

    def settle(self) -> None:
        """Return once the memtable :meth:`flush` switched is on disk."""
        self._memtable.wait(self._open()[0])

    def rewind(self, log_end: int) -> int:
        """The CommitLog ends at ``log_end`` (data lost in an OS crash): drop messages past it.

        A retained message whose offset the log no longer has would win
        against the new records that will reuse those offsets. Call it on open
        when :attr:`checkpoint` is past the log's end.

        Returns:
            the number of retained messages dropped.
        """
        family, handle = self._open()
        with self._lock:
            if log_end >= self._checkpoint and all(offset < log_end for _, offset in self._tree.items()):
                return 0  # nothing past the end: no flush (a flush on a full disk would wedge RocksDB)
        family.flush()  # the WAL'd deletes must not sit on top of unflushed updates a crash could lose
        with self._lock:
            doomed = [topic for topic, offset in self._tree.items() if offset >= log_end]
            batch = rocksdict.WriteBatch(raw_mode=True)
            for topic in doomed:
                batch.delete(topic.encode(), handle)
            if log_end < self._checkpoint:
                batch.put(CHECKPOINT_KEY, _U64.pack(log_end), handle)
            if not batch.is_empty():
                family.write(batch, self._wal)
            for topic in doomed:
                self._tree.remove(topic)
            self._checkpoint = min(self._checkpoint, log_end)
        return len(doomed)

    # -- direct writes (admin) -------------------------------------------------------

    def set(self, topic: str, log_offset: int, record: bytes) -> bool:
        """Retain ``record`` for ``topic`` now, with the WAL, outside any dispatch batch.

        The same rule as :meth:`stage`: ignored if the topic already holds an
        equal or later offset.

        Returns:
            True if stored.

        Raises:
            TopicError: the topic is not a valid topic name.
            ValueError: bad offset or empty record.
            TypeError: the record is not bytes (None included: use :meth:`delete`).
        """
        if record is None:
            raise TypeError("record must be bytes; delete() removes a retained message")
        _check_update(topic, log_offset, record)
        family, handle = self._open()
        with self._lock:
            current = self._tree.get(topic)
            if current is not None and log_offset <= current:
                self._stale += 1
                return False
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.put(topic.encode(), _U64.pack(log_offset) + record, handle)
            family.write(batch, self._wal)
            self._tree.set(topic, log_offset)
        return True

    def delete(self, topic: str) -> bool:
        """Delete ``topic``'s retained message now, with the WAL, whatever its offset.

        Returns:
            True if there was one.

        Raises:
            TopicError: the topic is not a valid topic name.
        """
        validate_topic(topic)
        family, handle = self._open()
        with self._lock:
            if self._tree.get(topic) is None:
                return False
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.delete(topic.encode(), handle)
            family.write(batch, self._wal)
            self._tree.remove(topic)
        return True

    # -- reads -----------------------------------------------------------------------

    def lookup(self, filter: str) -> list[Retained]:
        """The retained messages whose topics ``filter`` matches, sorted by topic.

        One tree walk and one multi-get of the matches: the cost grows with the
        matches, not with the number of retained topics. Pass a shared
        subscription's inner filter (lightqueue.topics.parse_shared).

        Raises:
            TopicError: the filter is not a valid topic filter.
        """
        return self.read(self.match(filter))

    def match(self, filter: str) -> list[tuple[str, int]]:
        """The first half of :meth:`lookup`: ``(topic, offset)`` of the retained messages ``filter`` matches, from
        the tree in memory (no database read: a caller on an event loop may ask it inline, and go to a thread for
        :meth:`read` only when something matched; most new subscriptions match nothing).

        Raises:
            TopicError: the filter is not a valid topic filter.
        """
        return self.match_all((filter,))[0]

    def match_all(self, filters: Sequence[str]) -> list[list[tuple[str, int]]]:
        """:meth:`match` of each filter under one lock (a connection's SUBSCRIBEs read together: the lock and the
        checks per filter were most of a subscription's retained lookup, issue 31).

        Raises:
            TopicError: one filter is not a valid topic filter (none was matched).
        """
        for filter in filters:
            validate_filter(filter)
        self._open()  # closed: raises, as a lookup does
        match = self._tree.match
        with self._lock:
            found = [match(filter) for filter in filters]
            self._lookups += len(found)
            self._records_read += sum(map(len, found))
        return found

    def read(self, found: list[tuple[str, int]]) -> list[Retained]:
        """The second half of :meth:`lookup`: the messages :meth:`match` found, sorted by topic (blocking: one
        multi-get; those deleted since the match are left out)."""
        if not found:
            return []
        family = self._open()[0]
        found.sort()
        values = family.get([topic.encode() for topic, _ in found])
        return [
            Retained(topic, _U64.unpack_from(value)[0], value[8:])
            for (topic, _), value in zip(found, values)
            if value is not None  # deleted since the tree walk
        ]

    def iter_topics(self, filter: str = "#") -> Iterator[str]:
        """The topics with a retained message that ``filter`` matches, in topic order (no values read).

        ``#`` follows the MQTT rule and leaves out ``$`` topics; ask for ``$SYS/#`` to list those.

        Raises:
            TopicError: the filter is not a valid topic filter.
        """
        validate_filter(filter)
        with self._lock:
            found = self._tree.match(filter)
        return iter(sorted(topic for topic, _ in found))

    def statistics(self) -> RetainedStatistics:
        with self._lock:
            tree = self._tree.statistics()
            return RetainedStatistics(
                topics=tree.topics,
                nodes=tree.nodes,
                checkpoint=self._checkpoint,
                lookups=self._lookups,
                nodes_visited=tree.nodes_visited,
                records_read=self._records_read,
                staged=self._staged,
                stale=self._stale,
            )

    def close(self) -> None:
        """Release the family handles (staged, uncommitted updates are forgotten). Idempotent."""
        self.discard_staged()
        self._family = None
        self._handle = None

    # -- internals -------------------------------------------------------------------

    def _open(self) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        if self._family is None or self._handle is None:
            raise RuntimeError("the retained store is closed")
        return self._family, self._handle

    def _staging(self, batch: rocksdict.WriteBatch) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        """The family handles, after checking that ``batch`` is the one being staged."""
        if self._staged_into is not None and self._staged_into is not batch:
            raise ValueError("another dispatch batch is still staged: call commit_staged() or discard_staged() first")
        return self._open()


def _check_update(topic: str, log_offset: int, record: bytes | None) -> None:
    validate_topic(topic)
    if not 0 <= log_offset <= _MAX_OFFSET:
        raise ValueError(f"log_offset must be between 0 and 2**64 - 1, not {log_offset}")
    if record is not None:
        if not isinstance(record, bytes):
            raise TypeError(f"record must be bytes (the encoded CommitLog record), not {type(record).__name__}")
        if not record:
            raise ValueError("record is empty: pass the encoded CommitLog record, or None to delete")
