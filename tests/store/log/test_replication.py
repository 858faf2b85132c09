"""What replication needs from the CommitLog, on real files: a follower's append of a leader's frames at the same
offsets, truncation at a record boundary (killed at every step), and the confirm offset that bounds readers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from crc32c import crc32c

from store.log.commitlog import CommitLog, CommitLogConfig, read_flushed_hint
from store.log.errors import InvalidOffset
from store.log.record import FLAG_BATCH, CorruptRecord, Record, encode_record
from tests.helpers.processes import ROOT

SEGMENT = 4096
CONFIG = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=2048)


def fill(log: CommitLog, count: int, start: int = 0) -> list[int]:
    """Append ``count`` records of varied sizes (so segments end in markers and short tails); their offsets."""
    return [log.append(encode_record(f"t/{i}", bytes([i % 251]) * (i * 37 % 300), store_ms=1_000 + i))
            for i in range(start, start + count)]


def scan_all(log: CommitLog, end: int | None = None) -> list[Record]:
    out, offset = [], log.min_offset
    stop = log.written_offset if end is None else end
    while offset < stop:
        scanned = log.scan(offset, 1 << 20, stop)
        out += scanned.records
        offset = scanned.next_offset
    return out


def topics(log: CommitLog, end: int | None = None) -> list[str]:
    return [r.topic for r in scan_all(log, end)]


def copy(leader: CommitLog, follower: CommitLog, chunk: int) -> None:
    offset = follower.written_offset
    while offset < leader.written_offset:
        offset = follower.append_frames(offset, leader.read_frames(offset, chunk))


@pytest.mark.parametrize("chunk", [1, 700, 5000, 1 << 20])
def test_a_follower_copying_the_leaders_frames_gets_the_same_segments_offsets_and_records(tmp_path, chunk):
    with CommitLog.open(tmp_path / "leader", CONFIG) as leader, CommitLog.open(tmp_path / "follower", CONFIG) as f:
        fill(leader, 150)
        copy(leader, f, chunk)
        assert len(leader.segments()) >= 4
        assert [(s.base, s.end, s.sealed, s.records, s.max_store_ms) for s in f.segments()] == \
               [(s.base, s.end, s.sealed, s.records, s.max_store_ms) for s in leader.segments()]
        assert topics(f) == topics(leader)
    with CommitLog.open(tmp_path / "follower", CONFIG) as again:  # what recovery finds on disk agrees too
        assert again.written_offset == f.written_offset and len(topics(again)) == 150


def undecodable(topic: str) -> bytes:
    """A batch record of no messages, its CRC right (a writer's bug): it frames and checks, and does not decode."""
    record = bytearray(encode_record(topic, bytes(4)))  # the body: a message count of 0
    record[12] |= FLAG_BATCH
    record[4:8] = crc32c(bytes(record[8:])).to_bytes(4, "big")
    return bytes(record)


@pytest.mark.parametrize("chunk", [700, 1 << 20])
def test_the_copied_records_come_decoded_as_a_scan_of_the_copy_finds_them(tmp_path, chunk):
    """A replica's dispatch indexes them from memory (store/replica/follower.py): they must be the records, at
    their offsets, that reading the copy back would give."""
    with CommitLog.open(tmp_path / "leader", CONFIG) as leader, CommitLog.open(tmp_path / "follower", CONFIG) as f:
        fill(leader, 150)
        decoded: list[Record] = []
        offset = 0
        while offset < leader.written_offset:
            offset = f.append_frames(offset, leader.read_frames(offset, chunk), decoded)
        assert decoded == scan_all(f) and len(decoded) == 150


def test_copied_records_are_decoded_up_to_one_that_checks_but_does_not_decode(tmp_path):
    """Such a record is copied (the copy is the leader's log, byte for byte), and the decoded records stop before
    it: dispatch then reads it and the rest from the log, where its scan reports it."""
    with CommitLog.open(tmp_path / "leader", CONFIG) as leader, CommitLog.open(tmp_path / "follower", CONFIG) as f:
        fill(leader, 5)
        bad = leader.append(undecodable("t/bad"))
        fill(leader, 5, 5)
        decoded: list[Record] = []
        assert f.append_frames(0, leader.read_frames(0, 1 << 20), decoded) == leader.written_offset
        assert [r.topic for r in decoded] == [f"t/{i}" for i in range(5)]
        scanned = f.scan(0, 1 << 20, f.written_offset)
        assert [c.offset for c in scanned.corrupt] == [bad] and len(scanned.records) == 10


def test_a_frame_that_does_not_check_is_refused_and_nothing_of_the_data_is_written(tmp_path):
    with CommitLog.open(tmp_path / "leader", CONFIG) as leader, CommitLog.open(tmp_path / "follower", CONFIG) as f:
        fill(leader, 40)
        data = bytearray(leader.read_frames(0, 1 << 20))
        data[len(data) - 5] ^= 0xFF  # a flipped bit in the last record
        with pytest.raises(CorruptRecord, match="CRC mismatch"):
            f.append_frames(0, bytes(data))
        with pytest.raises(CorruptRecord, match="overruns"):
            f.append_frames(0, bytes(data[:-3]))  # a torn last frame
        assert f.written_offset == 0 and len(f.segments()) == 1 and topics(f) == []


def test_a_gap_an_overlap_and_a_different_segment_layout_are_refused(tmp_path):
    other = CommitLogConfig(segment_bytes=2 * SEGMENT, max_record_bytes=2048)
    with CommitLog.open(tmp_path / "leader", CONFIG) as leader, CommitLog.open(tmp_path / "f", CONFIG) as f, \
            CommitLog.open(tmp_path / "big", other) as big:
        offsets = fill(leader, 60)
        copy(leader, f, 1 << 20)
        more = fill(leader, 5, 60)
        with pytest.raises(ValueError, match="a gap"):
            f.append_frames(more[1], leader.read_frames(more[1], 1 << 20))
        with pytest.raises(ValueError, match="an overlap"):
            f.append_frames(offsets[10], leader.read_frames(offsets[10], 1 << 20))
        with pytest.raises(ValueError, match="segment layouts disagree"):
            big.append_frames(0, leader.read_frames(0, 1 << 20))
        assert big.written_offset == 0
        copy(leader, f, 1 << 20)
        assert topics(f) == topics(leader)


def test_truncate_cuts_at_a_record_and_the_log_goes_on_from_there(tmp_path):
    with CommitLog.open(tmp_path / "log", CONFIG) as log:
        offsets = fill(log, 120)
        log.flush()
        cut = offsets[30]
        with pytest.raises(InvalidOffset):
            log.truncate(cut + 1)  # not a record boundary
        log.truncate(cut)
        assert log.written_offset == log.flushed_offset == log.confirm_offset == cut
        assert read_flushed_hint(tmp_path / "log") == cut
        assert topics(log) == [f"t/{i}" for i in range(30)]
        assert [s.base for s in log.segments()][-1] <= cut and not log.segments()[-1].sealed
        assert fill(log, 3, 500)[0] == cut
    with CommitLog.open(tmp_path / "log", CONFIG) as again:
        assert topics(again) == [f"t/{i}" for i in range(30)] + ["t/500", "t/501", "t/502"]
        assert sorted(p.name for p in (tmp_path / "log").glob("*.meta")) == \
               [f"{s.base:020d}.meta" for s in again.segments()[:-1]]


CHILD = """
import os, signal, sys
from pathlib import Path
from store.log.commitlog import CommitLog, CommitLogConfig
log = CommitLog.open(Path(sys.argv[1]), CommitLogConfig(segment_bytes={segment}, max_record_bytes=2048))
steps = [0]
def deadly(name):
    real = getattr(os, name)
    def call(*args):
        steps[0] += 1
        if steps[0] == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    setattr(os, name, call)
for name in ("unlink", "fsync", "fdatasync", "ftruncate", "replace", "pwrite", "write"):
    deadly(name)
log.truncate(int(sys.argv[2]))
""".format(segment=SEGMENT)


def test_a_truncate_killed_at_any_step_leaves_a_valid_log_that_a_second_truncate_finishes(tmp_path):
    pristine = tmp_path / "pristine"
    with CommitLog.open(pristine, CONFIG) as log:
        offsets = fill(log, 160)
        log.flush()
        log.epochs.append(1, 0)
        log.epochs.append(2, offsets[40])
        log.epochs.append(3, offsets[120])
        end = log.written_offset
        expected = topics(log)
    cut = offsets[40]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    step = 1
    while True:
        work = tmp_path / f"step{step}"
        shutil.copytree(pristine, work)
        child = subprocess.run([sys.executable, "-c", CHILD, str(work), str(cut), str(step)], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        with CommitLog.open(work, CONFIG) as log:
            assert cut <= log.written_offset <= end, step
            assert topics(log) == expected[:len(topics(log))], step  # a prefix of the old log: no hole
            assert log.epochs.entries in ([(1, 0)], [(1, 0), (2, cut), (3, offsets[120])]), step
            log.truncate(cut)
            assert log.written_offset == cut and topics(log) == expected[:40]
            assert log.epochs.entries == [(1, 0)]
        with CommitLog.open(work, CONFIG) as log:
            assert log.written_offset == cut and topics(log) == expected[:40]
        if child.returncode == 0:
            break
        assert child.returncode == -9, child.stderr
        step += 1
    assert step > 8  # the kills really hit the steps: epochs, hint, two segments, the cut segment


def test_the_confirm_offset_follows_written_until_held_then_bounds_read_span_and_the_hint(tmp_path):
    with CommitLog.open(tmp_path / "log", CONFIG) as log:
        first = fill(log, 10)
        assert log.confirm_offset == log.written_offset
        log.hold_confirm()
        held = log.written_offset
        more = fill(log, 10, 10)
        log.flush()
        assert log.confirm_offset == held and log.published_offset == held
        assert read_flushed_hint(tmp_path / "log") == held  # what Spark's planner reads
        start, data, data_end = log.read_span(first[0], 1 << 20)
        assert start + len(data) <= held and data_end == held
        with pytest.raises(InvalidOffset):
            log.read_span(more[1], 100)
        log.confirm(more[5])
        assert read_flushed_hint(tmp_path / "log") == more[5] and log.read_span(first[0], 1 << 20)[2] == more[5]
        with pytest.raises(ValueError, match="only a truncate"):
            log.confirm(more[2])
        with pytest.raises(ValueError, match="beyond the written end"):
            log.confirm(log.written_offset + 1)
        log.truncate(more[3])
        assert log.confirm_offset == more[3]
        log.release_confirm()
        assert log.confirm_offset == log.written_offset == more[3]


@pytest.mark.parametrize("where", ["a segment's base", "a sealed segment's data end"])
def test_truncate_at_a_segment_boundary_leaves_an_active_segment_that_appends_and_recovers(tmp_path, where):
    with CommitLog.open(tmp_path / "log", CONFIG) as log:
        fill(log, 80)
        log.flush()
        second = log.segments()[1]
        cut = second.base if where == "a segment's base" else second.end
        kept = len(topics(log, cut))
        log.truncate(cut)
        assert log.written_offset == cut and not log.segments()[-1].sealed
        assert len(log.segments()) == 2  # the later ones went; the cut one is the active one
        fill(log, 30, 900)
        log.flush()
        expected = topics(log)
        assert expected[kept:] == [f"t/{i}" for i in range(900, 930)]
    with CommitLog.open(tmp_path / "log", CONFIG) as again:
        assert topics(again) == expected


def test_an_empty_log_started_at_a_leaders_cut_copies_its_segments_and_reopens_there(tmp_path):
    """A new replica of a leader whose retention deleted its first segments: ``start_at`` begins the empty log at
    the leader's ``min_offset`` (a segment named by that base), frames from there make the same segment files, and
    recovery, the flushed hint and the epochs accept a log that starts there; a log with records refuses."""
    retained = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=2048, retention_hours=0,
                               retention_max_bytes=2 * SEGMENT)
    with CommitLog.open(tmp_path / "leader", retained) as leader:
        leader.epochs.append(1, 0)
        fill(leader, 150)
        assert leader.delete_expired() and leader.min_offset > 0
        with CommitLog.open(tmp_path / "follower", CONFIG) as follower:
            follower.start_at(leader.min_offset)
            assert follower.min_offset == follower.written_offset == leader.min_offset
            follower.epochs.append(1, 0)
            copy(leader, follower, 700)
            with pytest.raises(ValueError, match="holds records"):
                follower.start_at(0)
        expected = topics(leader)
    with CommitLog.open(tmp_path / "follower", CONFIG) as follower:
        assert topics(follower) == expected
        assert read_flushed_hint(tmp_path / "follower") == follower.written_offset
        assert follower.epochs.entries == [(1, 0)]
    names = sorted(p.name for p in (tmp_path / "leader").iterdir() if p.name.isdigit())
    assert sorted(p.name for p in (tmp_path / "follower").iterdir() if p.name.isdigit()) == names
    for name in names:
        assert (tmp_path / "follower" / name).read_bytes() == (tmp_path / "leader" / name).read_bytes()
