"""``lightgate snapshot``: a consistent copy of a stopped node's index database, for a replica to start from.

The index is the checkpoint of everything dispatch derives from the CommitLog (docs/storage.md, "Recovery"): a
node that gets a copy of the log and this snapshot dispatches only the records past the snapshot's checkpoints,
instead of the whole log. RocksDB's checkpoint (hard links to the table files where the target is on the same file
system, copies otherwise, and a fresh MANIFEST) is consistent by construction; the CommitLog is opened first, so
its lock refuses a snapshot of a node that still runs, and the memtable of that node was flushed when it stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rocksdict

from store.log.commitlog import CommitLog, CommitLogConfig
from store.rocks import open_db

__all__ = ["snapshot"]


def snapshot(data: Path, to: Path, config: CommitLogConfig) -> dict[str, Any]:
    """Copy ``data``'s index database to ``to`` (which must not exist); returns what it did, as log fields.

    Raises:
        FileExistsError: ``to`` exists.
        OSError: the data is in use by a running node (the CommitLog's lock), or I/O failed.
        Exception: RocksDB could not open the index (its message says why).
    """
    if to.exists():
        raise FileExistsError(f"{to} exists: a snapshot goes to a new directory")
    index = data / "index"
    if not (index / "CURRENT").is_file():
        raise FileNotFoundError(f"{index} holds no index database")
    with CommitLog.open(data / "commitlog", config) as log:
        db = open_db(index)
        try:
            rocksdict.Checkpoint(db).create_checkpoint(str(to))
        finally:
            db.close()
        return {"data": str(data), "to": str(to), "log_end": log.written_offset,
                "bytes": sum(p.stat().st_size for p in to.iterdir() if p.is_file())}
