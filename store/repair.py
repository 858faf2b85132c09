"""``lightgate repair``: bring a node's data back to a state it can start from after the index database broke.

The CommitLog is the only truth and checks itself on every open; the index database (``<data>/index``, RocksDB)
is wholly derived from it (docs/storage.md, "What is derived, and rebuilding it"): the light queues, the filter
activations with their queue ids and holders, consumer offsets, retained messages, QoS 2 flows, session blobs and
the client ledger are all made by dispatch from the log's records. When a RocksDB file is damaged (CURRENT,
MANIFEST, an SST) the node refuses to start with one line pointing here. The repair rebuilds the index:

1. opens the CommitLog, which takes its lock (a running node makes it fail) and recovers it;
2. moves the damaged index aside (``index.before-repair-<time>``), untouched, for later inspection;
3. dispatches the whole CommitLog into a new, empty index with every part that derives state from it, every entry
   at its original queue offset (from a log whose head retention deleted, queue offsets restart at the first
   record kept: docs/storage.md, "Retention").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightqueue.queues import LightQueues
from retain.store import RetainedStore
from store.awaiting import AwaitingRelease
from store.dispatch import Dispatcher
from store.ledger import ClientLedger
from store.log.commitlog import CommitLog, CommitLogConfig
from store.queuecontrol import QueueControls
from store.rocks import open_db
from store.sessions import SessionBlobs

__all__ = ["repair"]


def repair(data: Path, config: CommitLogConfig) -> dict[str, Any]:
    """Repair the node's data under ``data`` (see the module docstring); returns what it did, as log fields.

    Raises:
        OSError: the data is in use by a running node (the CommitLog's lock), or I/O failed.
        Exception: RocksDB could not create the new index (its message says why).
    """
    index = data / "index"
    with CommitLog.open(data / "commitlog", config) as log:
        backup = None  # an index deleted by hand: nothing to keep aside
        if index.exists():
            backup = data / f"index.before-repair-{time.strftime('%Y%m%d-%H%M%S')}"
            index.rename(backup)
        db = open_db(index)
        try:
            queues = LightQueues(db)
            retained = RetainedStore(db)
            awaiting = AwaitingRelease(db)
            blobs = SessionBlobs(db)
            ledger = ClientLedger(db)
            try:
                dispatcher = Dispatcher(log, queues, retained=retained, awaiting=awaiting,
                                        activations=QueueControls(queues),
                                        appliers=[blobs, ledger, awaiting.controls])
                dispatcher.recover()
                rebuilt = {"entries": queues.statistics().entries_indexed, "retained": retained.count,
                           "sessions": len(list(blobs.ids())), "clients": len(ledger.entries())}
                dispatcher.close()
            finally:
                for part in (ledger, blobs, awaiting, retained):
                    part.close()
        finally:
            db.close()
        return {"data": str(data), "backup": str(backup) if backup else None, "log_end": log.written_offset, "reindexed": rebuilt}
