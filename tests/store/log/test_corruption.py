"""Corrupt bytes in the CommitLog of a real `lightgate serve` process: a flipped bit is skipped, nothing else is lost.

The node is stopped cleanly (everything is flushed: the damage lands below the
flushed mark, where it cannot be a torn write), bits are flipped on disk in a
sealed segment (a payload bit, and a bit of a record's length field, which
breaks its framing) and in the active segment, and the node is started again.
Persistent subscribers that had not read those messages yet must get every
other message, in order; each corrupt record is logged once at ERROR with its
file and offset and counted in the Prometheus metric; the node stays up and
keeps delivering new messages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from store.log.commitlog import CommitLog, CommitLogConfig
from tests.helpers.mqtt_fixtures import Client, Node, connected
from tests.helpers.prometheus import metric

SEGMENT = 64 * 1024
FLAGS = ("--commitlog-segment-bytes", str(SEGMENT), "--commitlog-max-record-bytes", "4096", "--mqtt-sys-interval-s", "0")
MESSAGES = 1500  # about four 64 KiB segments of records
PAYLOAD = 100


def flip(path: Path, position: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << bit)]))


def payload(i: int) -> bytes:
    return str(i).encode().ljust(PAYLOAD, b".")


@pytest.mark.slow
def test_corrupt_records_are_skipped_once_and_every_other_message_is_delivered(tmp_path):
    data = tmp_path / "data"
    node = Node(data, *FLAGS)
    try:
        for client_id, filter in (("plus", "c/+/t"), ("hash", "c/#")):
            with connected(node.port, client_id=client_id, clean=False) as sub:
                sub.subscribe(filter, 1)
        with connected(node.port) as pub:  # both subscribers offline: all of it is their backlog
            for i in range(MESSAGES):
                pub.publish(f"c/d{i % 7}/t", payload(i), 1)
    finally:
        assert node.stop() == 0

    log_dir = data / "commitlog"
    with CommitLog.open(log_dir, CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=4096)) as log:
        segments = log.segments()
        records = [r for s in segments for r in log.scan(s.base, SEGMENT).records if not r.control]
    assert len(segments) >= 3 and len(records) == MESSAGES
    in_first = [r for r in records if r.offset < segments[0].end]
    in_last = [r for r in records if r.offset >= segments[-1].base]
    first, mid = in_first[100], in_last[len(in_last) // 2]
    victims = {  # record index -> (its segment, the global offset of the byte to damage, the bit)
        records.index(first): (segments[0], first.offset + first.size - 5, 3),  # a payload bit
        records.index(in_first[200]): (segments[0], in_first[200].offset + 2, 1),  # the length field
        records.index(mid): (segments[-1], mid.offset + 60, 5),  # in the active segment
    }
    for segment, offset, bit in victims.values():
        flip(segment.path, offset - segment.base, bit)
    expected = [payload(i) for i in range(MESSAGES) if i not in victims]

    node = Node(data, *FLAGS)
    try:
        admin = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        with connected(node.port) as pub:  # a barrier behind the backlog: nothing of it may come after
            pub.publish("c/d0/t", b"sentinel", 1)
        for client_id in ("plus", "hash"):
            sub = Client(node.port, client_id, clean=False)
            sub.connect()
            try:
                got = [m.payload for m in sub.receive(len(expected) + 1)]
                assert got == expected + [b"sentinel"], client_id
            finally:
                sub.disconnect()
        with connected(node.port, client_id="plus", clean=False) as plus:  # the node is up and still delivers
            with connected(node.port) as pub:
                pub.publish("c/d0/t", b"after", 1)
            assert plus.receive(1)[0].payload == b"after"
        assert metric(admin, "lightgate_corrupt_records_total") == len(victims)
    finally:
        assert node.stop() == 0
    reports = [d for d in node.errors() if d["msg"].startswith("corrupt record skipped")]
    assert sorted(d["offset"] for d in reports) == sorted(records[i].offset for i in victims), node.errors()
    assert {d["file"] for d in reports} == {str(segments[0].path), str(segments[-1].path)}
    assert len(node.errors()) == len(victims), node.errors()  # nothing else went wrong
