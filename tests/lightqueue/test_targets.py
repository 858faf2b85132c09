"""The target-queues section codec: round trips, the byte layout and every way a section can be bad."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightqueue.targets import MAX_QUEUE_ID, CorruptTargets, decode_queues, encode_queues

queue_ids = st.integers(min_value=0, max_value=MAX_QUEUE_ID)


@given(st.lists(queue_ids, max_size=30))
def test_round_trip_sorts_and_drops_duplicates(ids):
    assert decode_queues(encode_queues(ids)) == tuple(sorted(set(ids)))


def test_empty_section_is_empty_bytes():
    assert encode_queues([]) == b""
    assert decode_queues(b"") == ()


def test_layout_is_u32_big_endian_ids_ascending():
    assert encode_queues([7, 1, 7, MAX_QUEUE_ID]) == b"\x00\x00\x00\x01\x00\x00\x00\x07\xff\xff\xff\xff"
    assert len(encode_queues(range(1, 11))) == 40  # the storage benchmark's 10 filters


@pytest.mark.parametrize("ids", [[MAX_QUEUE_ID + 1], [-1, 3]])
def test_ids_outside_u32_are_refused(ids):
    with pytest.raises(ValueError, match="must be 0-4294967295"):
        encode_queues(ids)


@pytest.mark.parametrize("raw", [b"\x00", b"\x00\x00\x00\x01\x00\x02", b"\x00\x00\x00\x01\x00\x00\x00"])
def test_a_section_that_is_not_whole_ids_is_corrupt(raw):
    with pytest.raises(CorruptTargets, match=f"section of {len(raw)} bytes is not a whole number of 4-byte"):
        decode_queues(raw)


def test_only_small_sections_are_cached():
    """Sections of thousands of filters are made by clients; caching 4,096 of them could pin gigabytes."""
    from lightqueue.targets import CACHED_SECTION_BYTES

    small, large = encode_queues(range(1, 10)), encode_queues(range(1, CACHED_SECTION_BYTES))
    assert decode_queues(small) is decode_queues(small)
    assert decode_queues(large) == tuple(range(1, CACHED_SECTION_BYTES))
    assert decode_queues(large) is not decode_queues(large)
