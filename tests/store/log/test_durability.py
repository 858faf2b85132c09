"""Crash durability: a writer process is SIGKILLed mid-stream; every acknowledged record must survive.

The writer is tests/helpers/commitlog_writer.py. Under ``sync`` an acknowledgement means
"on disk", so every acknowledged record must be present and intact after the
kill. Under ``async`` only records below the last flushed offset the writer
reported are guaranteed; later ones may be missing but are never wrong.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.errors import InvalidOffset
from tests.helpers.commitlog_writer import SEGMENT_BYTES, payload
from tests.helpers.processes import ROOT

WRITER = ROOT / "tests" / "helpers" / "commitlog_writer.py"
ACKS_BEFORE_KILL = 3000  # enough batches that the kill lands mid-stream, past a few segment rolls



def run_and_kill(directory: Path, mode: str) -> tuple[list[tuple[int, int, int]], int]:
    """Start the writer, read acknowledgements until enough arrived, SIGKILL it mid-stream."""
    proc = subprocess.Popen([sys.executable, "-u", str(WRITER), str(directory), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # this tree's code
    acks: list[tuple[int, int, int]] = []
    flushed = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, *fields = line.split()
            if kind == "ack":
                offset, size, seq = map(int, fields)
                acks.append((offset, size, seq))
            elif kind == "flushed":
                flushed = max(flushed, int(fields[0]))
            # async: also wait for a reported flush, or the test would assert nothing on a busy machine
            if len(acks) >= ACKS_BEFORE_KILL and (mode == "sync" or flushed > 0):
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    assert len(acks) >= ACKS_BEFORE_KILL, err
    return acks, flushed


def open_after_crash(directory: Path) -> CommitLog:
    return CommitLog.open(directory, CommitLogConfig(segment_bytes=SEGMENT_BYTES, max_record_bytes=SEGMENT_BYTES))


def test_sync_mode_keeps_every_acknowledged_record(tmp_path):
    acks, _ = run_and_kill(tmp_path, "sync")
    with open_after_crash(tmp_path) as log:
        assert log.written_offset >= max(o + s for o, s, _ in acks)
        for offset, size, seq in acks:
            record = log.read(offset)
            assert record.size == size and record.payload == payload(seq), offset
        assert len(log.segments()) > 1


def test_async_mode_keeps_everything_below_the_flushed_offset(tmp_path):
    acks, flushed = run_and_kill(tmp_path, "async")
    assert flushed > 0
    with open_after_crash(tmp_path) as log:
        assert log.written_offset >= flushed
        for offset, size, seq in acks:
            if offset + size <= flushed:
                assert log.read(offset).payload == payload(seq), offset
            else:
                try:
                    assert log.read(offset).payload == payload(seq), offset
                except InvalidOffset:
                    pass  # after the flushed offset a record may be missing, never wrong
        log.append(log.read_bytes(acks[0][0], acks[0][1]))
