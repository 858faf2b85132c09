"""A derived column family (store/derived.py) never keeps what a record past the log's end made, even when RocksDB
persisted it on its own before the dispatcher's flush moved the family's checkpoint."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from store.derived import DerivedFamily
from store.rocks import open_db


@contextmanager
def opened(path: Path) -> Iterator[DerivedFamily]:
    """The ``sessions`` family of the index at ``path``; closing the database persists its memtable, as RocksDB may
    at any time on its own (no WAL needed for that)."""
    db = open_db(path / "index")
    family = DerivedFamily(db, "sessions")
    try:
        yield family
    finally:
        family.close()
        db.close()


def test_a_change_persisted_before_the_checkpoint_moved_is_forgotten_when_the_log_ends_before_its_record(tmp_path):
    with opened(tmp_path) as family:
        family.put("kept", b"1", 10)
        family.flush(20)  # the dispatcher's flush: everything below 20 is applied and the log is flushed to 20
        family.put("late", b"2", 100)  # applied from a record the log had not flushed yet

    with opened(tmp_path) as family:
        assert family.checkpoint == 20 and dict(family.items()) == {"kept": b"1", "late": b"2"}
        assert family.rewind(50)  # a power loss cut the log at 50: the record at 100 is gone
        assert dict(family.items()) == {} and family.checkpoint == 0  # derived again from the log's start
        assert not family.legacy


def test_a_family_whose_records_are_all_below_the_logs_end_is_kept(tmp_path):
    with opened(tmp_path) as family:
        family.put("a", b"1", 10)
        family.delete("a", 30)
        family.put("b", b"2", 40)
        assert not family.rewind(50) and dict(family.items()) == {"b": b"2"}


def test_a_patch_is_applied_with_its_mark_and_forgotten_with_it_when_the_log_ends_before_its_record(tmp_path):
    """A session patch's parts go in one write with the mark of their record (``patch``): persisted before the
    checkpoint moved, they are forgotten on a rewind below that record, as one ``put`` would be."""
    with opened(tmp_path) as family:
        family.put("c", b"blob", 10)
        family.put("c\x00gone", b"0", 11)
        family.flush(20)
        family.patch({"c\x00a": b"1", "c\x00b": b"2", "c\x00gone": b"", "c\x00never": b""}, 100)

    with opened(tmp_path) as family:
        assert dict(family.items()) == {"c": b"blob", "c\x00a": b"1", "c\x00b": b"2"}  # an empty part: its key goes
        assert family.applied_end == 101
        assert family.rewind(50)
        assert dict(family.items()) == {} and family.checkpoint == 0


def test_a_patch_that_removes_only_missing_keys_writes_nothing(tmp_path):
    with opened(tmp_path) as family:
        family.put("c", b"blob", 10)
        family.flush(20)
        family.patch({"c\x00never": b""}, 100)
        assert family.applied_end == 101  # applied, though it changed nothing

    with opened(tmp_path) as family:
        assert family.applied_end == 20 and not family.rewind(50)  # no mark was written: nothing to forget
        assert dict(family.items()) == {"c": b"blob"}
