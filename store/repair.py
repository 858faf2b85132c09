"""``lightgate repair``: bring a node's data back to a state it can start from after the index database broke.

The CommitLog is the source of truth and checks itself on every open; the index database (``<data>/index``,
RocksDB) is derived from it (docs/storage.md, "Recovery"). When a RocksDB file is damaged (CURRENT, MANIFEST, an
SST) the node refuses to start with one line pointing here. The repair rebuilds the index from the log:

1. opens the CommitLog, which takes its lock (a running node makes it fail) and recovers it;
2. moves the damaged index aside (``index.before-repair-<time>``), untouched, for later inspection;
3. while some state is still kept beside the log (:data:`BESIDE_THE_LOG`), salvages it: a copy of the damaged
   index goes through RocksDB's own repair (which keeps the table and WAL files it can read and sets aside, in
   ``index/lost``, those it cannot), then everything derived is forgotten and the rest made consistent
   (lightqueue/reindex.py); with nothing beside the log, the new index starts empty;
4. dispatches the whole CommitLog into it, every entry at its original queue offset, the retained messages taken
   again from the log's start, every position past the log's end pulled back to it (``Dispatcher.recover``).

What it cannot bring back is what :data:`BESIDE_THE_LOG` names, when it was only in a table file RocksDB could not
read (docs/storage.md, "Repair").
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

__all__ = ["BESIDE_THE_LOG", "repair"]

BESIDE_THE_LOG = ("session blobs", "client ledger", "filter activations and holders", "consumer offsets",
                  "queue ids", "inbound QoS 2 releases")
"""The state the index still keeps with no record in the CommitLog: salvaged from the damaged index (what RocksDB
can read of it), lost where it cannot. Each goes from here as it becomes control records (issue 26); empty, the
repair is a rebuild from the log alone."""


def repair(data: Path, config: CommitLogConfig) -> dict[str, Any]:
    """Repair the node's data under ``data`` (see the module docstring); returns what it did, as log fields.

    Raises:
        OSError: the data is in use by a running node (the CommitLog's lock), or I/O failed.
        Exception: RocksDB could not repair or open the index (its message says why).
    """
    index = data / "index"
    with CommitLog.open(data / "commitlog", config) as log:
        backup = data / f"index.before-repair-{time.strftime('%Y%m%d-%H%M%S')}"
        index.rename(backup)
        db, salvaged, set_aside = _salvaged(index, backup) if BESIDE_THE_LOG else (open_db(index), False, [])
        try:
            rebuilt = forget_derived(db, log.min_offset, log.written_offset) if salvaged else {}
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
                "tables_set_aside": set_aside,
                "reindexed": rebuilt, "pulled_back": pulled, "not_in_the_log": list(BESIDE_THE_LOG),
                "salvaged": salvaged}


def _salvaged(index: Path, damaged: Path) -> tuple[rocksdict.Rdict, bool, list[str]]:
    """What RocksDB's repair keeps of a copy of the ``damaged`` index, opened at ``index``, and the table files it
    set aside; an empty index (salvaged: False) when that cannot be opened (every table of a column family lost:
    rocksdict still lists the family)."""
    shutil.copytree(damaged, index)
    rocksdict.Rdict.repair(str(index), rocksdict.Options(raw_mode=True))
    lost = index / "lost"
    set_aside = sorted(p.name for p in lost.iterdir()) if lost.is_dir() else []
    try:
        return open_db(index), True, set_aside
    except Exception:  # rocksdict raises plain Exceptions ("Column family not found")
        shutil.rmtree(index)
        return open_db(index), False, set_aside
