"""Recent records kept decoded: the dispatcher indexes them and pulls read them without reading the log back.

Also the log side of the same read path (``CommitLog.read_many``: neighbouring
records in one read) and the back-pressure that keeps dispatch within reach of
the records in memory (``Dispatcher.wait_lag``).
"""

from pathlib import Path

import trio

from store.api import NewMessage
from store.log.commitlog import SKIPPED, CommitLog, CommitLogConfig
from store.log.recent import RecentRecords
from store.log.record import decode_record, encode_record, new_record
from store.node import open_store

CONFIG = CommitLogConfig(segment_bytes=64 << 10, max_record_bytes=16 << 10)


def made(topic: str, payload: bytes, offset: int, **fields):
    raw, record = new_record(topic, payload, store_ms=1_000, **fields)
    record.offset = offset
    return raw, record


def test_new_record_is_what_its_bytes_decode_to():
    raw, record = made("a/b", bytearray(b"payload"), 77, client_id="dev", qos=2, retain=True,
                       properties=b"\x01\x01", queues=b"\x00\x00\x00\x05\x00\x00\x00\x09", born_ms=5)
    assert record == decode_record(raw, 0, 77)
    assert type(record.payload) is bytes  # a caller's buffer is copied, not kept
    raw, record = made("a/b", b"", 3, born_ms=0)
    assert record == decode_record(raw, 0, 3) and record.born_ms == 0


def test_recent_records_run_until_a_gap_and_evict_oldest_first():
    recent = RecentRecords(max_records=4)
    records = [made("t", b"x" * 10, 0)[1]]
    for _ in range(4):
        last = records[-1]
        records.append(made("t", b"x" * 10, last.offset + last.size)[1])
    recent.add(records[:3])
    run, next_offset = recent.run(0, 1 << 20)
    assert run == records[:3] and next_offset == records[2].offset + records[2].size
    assert recent.run(next_offset, 1 << 20) == ([], next_offset)  # not appended yet
    assert recent.run(0, 1) == ([records[0]], records[1].offset)  # a run takes at least one record
    recent.add(records[3:])
    assert len(recent) == 4 and recent.get(0) is None  # the oldest went first
    assert recent.run(records[1].offset, 1 << 20)[0] == records[1:]


def test_recent_records_are_bounded_in_bytes():
    recent = RecentRecords(max_records=100, max_bytes=300)
    offset = 0
    for _ in range(5):
        record = made("t", b"x" * 80, offset)[1]
        recent.add([record])
        offset += record.size
    assert 0 < len(recent) * record.size <= 300


def test_read_many_reads_neighbours_together_and_answers_in_order(tmp_path: Path):
    log = CommitLog.open(tmp_path, CONFIG)
    try:
        raws = [encode_record(f"t/{i}", bytes([i]) * (100 + i)) for i in range(40)]
        offsets = log.append_batch(raws)
        locations = [(offsets[i], len(raws[i])) for i in (0, 1, 2, 7, 30, 31)]  # runs and gaps
        assert log.read_many(locations) == [raws[i] for i in (0, 1, 2, 7, 30, 31)]
        assert log.read_many([]) == []
        # A location whose bytes are not the record it promises is skipped (reported once), the others read
        assert log.read_many([(offsets[3], len(raws[3]) + 1)]) == [SKIPPED]
        assert log.read_many([(offsets[3], len(raws[3])), (offsets[4] + 1, len(raws[4]))]) == [raws[3], SKIPPED]
        assert log.statistics().corrupt_records == 2
    finally:
        log.close()


def test_read_many_gives_none_for_records_retention_deleted(tmp_path: Path):
    log = CommitLog.open(tmp_path, CommitLogConfig(segment_bytes=16 << 10, max_record_bytes=4 << 10,
                                                   retention_max_bytes=16 << 10))
    try:
        raws = [encode_record("t", b"x" * 3000) for _ in range(20)]
        offsets = log.append_batch(raws)
        assert log.delete_expired()  # the oldest sealed segments go
        assert log.min_offset > offsets[0]
        found = log.read_many([(offsets[0], len(raws[0])), (offsets[-1], len(raws[-1]))])
        assert found == [None, raws[-1]]
    finally:
        log.close()


async def test_appends_are_dispatched_and_pulled_from_memory(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as node:
        start = await node.activate("tele/+/temp", "s1")
        messages = [NewMessage(f"tele/d{i}/temp", b"%d" % i * 200, f"d{i}", 1) for i in range(600)]
        await node.append(messages)  # about 2.5 segments: the run of records breaks at each segment end
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        stats = node.dispatcher.statistics()
        assert stats.records == stats.from_memory == 600 + 1  # the activation is a control record
        result = node.read("tele/+/temp", start, max_count=1000, max_bytes=1 << 30)
        assert [r.payload for _, r in result.messages] == [m.payload for m in messages]
        assert result.messages[5][1] is node.recent.get(result.messages[5][1].offset)  # the kept object itself
    async with open_store(tmp_path, CONFIG) as node:  # a restart keeps nothing: pulls read the log
        assert len(node.recent) == 0
        result = node.read("tele/+/temp", start, max_count=1000, max_bytes=1 << 30)
        assert [r.payload for _, r in result.messages] == [m.payload for m in messages]


async def test_wait_lag_returns_once_dispatch_caught_up(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as node:
        node.log.log.append_batch([encode_record("a/b", b"x" * 1000) for _ in range(10)])  # nobody woke dispatch
        assert node.dispatcher.lag > 0
        with trio.fail_after(10):  # the dispatcher's fallback wake-up finds them
            await node.dispatcher.wait_lag(0)
        assert node.dispatcher.lag == 0
