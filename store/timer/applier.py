"""The timer's state, derived from the log: the enqueue step, and the ends of entries, as a ``ControlApplier``.

Dispatch applies the timer's control records (store/control.py) here, in log order: ``Delayed`` enqueues (a
TimerLog entry, linked into its wheel slot), ``TimersFired`` ends the entries whose messages were appended just
before it, ``TimersRolled`` ends entries and enqueues them again further on, ``TimerCancelled`` ends entries whose
messages are never delivered. Being an applier rather than a
reader of its own over the system queue, the timer gets log order, the checkpoint, ``rewind`` and replicas for
free: a replica's dispatch, or a rebuild after the data was deleted, derives the same pending entries.

Crash safety (docs/storage.md, "Delayed delivery"): :meth:`flush` runs after the CommitLog was flushed up to its
offset; it takes the checkpoint (store/timer/checkpoint.py: offset, TimerLog length, counts, and the wheel slots
and entry ends changed since the previous one) and hands it to a thread of its own, which fdatasyncs the TimerLog
and the wheel, writes the checkpoint, and only then writes its changes into the files; :attr:`checkpoint` moves
once it is done. Dispatch goes on meanwhile: a checkpoint of 100,000 ends written under dispatch's lock held it,
and every message waiting to be indexed, for a quarter of a second. On open the checkpoint's changes are written
again, the TimerLog is cut to its length and the counts are read from it: the state at the checkpoint, whatever a
crash left after it, without reading a single entry; dispatch then applies the records from the checkpoint again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, final

from crc32c import crc32c

from store.control import Control, Delayed, TimerCancelled, TimersFired, TimersRolled
from store.log.commitlog import CommitLog
from store.log.record import Record
from store.timer.checkpoint import TimerCheckpoint, read_checkpoint, write_checkpoint
from store.timer.timerlog import TimerEntry, TimerLog
from store.timer.wheel import EMPTY, Slot, TimerWheel

__all__ = ["BUCKET_BITS", "ENDS_FLUSH", "PAGE_WALK", "WINDOW_S", "TimerApplier", "client_hash", "topic_hash"]

LOGGER = logging.getLogger(__name__)

WINDOW_S = 14 * 24 * 3600
"""Slots of the wheel: twice the default maximum delay (7 days), as RocketMQ sizes it; an entry due beyond the
window waits in its last slot and is rolled (enqueued again) when the wheel reaches it."""

BUCKET_BITS = 24
"""Pending entries are counted per 16 MiB of CommitLog, for the retention guard (a few counters, not a heap)."""

PAGE_WALK = 65536
"""TimerLog entries one page of pending messages walks at most (4 MiB read, 0.2 s of Python): a filter that matches
few of them gets short pages, each as cheap as the last, rather than one unbounded walk."""

ENDS_FLUSH = 100_000
"""Ends of checkpointed entries kept in memory (``TimerLog.ends``, about 100 B each as a dict) before the timer asks
dispatch for a checkpoint of its own sooner than dispatch's interval (``EarlyCheckpoint``, store/dispatch.py):
firing 10,000 a second, the 30 s flush alone let 300,000 pile up, tens of MB, and made each checkpoint a long
write."""

SPAN_READ = 4
"""A slot's chain is read in file order (large reads, the entries between of other slots skipped) when it holds at
least a quarter of the entries between its first and its last; else walked entry by entry (a pread each)."""

PAGE_CHUNK = 4096
"""TimerLog entries a page walks per hold of the timer's lock: dispatch and the dequeue step wait 10 ms at most."""


def client_hash(client_id: str) -> int:
    """The 64-bit hash under which a client's pending delayed messages are counted (and listed)."""
    return int.from_bytes(hashlib.blake2b(client_id.encode(), digest_size=8).digest(), "big")


def topic_hash(topic: str) -> int:
    """The 32-bit hash of a real topic that its entries carry (listing by topic)."""
    return crc32c(topic.encode())


@final
class TimerApplier:
    """The TimerLog, the TimerWheel and the counts under ``directory``, kept up to date by dispatch.

    ``window_s``: slots of the wheel (seconds). ``log``: the CommitLog, made durable up to a checkpoint's offset
    before the checkpoint is written (dispatch asks for the timer's checkpoint alone, without flushing the log
    first: ``EarlyCheckpoint``, store/dispatch.py); None: the caller flushes it before each :meth:`flush`. Methods
    are thread-safe: dispatch applies in its thread, the dequeue step reads in another.

    Resource handling: :meth:`close` closes the files (flush first: the dispatcher's close does).
    """

    def __init__(self, directory: Path, window_s: int = WINDOW_S, log: CommitLog | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._checkpoint_path = directory / "checkpoint"
        self._log = TimerLog(directory / "timerlog")
        self._wheel = TimerWheel(directory / "wheel", window_s)
        self._window = window_s
        self._commitlog = log
        self._lock = threading.Lock()
        self.scheduled = 0  # entries enqueued by Delayed records since this start
        self.fired = 0
        self.rolled = 0
        self.cancelled = 0
        self._writer: threading.Thread | None = None  # the checkpoint being written, if any
        self._restore()

    # -- ControlApplier ----------------------------------------------------------------------------------------

    @property
    def checkpoint(self) -> int:
        return self._checkpoint

    def apply(self, record: Record, control: Control) -> None:
        if isinstance(control, Delayed):
            entry = TimerEntry(0, self._slot_second(control.due_ms, record.store_ms), control.due_ms, record.offset,
                               record.offset, 0, record.size, topic_hash(control.topic),
                               client_hash(control.client))
            with self._lock:
                self._enqueue(entry)
                self.scheduled += 1
        elif isinstance(control, TimersFired):
            with self._lock:
                self.fired += len(self._end_all(control.entries, record.offset))
        elif isinstance(control, TimersRolled):
            with self._lock:
                for old in self._end_all(control.entries, record.offset):
                    self._enqueue(old._replace(prev=0, slot_s=self._slot_second(old.due_ms, record.store_ms),
                                               made_at=record.offset, done_at=0))
                    self.rolled += 1
        elif isinstance(control, TimerCancelled):
            with self._lock:
                self.cancelled += len(self._end_all(control.entries, record.offset))

    def flush(self, offset: int) -> None:
        """Persist below ``offset``: the checkpoint is taken now and written by a thread of its own, which
        :meth:`settle` waits for (the dispatcher's flush does, outside its lock; a previous one still running is
        waited for first); with nothing pending it is written here and the TimerLog starts again empty (it grows
        only while messages wait: appends must not race the cut)."""
        self.settle()
        with self._lock:
            if not self._pending:
                self._write_checkpoint(offset)
                return
            taken = self._take_checkpoint(offset)
        self._writer = threading.Thread(target=self._write_behind, args=(taken,), name="timer-checkpoint")
        self._writer.start()

    def settle(self) -> None:
        """Wait until the checkpoint being written (if any) is done, or failed (it is logged, and its changes are
        the next one's). Not under the lock: the writer takes it at the end."""
        writer = self._writer
        if writer is not None:
            writer.join()

    def rewind(self, log_end: int) -> None:
        """Back to the checkpoint's state (dispatch applies the records from it again), or, when ``log_end`` is
        below the checkpoint (a follower's truncate of flushed records), to the state at ``log_end`` by a walk."""
        self.settle()
        with self._lock:
            self._restore()
            if log_end < self._checkpoint:
                self._rebuild(log_end)

    def flush_wanted(self) -> bool:
        """Whether the ends kept in memory until the next checkpoint passed ``ENDS_FLUSH`` (dispatch then has the
        timer take its checkpoint before dispatch's interval, alone: ``EarlyCheckpoint``, store/dispatch.py; the
        checkpoint takes them to the file)."""
        return len(self._log.ends) >= ENDS_FLUSH

    def restate(self) -> Iterable[Control]:
        """Nothing: the ``Delayed`` records stay in the log while their entries are pending (:meth:`may_delete`
        keeps their segments from retention), and the ends after them stay with them."""
        return ()

    # -- what the rest of the store asks -----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Delayed messages enqueued and not fired yet."""
        return self._pending

    @property
    def entries_read(self) -> int:
        """TimerLog entries read since opened (a statistic: opening reads none, dequeueing a slot reads its
        chain)."""
        return self._log.reads

    def pending_of(self, client_id: str) -> int:
        """Pending delayed messages published by ``client_id`` (by hash: two ids that collide share a count)."""
        return self._clients.get(client_hash(client_id), 0)

    def may_delete(self, base: int, end: int) -> bool:
        """The CommitLog retention guard: may the segment ``[base, end)`` go? Not while a pending entry points
        into it, or into a later one (the count is per ``BUCKET_BITS``, rounded down: never too early)."""
        with self._lock:
            return not self._buckets or min(self._buckets) << BUCKET_BITS >= end

    def take_low(self) -> int | None:
        """The earliest wheel second an entry was placed at since the last call (None: none was): the dequeue
        step goes back there when it is behind its cursor (a message due in the past, a restart)."""
        with self._lock:
            low, self._low = self._low, None
            return low

    def next_due(self, first: int, last: int) -> int | None:
        """:meth:`TimerWheel.next_due`."""
        with self._lock:
            return self._wheel.next_due(first, last)

    def due_entries(self, second: int) -> list[tuple[int, TimerEntry]]:
        """The pending entries of the slot of ``second``, with their positions, in the order they were placed;
        empty when the slot holds nothing for ``second`` or before (only later revolutions)."""
        return sorted(item for found in self.due_slices(second) for item in found)

    def due_slices(self, second: int, size: int = PAGE_CHUNK) -> Iterator[list[tuple[int, TimerEntry]]]:
        """:meth:`due_entries` read ``size`` TimerLog positions at a time (the slot's span in file order, or its chain
        walked back from its last entry), each under the lock and none held between them: the dequeue step reads
        a second's 10,000 entries between other steps of the event loop, and what dispatch applies meanwhile
        waits for one slice at most. Entries appended to the slot after the first slice are not given (their
        placing set ``take_low``); the slices' order within and between them is the walk's."""
        with self._lock:
            slot = self._wheel.get(second)
            if not slot.pending or slot.delayed_s > second:
                return
            first, last = slot.first, slot.last
            dense = last - first < SPAN_READ * slot.num  # the chain is most of its span: large reads
        if dense:
            index = second % self._window
            for start in range(first, last + 1, size):
                with self._lock:
                    found = [(pos, entry) for pos, entry in self._log.entries(start, min(last, start + size - 1))
                             if not entry.done_at and entry.slot_s % self._window == index]
                yield found
            return
        pos = last
        while pos:
            with self._lock:
                found = []
                for _ in range(size):
                    entry = self._log.read(pos)
                    if not entry.done_at:
                        found.append((pos, entry))
                    pos = entry.prev
                    if not pos:
                        break
            yield found

    def still_pending(self, items: list[tuple[int, TimerEntry]]) -> list[tuple[int, TimerEntry]]:
        """Those of ``items`` (as :meth:`due_entries` gave them) that are still pending: not cancelled since. An
        entry is looked for elsewhere only when its position holds another one now (a rebuild moved it)."""
        with self._lock:
            kept = []
            for pos, entry in items:
                now = self._log.read(pos) if pos <= self._log.count else None
                if now is not None and now.offset_real == entry.offset_real:
                    if not now.done_at:
                        kept.append((pos, entry))
                elif self._find(entry.offset_real, pos) is not None:
                    kept.append((pos, entry))
            return kept

    def locate(self, offset: int, due_ms: int, store_ms: int) -> tuple[int, TimerEntry] | None:
        """The pending entry of the Delayed record at ``offset`` (due at ``due_ms``, stored at ``store_ms``), with its
        position; None when none is pending. Looked for in the chain of the slot its record placed it in; an entry
        due beyond the window may have rolled since, and only such an entry is looked for in the whole TimerLog."""
        with self._lock:
            second = self._slot_second(due_ms, store_ms)
            slot = self._wheel.get(second)
            pos = slot.last if slot.pending else 0
            while pos:
                entry = self._log.read(pos)
                if entry.offset_real == offset and not entry.done_at:
                    return pos, entry
                pos = entry.prev
            return self._find(offset, 0) if due_ms // 1000 > second else None

    def pending_page(self, after: int, topic: int | None, client: int | None,
                     limit: int) -> tuple[list[TimerEntry], int]:
        """Up to ``limit`` pending entries past TimerLog position ``after`` whose topic and client hashes are
        ``topic`` and ``client`` (None: any), in TimerLog order, walking at most ``PAGE_WALK`` entries; and the
        position the next page starts after (0: the walk reached the end)."""
        found: list[TimerEntry] = []
        last, stop = after, after + PAGE_WALK
        while True:
            with self._lock:  # a chunk at a time: dispatch and the dequeue step wait for one chunk at most
                count = self._log.count
                end = min(count, stop, last + PAGE_CHUNK)
                if last >= end or len(found) == limit:
                    return found, last if last < count else 0
                for last, entry in self._log.entries(last + 1, end):
                    if not entry.done_at and topic in (None, entry.hash_topic) and client in (None, entry.hash_client):
                        found.append(entry)
                        if len(found) == limit:
                            break

    def close(self) -> None:
        self.settle()
        self._log.close()
        self._wheel.close()

    # -- inside ------------------------------------------------------------------------------------------------

    def _slot_second(self, due_ms: int, store_ms: int) -> int:
        """The second whose slot takes an entry due at ``due_ms``, placed by a record stored at ``store_ms``: its
        due second, or the window's last second when it is due beyond (it rolls from there). From the records
        alone, so that every replica places it alike."""
        return min(due_ms // 1000, store_ms // 1000 + self._window - 1)

    def _enqueue(self, entry: TimerEntry) -> None:
        pos = self._log.count + 1
        slot = self._wheel.get(entry.slot_s)
        if slot.pending:
            new = Slot(min(slot.delayed_s, entry.slot_s), slot.first, pos, slot.num + 1, slot.pending + 1)
        else:
            new = Slot(entry.slot_s, pos, pos, 1, 1)
        self._log.append(entry._replace(prev=slot.last if slot.pending else 0))
        self._wheel.put(entry.slot_s, new)
        self._count(entry, 1)
        self._placed(entry, pos)

    def _end_all(self, refs: list[tuple[int, int, int]], at: int) -> list[TimerEntry]:
        """End the pending entries ``refs`` names (as the ``TimersFired`` / ``TimersRolled`` record at ``at`` does);
        returns each as it was. An entry already ended, or unknown here, is skipped: applying is idempotent. The
        slots and counts change once per slot, client and bucket the entries share, not once per entry: a record
        of a tick's 200 fired messages (one slot, a few clients) is applied in one step of the event loop, which
        undelayed traffic waits for (dispatch indexes a small write there)."""
        log = self._log
        wanted = sorted({pos for _, pos, _ in refs if 0 < pos <= log.count})
        known = dict(zip(wanted, log.read_many(wanted)))
        ended: list[TimerEntry] = []
        for offset, pos, _ in refs:
            entry = known.pop(pos, None)  # popped: a position named twice is looked up again (and found ended)
            if entry is not None and entry.offset_real == offset and not entry.done_at:
                log.end(pos, at)
                ended.append(entry)
            elif (found := self._find(offset, 0 if entry is not None else pos)) is not None:
                log.end(found[0], at)
                ended.append(found[1])
        self._uncount(ended)
        return ended

    def _uncount(self, ended: list[TimerEntry]) -> None:
        """Take the entries ``ended`` out of their slots (a slot whose last pending entry ends is cleared) and out
        of the counts."""
        wheel = self._wheel
        for second, count in Counter(entry.slot_s for entry in ended).items():
            slot = wheel.get(second)
            wheel.put(second, Slot(slot.delayed_s, slot.first, slot.last, slot.num, slot.pending - count)
                      if slot.pending > count else EMPTY)
        self._pending -= len(ended)
        for client, count in Counter(entry.hash_client for entry in ended).items():
            _bump(self._clients, client, -count)
        for bucket, count in Counter(entry.offset_real >> BUCKET_BITS for entry in ended).items():
            _bump(self._buckets, bucket, -count)

    def _placed(self, entry: TimerEntry, pos: int) -> None:
        """Note where dequeue must look (``_low``; ``_earliest``: since the TimerLog was last empty, kept by the
        checkpoint) and the TimerLog's first Delayed offset."""
        self._low = entry.slot_s if self._low is None else min(self._low, entry.slot_s)
        self._earliest = min(self._earliest or entry.slot_s, entry.slot_s)
        if pos == 1:
            self._lowest_real = entry.offset_real

    def _count(self, entry: TimerEntry, delta: int) -> None:
        self._pending += delta
        _bump(self._clients, entry.hash_client, delta)
        _bump(self._buckets, entry.offset_real >> BUCKET_BITS, delta)

    def _find(self, offset: int, pos: int) -> tuple[int, TimerEntry] | None:
        """The pending entry of the Delayed record at ``offset``, with its position: at ``pos`` when the TimerLog is
        laid out as where the end was written (always, but after a rebuild from a log retention shortened), else
        found by a walk; None when there is none (its record is older than the log this TimerLog was built from)."""
        log = self._log
        if 0 < pos <= log.count:
            entry = log.read(pos)
            if entry.offset_real == offset and not entry.done_at:
                return pos, entry
        if not self._pending or offset < self._lowest_real:
            return None
        for pos, entry in log.entries():
            if entry.offset_real == offset and not entry.done_at:
                return pos, entry
        return None

    def _restore(self) -> None:
        """The state at the checkpoint: its changes written into the files again, the TimerLog cut to its length,
        its counts; no entry is read. Without a usable checkpoint (none, or a TimerLog shorter than it: deleted)
        the files start empty and dispatch derives them from the whole log; a wheel file that was not there (or had
        another window) is rebuilt from the TimerLog."""
        log, wheel = self._log, self._wheel
        found = read_checkpoint(self._checkpoint_path)
        if found is None or log.count < found.count:
            found = TimerCheckpoint()
            wheel.clear()
        wheel.dirty, wheel.writing = {}, {}
        wheel.write(found.slots)
        log.ends, log.writing = {}, {}
        log.truncate(found.count)
        log.write_ends(found.ends)
        log.durable = found.count
        self._checkpoint = found.offset
        self._pending = found.pending
        self._clients: Counter[int] = Counter(found.clients)
        self._buckets: Counter[int] = Counter(found.buckets)
        self._earliest = found.earliest
        self._lowest_real = found.lowest_real
        self._low: int | None = found.earliest if found.pending else None
        if wheel.fresh and found.count:
            self._rebuild(found.offset)
        wheel.fresh = False

    def _write_checkpoint(self, offset: int) -> None:
        """Checkpoint the state at ``offset`` here and now (hold the lock, no checkpoint being written)."""
        taken = self._take_checkpoint(offset)
        self._write_taken(taken)
        self._log.truncate(taken.count)
        if not taken.count:
            self._earliest = self._lowest_real = 0
        self._written(taken)

    def _take_checkpoint(self, offset: int) -> TimerCheckpoint:
        """The checkpoint of the state at ``offset``: the changes it records move to ``writing`` (read from there
        until they are in the files), those made from now on go to the next one. Hold the lock."""
        log, wheel = self._log, self._wheel
        count = log.count if self._pending else 0
        taken = TimerCheckpoint(offset, count, self._pending, self._earliest if count else 0,
                                self._lowest_real if count else 0, dict(self._buckets), dict(self._clients),
                                wheel.dirty, log.ends if count else {})
        wheel.writing, wheel.dirty = wheel.dirty, {}
        log.writing, log.ends = taken.ends, {}
        log.durable = count  # ends of the entries it covers wait in memory for the next one
        return taken

    def _write_taken(self, taken: TimerCheckpoint) -> None:
        """The CommitLog durable up to the checkpoint ``taken`` and the files synced (the previous checkpoint's
        changes are in them), then the checkpoint, then its changes written into the files. Only the entries and
        slots it records are written: dispatch may append and end others meanwhile."""
        if self._commitlog is not None and self._commitlog.flushed_offset < taken.offset:
            self._commitlog.flush()  # an early checkpoint: the records it applied are on disk before it is
        self._log.sync()
        self._wheel.sync()
        write_checkpoint(self._checkpoint_path, taken)
        self._wheel.write(taken.slots)
        self._log.write_ends(taken.ends)

    def _written(self, taken: TimerCheckpoint) -> None:
        """``taken`` is in the checkpoint and in the files: read from there from now on. Hold the lock."""
        self._wheel.writing = {}
        self._log.writing = {}
        self._checkpoint = taken.offset

    def _write_behind(self, taken: TimerCheckpoint) -> None:
        """The checkpoint writer's thread: :meth:`_write_taken`; if it fails (a full disk), its changes go back to
        memory, where the next checkpoint records them with its own, and the checkpoint stays where it was."""
        try:
            self._write_taken(taken)
        except OSError as exc:
            LOGGER.error("timer checkpoint not written; the next flush tries again: %r", exc,
                         extra={"ctx": {"offset": taken.offset}})
            with self._lock:
                log, wheel = self._log, self._wheel
                log.ends, log.writing = {**log.writing, **log.ends}, {}
                wheel.dirty, wheel.writing = {**wheel.writing, **wheel.dirty}, {}
            return
        with self._lock:
            self._written(taken)

    def _rebuild(self, cut: int) -> None:
        """Keep the entries made below ``cut``, undo the ends at or past ``cut``, rebuild the wheel and the counts
        from the entries pending then, and checkpoint that at ``cut``: a walk of the TimerLog, for a wheel file
        that was lost and a follower's truncate below the checkpoint. The checkpoint goes first, so a crash in the
        middle derives the timer again from the whole log."""
        _remove(self._checkpoint_path)
        log = self._log
        self._wheel.clear()
        self._pending = 0
        self._clients = Counter()
        self._buckets = Counter()
        self._low = None
        self._earliest = self._lowest_real = 0
        slots: dict[int, Slot] = {}
        kept = 0
        for pos, entry in log.entries():
            if entry.made_at >= cut:
                break
            kept = pos
            if kept == 1:
                self._lowest_real = entry.offset_real
            fixed = entry._replace(done_at=0) if entry.done_at >= cut else entry
            if not fixed.done_at:
                index = fixed.slot_s % self._window
                slot = slots.get(index, EMPTY)
                fixed = fixed._replace(prev=slot.last)
                slots[index] = Slot(min(slot.delayed_s or fixed.slot_s, fixed.slot_s), slot.first or pos, pos,
                                    slot.num + 1, slot.pending + 1)
                self._count(fixed, 1)
                self._placed(fixed, pos)
            if fixed != entry:
                log.write(pos, fixed)
        log.truncate(kept)
        self._wheel.write(slots)
        self._write_checkpoint(cut)


def _bump(counts: Counter[int], key: int, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key at 0 (once per fired message: no loop, no ``__missing__``)."""
    count = counts.get(key, 0) + delta
    if count:
        counts[key] = count
    else:
        del counts[key]


def _remove(path: Path) -> None:
    """Remove ``path``, durably (the directory fsynced)."""
    path.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
