"""Subprocess for tests/store/test_queuecontrol.py: append control records and messages, never dispatch, get killed.

Usage: ``python tests/helpers/control_writer.py DATA_DIR``. Appends to ``DATA_DIR/commitlog`` what a store node
appends (an activation's record, messages whose targets list the filter from then on, commits, a second holder),
keeping the writer's own state in a scratch RocksDB (``DATA_DIR/writer``, deleted: the index is never written),
flushes the log, prints ``appended <log end>`` and waits on stdin for the test's SIGKILL.
"""

import shutil
import sys
from pathlib import Path

from lightqueue.queues import LightQueues
from store.control import Activated, Committed, encode_control
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record
from store.queuecontrol import QueueControls
from store.rocks import open_db


def main(data: Path) -> None:
    log = CommitLog.open(data / "commitlog", CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10))
    db = open_db(data / "writer")
    lq = LightQueues(db)
    applier = QueueControls(lq)

    def control(made):
        raw, record = encode_control(made, 0, 64 << 10)
        record.offset = log.append(raw)
        applier.apply(record, made)  # the writer's state, as StoreNode.append_control returns once applied

    def publish(topic, payload):
        log.append(encode_record(topic, payload, queues=lq.targets(topic)))

    publish("s/1", b"before")
    control(Activated("s/+", "h1", lq.filter_id("s/+")))
    for topic in ("s/1", "s/2", "s/3"):
        publish(topic, b"after")
    control(Activated("s/+", "h2", lq.filter_id("s/+")))
    control(Committed("h1", {"s/+": 2, "s/1": 1}))
    log.flush()
    db.close()
    shutil.rmtree(data / "writer")
    print("appended", log.written_offset, flush=True)
    sys.stdin.readline()  # the test kills us here


if __name__ == "__main__":
    main(Path(sys.argv[1]))
