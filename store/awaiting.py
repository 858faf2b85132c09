"""Inbound QoS 2 flows awaiting PUBREL, derived from the CommitLog.

A QoS 2 PUBLISH is acknowledged with PUBREC once its record is appended (and
on disk under the ``sync`` flush policy); until the publisher's PUBREL, any
PUBLISH with the same packet id is a resend that must not be stored again
([MQTT-4.3.3-2]). "Stored" and "awaits PUBREL" must be one fact, or a crash
between two writes either stores a resend twice or takes a new message with
a recycled id for a resend. The record is that fact: it carries the
publisher's packet id (store/log/record.py, ``FLAG_PACKET_ID``), and this module
derives from the log, in dispatch, which (client id, packet id) await PUBREL.

State per (client id, packet id): the CommitLog offset of the latest QoS 2
record with that id and whether it was released. The rules make dispatch
deterministic, including re-dispatch after a crash, in any order with the
releases:

- dispatch of a record at offset X marks (client, id) awaiting at X unless
  the entry already holds X or a later offset (the same record again, or a
  release that covers it);
- a release of (client, id, X) marks the entry released at X unless it holds a
  later offset; it is a control record (``FlowsReleased``, store/control.py)
  appended and fsynced under every flush policy before the PUBCOMP goes out, so
  a PUBCOMP never outruns the release it reports;
- the end of a session (``SessionEnded`` at offset E: expiry, clean start)
  releases every flow of the client below E, so records of the old session
  re-dispatched after a crash stay released, and a message the next session
  sends with the id (after E) awaits release again.

These rules commute: the QoS 2 records of a dispatch batch and its control records may be applied in either order
(the records by :meth:`AwaitingRelease.apply`, the controls by :attr:`AwaitingRelease.controls`, the
``ControlApplier`` with a checkpoint of its own).

Released entries are needed only while a re-dispatch could meet the records
they cover: ``collect`` deletes them once the family's checkpoint is durably
past them (at each dispatcher flush).

Storage: the column family ``qos2``, key u16 length + client id (UTF-8) + u16
packet id, value u64 offset + u8 released; the family's checkpoint (every
record below it applied) under the empty key, its control records' under
``b"\\0"``. Every write goes without the WAL, like the light-queue index: the
CommitLog produces them again. The whole
family is mirrored in memory (entries exist only for flows in flight and, for
a few seconds, released ones), so dispatch and lookups never read RocksDB.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import final

import rocksdict

from lightqueue.memtable import MemtableFlush
from store.control import Control, FlowsAwaiting, FlowsReleased, SessionEnded
from store.log.record import QOS_MASK, Record
from store.rocks import open_family

__all__ = ["AWAITING_FAMILY", "AwaitingRelease"]

AWAITING_FAMILY = "qos2"
"""Its own column family: the light queues own every key of the default family."""

CHECKPOINT_KEY = b""
"""The family's checkpoint: every key of an entry starts with a two-byte length, so none is empty."""

CONTROLS_KEY = b"\0"
"""The checkpoint of the control records applied (no entry's key is one byte long)."""

RESTATE_FLOWS = 1000
"""Flows per restated record (a record stays far below the record size limit)."""

_U64 = struct.Struct(">Q")
_VALUE = struct.Struct(">QB")  # offset, released
_LENGTH = struct.Struct(">H")
_PID = struct.Struct(">H")
_NO_WAL = rocksdict.WriteOptions()
_NO_WAL.disable_wal = True  # dispatch writes: the CommitLog re-produces them after a crash

Flow = tuple[str, int, int]
"""(client id, packet id, CommitLog offset of the QoS 2 record)."""


def _key(client_id: str, packet_id: int) -> bytes:
    raw = client_id.encode()
    return _LENGTH.pack(len(raw)) + raw + _PID.pack(packet_id)


@final
class AwaitingRelease:
    """The inbound QoS 2 flows of every client of one store node, over the ``qos2`` column family.

    Args:
        db: the node's raw-mode Rdict (store.rocks.open_db); the family is created on first use.

    ``legacy``: records applied and no control checkpoint: releases written by a version before control records,
    which the log does not hold; ``controls.restate`` them once (``open_store``).

    Concurrency: the dispatcher's thread applies records; lookups may come from any thread (one lock).

    Resource handling: the caller owns ``db``; call :meth:`close` before closing it.
    """

    def __init__(self, db: rocksdict.Rdict) -> None:
        self._family: rocksdict.Rdict = open_family(db, AWAITING_FAMILY)
        self._handle = db.get_column_family_handle(AWAITING_FAMILY)
        self._memtable = MemtableFlush()
        self._db = db
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, tuple[int, bool]]] = {}  # client -> packet id -> (offset, released)
        self._checkpoint = 0
        controls = None
        for key, value in self._family.items():
            if key == CHECKPOINT_KEY:
                self._checkpoint = _U64.unpack(value)[0]
                continue
            if key == CONTROLS_KEY:
                controls = _U64.unpack(value)[0]
                continue
            (length,) = _LENGTH.unpack_from(key)
            (pid,) = _PID.unpack_from(key, 2 + length)
            offset, released = _VALUE.unpack(value)
            self._entries.setdefault(key[2 : 2 + length].decode(), {})[pid] = (offset, bool(released))
        self.legacy = controls is None and self._checkpoint > 0
        self.controls = AwaitingControls(self, controls or 0)

    @property
    def checkpoint(self) -> int:
        """Every QoS 2 record below this CommitLog offset has been applied (after a restart: durably)."""
        return self._checkpoint

    def awaiting(self, client_id: str) -> dict[int, int]:
        """``{packet id: CommitLog offset}`` of the client's QoS 2 messages stored and not released.

        Complete only once dispatch has passed every record the client appended.
        """
        with self._lock:
            entries = self._entries.get(client_id, {})
            return {pid: offset for pid, (offset, released) in entries.items() if not released}

    def __len__(self) -> int:
        """Entries kept (awaiting and released)."""
        return sum(len(entries) for entries in self._entries.values())

    # -- dispatch ------------------------------------------------------------------

    def apply(self, records: Iterable[Record], next_log_offset: int) -> int:
        """Mark the QoS 2 records of one dispatch batch (in CommitLog order) as awaiting release; write the
        entries and the checkpoint ``next_log_offset`` without the WAL. Returns the entries written."""
        with self._lock:
            checkpoint = self._checkpoint
            flows = [(record.client_id, record.packet_id, record.offset) for record in records
                     if record.packet_id and record.flags & QOS_MASK == 2 and record.offset >= checkpoint]
            batch, marked = self._mark(flows, released=False)
            if next_log_offset > checkpoint:
                batch.put(CHECKPOINT_KEY, _U64.pack(next_log_offset), self._handle)
            if not batch.is_empty():
                self._db.write(batch, _NO_WAL)
            self._checkpoint = max(checkpoint, next_log_offset)
        return marked

    def _mark(self, flows: Iterable[Flow], *, released: bool, stated: bool = False) -> tuple[rocksdict.WriteBatch, int]:
        """Mark ``flows`` awaiting (a record) or released, each unless its entry holds a later offset (or, awaiting,
        the same one, unless ``stated``: a restatement says it awaits); the batch of the changes, to write, and how
        many. Holds the lock."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        marked = 0
        for client, pid, offset in flows:
            entries = self._entries.setdefault(client, {})
            current = entries.get(pid)
            if current is not None and (current[0] > offset or (current[0] == offset and not released
                                                                 and not stated)):
                continue
            entries[pid] = (offset, released)
            batch.put(_key(client, pid), _VALUE.pack(offset, int(released)), self._handle)
            marked += 1
        return batch, marked

    def collect(self, durable_offset: int) -> int:
        """Delete released entries below ``durable_offset`` (no WAL): once the family's checkpoint
        is flushed past them no re-dispatch meets their records again. Call just before :meth:`flush`.
        Returns the entries deleted."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        deleted = 0
        with self._lock:
            for client in list(self._entries):
                entries = self._entries[client]
                for pid in [pid for pid, (offset, released) in entries.items() if released and offset < durable_offset]:
                    del entries[pid]
                    batch.delete(_key(client, pid), self._handle)
                    deleted += 1
                if not entries:
                    del self._entries[client]
            if deleted:
                self._db.write(batch, _NO_WAL)
        return deleted

    def flush(self, *, wait: bool = True) -> None:
        """Persist the family's memtable (with the dispatcher's other flushes); ``wait=False``: only switch it, and
        let :meth:`settle` wait until it is written (``LightQueues.flush``)."""
        self._memtable.flush(self._family, wait=wait)

    def settle(self) -> None:
        """Return once the memtable :meth:`flush` switched is on disk."""
        self._memtable.wait(self._family)

    def rewind(self, log_end: int) -> int:
        """The CommitLog ends at ``log_end`` (its tail was lost in an OS crash): forget what lies past it.

        An entry at or past the log's end came from a lost record. The client
        reused that packet id only after completing its earlier flows with it,
        so the entry becomes "released up to the end" (a record with that id
        appended after the recovery awaits release again). Returns the entries changed.
        """
        with self._lock:
            past = [(client, pid) for client, entries in self._entries.items()
                    for pid, (offset, _) in entries.items() if offset >= log_end]
            if not past and self._checkpoint <= log_end:
                return 0
            batch = rocksdict.WriteBatch(raw_mode=True)
            for client, pid in past:
                self._entries[client][pid] = (log_end - 1, True)
                batch.put(_key(client, pid), _VALUE.pack(log_end - 1, 1), self._handle)
            if self._checkpoint > log_end:
                self._checkpoint = log_end
                batch.put(CHECKPOINT_KEY, _U64.pack(log_end), self._handle)
            self._db.write(batch, _NO_WAL)
            self._family.flush()
        return len(past)

    # -- control records (``AwaitingControls``) ---------------------------------------------

    def release(self, flows: Sequence[Flow]) -> None:
        """Mark flows released (a ``FlowsReleased`` record), each unless a later record holds its id."""
        self.mark(flows, released=True)

    def mark(self, flows: Sequence[Flow], *, released: bool) -> None:
        """Mark flows as a record or a release says (``_mark``), and write the changes."""
        with self._lock:
            batch, _ = self._mark(flows, released=released)
            if not batch.is_empty():
                self._db.write(batch, _NO_WAL)

    def restated(self, flows: Sequence[Flow], settled_below: int) -> None:
        """A ``FlowsAwaiting`` record: every flow below ``settled_below`` is released, then ``flows`` await."""
        with self._lock:
            settled = [(client, pid, offset) for client, entries in self._entries.items()
                       for pid, (offset, released) in entries.items() if not released and offset < settled_below]
            batch, _ = self._mark(settled, released=True)
            stated, _ = self._mark(flows, released=False, stated=True)
            for write in (batch, stated):
                if not write.is_empty():
                    self._db.write(write, _NO_WAL)

    def drop(self, client_id: str, before: int = 1 << 63) -> bool:
        """Release every flow of the client whose record lies below CommitLog offset ``before`` (its session ended
        there): its records, dispatched again after a crash, stay released. Returns whether it had any."""
        with self._lock:
            entries = self._entries.get(client_id, {})
            flows = [(client_id, pid, offset) for pid, (offset, released) in entries.items()
                     if not released and offset < before]
        if flows:
            self.release(flows)
        return bool(flows)

    def restate(self) -> Iterator[FlowsAwaiting]:
        """The flows as records that make them again: every QoS 2 record applied so far is settled (released)
        except the flows awaiting release, listed (in records of at most ``RESTATE_FLOWS``; the first settles)."""
        with self._lock:
            awaiting = [(c, pid, o) for c, entries in self._entries.items() for pid, (o, r) in entries.items() if not r]
            settled_below = self._checkpoint
        yield FlowsAwaiting(awaiting[:RESTATE_FLOWS], settled_below)
        for start in range(RESTATE_FLOWS, len(awaiting), RESTATE_FLOWS):
            yield FlowsAwaiting(awaiting[start : start + RESTATE_FLOWS])

    def write_checkpoint(self, key: bytes, offset: int) -> None:
        """Write a checkpoint (no WAL: the next :meth:`flush` persists it)."""
        self._family.put(key, _U64.pack(offset), _NO_WAL)

    def close(self) -> None:
        """Release the family handles (they keep the database open)."""
        self._family.close()
        del self._handle


@final
class AwaitingControls:
    """The ``ControlApplier`` of the inbound QoS 2 flows: releases (``FlowsReleased``), session ends
    (``SessionEnded``) and restated flows (``FlowsAwaiting``), with the control checkpoint of the ``qos2`` family."""

    def __init__(self, state: AwaitingRelease, checkpoint: int) -> None:
        self._state = state
        self._checkpoint = checkpoint
        self._taken: int | None = None  # the checkpoint the last flush took, until it is on disk

    @property
    def checkpoint(self) -> int:
        return self._checkpoint

    def apply(self, record: Record, control: Control) -> None:
        state = self._state
        if isinstance(control, FlowsReleased):
            state.release(control.flows)
        elif isinstance(control, SessionEnded):
            state.drop(control.client, record.offset)
        elif isinstance(control, FlowsAwaiting):
            state.restated(control.flows, control.settled_below)

    def flush(self, offset: int) -> None:
        self._state.write_checkpoint(CONTROLS_KEY, offset)
        self._state.flush(wait=False)
        self._taken = offset

    def settle(self) -> None:
        self._state.settle()
        if self._taken is not None:
            self._checkpoint, self._taken = self._taken, None

    def rewind(self, log_end: int) -> None:
        """Entries past the log's end are released by ``AwaitingRelease.rewind``; the checkpoint comes back."""
        if self._checkpoint > log_end:
            self._checkpoint = log_end

    def restate(self) -> Iterable[Control]:
        return list(self._state.restate())
