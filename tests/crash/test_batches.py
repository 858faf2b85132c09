"""Batch records through crashes: a store node appending batches (tests/helpers/batch_writer.py) is SIGKILLed
mid-write; its log may then lose its unflushed tail (a power loss), or a batch in it may be damaged.

A batch record is one frame with one CRC (docs/storage.md, "Batch records"), so it is all or nothing: after any of
these, every batch a queue serves is whole, each message once, at consecutive queue offsets. What is lost is only
what the flush policy allows: under ``sync`` nothing acknowledged; under ``async`` after a power loss nothing below
the flushed mark; a corrupt batch costs that batch alone, whether the index had it already or is derived again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from store.api import PullRequest
from store.dump import dump
from store.local import LocalStore
from store.log.commitlog import CommitLog, read_flushed_hint
from store.node import open_store
from tests.helpers.batch_writer import TOPICS, config, parse, payload
from tests.helpers.powerloss import lose_unflushed_tail
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow

WRITER = ROOT / "tests" / "helpers" / "batch_writer.py"
ACKS_BEFORE_KILL = 600  # batches: about 12,000 messages, past several segment rolls and index flushes


class Acked:
    """What the writer acknowledged: per batch (topic, first position, first seq, count), and its last flush."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, int, int]] = []
        self.flushed = 0


def run_and_kill(data: Path, mode: str) -> Acked:
    """Start the writer, read acknowledgements until enough arrived (and, ``async``, a flush), SIGKILL it."""
    proc = subprocess.Popen([sys.executable, "-u", str(WRITER), str(data), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    acked = Acked()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, *fields = line.split()
            if kind == "ack":
                acked.batches.append((fields[0], *map(int, fields[1:])))
            elif kind == "flushed":
                acked.flushed = max(acked.flushed, int(fields[0]))
            if len(acked.batches) >= ACKS_BEFORE_KILL and (mode == "sync" or acked.flushed > 0):
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    assert len(acked.batches) >= ACKS_BEFORE_KILL, err
    return acked


async def served(data: Path, mode: str) -> dict[str, list[tuple[int, int, bytes]]]:
    """Open the store as a restart does and pull every queue whole: (queue offset, position, payload) per message."""
    async with open_store(data, config(mode)) as node:
        store = LocalStore(node, "reader")
        out: dict[str, list[tuple[int, int, bytes]]] = {}
        for topic in TOPICS:
            messages: list[tuple[int, int, bytes]] = []
            offset = 0
            while True:
                (result,) = await store.pull([PullRequest(topic, offset, max_count=10_000, max_bytes=64 << 20)])
                messages += [(qoff, record.offset, record.payload) for qoff, record in result.messages]
                if result.next_offset == offset:
                    break
                offset = result.next_offset
            out[topic] = messages
        return out


def check_whole(queues: dict[str, list[tuple[int, int, bytes]]], *, consecutive: bool = True) -> set[int]:
    """Every message's payload is right, each batch is whole and in order, queue offsets are consecutive (else
    ascending: an entry whose record went bad is passed over); the first seqs of the batches served."""
    firsts = set()
    for topic, messages in queues.items():
        offsets = [qoff for qoff, _, _ in messages]
        assert offsets == list(range(len(messages))) if consecutive else offsets == sorted(set(offsets)), topic
        i = 0
        while i < len(messages):
            seq, first, count = parse(messages[i][2])
            assert seq == first, (topic, messages[i])
            batch = messages[i:i + count]
            assert [m[2] for m in batch] == [payload(first + k, first, count) for k in range(count)], topic
            assert [m[1] for m in batch] == [batch[0][1] + k for k in range(count)]  # positions: offset + index
            firsts.add(first)
            i += count
    return firsts


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_kill_mid_write_keeps_every_acknowledged_batch_whole(tmp_path, mode):
    """A SIGKILL loses nothing under either policy (the page cache keeps the log); the batches in flight are
    whole or absent."""
    acked = run_and_kill(tmp_path, mode)
    firsts = check_whole(await served(tmp_path, mode))
    assert {first for _, _, first, _ in acked.batches} <= firsts


async def test_a_power_loss_keeps_the_batches_below_the_flushed_mark_and_serves_no_part_of_the_others(tmp_path):
    """The writer goes on flushing between its last ``flushed`` line the test read and the kill, so the cut is at
    the mark the log itself recorded last (its ``flushed`` hint), at or past the one the test saw."""
    acked = run_and_kill(tmp_path, "async")
    mark = read_flushed_hint(tmp_path / "commitlog")
    assert mark is not None and mark >= acked.flushed
    assert lose_unflushed_tail(tmp_path / "commitlog") > 0
    firsts = check_whole(await served(tmp_path, "async"))
    kept = {first for _, position, first, _ in acked.batches if position < acked.flushed}
    assert kept and kept <= firsts
    lost = {first for _, position, first, _ in acked.batches if position >= mark}
    assert not lost & firsts  # the log lost them: no index entry the index kept serves them


@pytest.mark.parametrize("index", ["kept", "rebuilt"])
async def test_a_corrupt_batch_costs_that_batch_only(tmp_path, index):
    """One byte flipped inside a flushed batch record: its CRC fails, it is never served, and every other message
    is (with the index that had it, and with one derived again from the log, where later offsets close up)."""
    acked = run_and_kill(tmp_path, "sync")
    before = await served(tmp_path, "sync")  # the restart indexes everything; the clean stop flushes the index
    topic, position, first, count = acked.batches[len(acked.batches) // 2]
    with CommitLog.open(tmp_path / "commitlog", config("sync")) as log:
        record = log.read(position)
        assert record.batch_count == count
        base = max(s.base for s in log.segments() if s.base <= position)
    with open(tmp_path / "commitlog" / f"{base:020d}", "r+b") as f:  # a byte of its last message's payload
        f.seek(position - base + record.size - 2)
        flipped = bytes([f.read(1)[0] ^ 0xFF])
        f.seek(-1, os.SEEK_CUR)
        f.write(flipped)
    if index == "rebuilt":
        shutil.rmtree(tmp_path / "index")
    after = await served(tmp_path, "sync")
    assert sum(map(len, after.values())) == sum(map(len, before.values())) - count
    check_whole(after, consecutive=index == "rebuilt")
    expected = [m[2] for m in before[topic] if parse(m[2])[1] != first]
    assert [m[2] for m in after[topic]] == expected
    for other in TOPICS:
        if other != topic:
            assert after[other] == before[other]
    if index == "kept":  # the entry stays, its queue offsets are passed over; rebuilt, they close up
        assert after[topic][-1][0] == before[topic][-1][0]


async def test_an_index_derived_again_from_a_log_of_batches_is_the_same(tmp_path):
    """The index holds only what dispatch derives: delete it and the next start makes the same one (store/dump.py
    expands batch runs to one entry per queue offset, so the dump does not depend on how runs were cut)."""
    run_and_kill(tmp_path, "sync")
    await served(tmp_path, "sync")
    original = dump(tmp_path / "index")
    shutil.rmtree(tmp_path / "index")
    await served(tmp_path, "sync")
    assert dump(tmp_path / "index") == original
