"""The key layout keeps one queue's entries contiguous, in queue-offset order, apart from every other key."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightqueue import keys

u64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(u64, u64, u64)
def test_entries_sort_by_queue_then_offset(qid, a, b):
    assert (keys.entry_key(qid, a) < keys.entry_key(qid, b)) == (a < b)
    assert keys.entry_key(qid, a).startswith(keys.entry_prefix(qid))


@given(st.integers(min_value=0, max_value=2**64 - 2), u64, u64)
def test_queues_do_not_interleave(qid, a, b):
    assert keys.entry_key(qid, a) < keys.entry_key(qid + 1, b)
    assert keys.entry_key(qid, a) < keys.prefix_end(keys.entry_prefix(qid)) <= keys.entry_key(qid + 1, b)


@given(st.text(min_size=1), st.text(), st.text(min_size=1), st.text())
def test_length_prefixed_strings_never_run_into_each_other(f1, h1, f2, h2):
    """A holder key of one filter never falls inside another filter's prefix range."""
    k = keys.holder_key(f1, h1)
    inside = keys.holder_prefix(f2) <= k < keys.prefix_end(keys.holder_prefix(f2))
    assert inside == (f1 == f2)


def test_prefix_end():
    assert keys.prefix_end(b"E\x00\x01") == b"E\x00\x02"
    assert keys.prefix_end(b"E\x00\xff") == b"E\x01"
    with pytest.raises(ValueError, match="no upper bound"):
        keys.prefix_end(b"\xff\xff")


def test_entry_value_is_twenty_bytes():
    assert len(keys.ENTRY.pack(2**63, 2**32 - 1, 1_700_000_000_000)) == 20
