"""store/log/segment.py: one fixed-size file of opaque bytes, on real files."""

from __future__ import annotations

import pytest

from store.log.segment import AppendStatus, Segment, SegmentRetired, parse_segment_name, segment_name

SIZE = 4096


@pytest.fixture
def seg(tmp_path):
    segment = Segment.create(tmp_path, 8192, SIZE)
    yield segment
    segment.close()


def test_names_are_20_digit_base_offsets():
    assert segment_name(268435456) == "00000000000268435456"
    assert parse_segment_name("00000000000268435456") == 268435456
    assert parse_segment_name("00000000000268435456.meta") is None
    assert parse_segment_name("flushed") is None


def test_create_pre_sizes_a_sparse_file(tmp_path, seg):
    path = tmp_path / "00000000000000008192"
    assert seg.path == path
    assert path.stat().st_size == SIZE
    assert path.read_bytes() == b"\0" * SIZE
    assert (seg.base, seg.end, seg.write_pos, seg.remaining) == (8192, 8192 + SIZE, 0, SIZE)
    with pytest.raises(FileExistsError):
        Segment.create(tmp_path, 8192, SIZE)


def test_append_returns_positions_and_bytes_read_back(seg):
    first = seg.append(b"hello")
    second = seg.append(b"world!")
    assert (first.status, first.offset, first.size) == (AppendStatus.OK, 0, 5)
    assert (second.status, second.offset, second.size) == (AppendStatus.OK, 5, 6)
    assert seg.read(0, 11) == b"helloworld!"
    assert seg.write_pos == 11


def test_data_that_exactly_fills_fits_and_one_byte_more_does_not(seg):
    seg.append(b"a" * 100)
    too_big = seg.append(b"b" * (SIZE - 99))
    assert too_big.status is AppendStatus.END_OF_SEGMENT
    assert seg.write_pos == 100
    assert seg.read(100, 10) == b"\0" * 10
    exact = seg.append(b"c" * (SIZE - 100))
    assert exact.status is AppendStatus.OK and seg.remaining == 0


def test_seal_writes_the_marker_past_the_data_and_refuses_appends(seg):
    seg.append(b"data")
    seg.seal(b"MARKER")
    assert seg.sealed and seg.write_pos == 4
    assert seg.read(0, 10) == b"dataMARKER"
    with pytest.raises(ValueError, match="sealed"):
        seg.append(b"more")


def test_sync_moves_the_flushed_position(seg):
    seg.append(b"x" * 300)
    assert seg.flushed_pos == 0
    assert seg.sync() == 300
    assert seg.flushed_pos == 300


def test_truncate_zeroes_the_tail_and_moves_back(seg):
    seg.append(b"keep" + b"drop" * 10)
    seg.sync()
    seg.truncate(4)
    assert seg.write_pos == 4 and seg.flushed_pos == 4
    assert seg.read(0, 50) == b"keep" + b"\0" * 46
    assert seg.path.stat().st_size == SIZE


def test_dirty_end_finds_the_last_non_zero_byte(seg):
    assert seg.dirty_end(0) == 0
    seg.append(b"abc")
    with open(seg.path, "r+b") as fh:
        fh.seek(3000)
        fh.write(b"z")
    assert seg.dirty_end(3) == 3001
    assert seg.dirty_end(3001) == 3001


def test_open_re_extends_a_short_file(tmp_path):
    path = tmp_path / segment_name(0)
    path.write_bytes(b"abc")
    seg = Segment.open(path, SIZE)
    try:
        assert path.stat().st_size == SIZE
        assert seg.read(0, 5) == b"abc\0\0"
    finally:
        seg.close()
    with pytest.raises(ValueError, match="20 decimal digits"):
        Segment.open(tmp_path / "nope", SIZE)


def test_a_retired_segment_stays_readable_until_the_last_pin_is_released(seg):
    seg.append(b"still here")
    with seg.pinned():
        seg.retire()
        assert seg.read(0, 10) == b"still here"
        with pytest.raises(SegmentRetired):
            with seg.pinned():
                pass
    with pytest.raises(OSError):
        seg.read(0, 10)  # the descriptor is closed now
