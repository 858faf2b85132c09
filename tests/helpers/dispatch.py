"""A CommitLog, RocksDB and dispatcher wired together in-process, as the dispatch and re-index tests need them."""

from lightqueue import keys
from lightqueue.queues import LightQueues
from store.control import encode_control
from store.dispatch import Dispatcher
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import decode_record, encode_record
from store.queuecontrol import QueueControls
from store.rocks import open_db

SEGMENT = 256 * 1024


def decode(raw, offset):
    return decode_record(raw, 0, offset)


def dump(db):
    """The keys of ``db``'s default family (the light queues'), each run of entries (``E`` keys) expanded to one
    key per entry: where dispatch batches began decides how entries are grouped into runs, not which there are."""
    found = {}
    for key, value in db.items():
        if key[:1] != b"E":
            found[key] = value
            continue
        qid, first = keys.U64.unpack_from(key, 1)[0], keys.U64.unpack_from(key, 9)[0]
        for i in range(len(value) // keys.ENTRY.size):
            found[keys.entry_key(qid, first + i)] = value[i * keys.ENTRY.size:(i + 1) * keys.ENTRY.size]
    return found


class Node:
    """A CommitLog, light queues and a dispatcher in one directory."""

    def __init__(self, path, listener=None, controls=True, **kwargs):
        self.path = path
        self.log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, **kwargs))
        self.db = open_db(path / "index")
        self.lq = LightQueues(self.db)
        self.dispatcher = Dispatcher(self.log, self.lq, listener,  # with appliers, retention restates them first
                                     activations=QueueControls(self.lq) if controls else None)

    def append(self, *topics, payload=b"p"):
        return self.log.append_batch([encode_record(t, payload, queues=self.lq.targets(t)) for t in topics])

    def control(self, *controls):
        """Append control records (store/control.py), as ``StoreNode.append_control`` writes them."""
        return self.log.append_batch([encode_control(c, 0, SEGMENT)[0] for c in controls])

    def dump(self):
        """The index, each run of entries expanded (:func:`dump`)."""
        return dump(self.db)

    def close(self):
        self.dispatcher.close()
        self.db.close()
        self.log.close()
