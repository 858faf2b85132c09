"""The index database opens in raw (bytes) mode, creates its directory and reopens with its data."""

import rocksdict

from store.rocks import open_db


def test_open_creates_and_reopens(tmp_path):
    db = open_db(tmp_path / "index")
    wal = rocksdict.WriteOptions()
    db.put(b"k", b"v", wal)
    db.close()
    db = open_db(tmp_path / "index")
    try:
        assert db.get(b"k") == b"v"
        assert (tmp_path / "index" / "CURRENT").is_file()
    finally:
        db.close()
