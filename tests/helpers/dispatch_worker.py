"""Subprocess for the crash test in tests/store/test_dispatch.py: dispatch a prepared log until killed.

Usage: ``python tests/helpers/dispatch_worker.py DATA_DIR PAUSE_AFTER``. Opens
``DATA_DIR/commitlog`` and ``DATA_DIR/index`` and dispatches in small steps
with a memtable flush every few steps. After ``PAUSE_AFTER`` steps it prints
``paused <dispatched offset> <flushed offset>`` and waits on stdin, with index
batches since the last flush only in the memtable, for the test's SIGKILL.
"""

import sys
from pathlib import Path

from lightqueue.queues import LightQueues
from store.log.commitlog import CommitLog, CommitLogConfig
from store.dispatch import Dispatcher
from store.queuecontrol import QueueControls
from store.rocks import open_db

SEGMENT_BYTES = 256 * 1024


def main(data: Path, pause_after: int) -> None:
    log = CommitLog.open(data / "commitlog", CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES))
    queues = LightQueues(open_db(data / "index"))
    dispatcher = Dispatcher(log, queues, scan_bytes=16 * 1024, flush_bytes=1024 * 1024,
                            activations=QueueControls(queues))
    for _ in range(pause_after):
        if dispatcher.dispatch_once() is None:
            break
    stats = dispatcher.statistics()
    print("paused", stats.dispatched_offset, stats.flushed_offset, flush=True)
    sys.stdin.readline()  # the test kills us here


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
