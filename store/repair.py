"""``lightgate repair``: bring a node's data back to a state it can start from after the index database broke.

The CommitLog is the source of truth and checks itself on every open; the
index database (``<data>/index``, RocksDB) holds derived state (light-queue
entries, max offsets, the dispatch checkpoint, retained copies) and state with
no other source (queue ids, filter activations and holders, consumer offsets,
session blobs). When a RocksDB file is damaged (CURRENT, MANIFEST, an SST) the
node refuses to start with one line pointing here. The repair:

1. opens the CommitLog, which takes its lock (a running node makes it fail) and recovers it;
2. copies the index directory aside (``index.before-repair-<time>``), untouched, for later inspection;
3. runs RocksDB's own repair, which rebuilds the MANIFEST and CURRENT from the table and WAL files it
   can read and sets aside (in ``index/lost``) those it cannot;
4. forgets the derived index state (entries, max offsets, the checkpoint) and makes the rest consistent
   (lightqueue/reindex.py), and has the retained messages taken again from the log's start: a lost table
   may have held entries or retained messages below a checkpoint that survived in another;
5. opens the result as the node would and re-indexes the whole CommitLog, every entry at its original
   queue offset, pulling every position past the log's end back to it (``Dispatcher.recover``).

What it cannot bring back is described in docs/storage.md ("Repair"): state with no other source
(session blobs, consumer offsets, filter holders and activations, queue ids) that was only in a table
file RocksDB could not read.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import rocksdict

from lightqueue.queues import LightQueues
from lightqueue.reindex import forget_derived
from retain.store import RetainedStore
from store.log.commitlog import CommitLog, CommitLogConfig
from store.dispatch import Dispatcher
from store.queuecontrol import QueueControls
from store.rocks import open_db

__all__ = ["repair"]


def repair(data: Path, config: CommitLogConfig) -> dict[str, Any]:
    """Repair the node's data under ``data`` (see the module docstring); returns what it did, as log fields.

    Raises:
        OSError: the data is in use by a running node (the CommitLog's lock), or I/O failed.
        Exception: RocksDB could not repair or open the index (its message says why).
    """
    index = data / "index"
    with CommitLog.open(data / "commitlog", config) as log:
        backup = data / f"index.before-repair-{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.copytree(index, backup)
        rocksdict.Rdict.repair(str(index), rocksdict.Options(raw_mode=True))
        lost = index / "lost"
        db = open_db(index)
        try:
            rebuilt = forget_derived(db, log.min_offset, log.written_offset)
            queues = LightQueues(db)
            retained = RetainedStore(db)
            retained.replay_all()
            dispatcher = Dispatcher(log, queues, retained=retained, appliers=[QueueControls(queues)])
            pulled = dispatcher.recover()
            rebuilt.update(entries=queues.statistics().entries_indexed, retained=retained.count)
            dispatcher.close()
            retained.close()
        finally:
            db.close()
        return {"data": str(data), "backup": str(backup), "log_end": log.written_offset,
                "tables_set_aside": sorted(p.name for p in lost.iterdir()) if lost.is_dir() else [],
                "reindexed": rebuilt, "pulled_back": pulled}
