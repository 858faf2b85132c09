"""The target-queues section codec: round trips and every way a section can be corrupt."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightqueue.targets import CorruptTargets, decode_queues, encode_queues


@given(st.lists(st.text(max_size=40), max_size=20))
def test_round_trip(names):
    assert decode_queues(encode_queues(names)) == tuple(names)


def test_empty_section_is_empty_bytes():
    assert encode_queues([]) == b""
    assert decode_queues(b"") == ()


def test_layout_is_u16_length_then_utf8():
    assert encode_queues(["a/+", "é/#"]) == b"\x00\x03a/+\x00\x04\xc3\xa9/#"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00", "truncated"),
        (b"\x00\x05abc", "overruns its section"),
        (b"\x00\x01a\x00", "truncated"),
        (b"\x00\x02\xff\xfe", "is not UTF-8"),
    ],
)
def test_corrupt_sections_are_rejected_with_a_reason(raw, message):
    with pytest.raises(CorruptTargets, match=message):
        decode_queues(raw)
