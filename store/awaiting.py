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
  later offset; it is written with the WAL, fsynced (``sync``), before the
  PUBCOMP goes out, so a PUBCOMP never outruns the release it reports;
- dropping a client's flows (its session ended, clean start) releases them
  all, so records of the old session re-dispatched after a crash stay released.

Released entries are needed only while a re-dispatch could meet the records
they cover: ``collect`` deletes them once the family's checkpoint is durably
past them (at each dispatcher flush).

Storage: the column family ``qos2``, key u16 length + client id (UTF-8) + u16
packet id, value u64 offset + u8 released; the family's checkpoint (every
record below it applied) under the empty key. Dispatch writes go without the
WAL, like the light-queue index: the CommitLog produces them again. The whole
family is mirrored in memory (entries exist only for flows in flight and, for
a few seconds, released ones), so dispatch and lookups never read RocksDB.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Sequence
from typing import final

import rocksdict

from store.log.record import QOS_MASK, Record
from store.rocks import open_family

__all__ = ["AWAITING_FAMILY", "AwaitingRelease"]

AWAITING_FAMILY = "qos2"
"""Its own column family: the light queues own every key of the default family."""

CHECKPOINT_KEY = b""
"""The family's checkpoint: every key of an entry starts with a two-byte length, so none is empty."""

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
        sync: fsync the WAL of releases and drops. True (the default) makes a
            PUBCOMP survive a power loss under every flush policy: a release
            lost while its record survives would take the client's next
            message with that id, sent after the recovery, for a resend.

    Concurrency: the dispatcher's thread applies records; releases, drops and
    lookups may come from any thread (one lock).

    Resource handling: the caller owns ``db``; call :meth:`close` before closing it.
    """

    def __init__(self, db: rocksdict.Rdict, *, sync: bool = True) -> None:
        self._family: rocksdict.Rdict = open_family(db, AWAITING_FAMILY)
        self._handle = db.get_column_family_handle(AWAITING_FAMILY)
        self._db = db
        self._wal = rocksdict.WriteOptions()
        self._wal.sync = sync
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, tuple[int, bool]]] = {}  # client -> packet id -> (offset, released)
        self._checkpoint = 0
        for key, value in self._family.items():
            if key == CHECKPOINT_KEY:
                self._checkpoint = _U64.unpack(value)[0]
                continue
            (length,) = _LENGTH.unpack_from(key)
            (pid,) = _PID.unpack_from(key, 2 + length)
            offset, released = _VALUE.unpack(value)
            self._entries.setdefault(key[2 : 2 + length].decode(), {})[pid] = (offset, bool(released))

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
        batch = rocksdict.WriteBatch(raw_mode=True)
        handle = self._handle
        marked = 0
        with self._lock:
            checkpoint = self._checkpoint
            for record in records:
                pid = record.packet_id
                offset = record.offset
                if not pid or record.flags & QOS_MASK != 2 or offset < checkpoint:
                    continue
                entries = self._entries.setdefault(record.client_id, {})
                current = entries.get(pid)
                if current is not None and current[0] >= offset:
                    continue
                entries[pid] = (offset, False)
                batch.put(_key(record.client_id, pid), _VALUE.pack(offset, 0), handle)
                marked += 1
            if next_log_offset > checkpoint:
                batch.put(CHECKPOINT_KEY, _U64.pack(next_log_offset), handle)
            if not batch.is_empty():
                self._db.write(batch, _NO_WAL)
            self._checkpoint = max(checkpoint, next_log_offset)
        return marked

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

    def flush(self) -> None:
        """Persist the family's memtable (with the dispatcher's other flushes)."""
        self._family.flush()

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
            self._family.flush()  # the WAL'd changes must not sit on top of dispatch writes a crash could lose
            batch = rocksdict.WriteBatch(raw_mode=True)
            for client, pid in past:
                self._entries[client][pid] = (log_end - 1, True)
                batch.put(_key(client, pid), _VALUE.pack(log_end - 1, 1), self._handle)
            if self._checkpoint > log_end:
                self._checkpoint = log_end
                batch.put(CHECKPOINT_KEY, _U64.pack(log_end), self._handle)
            self._db.write(batch, self._wal)
        return len(past)

    # -- the gateway's calls -----------------------------------------------------------

    def release(self, flows: Sequence[Flow]) -> None:
        """Mark flows released, durably (WAL, fsynced when ``sync``), in one write: the PUBCOMPs may go out.

        The fsync happens outside the lock: dispatch, which takes it, may run in the event loop's thread. Nothing
        can reorder it against dispatch: a record that takes the same key again comes after the PUBCOMP.
        """
        if not all(1 <= pid <= 0xFFFF for _, pid, _ in flows):
            raise ValueError("packet ids are 1..65535")
        batch = rocksdict.WriteBatch(raw_mode=True)
        with self._lock:
            for client, pid, offset in flows:
                entries = self._entries.setdefault(client, {})
                current = entries.get(pid)
                if current is not None and current[0] > offset:
                    continue  # a later record holds the id: this release is stale
                entries[pid] = (offset, True)
                batch.put(_key(client, pid), _VALUE.pack(offset, 1), self._handle)
        if not batch.is_empty():
            self._db.write(batch, self._wal)

    def drop(self, client_id: str) -> bool:
        """Release every flow of the client (its session ended), durably: its records, dispatched again after a
        crash, stay released. Call once dispatch has passed the client's records. Writes only when the client
        has flows awaiting release; returns whether it had any."""
        with self._lock:
            entries = self._entries.get(client_id, {})
            flows = [(client_id, pid, offset) for pid, (offset, released) in entries.items() if not released]
        if flows:
            self.release(flows)
        return bool(flows)

    def close(self) -> None:
        """Release the family handles (they keep the database open)."""
        self._family.close()
        del self._handle
