"""A canonical dump of a stopped node's index database: what it holds, independent of how it was written.

The proof that RocksDB holds only derived state is a rebuild (docs/storage.md, "Recovery"): dump the index, delete
it, let dispatch derive it again from the CommitLog, dump again, compare. So the dump must show every piece of state
and nothing that depends on *when* it was written:

- light queues by name, with their queue id, min and max offsets and their entries expanded from the runs they were
  written in (a run's length depends on the dispatch batches, not on the state), each queue offset with its
  CommitLog offset, size and store time; the filters with their active-since offset and their holders; the consumer
  offsets of each owner by queue name; the next queue id;
- every column family: the known ones decoded (``retain``, ``qos2``, ``sessions``, ``clients``), any other
  (a family added later) as hex keys and values, so the dump keeps covering what is added beside it;
- the timer's pending delayed messages (``<data>/timer/`` beside the index, store/timer/), when there are any:
  their count, per due second the number pending and an order-free digest of their entries (the Delayed record,
  due time, slot second, size, topic and client hashes, the record that placed it), and the wheel's pending
  count per slot; so the output is bounded by the seconds, not the messages. TimerLog positions and chain links
  are left out (a TimerLog that was emptied at another flush numbers its entries otherwise).

Left out, on purpose: the checkpoints (the light queues' ``C`` and control checkpoint ``c``, the retention mark ``T``,
a family's empty key, the convention of ``retain`` and ``qos2`` for theirs, the QoS 2 family's control checkpoint and
a derived family's, store/derived.py). They say how far dispatch got, not what it derived: they move
with flushes, and a rebuild reaches the same state with its own. Released QoS 2 flows are left out too: they are
kept only until the family's checkpoint is durably past them (store/awaiting.py), a matter of flush timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import rocksdict

from lightqueue import keys
from retain.store import RETAIN_FAMILY
from store.awaiting import AWAITING_FAMILY, CONTROLS_KEY as AWAITING_CONTROLS_KEY
from store.derived import APPLIED_KEY as DERIVED_APPLIED_KEY, CHECKPOINT_KEY as DERIVED_CHECKPOINT_KEY
from store.ledger import LEDGER_FAMILY, ClientEntry
from store.log.record import CorruptRecord, decode_record
from store.timer.checkpoint import read_checkpoint
from store.timer.timerlog import read_entries
from store.timer.wheel import READ_SLOTS, SLOT, SLOT_SIZE, Slot

__all__ = ["dump", "dump_json"]

_U16 = struct.Struct(">H")
_QOS2_VALUE = struct.Struct(">QB")
_CLIENT_ENTRY = msgspec.msgpack.Decoder(ClientEntry)
_SESSIONS_FAMILY = "sessions"  # store/node.py's SESSIONS_FAMILY (the dump does not import the running node)
_EXCLUDED = (keys.CHECKPOINT, keys.RETAINED, keys.APPLIED)
_FAMILY_CHECKPOINTS = (b"", AWAITING_CONTROLS_KEY, DERIVED_CHECKPOINT_KEY, DERIVED_APPLIED_KEY)
"""A family's checkpoints: the empty key (retain, qos2), the QoS 2 family's control checkpoint, a derived family's."""
_TIMER_DIR = "timer"  # store/node.py's <data>/timer (the dump does not import the running node)
_TIMER_FIELDS = struct.Struct(">QQQQIIQ")
_DIGEST_MOD = 1 << 128


def dump(index: Path) -> dict[str, Any]:
    """The canonical form of the index database at ``index`` (the node stopped: it is opened read-only).

    Raises:
        Exception: RocksDB could not open it (rocksdict's message says why: missing, damaged).
    """
    if not (index / "CURRENT").is_file():
        raise FileNotFoundError(f"{index} holds no RocksDB database")
    families = rocksdict.Rdict.list_cf(str(index))
    db = rocksdict.Rdict(str(index), rocksdict.Options(raw_mode=True),
                         access_type=rocksdict.AccessType.read_only())
    try:
        out = _light_queues(db.items())
        out["families"] = {}
        for name in families:
            if name == "default":
                continue
            family = db.get_column_family(name)
            try:
                found = _family(name, [(k, v) for k, v in family.items() if k not in _FAMILY_CHECKPOINTS])
            finally:
                family.close()
            if found:  # an empty family is no state: whether it exists depends on what opened the database
                out["families"][name] = found
    finally:
        db.close()
    timer = _timer(index.parent / _TIMER_DIR)
    if timer:
        out["timer"] = timer
    return out


def dump_json(index: Path) -> str:
    """:func:`dump` as JSON with sorted keys: two dumps of the same state are the same text."""
    return json.dumps(dump(index), sort_keys=True, indent=1)


def _light_queues(items: Iterable[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The default family (lightqueue/keys.py's layout) by meaning instead of by key."""
    names: dict[int, str] = {}
    ids: dict[str, int] = {}
    runs: dict[int, list[tuple[int, bytes]]] = {}
    bounds: dict[bytes, dict[int, int]] = {b"M": {}, b"m": {}}
    filters: dict[str, dict[str, Any]] = {}
    offsets: dict[str, dict[int, int]] = {}
    refs: dict[int, list[str]] = {}
    held_by: set[tuple[str, str]] = set()
    other: dict[str, str] = {}
    next_id = next_filter_id = None
    for key, value in items:
        kind = key[:1]
        if key in _EXCLUDED:
            continue
        if key == keys.NEXT_ID:
            next_id = keys.U64.unpack(value)[0]
        elif key == keys.NEXT_FILTER_ID:
            next_filter_id = keys.U64.unpack(value)[0]
        elif kind == b"N":
            ids[key[1:].decode()] = keys.U64.unpack(value)[0]
        elif kind == b"Q":
            names[keys.U64.unpack_from(key, 1)[0]] = value.decode()
        elif kind == b"E":
            qid, qoff = struct.unpack_from(">QQ", key, 1)
            runs.setdefault(qid, []).append((qoff, value))
        elif kind in bounds:
            bounds[kind][keys.U64.unpack_from(key, 1)[0]] = keys.U64.unpack(value)[0]
        elif kind == b"A":
            filters.setdefault(key[1:].decode(), {})["since"] = keys.U64.unpack(value)[0]
        elif kind in (b"H", b"h", b"O"):
            first, rest = _string(key, 1)
            if kind == b"H":
                filters.setdefault(first, {}).setdefault("holders", []).append(rest.decode())
            elif kind == b"h":
                held_by.add((rest.decode(), first))
            else:
                offsets.setdefault(first, {})[keys.U64.unpack(rest)[0]] = keys.U64.unpack(value)[0]
        elif kind == b"R":
            refs.setdefault(keys.U64.unpack_from(key, 1)[0], []).append(key[9:].decode())
        else:
            other[key.hex()] = value.hex()
    queues = {}
    for name, qid in ids.items():
        low, high = bounds[b"m"].get(qid, 0), bounds[b"M"].get(qid, 0)
        queues[name] = {"id": qid, "min": low, "max": high, "entries": _entries(runs.get(qid, ()), low, high),
                        "referenced_by": sorted(refs.get(qid, ()))}
    held = {(f, h) for f, state in filters.items() for h in state.get("holders", ())}
    out: dict[str, Any] = {
        "next_queue_id": next_id,
        "next_filter_id": next_filter_id,
        "queues": queues,
        "filters": filters,
        "offsets": {owner: {names.get(qid, f"#{qid}"): offset for qid, offset in by_qid.items()}
                    for owner, by_qid in offsets.items()},
    }
    inconsistent = {
        "ids_without_name": sorted(set(names) - set(ids.values())),
        "names_with_other_id": sorted(n for n, qid in ids.items() if names.get(qid) != n),
        "holders_one_way": sorted(map(list, held ^ held_by)),
    }
    if any(inconsistent.values()):
        out["inconsistent"] = inconsistent
    if other:
        out["other_keys"] = other
    return out


def _string(key: bytes, at: int) -> tuple[str, bytes]:
    """A u16-length-prefixed string at ``at`` of ``key``, and the bytes after it."""
    (length,) = _U16.unpack_from(key, at)
    return key[at + 2:at + 2 + length].decode(), key[at + 2 + length:]


def _entries(runs: Iterable[tuple[int, bytes]], low: int, high: int) -> list[list[int]]:
    """The entries ``[low, high)`` of a queue, one ``[queue offset, log position, size, store ms]`` each: a batch
    record's messages one by one (at the record's offset + their index), so the dump says what the queue holds
    whichever runs hold it."""
    found = []
    for first, run in sorted(runs):
        for base, log_offset, size, store_ms, count in keys.run_entries(first, run):
            for i in range(count or 1):
                if low <= base + i < high:
                    found.append([base + i, log_offset + i, size, store_ms])
    return found


def _family(name: str, items: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """One column family, decoded when it is a known one, else as hex."""
    if name == RETAIN_FAMILY:
        return {key.decode(): _retained(value) for key, value in items}
    if name == AWAITING_FAMILY:
        flows: dict[str, dict[str, int]] = {}
        for key, value in items:
            client, rest = _string(key, 0)
            offset, released = _QOS2_VALUE.unpack(value)
            if not released:
                flows.setdefault(client, {})[str(_U16.unpack(rest)[0])] = offset
        return flows
    if name == _SESSIONS_FAMILY:
        return {key.decode(): value.hex() for key, value in items}
    if name == LEDGER_FAMILY:
        return {key.decode(): msgspec.to_builtins(_CLIENT_ENTRY.decode(value)) for key, value in items}
    return {key.hex(): value.hex() for key, value in items}


def _retained(value: bytes) -> dict[str, Any]:
    """A retained message: its CommitLog offset and the record's fields (hex if the copy does not decode)."""
    offset = keys.U64.unpack_from(value)[0]
    try:
        record = decode_record(value, 8, offset)
    except (CorruptRecord, struct.error, UnicodeDecodeError):
        return {"offset": offset, "record": value[8:].hex()}
    return {"offset": offset, "topic": record.topic, "payload": record.payload.hex(), "qos": record.qos,
            "flags": record.flags, "client_id": record.client_id, "store_ms": record.store_ms}


def _timer(directory: Path) -> dict[str, Any]:
    """The pending delayed messages of a stopped node's timer at its checkpoint (read-only: the checkpoint's
    changes are applied here, not written); empty when nothing is pending."""
    checkpoint = read_checkpoint(directory / "checkpoint")
    if checkpoint is None or not checkpoint.count:
        return {}
    wheel_path = directory / "wheel"
    window = wheel_path.stat().st_size // SLOT_SIZE if wheel_path.exists() else 0
    due: dict[int, list[int]] = {}
    by_slot: dict[int, int] = {}
    fd = os.open(directory / "timerlog", os.O_RDONLY)
    try:
        for _, entry in read_entries(fd, checkpoint.count, checkpoint.ends):
            if entry.done_at:
                continue
            fields = _TIMER_FIELDS.pack(entry.slot_s, entry.due_ms, entry.offset_real, entry.made_at,
                                        entry.size_real, entry.hash_topic, entry.hash_client)
            counted = due.setdefault(entry.due_ms // 1000, [0, 0])
            counted[0] += 1
            counted[1] = (counted[1] + int.from_bytes(hashlib.blake2b(fields, digest_size=16).digest(), "big")) \
                % _DIGEST_MOD
            if window:
                by_slot[entry.slot_s % window] = by_slot.get(entry.slot_s % window, 0) + 1
    finally:
        os.close(fd)
    wheel = _wheel_pending(wheel_path, window, checkpoint.slots) if window else {}
    out: dict[str, Any] = {
        "pending": sum(n for n, _ in due.values()),
        "due": {str(second): [n, f"{digest:032x}"] for second, (n, digest) in sorted(due.items())},
        "wheel": {str(index): n for index, n in sorted(wheel.items())},
    }
    disagrees = sorted(index for index in wheel.keys() | by_slot.keys() if wheel.get(index) != by_slot.get(index))
    if disagrees or out["pending"] != checkpoint.pending:
        out["inconsistent"] = {"wheel_slots": disagrees, "checkpoint_pending": checkpoint.pending}
    return out


def _wheel_pending(path: Path, window: int, changed: dict[int, Slot]) -> dict[int, int]:
    """Pending entries per wheel slot index (non-empty slots), with the checkpoint's ``changed`` slots applied."""
    found = {}
    with open(path, "rb") as handle:
        index = 0
        while index < window:
            chunk = handle.read(min(READ_SLOTS, window - index) * SLOT_SIZE)
            if not chunk:
                break
            for i, slot in enumerate(SLOT.iter_unpack(chunk)):
                if slot[4]:
                    found[index + i] = slot[4]
            index += len(chunk) // SLOT_SIZE
    for index, slot in changed.items():
        if slot.pending:
            found[index] = slot.pending
        else:
            found.pop(index, None)
    return found
