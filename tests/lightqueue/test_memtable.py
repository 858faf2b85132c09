"""A column family's memtable flushed in two steps (lightqueue/memtable.py), over a real RocksDB."""

import threading

import rocksdict

from lightqueue.memtable import MemtableFlush
from store.rocks import open_db
from tests.helpers.rocksdb_held import flushes_held, unwritten

WAIT_S = 30.0
"""A guard against a hang, not a timing: the wait ends as soon as RocksDB wrote the memtable."""

NO_WAL = rocksdict.WriteOptions()
NO_WAL.disable_wal = True


def test_start_switches_the_memtable_at_once_and_wait_returns_once_rocksdb_wrote_it(tmp_path):
    db = open_db(tmp_path / "index")
    flush = MemtableFlush()
    try:
        db.put(b"before", b"1", NO_WAL)
        with flushes_held():
            flush.start(db)  # returns although RocksDB writes nothing now
            db.put(b"after", b"2", NO_WAL)
            assert unwritten(db) == 1  # the switched memtable, waiting
            assert db.property_int_value("rocksdb.num-entries-active-mem-table") == 1  # only the later write
            waiter = threading.Thread(target=flush.wait, args=(db,))
            waiter.start()
        waiter.join(WAIT_S)
        assert not waiter.is_alive() and unwritten(db) == 0
        assert db.property_int_value("rocksdb.num-entries-active-mem-table") == 1  # the later write stays behind
        assert db.get(b"before") == b"1" and db.get(b"after") == b"2"
    finally:
        db.close()


def test_flush_with_wait_leaves_nothing_unwritten(tmp_path):
    db = open_db(tmp_path / "index")
    try:
        db.put(b"k", b"v", NO_WAL)
        MemtableFlush().flush(db, wait=True)
        assert unwritten(db) == 0 and db.property_int_value("rocksdb.num-entries-active-mem-table") == 0
    finally:
        db.close()
