"""The confirm offset bounds everything derived from the log (dispatch, pulls, notify, retained messages, QoS 2
flows, control appliers, ``read_log``), and ``Dispatcher.truncate`` rewinds all of it; on real files and RocksDB."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lightqueue.queues import LightQueues
from retain.store import RetainedStore
from store.api import NewMessage
from store.awaiting import AwaitingRelease
from store.control import SessionEnded, encode_control
from store.dispatch import Dispatcher
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.errors import InvalidOffset
from store.log.recent import RecentRecords
from store.log.record import Record, decode_record, new_record
from store.node import open_store
from store.rocks import open_db
from tests.helpers.processes import ROOT

SEGMENT = 64 * 1024


class Applied:
    """A ControlApplier that keeps history: the offsets it applied, so a rewind undoes exactly the later ones."""

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.checkpoint = 0

    def apply(self, record: Record, control: object) -> None:
        self.offsets.append(record.offset)

    def flush(self, offset: int) -> None:
        self.checkpoint = offset

    def settle(self) -> None:
        pass  # kept in memory: nothing to wait for

    def rewind(self, log_end: int) -> None:
        self.offsets = [o for o in self.offsets if o < log_end]
        self.checkpoint = min(self.checkpoint, log_end)

    def restate(self):
        return ()


class Parts:
    """A log, its index, retained messages, QoS 2 flows, an applier, the recent records and a dispatcher."""

    def __init__(self, path, *, recent: bool) -> None:
        self.log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT))
        self.db = open_db(path / "index")
        self.lq = LightQueues(self.db)
        self.retained = RetainedStore(self.db)
        self.awaiting = AwaitingRelease(self.db)
        self.applier = Applied()
        self.recent = RecentRecords() if recent else None
        self.announced: list[dict[str, int]] = []
        self.dispatcher = Dispatcher(self.log, self.lq, self.announced.append, retained=self.retained,
                                     awaiting=self.awaiting, recent=self.recent, appliers=[self.applier])

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, packet_id: int = 0) -> int:
        raw, record = new_record(topic, payload, 1_000, "pub", 2 if packet_id else 0, retain,
                                 queues=self.lq.targets(topic), packet_id=packet_id)
        return self._append(raw, record)

    def control(self, client: str) -> int:
        return self._append(*encode_control(SessionEnded(client), 1_000, SEGMENT))

    def _append(self, raw: bytes, record: Record) -> int:
        offset = self.log.append_stamped([raw], 1_000)[0]
        if self.recent is not None:
            record.offset = offset
            self.recent.add([record])
        return offset

    def dispatch(self) -> None:
        while self.dispatcher.dispatch_once():
            pass

    def payloads(self, queue: str) -> list[bytes]:
        return [m.payload for _, m in self.lq.pull(queue, 0, 1000, 1 << 30, self.log,
                                                    lambda raw, offset: decode_record(raw, 0, offset)).messages]

    def retained_payloads(self) -> dict[str, bytes]:
        return {r.topic: decode_record(r.record, 0, r.log_offset).payload for r in self.retained.lookup("#")}

    def close(self) -> None:
        self.dispatcher.close()
        self.awaiting.close()
        self.retained.close()
        self.db.close()
        self.log.close()


@pytest.mark.parametrize("recent", [False, True], ids=["from the log", "from memory"])
def test_dispatch_stops_at_the_confirm_offset_and_resumes_when_it_moves(tmp_path, recent):
    p = Parts(tmp_path, recent=recent)
    try:
        p.publish("s/a", b"1", retain=True)
        p.log.hold_confirm()
        held = p.log.written_offset
        p.publish("s/a", b"2", retain=True)
        ended = p.control("c1")
        p.publish("s/b", b"3", packet_id=7)
        p.dispatch()
        assert p.dispatcher.dispatched_offset == held
        assert p.payloads("s/a") == [b"1"] and p.payloads("s/b") == []  # pulls see no unconfirmed record
        assert p.retained_payloads() == {"s/a": b"1"} and p.applier.offsets == []
        assert p.awaiting.awaiting("pub") == {} and p.announced == [{"s/a": 1, "s/#": 1}]  # nothing notified past it
        p.log.confirm(ended)
        p.dispatch()
        assert p.dispatcher.dispatched_offset == ended and p.applier.offsets == []
        assert p.payloads("s/a") == [b"1", b"2"] and p.retained_payloads() == {"s/a": b"2"}
        p.log.confirm(p.log.written_offset)
        p.dispatch()
        assert p.applier.offsets == [ended] and p.payloads("s/b") == [b"3"] and 7 in p.awaiting.awaiting("pub")
        assert p.announced[-1]["s/b"] == 1 and p.announced[-1]["s/#"] == 3
    finally:
        p.close()


@pytest.mark.parametrize("recent", [False, True], ids=["from the log", "from memory"])
def test_truncate_rewinds_the_index_retained_flows_appliers_and_memory_and_the_log_goes_on(tmp_path, recent):
    p = Parts(tmp_path, recent=recent)
    try:
        p.publish("s/a", b"kept", retain=True)
        cut = p.publish("s/a", b"dropped", retain=True)
        p.publish("s/b", b"dropped", packet_id=9)
        p.control("c1")
        p.dispatch()
        p.dispatcher.close()  # flushed: the checkpoints are past the cut, durably
        assert p.applier.offsets and p.payloads("s/b") == [b"dropped"]
        p.dispatcher.truncate(cut)
        assert p.log.written_offset == p.dispatcher.dispatched_offset == cut
        assert p.payloads("s/a") == [b"kept"] and p.payloads("s/b") == [] and p.applier.offsets == []
        assert p.awaiting.awaiting("pub") == {} and p.lq.checkpoint <= cut
        assert "s/a" not in p.retained_payloads()  # the message past the cut went (retained keeps no history)
        p.publish("s/b", b"new")  # at the same offset as the dropped one
        p.dispatch()
        assert p.payloads("s/a") == [b"kept"] and p.payloads("s/b") == [b"new"]
    finally:
        p.close()


async def test_read_log_and_its_flushed_bound_stop_at_the_confirm_offset(tmp_path):
    async with open_store(tmp_path, CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT)) as store:
        await store.append([NewMessage("a", b"1")], durable=True)
        log = store.log.log
        log.hold_confirm()
        held = log.written_offset
        await store.append([NewMessage("a", b"2")], durable=True)
        bounds = store.read_log(0, 0)
        assert bounds.flushed == held and log.flushed_offset > held
        span = store.read_log(0, 1 << 20)
        assert span.start + len(span.data) == held and span.flushed == held
        assert store.read_log(held, 100).data == b""
        with pytest.raises(InvalidOffset):
            store.read_log(log.written_offset, 100)
        log.confirm(log.written_offset)
        assert store.read_log(0, 0).flushed == log.flushed_offset
        assert len(store.read_log(0, 1 << 20).data) == log.written_offset


KILLED_AFTER_THE_CUT = """
import os, signal, sys
from pathlib import Path
from lightqueue.queues import LightQueues
from tests.store.test_confirm import Parts

def crash(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

p = Parts(Path(sys.argv[1]), recent=False)
LightQueues.rewind = crash  # the log is cut; nothing derived is rewound yet
p.dispatcher.truncate(int(sys.argv[2]))
"""


def test_a_crash_between_the_cut_and_the_rewind_is_rewound_on_the_next_open(tmp_path):
    p = Parts(tmp_path, recent=False)
    p.publish("s/a", b"kept", retain=True)
    cut = p.publish("s/a", b"dropped", retain=True)
    p.publish("s/b", b"dropped", packet_id=9)
    p.dispatch()
    p.close()  # everything derived is flushed, its checkpoints past the cut
    child = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_CUT, str(tmp_path), str(cut)], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    p = Parts(tmp_path, recent=False)
    try:
        assert p.log.written_offset == cut
        p.dispatcher.recover()
        assert p.payloads("s/a") == [b"kept"] and p.payloads("s/b") == [] and p.awaiting.awaiting("pub") == {}
        assert "s/a" not in p.retained_payloads()
        p.publish("s/b", b"new")
        p.dispatch()
        assert p.payloads("s/b") == [b"new"]
    finally:
        p.close()
