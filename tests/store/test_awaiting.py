"""Inbound QoS 2 flows awaiting PUBREL, derived from the CommitLog (store/awaiting.py), on a real RocksDB.

The rules must make dispatch deterministic in any order with releases and
drops, across re-dispatch after a crash and a log cut by a power loss: a new
message with a recycled packet id must never be taken for a resend
([MQTT-4.3.3-2] holds the id only until PUBREL), and a resend must never be
stored twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from store.api import NewMessage
from store.awaiting import AwaitingRelease
from store.log.commitlog import CommitLogConfig
from store.log.record import CorruptRecord, Record, decode_record, encode_record, new_record
from store.node import open_store
from store.rocks import open_db
from tests.helpers.processes import ROOT



def record(offset: int, client: str, pid: int, qos: int = 2) -> Record:
    _, rec = new_record("t", b"x", 1, client, qos, packet_id=pid if qos == 2 else 0)
    rec.offset = offset
    return rec


@pytest.fixture
def db(tmp_path):
    handle = open_db(tmp_path / "index")
    yield handle
    handle.close()


def test_the_record_keeps_the_packet_id_after_the_target_queues():
    raw = encode_record("t", b"p", client_id="c", qos=2, queues=b"\0\0\0\x07", packet_id=513, store_ms=1)
    rec = decode_record(raw, 0, 100)
    assert (rec.queues, rec.packet_id, rec.qos, rec.payload) == ((7,), 513, 2, b"p")
    assert decode_record(encode_record("t", b"p", qos=2, store_ms=1), 0, 0).packet_id == 0  # as before
    with pytest.raises(ValueError):
        encode_record("t", b"p", qos=1, packet_id=5)  # kept for QoS 2 only


def test_a_record_flagged_with_a_packet_id_but_no_section_is_corrupt():
    raw = bytearray(encode_record("t", b"p", qos=2, store_ms=1))
    raw[12] |= 0x08
    with pytest.raises(CorruptRecord):
        decode_record(bytes(raw), 0, 0)


def test_dispatch_marks_release_clears_and_redispatch_does_not_resurrect(tmp_path, db):
    state = AwaitingRelease(db)
    state.apply([record(10, "c", 5), record(20, "c", 6), record(30, "d", 5), record(40, "c", 7, qos=1)], 50)
    assert state.awaiting("c") == {5: 10, 6: 20} and state.awaiting("d") == {5: 30}
    state.release([("c", 5, 10)])
    state.apply([record(10, "c", 5)], 50)  # the same record again (re-dispatch)
    assert state.awaiting("c") == {6: 20}
    state.apply([record(60, "c", 5)], 70)  # a new message with the recycled id
    assert state.awaiting("c") == {5: 60, 6: 20}


def test_a_release_before_dispatch_covers_its_record(db):
    state = AwaitingRelease(db)
    state.release([("c", 5, 10)])  # PUBREL answered before dispatch reached the record
    state.apply([record(10, "c", 5)], 20)
    assert state.awaiting("c") == {}


def test_collect_forgets_what_no_redispatch_can_meet_again(tmp_path):
    db = open_db(tmp_path / "index")
    state = AwaitingRelease(db)
    state.apply([record(10, "c", 5), record(20, "c", 6)], 30)
    state.release([("c", 5, 10)])
    assert state.collect(30) == 1 and len(state) == 1
    state.flush()
    state.close()
    db.close()
    db = open_db(tmp_path / "index")
    state = AwaitingRelease(db)
    try:
        state.apply([record(10, "c", 5)], 30)  # below the durable checkpoint: ignored
        assert state.checkpoint == 30 and state.awaiting("c") == {6: 20}
    finally:
        state.close()
        db.close()


def test_a_dropped_session_releases_its_flows_for_good(db):
    state = AwaitingRelease(db)
    state.apply([record(10, "c", 5), record(20, "c", 6)], 25)
    state.release([("c", 6, 20)])
    assert state.drop("c") is True and state.awaiting("c") == {}  # released: a re-dispatch of 10 stays so
    state.apply([record(30, "c", 5)], 40)  # the next session's message with the id
    assert state.awaiting("c") == {5: 30}
    assert state.drop("x") is False  # nothing to release: no write


def test_a_log_cut_releases_what_lies_past_the_end(db):
    state = AwaitingRelease(db)
    state.apply([record(10, "c", 5), record(100, "c", 6)], 105)
    state.release([("c", 5, 10)])
    state.apply([record(110, "c", 5)], 120)  # the recycled id, in the tail a power loss takes
    assert state.rewind(100) == 2 and state.checkpoint == 100
    assert state.awaiting("c") == {}  # 6 and the second 5 were lost with the log's tail
    state.apply([record(10, "c", 5), record(100, "c", 6), record(104, "c", 5)], 120)  # appended after the recovery
    assert state.awaiting("c") == {5: 104, 6: 100}


WRITER = textwrap.dedent("""
    import os, signal, sys, trio
    from pathlib import Path
    from store.api import NewMessage
    from store.log.commitlog import CommitLogConfig
    from store.node import open_store

    async def main():
        async with open_store(Path(sys.argv[1]), CommitLogConfig(flush=sys.argv[2])) as store:
            offsets = []
            for pid in (1, 2, 3):
                [offset] = await store.append([NewMessage("t", b"m", "pub", 2, packet_id=pid)])
                offsets.append(offset)
            await store.sessions.release_awaiting([("pub", 2, offsets[1]), ("pub", 3, offsets[2])])
            await store.log.flush()
            # Packet id 3 again (its first flow is complete), appended and released before the log's next flush.
            [tail] = await store.append([NewMessage("t", b"tail", "pub", 2, packet_id=3)], durable=False)
            await store.sessions.release_awaiting([("pub", 3, tail)])
            print(*offsets, tail, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    trio.run(main)
""")


def crash_writer(data: Path, flush: str) -> list[int]:
    """A store process that appends QoS 2 records, releases one, and is SIGKILLed (no flush of the index)."""
    proc = subprocess.run([sys.executable, "-c", WRITER, str(data), flush], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return [int(word) for word in proc.stdout.split()]


async def awaiting_after_restart(data: Path, flush: str) -> dict[int, int]:
    async with open_store(data, CommitLogConfig(flush=flush)) as store:
        return await store.sessions.awaiting_release("pub")


def test_after_a_sigkill_the_store_knows_which_flows_await_release(tmp_path):
    first, *_ = crash_writer(tmp_path, "sync")
    assert trio.run(awaiting_after_restart, tmp_path, "sync") == {1: first}


def test_a_power_loss_under_async_never_takes_a_later_message_for_a_resend(tmp_path):
    """docs/storage.md: under async a power loss loses the log's unflushed tail; its QoS 2 flows go with it."""
    first, _, _, tail = crash_writer(tmp_path, "async")
    segment = sorted((tmp_path / "commitlog").glob("0*[0-9]"))[-1]
    with open(segment, "r+b") as handle:  # the power loss: the log loses what was not flushed (RocksDB is kept)
        handle.seek(tail)
        handle.write(bytes(64 * 1024))
    assert trio.run(awaiting_after_restart, tmp_path, "async") == {1: first}

    async def new_message_with_recycled_id() -> dict[int, int]:
        async with open_store(tmp_path, CommitLogConfig(flush="async")) as store:
            [offset] = await store.append([NewMessage("t", b"after", "pub", 2, packet_id=3)])
            assert offset == tail  # the lost tail's offset, reused
            return await store.sessions.awaiting_release("pub")

    # The release of the lost record (fsynced) must not cover the new one at the same offset: a resend of it
    # would be stored twice.
    assert trio.run(new_message_with_recycled_id) == {1: first, 3: tail}
