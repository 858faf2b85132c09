"""Make a damaged index rebuildable from the CommitLog: ``lightgate repair`` after RocksDB lost some of its tables.

RocksDB's repair keeps the keys of the table files it can read and drops the
others, so what survives is an arbitrary subset of the index: a newer
checkpoint over entries that are gone, a queue id whose name is gone, a filter
activation without its queue. Dispatch from the surviving checkpoint would
leave every record below it that lost its entries undeliverable.

The entries, max offsets and the checkpoint are derived from the CommitLog, so
:func:`forget_derived` deletes them all and sets each queue's max offset back to
its minimum (``m``: retention deleted the entries below it); dispatching the
whole log again from its first record then writes every entry anew, at its
original queue offset (queue offsets are ordinals, and dispatch is
deterministic: keys.py, docs/storage.md). The state with no other source is
kept and made consistent first, so that dispatch can run over it:

- a queue id whose name key (``N``) or id key (``Q``) survived alone gets the other back;
- the next ids (``I`` of topic queues, ``F`` of filters: their ranges are split at ``TOPIC_IDS``) are set above
  every id still named, so no new queue takes a surviving id;
- a wildcard filter whose queue is named but whose activation (``A``) was lost is active again since
  the log's start: the records that list its id are exactly those appended while it was active;
- a filter activation whose queue id was lost gets a new id, active since the log's end (the records
  that listed the lost id cannot be told apart: the filter's subscribers get what comes next);
- retention counts as applied at the log's start (``T``), so nothing is expired twice.
"""

from __future__ import annotations

from typing import Any

import rocksdict

from lightqueue import keys
from lightqueue.queues import TOPIC_IDS, is_implicit
from lightqueue.topics import is_wildcard

__all__ = ["forget_derived"]


def forget_derived(db: rocksdict.Rdict, log_min: int, log_end: int) -> dict[str, Any]:
    """Delete the derived index state and make the rest consistent (see the module docstring), in one WAL'd write.

    Call it on the repaired database before anything opens it (``LightQueues`` refuses an activation without a
    queue id), then dispatch the log from ``log_min``. ``log_end`` is where a re-created filter starts.

    Returns:
        what was done, as log fields.
    """
    batch = rocksdict.WriteBatch(raw_mode=True)
    names = {key[1:].decode(): keys.U64.unpack(value)[0] for key, value in _scan(db, b"N")}
    ids = {keys.U64.unpack_from(key, 1)[0]: value.decode() for key, value in _scan(db, b"Q")}
    restored = 0
    for name, qid in names.items():
        if qid not in ids:
            batch.put(keys.id_key(qid), name.encode())
            ids[qid] = name
            restored += 1
    for qid, name in ids.items():
        if name not in names:
            batch.put(keys.name_key(name), keys.U64.pack(qid))
            names[name] = qid
            restored += 1
    raw = db.get(keys.NEXT_ID)
    next_id = keys.U64.unpack(raw)[0] if raw else TOPIC_IDS
    raw = db.get(keys.NEXT_FILTER_ID)
    next_filter_id = max(keys.U64.unpack(raw)[0] if raw else 1, next_id if next_id < TOPIC_IDS else 1,
                         max((qid for qid in ids if qid < TOPIC_IDS), default=0) + 1)
    next_id = max(next_id, TOPIC_IDS, max(ids, default=0) + 1)
    active = {key[1:].decode() for key, _ in _scan(db, b"A")}
    reactivated = 0
    for name in names.keys() - active:
        if is_wildcard(name) and not is_implicit(name):
            batch.put(keys.active_key(name), keys.U64.pack(0))
            reactivated += 1
    renamed = 0
    for name in active - names.keys():
        batch.put(keys.name_key(name), keys.U64.pack(next_filter_id))
        batch.put(keys.id_key(next_filter_id), name.encode())
        batch.put(keys.active_key(name), keys.U64.pack(log_end))
        next_filter_id += 1
        renamed += 1
    batch.put(keys.NEXT_ID, keys.U64.pack(next_id))
    batch.put(keys.NEXT_FILTER_ID, keys.U64.pack(next_filter_id))
    minimums = {keys.U64.unpack_from(key, 1)[0]: value for key, value in _scan(db, b"m")}
    for key, _ in _scan(db, b"M"):
        if keys.U64.unpack_from(key, 1)[0] not in minimums:
            batch.delete(key)
    for qid, low in minimums.items():
        batch.put(keys.max_key(qid), low)
    batch.delete_range(b"E", keys.prefix_end(b"E"))
    batch.delete(keys.CHECKPOINT)
    batch.put(keys.RETAINED, keys.U64.pack(log_min))
    db.write(batch, rocksdict.WriteOptions())
    return {"queues": len(names), "ids_restored": restored, "filters_reactivated": reactivated,
            "filters_with_new_ids": renamed, "next_queue_id": next_id, "next_filter_id": next_filter_id}


def _scan(db: rocksdict.Rdict, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """Every key with ``prefix`` (one type byte) and its value."""
    opts = rocksdict.ReadOptions()
    opts.set_iterate_upper_bound(keys.prefix_end(prefix))
    it = db.iter(opts)
    it.seek(prefix)
    found = []
    while it.valid():
        found.append((it.key(), it.value()))
        it.next()
    it.status()  # raises the iterator's error: a damaged block must not read as the end of the keys
    return found
