"""Columnar decoding of CommitLog segments (spark_analytics.framing), without Spark.

Logs are written with the real CommitLog; expectations come from the
CommitLog's own reader or from the generated messages.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.helpers.spark_fixtures import Msg, encode, telemetry, write_log

from spark_analytics.framing import (RAW_SCHEMA, DecodeOptions, ScanRange, corrupt_skipped, frames_in, scan_range,
                                     valid_end)
from spark_analytics.layout import FLUSHED_FILE, list_segments, read_flushed
from spark_analytics.planning import plan_ranges, readable_limit
from lightqueue.topics import matches
from store.log.commitlog import CommitLog, CommitLogConfig
from store.control import SessionEnded, encode_control
from store.api import NewMessage
from store.log.record import FLAG_ZSTD, MAGIC_V1, encode_record, new_batch
from tests.helpers.batches import malformed_batch, zstd_batch

MAGIC = MAGIC_V1.to_bytes(4, "big")


def rows(data: Path, opts: DecodeOptions | None = None, *, target: int = 1 << 20) -> list[dict]:
    directory = data / "commitlog"
    out = []
    for ranges in plan_ranges(list_segments(directory), read_flushed(directory), target_bytes=target):
        for rng in ranges:
            for frames in scan_range(rng, opts or DecodeOptions()):
                batch = frames.raw_batch()
                assert batch.schema == RAW_SCHEMA
                out += batch.to_pylist()
    return out


def test_every_field_matches_the_commitlog_reader(tmp_path: Path) -> None:
    msgs = [Msg("a/b", b"x" * i, 1_000 + i, client_id=f"c{i}", qos=i % 3, retain=i % 2 == 0,
                properties=bytes([0x26, 0, 1, 0x6B, 0, 1, 0x76]) if i % 4 == 0 else b"")
            for i in range(600)]
    msgs.append(Msg("ünïcode/τοπικό/🛰", "häßlich".encode(), 5_000, client_id="ж"))
    offsets = write_log(tmp_path, msgs, segment_bytes=16 * 1024)
    got = rows(tmp_path)
    assert [r["offset"] for r in got] == offsets
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        for row, offset in zip(got, offsets):
            rec = log.read(offset)
            assert (row["topic"], row["client_id"], row["qos"], row["retain"], row["properties"], row["payload"]) == (
                rec.topic, rec.client_id, rec.qos, rec.retain, rec.properties, rec.payload)
            assert round(row["store_ts"].timestamp() * 1000) == rec.store_ms
            assert round(row["born_ts"].timestamp() * 1000) == rec.born_ms


def test_split_ranges_return_every_record_exactly_once(tmp_path: Path) -> None:
    msgs = telemetry(400)
    offsets = write_log(tmp_path, msgs, segment_bytes=1 << 20)
    seg = list_segments(tmp_path / "commitlog")[0]
    limit, strict = readable_limit(seg, read_flushed(tmp_path / "commitlog"))
    boundaries = [o - seg.base for o in offsets]
    cuts = sorted({b + d for b in boundaries[1:50:7] for d in (-1, 0, 1, 4, 8, 12, 42, 43)})
    for cut in cuts:
        assert read_in_two(seg, cut, limit, strict) == offsets, f"cut at {cut}"


def read_in_two(seg, cut: int, limit: int, strict: bool) -> list[int]:
    """The offsets read by two readers of one segment, one range cut at ``cut``."""
    seen = []
    for lo, hi in ((0, cut), (cut, limit)):
        rng = ScanRange(seg.path, seg.base, 0, lo, hi, limit, strict)
        for frames in scan_range(rng, DecodeOptions(window_bytes=4096)):
            seen += frames.offset.tolist()
    return seen


def test_payloads_that_contain_record_bytes_do_not_confuse_the_walk(tmp_path: Path) -> None:
    inner = encode_record("fake/topic", b"inside", store_ms=1)
    payloads = [MAGIC * 50, inner, b"\0" * 8 + MAGIC + inner + MAGIC, b"y" * 3000, inner * 3]
    msgs = [Msg(f"t/{i}", payloads[i % len(payloads)], 10 + i) for i in range(60)]
    offsets = write_log(tmp_path, msgs)
    got = rows(tmp_path, DecodeOptions(window_bytes=2048))
    assert [r["offset"] for r in got] == offsets
    assert [r["payload"] for r in got] == [m.payload for m in msgs]


def test_records_larger_than_a_read_window(tmp_path: Path) -> None:
    msgs = [Msg("big", bytes([i]) * (9_000 + i), 10 + i) for i in range(20)]
    write_log(tmp_path, msgs, segment_bytes=64 * 1024)
    got = rows(tmp_path, DecodeOptions(window_bytes=1024))
    assert [r["payload"] for r in got] == [m.payload for m in msgs]


def test_topic_and_time_push_down(tmp_path: Path) -> None:
    msgs = telemetry(300, devices=5) + [Msg("$SYS/uptime", b"1", 99), Msg("fleet", b"{}", 98)]
    write_log(tmp_path, msgs)
    for topic_filter in ("fleet/dev3/#", "fleet/+/telemetry", "#", "fleet/#", "+/+/+"):
        got = rows(tmp_path, DecodeOptions(topic_filters=(topic_filter,)))
        assert [r["topic"] for r in got] == [m.topic for m in msgs if matches(topic_filter, m.topic)]
    lo, hi = msgs[40].store_ms, msgs[77].store_ms
    got = rows(tmp_path, DecodeOptions(from_ms=lo, to_ms=hi, topic_filters=("fleet/dev1/telemetry",)))
    want = [m for m in msgs if lo <= m.store_ms < hi and m.topic == "fleet/dev1/telemetry"]
    assert [r["payload"] for r in got] == [m.payload for m in want]
    assert len(want) > 3


def _active_tail(data: Path, offsets: list[int], msgs: list[Msg]) -> tuple[Path, int]:
    """The active segment file and the position after its last record."""
    seg = list_segments(data / "commitlog")[-1]
    return Path(seg.path), offsets[-1] + len(encode(msgs[-1])) - seg.base


@pytest.mark.parametrize("hint", ["valid", "missing", "bad-crc"])
def test_a_half_written_tail_is_never_read(tmp_path: Path, hint: str) -> None:
    msgs = telemetry(50)
    offsets = write_log(tmp_path, msgs)
    path, end = _active_tail(tmp_path, offsets, msgs)
    torn = encode(Msg("fleet/dev0/telemetry", b'{"temp": 1, "hum": 2}', 5))
    with open(path, "r+b") as fh:
        os.pwrite(fh.fileno(), torn[: len(torn) // 2], end)
    flushed = tmp_path / "commitlog" / FLUSHED_FILE
    if hint == "missing":
        flushed.unlink()
    elif hint == "bad-crc":
        flushed.write_bytes(flushed.read_bytes()[:8] + b"\0\0\0\0")
    assert [r["offset"] for r in rows(tmp_path)] == offsets


def _flip(path: str, position: int) -> None:
    with open(path, "r+b") as fh:
        byte = os.pread(fh.fileno(), 1, position)
        os.pwrite(fh.fileno(), bytes([byte[0] ^ 0xFF]), position)


def _corrupt_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("corrupt CommitLog record skipped")]


def test_a_corrupt_record_below_the_durable_end_is_skipped_alone_logged_and_counted(tmp_path: Path, caplog) -> None:
    msgs = telemetry(1500)
    offsets = write_log(tmp_path, msgs)
    seg = list_segments(tmp_path / "commitlog")[0]
    assert seg.sealed
    _flip(seg.path, offsets[3] - seg.base + len(encode(msgs[3])) - 2)  # a payload byte of record 3
    before = corrupt_skipped()
    got = rows(tmp_path)
    assert [r["offset"] for r in got] == offsets[:3] + offsets[4:]  # as the store does: every other record
    assert corrupt_skipped() == before + 1
    (line,) = _corrupt_lines(caplog)
    assert f"{seg.path}, CommitLog offsets {offsets[3]} to {offsets[4]}" in line and "CRC mismatch" in line, line
    unchecked = rows(tmp_path, DecodeOptions(verify_crc=False))  # the option really skips the check
    assert len(unchecked) == len(offsets) and unchecked[3]["payload"] != msgs[3].payload


@pytest.mark.parametrize("byte", [1, 2, 3, 9], ids=["length-high", "length-middle", "length-low", "magic"])
def test_broken_framing_below_the_durable_end_resumes_at_the_next_valid_record(tmp_path: Path, caplog,
                                                                               byte: int) -> None:
    """Flipped bits in a record's length (so that it overruns the segment, or leads into the middle of a later
    record) or magic: the walk cannot step over the record by its length; it resumes at the next CRC-valid
    record, whatever range the reader starts in, and each other record is read exactly once."""
    msgs = telemetry(1500)
    offsets = write_log(tmp_path, msgs, segment_bytes=1 << 20)
    seg = list_segments(tmp_path / "commitlog")[0]
    limit, strict = readable_limit(seg, read_flushed(tmp_path / "commitlog"))
    assert strict
    victim = 700
    _flip(seg.path, offsets[victim] - seg.base + byte)
    want = offsets[:victim] + offsets[victim + 1:]
    starts = [o - seg.base for o in offsets[victim - 1:victim + 5]]
    for cut in sorted({*starts, *(s + 5 for s in starts), limit}):
        caplog.clear()
        before = corrupt_skipped()
        assert read_in_two(seg, cut, limit, strict) == want, f"cut at {cut}"
        assert corrupt_skipped() == before + 1 and len(_corrupt_lines(caplog)) == 1, (cut, _corrupt_lines(caplog))


def test_past_the_durable_end_an_invalid_record_still_ends_the_data(tmp_path: Path) -> None:
    msgs = telemetry(200)
    offsets = write_log(tmp_path, msgs)
    (tmp_path / "commitlog" / FLUSHED_FILE).unlink()
    path, _end = _active_tail(tmp_path, offsets, msgs)
    seg = list_segments(tmp_path / "commitlog")[-1]
    first = next(i for i, o in enumerate(offsets) if o >= seg.base)
    _flip(str(path), offsets[first + 5] - seg.base + 9)  # not known durable: a torn tail, not corruption
    before = corrupt_skipped()
    assert [r["offset"] for r in rows(tmp_path)] == offsets[:first + 5]
    assert corrupt_skipped() == before


def test_valid_end_stops_at_a_torn_record_and_reports_rolled_segments(tmp_path: Path) -> None:
    msgs = telemetry(1500)
    offsets = write_log(tmp_path, msgs)
    segments = list_segments(tmp_path / "commitlog")
    first = segments[0]
    assert len(segments) > 1
    pos, rolled = valid_end(ScanRange(first.path, first.base, 0, 0, first.size, first.size, False))
    assert rolled and first.base + pos == first.end
    path, end = _active_tail(tmp_path, offsets, msgs)
    torn = encode(msgs[0])
    with open(path, "r+b") as fh:
        os.pwrite(fh.fileno(), torn[:-1], end)
    last = segments[-1]
    pos, rolled = valid_end(ScanRange(last.path, last.base, 0, 0, last.size, last.size, False))
    assert (pos, rolled) == (end, False)


def test_a_record_that_leaves_fewer_than_12_bytes_in_its_segment(tmp_path: Path) -> None:
    topic = "t"
    first = Msg(topic, b"a" * (4096 - 5 - 43 - len(topic)), 10)  # leaves 5 bytes: no end-of-segment marker
    msgs = [first, Msg(topic, b"next segment", 11)]
    offsets = write_log(tmp_path, msgs, segment_bytes=4096)
    assert offsets == [0, 4096]
    (tmp_path / "commitlog" / FLUSHED_FILE).unlink()  # no hint and no .meta: read by walking to the file's end
    (tmp_path / "commitlog" / f"{0:020d}.meta").unlink()
    assert [r["payload"] for r in rows(tmp_path)] == [m.payload for m in msgs]
    first_seg = list_segments(tmp_path / "commitlog")[0]
    pos, rolled = valid_end(ScanRange(first_seg.path, 0, 0, 0, 4096, 4096, False))
    assert (pos, rolled) == (4091, True)


def test_records_with_a_packet_id_read_like_any_other(tmp_path: Path) -> None:
    """A QoS 2 record keeps its publisher's packet id at the end of the target-queues section (store/log/record.py,
    FLAG_PACKET_ID): the columnar reader skips the section by its length and reads every field as before."""
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    records = [encode_record("a/b", b"p%d" % i, client_id="c", qos=2, queues=b"\0\0\0\x05" if i % 2 else b"",
                             packet_id=i + 1, store_ms=1_000 + i) for i in range(300)]
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        offsets = log.append_batch(records)
        log.flush()
        assert [log.read(o).packet_id for o in offsets] == list(range(1, 301))
    got = rows(tmp_path)
    assert [(r["offset"], r["qos"], r["retain"], r["client_id"], r["payload"]) for r in got] == \
        [(o, 2, False, "c", b"p%d" % i) for i, o in enumerate(offsets)]


def test_ranges_read_in_any_order_after_earlier_ones_are_exact_and_a_rewritten_log_is_not_trusted(
        tmp_path: Path) -> None:
    # a worker remembers the record boundaries earlier ranges found (framing._Boundaries); neither the order
    # of the ranges nor a log written again under the same names may change what a range returns
    def offsets(sizes: int) -> tuple[list[int], list[list[int]]]:
        msgs = [Msg("a/b", MAGIC * (i % 9) + b"p" * (i * sizes % 300), 1_000 + i) for i in range(3000)]
        written = write_log(tmp_path, msgs, segment_bytes=1 << 20, batch=97)
        directory = tmp_path / "commitlog"
        ranges = [r for group in plan_ranges(list_segments(directory), read_flushed(directory), target_bytes=9_000)
                  for r in group]
        assert len(ranges) > 20
        read = lambda r: [o for f in scan_range(r, DecodeOptions()) for o in f.offset.tolist()]  # noqa: E731
        forward = [read(r) for r in ranges]
        backward = [read(r) for r in reversed(ranges)][::-1]
        assert backward == forward
        return written, forward

    written, got = offsets(7)
    assert sum(got, []) == written
    for path in (tmp_path / "commitlog").iterdir():
        path.unlink()
    written, got = offsets(13)  # the same file names, other record boundaries
    assert sum(got, []) == written


def test_control_records_of_the_store_are_not_rows(tmp_path: Path) -> None:
    """Records with FLAG_CONTROL (store/control.py) are the store's own state, not messages: neither the segment
    reader nor the live tail's framing (``frames_in``) makes rows of them; the messages around them are all there."""
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        offsets = []
        for i in range(200):
            offsets.append(log.append(encode_record("a/b", b"m%d" % i, store_ms=1_000 + i)))
            if i % 3 == 0:
                log.append(encode_control(SessionEnded(f"c{i}"), 1_000 + i, 1 << 20)[0])
        log.flush()
        span = log.read_span(0, 1 << 20)[1]
    assert [(r["offset"], r["payload"]) for r in rows(tmp_path)] == [(o, b"m%d" % i) for i, o in enumerate(offsets)]
    frames, _used = frames_in(span, 0, DecodeOptions(), "live")
    assert frames.raw_batch().to_pydict()["offset"] == [o for o in offsets if o < len(span)]


@pytest.mark.parametrize("compress", [False, True])
def test_a_batch_record_is_a_row_per_message_in_the_segment_reader_and_the_live_tail(tmp_path: Path,
                                                                                     compress: bool) -> None:
    """A batch record (docs/storage.md, "Batch records") is one frame; the reader makes a row of each message, at
    its position (the record's offset + its index), with its own fields and the batch's topic and store time,
    in order with the single records around it; a topic push-down keeps or drops the batch whole. A compressed
    body (``FLAG_ZSTD``) is inflated: its rows are the same."""
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    expected = []
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        for n in range(30):
            if n % 3:
                offset = log.append(encode_record("a/single", b"s%d" % n, client_id="s", store_ms=2_000 + n))
                expected.append((offset, "a/single", "s", 0, False, b"", b"s%d" % n))
                continue
            items = [NewMessage("b/batch", b"b%d.%d " % (n, i) + b"reading " * 20, client_id=f"c{i}", qos=i % 3,
                                retain=i == 1, properties=b"\x01\x01" if i == 2 else b"", born_ms=1_000 + i)
                     for i in range(5)]
            raw = new_batch("b/batch", items, 2_000 + n, compress=compress)[0]
            assert bool(raw[12] & FLAG_ZSTD) == compress
            offset = log.append(raw)
            expected += [(offset + i, "b/batch", m.client_id, m.qos, m.retain, m.properties, m.payload)
                         for i, m in enumerate(items)]
        log.flush()
        span = log.read_span(0, 1 << 20)[1]
    got = rows(tmp_path, target=4096)
    assert [(r["offset"], r["topic"], r["client_id"], r["qos"], r["retain"], r["properties"], r["payload"])
            for r in got] == expected
    assert {round(r["born_ts"].timestamp() * 1000) for r in got if r["topic"] == "b/batch"} == set(range(1_000, 1_005))
    only = rows(tmp_path, DecodeOptions(topic_filters=("b/#",)))
    assert [r["offset"] for r in only] == [e[0] for e in expected if e[1] == "b/batch"]
    frames, _used = frames_in(span, 0, DecodeOptions(), "live")
    assert frames.raw_batch().to_pydict()["offset"] == [e[0] for e in expected]


@pytest.mark.parametrize("malformed", [lambda: malformed_batch("a/b", 2), lambda: zstd_batch("a/b", b"garbage", 2)],
                         ids=["raw", "zstd"])
def test_a_batch_whose_body_does_not_parse_is_skipped_alone_below_the_durable_end(tmp_path: Path, caplog,
                                                                                  malformed) -> None:
    """Its CRC is right (a writer's bug): skipped, logged and counted like a corrupt record, as the store skips it;
    a compressed body that does not inflate too."""
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        first = log.append(encode_record("a/b", b"1", store_ms=1))
        log.append(malformed())
        last = log.append(encode_record("a/b", b"2", store_ms=3))
        log.flush()
    skipped = corrupt_skipped()
    assert [r["offset"] for r in rows(tmp_path)] == [first, last]
    assert corrupt_skipped() == skipped + 1 and _corrupt_lines(caplog)
