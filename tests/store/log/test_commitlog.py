"""store/log/commitlog.py on real files: appends, rolling, reads, scans, recovery, retention, full disk."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
from crc32c import crc32c

from store.log.commitlog import CommitLog, CommitLogConfig, read_flushed_hint
from store.log.errors import InvalidOffset, LogFullError, OffsetExpired
from store.log.record import EOS_SIZE, HEADER_SIZE, CorruptRecord, RecordTooLarge, encode_eos, encode_record
from store.log.segment import segment_name
from tests.helpers.fulldisk import tmpfs

SEG = 4096
CFG = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG)
TOPIC = "t/x"
FIXED = HEADER_SIZE + len(TOPIC)  # record size without payload


def rec(i: int, size: int = 100, store_ms: int = 1_000) -> bytes:
    """A record of exactly ``size`` bytes whose payload starts with its sequence number."""
    tag = f"{i}:".encode()
    return encode_record(TOPIC, tag + b"p" * (size - FIXED - len(tag)), store_ms=store_ms, born_ms=store_ms)


def seq(record) -> int:
    return int(record.payload.split(b":", 1)[0])


@pytest.fixture
def logdir(tmp_path) -> Path:
    return tmp_path / "commitlog"


@pytest.fixture
def log(logdir):
    with CommitLog.open(logdir, CFG) as opened:
        yield opened


def scan_all(log: CommitLog, start: int = 0, max_bytes: int = 1 << 20, corrupt: list | None = None):
    """Every record from ``start``; corrupt ranges fail the test unless ``corrupt`` collects them."""
    out, offset = [], start
    while offset < log.written_offset:
        result = log.scan(offset, max_bytes)
        if corrupt is None:
            assert not result.corrupt
        else:
            corrupt.extend(result.corrupt)
        out.extend(result.records)
        offset = result.next_offset
    return out


# ---------------------------------------------------------------- appends and reads

def test_append_batch_returns_offsets_and_records_read_back(log):
    records = [rec(i, 60 + i) for i in range(10)]
    offsets = log.append_batch(records)
    expected = [0]
    for r in records[:-1]:
        expected.append(expected[-1] + len(r))
    assert offsets == expected
    assert log.written_offset == sum(map(len, records))
    for i, (offset, raw) in enumerate(zip(offsets, records)):
        assert seq(log.read(offset)) == i
        assert log.read_bytes(offset, len(raw)) == raw
    assert log.append(rec(99)) == log.written_offset - 100


def test_empty_batch_is_a_no_op(log):
    assert log.append_batch([]) == []
    assert log.written_offset == 0


def test_oversized_and_malformed_records_are_rejected_and_nothing_is_stored(logdir):
    with CommitLog.open(logdir, CommitLogConfig(segment_bytes=SEG, max_record_bytes=200)) as log:
        with pytest.raises(RecordTooLarge, match="record 1 of the batch has 201 bytes"):
            log.append_batch([rec(0), rec(1, 201)])
        with pytest.raises(ValueError, match="not an encoded v1 record"):
            log.append_batch([rec(0), b"x" * 60])
        with pytest.raises(ValueError, match="shorter than"):
            log.append(b"tiny")
        assert log.written_offset == 0
        assert log.append(rec(0, 200)) == 0


def test_reads_outside_records_give_clear_errors(log):
    log.append_batch([rec(0), rec(1)])
    with pytest.raises(InvalidOffset, match="beyond the written end"):
        log.read(200)
    with pytest.raises(InvalidOffset, match="no record starts there"):
        log.read(50)
    with pytest.raises(InvalidOffset, match="not 99 bytes"):
        log.read_bytes(0, 99)
    with pytest.raises(InvalidOffset):
        log.read_bytes(100, 101)


def test_config_is_validated():
    with pytest.raises(ValueError, match="flush policy"):
        CommitLogConfig(flush="sometimes")
    with pytest.raises(ValueError, match="must fit in one segment"):
        CommitLogConfig(segment_bytes=4096, max_record_bytes=8192)
    with pytest.raises(ValueError, match="negative"):
        CommitLogConfig(retention_hours=-1)


def test_config_from_flat_settings():
    cfg = CommitLogConfig.from_settings({
        "commitlog.segment_bytes": 8192, "commitlog.max_record_bytes": 4096, "commitlog.flush": "sync", "retention.hours": 1.5,
        "retention.max_bytes": 10, "retention.check_interval_s": 5.0, "node.port": 1883})
    assert (cfg.segment_bytes, cfg.flush, cfg.retention_hours, cfg.retention_max_bytes,
            cfg.retention_check_interval_s) == (8192, "sync", 1.5, 10, 5.0)


def test_a_second_open_of_the_same_directory_is_refused(log, logdir):
    with pytest.raises(OSError, match="already open"):
        CommitLog.open(logdir, CFG)


def test_a_closed_log_refuses_work(logdir):
    log = CommitLog.open(logdir, CFG)
    log.append(rec(0))
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.append(rec(1))
    with pytest.raises(ValueError, match="closed"):
        log.read(0)
    with pytest.raises(ValueError, match="closed"):
        log.flush()


# ---------------------------------------------------------------- rolling

def test_a_record_that_exactly_fills_a_segment_stays_in_it(log, logdir):
    log.append(rec(0, 1000))
    offset = log.append(rec(1, SEG - 1000))
    assert offset == 1000
    assert log.append(rec(2)) == SEG
    infos = log.segments()
    assert [(s.base, s.sealed, s.used, s.records) for s in infos] == [(0, True, SEG, 2), (SEG, False, 100, 1)]
    assert [seq(r) for r in scan_all(log)] == [0, 1, 2]


def test_a_record_one_byte_too_big_goes_to_the_next_segment_after_a_marker(log, logdir):
    log.append(rec(0, 1000))
    offset = log.append(rec(1, SEG - 1000 + 1))
    assert offset == SEG
    data = (logdir / segment_name(0)).read_bytes()
    assert data[1000:1000 + EOS_SIZE] == encode_eos(SEG - 1000)
    assert log.segments()[0].end == 1000
    assert [seq(r) for r in scan_all(log)] == [0, 1]
    with pytest.raises(InvalidOffset, match="unused tail"):
        log.read(1000)


def test_a_tail_shorter_than_a_marker_is_left_zero(log, logdir):
    log.append(rec(0, SEG - 5))
    assert log.append(rec(1)) == SEG
    assert (logdir / segment_name(0)).read_bytes()[SEG - 5:] == b"\0" * 5
    assert [seq(r) for r in scan_all(log, max_bytes=64)] == [0, 1]


def test_a_batch_spanning_segments_gets_contiguous_offsets(log):
    records = [rec(i, 300) for i in range(40)]  # 13 records per segment, 196-byte tails
    offsets = log.append_batch(records)
    per_seg = SEG // 300
    assert offsets[per_seg] == SEG and offsets[2 * per_seg] == 2 * SEG
    assert len(log.segments()) == 4
    assert [seq(log.read(o)) for o in offsets] == list(range(40))
    assert [r.offset for r in scan_all(log, max_bytes=700)] == offsets


def test_append_stamped_appends_its_own_records_as_append_batch_does(logdir, tmp_path):
    """The store's own records (one timestamp per batch) skip the header checks, nothing else."""
    records = [rec(i, 300, store_ms=7_000) for i in range(20)]  # across two segments
    with CommitLog.open(tmp_path / "batch", CFG) as twin:
        expected = twin.append_batch(records)
    with CommitLog.open(logdir, CFG) as log:
        assert log.append_stamped(records, 7_000) == expected and log.append_stamped([], 7_000) == []
        assert [seq(log.read(o)) for o in expected] == list(range(20))
        with pytest.raises(RecordTooLarge, match="record 1 of the batch"):
            log.append_stamped([rec(20), rec(21, SEG + 1)], 7_000)
        assert log.written_offset == expected[-1] + 300  # nothing of the refused batch
        log.flush()
    meta = json.loads((logdir / (segment_name(0) + ".meta")).read_text())
    assert (meta["min_store_ms"], meta["max_store_ms"], meta["records"]) == (7_000, 7_000, SEG // 300)


def test_sealed_segments_get_a_meta_file_after_flush(log, logdir):
    log.append_batch([rec(i, 1000, store_ms=5_000 + i) for i in range(6)])
    meta_path = logdir / (segment_name(0) + ".meta")
    assert not meta_path.exists()
    log.flush()
    assert json.loads(meta_path.read_text()) == {
        "version": 1, "base": 0, "end": 4000, "records": 4, "min_store_ms": 5000, "max_store_ms": 5003}
    assert not (logdir / (segment_name(SEG) + ".meta")).exists()


# ---------------------------------------------------------------- scans

def test_scan_returns_complete_records_and_where_to_continue(log):
    offsets = log.append_batch([rec(i, 100) for i in range(30)])
    first = log.scan(0, 250)
    assert [seq(r) for r in first.records] == [0, 1]
    assert first.next_offset == 200
    assert scan_all(log, 200, 250)[0].offset == 200
    end = log.scan(log.written_offset)
    assert end.records == [] and end.next_offset == log.written_offset
    assert [r.offset for r in scan_all(log, 0, 333)] == offsets


def test_scan_returns_a_record_larger_than_max_bytes_whole(log):
    log.append_batch([rec(0, 3000), rec(1, 50)])
    result = log.scan(0, 100)
    assert [seq(r) for r in result.records] == [0]
    assert result.next_offset == 3000


def test_scan_moves_past_the_marker_to_the_next_segment(log):
    log.append_batch([rec(0, 3000), rec(1, 3000)])
    result = log.scan(0, 3500)
    assert [seq(r) for r in result.records] == [0]
    assert result.next_offset == SEG
    assert [seq(r) for r in log.scan(3000).records] == [1]  # from the marker itself


def test_scan_beyond_the_end_is_invalid(log):
    log.append(rec(0))
    with pytest.raises(InvalidOffset):
        log.scan(101)


def test_concurrent_readers_never_see_partial_records(logdir):
    total, batch = 2000, 7
    cfg = CommitLogConfig(segment_bytes=16384, max_record_bytes=16384)
    errors: list[BaseException] = []
    done = threading.Event()

    with CommitLog.open(logdir, cfg) as log:
        def writer():
            try:
                for start in range(0, total, batch):
                    log.append_batch([rec(i, 60 + (i * 37) % 900) for i in range(start, min(total, start + batch))])
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        def reader():
            try:
                offset, expected = 0, 0
                while expected < total:
                    finished = done.is_set()
                    result = log.scan(offset, 2000)
                    assert not result.corrupt
                    for r in result.records:
                        assert seq(r) == expected and r.size == 60 + (expected * 37) % 900
                        assert r.payload.endswith(b"p")
                        expected += 1
                    offset = result.next_offset
                    if finished and offset >= log.written_offset:
                        break
                assert expected == total
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert len(log.segments()) > 10


# ---------------------------------------------------------------- flushing and the hint

def test_flush_moves_the_flushed_offset_and_the_hint(log, logdir):
    log.append_batch([rec(i) for i in range(5)])
    assert log.flushed_offset == 0
    assert log.flush() == 500 == log.flushed_offset
    raw = (logdir / "flushed").read_bytes()
    assert len(raw) == 12
    assert int.from_bytes(raw[:8], "big") == 500
    assert int.from_bytes(raw[8:], "big") == crc32c(raw[:8])
    assert read_flushed_hint(logdir) == 500


def test_flush_runs_while_appends_continue(log):
    stop = threading.Event()
    flushed: list[int] = []

    def flusher():
        while not stop.is_set():
            flushed.append(log.flush())

    t = threading.Thread(target=flusher)
    t.start()
    try:
        for i in range(300):
            log.append(rec(i))
    finally:
        stop.set()
        t.join()
    assert flushed == sorted(flushed)
    assert log.flush() == log.written_offset
    assert [seq(r) for r in scan_all(log)] == list(range(300))


def test_a_bad_hint_is_ignored(logdir):
    logdir.mkdir()
    (logdir / "flushed").write_bytes(b"\0" * 8 + b"\1\2\3\4")
    assert read_flushed_hint(logdir) is None
    assert read_flushed_hint(logdir / "missing") is None


# ---------------------------------------------------------------- recovery

def write_and_close(logdir: Path, records: list[bytes], cfg: CommitLogConfig = CFG) -> list[int]:
    with CommitLog.open(logdir, cfg) as log:
        return log.append_batch(records)


def reopen_seqs(logdir: Path, cfg: CommitLogConfig = CFG) -> tuple[list[int], int]:
    with CommitLog.open(logdir, cfg) as log:
        return [seq(r) for r in scan_all(log)], log.written_offset


def test_reopen_keeps_everything(logdir):
    offsets = write_and_close(logdir, [rec(i, 250) for i in range(50)])
    seqs, written = reopen_seqs(logdir)
    assert seqs == list(range(50))
    with CommitLog.open(logdir, CFG) as log:
        assert log.flushed_offset == log.written_offset == written
        assert [seq(log.read(o)) for o in offsets] == list(range(50))
        assert log.append(rec(50)) == written


def test_truncating_the_last_record_at_every_byte_keeps_all_earlier_records(tmp_path, caplog):
    pristine = tmp_path / "pristine"
    offsets = write_and_close(pristine, [rec(i, 90 + i) for i in range(4)])
    last, end = offsets[-1], offsets[-1] + 93
    seg_file = segment_name(0)
    for cut in range(last, end):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(pristine, work)
        os.truncate(work / seg_file, cut)
        with caplog.at_level(logging.WARNING, logger="store.log.commitlog"):
            seqs, written = reopen_seqs(work)
        assert seqs == [0, 1, 2], cut
        assert written == last
        assert (work / seg_file).stat().st_size == SEG
        shutil.rmtree(work)


def test_a_torn_write_with_zeros_inside_is_cut_and_logged(tmp_path, caplog):
    offsets = write_and_close(tmp_path / "a", [rec(i, 100) for i in range(5)])
    path = tmp_path / "a" / segment_name(0)
    data = bytearray(path.read_bytes())
    data[offsets[3] + 20:offsets[3] + 60] = b"\0" * 40  # a page of the batch never reached the disk
    path.write_bytes(bytes(data))
    set_hint(tmp_path / "a", offsets[3])  # the batch was written after the last flush: torn, not damaged
    with caplog.at_level(logging.WARNING, logger="store.log.commitlog"):
        seqs, written = reopen_seqs(tmp_path / "a")
    assert seqs == [0, 1, 2] and written == 300
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped and dropped[0].ctx["dropped_bytes"] == 200 and dropped[0].ctx["offset"] == 300
    assert path.read_bytes()[300:] == b"\0" * (SEG - 300)


def set_hint(logdir: Path, offset: int) -> None:
    """Write the ``flushed`` hint as the log would after flushing up to ``offset``."""
    raw = offset.to_bytes(8, "big")
    (logdir / "flushed").write_bytes(raw + crc32c(raw).to_bytes(4, "big"))


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([byte[0] ^ 0x5A]))


def test_corrupting_any_single_byte_past_the_flushed_mark_drops_that_record_and_the_rest(tmp_path):
    pristine = tmp_path / "pristine"
    offsets = write_and_close(pristine, [rec(i, 80) for i in range(6)])
    set_hint(pristine, offsets[2])  # from record 2 on nothing was flushed: a bad record there is a torn write
    for pos in list(range(offsets[2], offsets[4])) + [offsets[5] + 79]:
        work = tmp_path / "work"
        shutil.copytree(pristine, work)
        flip(work / segment_name(0), pos)
        victim = max(i for i, o in enumerate(offsets) if o <= pos)
        seqs, written = reopen_seqs(work)
        assert seqs == list(range(victim)), pos
        assert written == offsets[victim]
        shutil.rmtree(work)


def test_corrupting_any_single_byte_below_the_flushed_mark_skips_that_record_alone(tmp_path, caplog):
    """Below the flushed mark the bytes were fsynced: damage there (a flipped bit, in any field) is skipped,
    reported once, and the records after it are kept and read."""
    pristine = tmp_path / "pristine"
    offsets = write_and_close(pristine, [rec(i, 80) for i in range(6)])
    end = offsets[5] + 80
    for pos in range(offsets[2], offsets[4]):
        work = tmp_path / "work"
        shutil.copytree(pristine, work)
        flip(work / segment_name(0), pos)
        victim = max(i for i, o in enumerate(offsets) if o <= pos)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="store.log.commitlog"), CommitLog.open(work, CFG) as log:
            corrupt: list = []
            assert [seq(r) for r in scan_all(log, corrupt=corrupt)] == [i for i in range(6) if i != victim], pos
            assert log.written_offset == end and [(c.offset, c.end) for c in corrupt] == [
                (offsets[victim], offsets[victim] + 80)], pos
            assert log.statistics().corrupt_records == 1
        reports = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(reports) == 1 and reports[0].ctx["offset"] == offsets[victim], (pos, reports)
        assert reports[0].ctx["file"] == str(work / segment_name(0))
        shutil.rmtree(work)


def test_garbage_after_the_last_record_is_dropped(logdir):
    write_and_close(logdir, [rec(0), rec(1)])
    with open(logdir / segment_name(0), "r+b") as fh:
        fh.seek(1000)
        fh.write(b"junk")
    seqs, written = reopen_seqs(logdir)
    assert seqs == [0, 1] and written == 200
    assert (logdir / segment_name(0)).read_bytes()[200:] == b"\0" * (SEG - 200)


def test_a_missing_meta_is_rebuilt(logdir):
    write_and_close(logdir, [rec(i, 1000, store_ms=7_000 + i) for i in range(9)])
    meta = logdir / (segment_name(SEG) + ".meta")
    original = meta.read_text()
    meta.unlink()
    seqs, _ = reopen_seqs(logdir)
    assert seqs == list(range(9))
    assert json.loads(meta.read_text()) == json.loads(original) == {
        "version": 1, "base": SEG, "end": SEG + 4000, "records": 4, "min_store_ms": 7004, "max_store_ms": 7007}


def test_a_stale_meta_is_rebuilt(logdir):
    write_and_close(logdir, [rec(i, 1000) for i in range(5)])
    meta = logdir / (segment_name(0) + ".meta")
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps(dict(doc, end=2000, records=2)))
    seqs, _ = reopen_seqs(logdir)
    assert seqs == list(range(5))
    assert json.loads(meta.read_text()) == doc


def test_a_torn_sealed_segment_without_meta_ends_the_log(logdir, caplog):
    """A crash after a roll but before the flush: the sealed segment's tail may be torn."""
    offsets = write_and_close(logdir, [rec(i, 1000) for i in range(7)])
    (logdir / (segment_name(0) + ".meta")).unlink()
    with open(logdir / segment_name(0), "r+b") as fh:
        fh.seek(offsets[3] + 500)
        fh.write(b"\0" * 8)
    set_hint(logdir, offsets[3])  # the crash came before the flush that would have covered record 3
    with caplog.at_level(logging.WARNING, logger="store.log.commitlog"):
        seqs, written = reopen_seqs(logdir)
    assert seqs == [0, 1, 2] and written == 3000
    assert not (logdir / segment_name(SEG)).exists()
    assert any(r.ctx.get("segments_deleted") == 1 for r in caplog.records if hasattr(r, "ctx"))
    with CommitLog.open(logdir, CFG) as log:
        assert log.append(rec(3, 1000)) == 3000


def test_a_last_segment_ending_in_a_marker_gets_a_successor(logdir):
    write_and_close(logdir, [rec(0, 1000)])
    with open(logdir / segment_name(0), "r+b") as fh:
        fh.seek(1000)
        fh.write(encode_eos(SEG - 1000))
    with CommitLog.open(logdir, CFG) as log:
        assert [s.base for s in log.segments()] == [0, SEG]
        assert log.append(rec(1)) == SEG
    assert (logdir / (segment_name(0) + ".meta")).exists()


def test_a_corrupt_record_in_a_sealed_segment_is_reported_and_never_served(logdir, caplog):
    offsets = write_and_close(logdir, [rec(i, 1000) for i in range(6)])
    with open(logdir / segment_name(0), "r+b") as fh:
        fh.seek(offsets[1] + 700)
        fh.write(b"X")
    with CommitLog.open(logdir, CFG) as log:
        assert log.written_offset == SEG + 2000  # sealed segments with a .meta are not rewritten
        with pytest.raises(CorruptRecord, match=f"record at offset {offsets[1]}: CRC mismatch"):
            log.read(offsets[1])
        with pytest.raises(CorruptRecord):
            log.read_bytes(offsets[1], 1000)
        with caplog.at_level(logging.ERROR, logger="store.log.commitlog"):
            result = log.scan(0)
        assert [seq(r) for r in result.records] == [0, 2, 3, 4, 5]
        assert [(c.offset, c.end) for c in result.corrupt] == [(1000, 2000)]
        assert "CRC mismatch" in result.corrupt[0].reason
        assert any("corrupt" in r.getMessage() for r in caplog.records)


def test_overlapping_segment_files_are_refused(logdir):
    write_and_close(logdir, [rec(0)])
    (logdir / segment_name(100)).write_bytes(b"")
    with pytest.raises(ValueError, match="inconsistent"):
        CommitLog.open(logdir, CFG)


# ---------------------------------------------------------------- retention

HOUR_MS = 3_600_000


def fill_segments(log: CommitLog, count: int, store_ms_of=lambda seg: 0) -> None:
    for s in range(count):
        log.append_batch([rec(s * 4 + i, 1000, store_ms=store_ms_of(s)) for i in range(4)])


def test_retention_deletes_old_sealed_segments_and_reads_below_expire(logdir):
    cfg = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG, retention_hours=1.0)
    now = 100 * HOUR_MS
    seen: list[int] = []
    with CommitLog.open(logdir, cfg) as log:
        log.add_retention_listener(seen.append)
        fill_segments(log, 4, store_ms_of=lambda s: now - (3 - s) * HOUR_MS - 1)  # ages 3h+, 2h+, 1h+, ~0
        log.append(rec(99))
        log.flush()
        assert log.delete_expired(now) == [0, SEG, 2 * SEG]
        assert log.min_offset == 3 * SEG
        assert seen == [3 * SEG]
        assert not (logdir / segment_name(0)).exists()
        assert not (logdir / (segment_name(0) + ".meta")).exists()
        with pytest.raises(OffsetExpired, match="offset 1000 has expired.*starts at 12288"):
            log.read(1000)
        with pytest.raises(OffsetExpired):
            log.read_bytes(0, 1000)
        with pytest.raises(OffsetExpired):
            log.scan(0)
        assert seq(log.read(3 * SEG)) == 12
        assert log.delete_expired(now + 100 * HOUR_MS) == [3 * SEG]  # the active segment stays
        assert [s.base for s in log.segments()] == [4 * SEG]
    with CommitLog.open(logdir, cfg) as log:
        assert log.min_offset == 4 * SEG
        assert seq(log.read(4 * SEG)) == 99


def test_retention_by_size_keeps_the_newest_bytes(logdir):
    cfg = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG, retention_hours=0, retention_max_bytes=2 * SEG)
    with CommitLog.open(logdir, cfg) as log:
        fill_segments(log, 5, store_ms_of=lambda s: 0)
        log.append(rec(99))
        assert log.delete_expired(10**15) == [0, SEG, 2 * SEG, 3 * SEG]
        assert log.written_offset - log.min_offset == SEG + 100


def test_a_failing_listener_does_not_stop_retention(logdir, caplog):
    cfg = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG, retention_max_bytes=1)
    seen: list[int] = []
    with CommitLog.open(logdir, cfg) as log:
        log.add_retention_listener(lambda m: 1 / 0)
        log.add_retention_listener(seen.append)
        fill_segments(log, 2)
        log.append(rec(9))
        with caplog.at_level(logging.ERROR, logger="store.log.commitlog"):
            assert log.delete_expired() == [0, SEG]
        assert seen == [2 * SEG]
        assert any("listener failed" in r.getMessage() for r in caplog.records)


def test_a_reader_holding_a_segment_survives_its_deletion(logdir):
    cfg = CommitLogConfig(segment_bytes=SEG, max_record_bytes=SEG, retention_max_bytes=1)
    with CommitLog.open(logdir, cfg) as log:
        fill_segments(log, 2)
        seg = log._view.segments[0]
        with seg.pinned():
            log.delete_expired()
            assert seg.read(0, 4) == rec(0, 1000)[:4]


# ---------------------------------------------------------------- full disk

@pytest.fixture
def small_fs(tmp_path):
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        yield mnt


def test_a_full_disk_rejects_appends_cleanly_and_recovers_when_space_frees(small_fs):
    cfg = CommitLogConfig(segment_bytes=256 * 1024, max_record_bytes=64 * 1024)
    logdir = small_fs / "commitlog"
    filler = small_fs / "filler"
    acked: dict[int, int] = {}
    with CommitLog.open(logdir, cfg) as log:
        with open(filler, "wb") as fh:  # leave ~300 KiB free
            fh.write(b"\1" * (2 * 1024 * 1024 - 300 * 1024))
        seqno = 0
        with pytest.raises(LogFullError) as info:
            while True:
                batch = [rec(seqno + i, 20_000) for i in range(3)]
                for i, offset in enumerate(log.append_batch(batch)):
                    acked[offset] = seqno + i
                seqno += 3
        assert info.value.errno in (errno.ENOSPC, errno.EDQUOT)
        assert "was not stored" in str(info.value)
        written = log.written_offset
        assert written == max(acked) + 20_000
        for offset, s in acked.items():
            assert seq(log.read(offset)) == s
        with pytest.raises(LogFullError):
            log.append_batch([rec(seqno, 20_000)] * 3)
        assert log.written_offset == written
        filler.unlink()
        offsets = log.append_batch([rec(seqno + i, 20_000) for i in range(3)])
        assert offsets[0] == written or offsets[0] % cfg.segment_bytes == 0
        acked.update({o: seqno + i for i, o in enumerate(offsets)})
    with CommitLog.open(logdir, cfg) as log:
        assert [seq(r) for r in scan_all(log)] == [acked[o] for o in sorted(acked)]
