"""The store node wiring: append -> dispatch -> pull, clean shutdown, and reopening."""

import gc
from pathlib import Path

import pytest
import trio

import store.api
import store.node

from gateway.app.process import GC_THRESHOLDS, set_collection_policy
from store.api import NewMessage, PullRequest, batchable
from store.local import INLINE_PULL, LocalStore
from store.log.commitlog import CommitLogConfig
from store.log.errors import LogFullError
from store.log.record import RecordTooLarge
from store.node import open_store
from tests.helpers.processes import ROOT

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)


async def test_appended_messages_are_indexed_and_pullable(tmp_path: Path):
    events: list[dict[str, int]] = []
    async with open_store(tmp_path, CONFIG, listener=events.append) as node:
        start = await node.activate("tele/+/temp", "session-1")
        offsets = await node.append([NewMessage("tele/d1/temp", b"21.5", "d1", 1), NewMessage("tele/d2/hum", b"40", "d2")])
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        result = node.read("tele/+/temp", start)
        assert [(o, r.topic, r.payload) for o, r in result.messages] == [(start, "tele/d1/temp", b"21.5")]
        assert len(offsets) == 2
    merged = {k: v for batch in events for k, v in batch.items()}
    assert merged["tele/+/temp"] == start + 1
    assert merged["tele/#"] >= 2
    assert merged["tele/d2/hum"] == 1


async def test_state_survives_a_clean_restart(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as node:
        await node.append([NewMessage("cmd/dev-7", b"reboot", "app", 1)], durable=True)
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
    async with open_store(tmp_path, CONFIG) as node:
        assert node.queues.max_offset("cmd/dev-7") == 1
        assert node.dispatcher.lag == 0
        ((offset, record),) = node.read("cmd/dev-7", 0).messages
        assert (offset, record.payload, record.client_id, record.qos) == (0, b"reboot", "app", 1)


async def test_append_nowait_appends_in_the_callers_step_only_when_nothing_must_be_waited_for(tmp_path: Path):
    async with open_store(tmp_path / "async", CONFIG) as node:
        (offset,) = node.append_nowait([NewMessage("a/b", b"now", qos=1)])
        assert node.log.log.written_offset > offset and node.recent.get(offset).payload == b"now"
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert [r.payload for _, r in node.read("a/b", 0).messages] == [b"now"]
        written = node.log.log.written_offset
        with pytest.raises(RecordTooLarge):
            node.append_nowait([NewMessage("a/b", b"x" * (CONFIG.max_record_bytes + 1))])
        assert node.log.log.written_offset == written  # nothing appended
    sync = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10, flush="sync")
    async with open_store(tmp_path / "sync", sync) as node:
        with pytest.raises(trio.WouldBlock):  # the fsync must be awaited: append() does it
            node.append_nowait([NewMessage("a/b", b"later")])
        assert node.log.log.written_offset == 0


async def test_append_nowait_writes_each_run_of_one_topic_at_qos_0_and_1_as_a_batch_record_read_back_as_sent(
        tmp_path: Path):
    """A gateway's read round: consecutive QoS 0 and 1 messages of one topic share a batch record (consecutive
    positions); retained, QoS 2 (a packet id) and lone messages stay records of their own; every message reads back
    with its own fields, in the order appended, at the position the append answered."""
    props = b"\x02\x00\x00\x02\x58"  # Message Expiry Interval 600: properties stay per message
    messages = [NewMessage("tele/a", b"a0", "c1", born_ms=1000), NewMessage("tele/a", b"a1", "c2", properties=props),
                NewMessage("tele/a", b"a2", "c1", born_ms=1002), NewMessage("tele/b", b"b0", "c3"),
                NewMessage("tele/a", b"a3", "c1", retain=True), NewMessage("tele/a", b"a4", "c1"),
                NewMessage("tele/a", b"a5", "c1", qos=1), NewMessage("tele/a", b"a6", "c1", qos=1),
                NewMessage("tele/a", b"a7", "c1"), NewMessage("tele/a", b"a8", "c1", qos=2, packet_id=9),
                NewMessage("tele/a", b"a9", "c1", qos=1), NewMessage("tele/a", b"a10", "c1", qos=1)]
    async with open_store(tmp_path, CONFIG) as node:
        positions = node.append_nowait(messages)
        assert len(positions) == len(messages) and positions == sorted(set(positions))
        steps = [b - a for a, b in zip(positions, positions[1:])]
        # a0-a2, a4-a7 (QoS 0 and 1 together) and a9-a10 (QoS 1): batch records
        assert steps[:2] == [1, 1] and steps[5:8] == [1, 1, 1] and steps[10] == 1
        assert all(step > 1 for step in steps[2:5] + steps[8:10])  # b0, the retained a3, the QoS 2 a8: records
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        read = [record for _, record in node.read("tele/a", 0, max_count=100).messages]
        sent = [(p, m) for p, m in zip(positions, messages) if m.topic == "tele/a"]
        assert [(r.offset, r.payload, r.client_id, r.qos, r.retain, r.properties, r.born_ms) for r in read] == [
            (p, m.payload, m.client_id, m.qos, m.retain, m.properties, m.born_ms or r.store_ms)
            for (p, m), r in zip(sent, read)] and len(read) == len(sent)
        assert len({r.store_ms for r in read}) == 1  # one append, one store timestamp: batched or not
        assert [r.payload for _, r in node.read("tele/b", 0).messages] == [b"b0"]
async def test_a_publishers_alike_read_is_checked_whole_and_what_may_not_share_a_batch_record_still_stays_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A flooding publisher's read (messages alike but for payload and born time) is one run checked in a few passes,
    not a ``batchable`` call per message; a retained or QoS 2 run stays single records, a message too large for a
    batch record stays alone between its neighbours' batch records, a run too large for one record is cut, and every
    message reads back as sent at the position the append answered."""
    checks = []

    def counted(message: NewMessage, room: int) -> bool:
        checks.append(message)
        return batchable(message, room)

    monkeypatch.setattr(store.node, "batchable", counted)
    monkeypatch.setattr(store.api, "batchable", counted)

    def alike(count: int, size: int = 64, **fields: object) -> list[NewMessage]:
        return [NewMessage("tele/d1", i.to_bytes(4, "big") * (size // 4), "pub-1", born_ms=1000 + i, **fields)
                for i in range(count)]

    def steps(positions: list[int]) -> list[int]:
        return [b - a for a, b in zip(positions, positions[1:])]

    big = NewMessage("tele/d1", b"x" * (CONFIG.max_record_bytes - 2048), "pub-1", born_ms=5000)
    appends = {
        "flood": alike(500), "qos1": alike(50, qos=1), "retained": alike(5, retain=True), "qos2": alike(5, qos=2),
        "one too large": [*alike(3), big, *alike(3)], "cut": alike(200, size=1024),
    }
    async with open_store(tmp_path, CONFIG) as node:
        positions = {}
        for name, messages in appends.items():
            checks.clear()
            positions[name] = node.append_nowait(messages)
            assert len(positions[name]) == len(messages)
            if name in ("flood", "qos1"):
                assert len(checks) <= 1, name  # checked whole, not once per message
        assert set(steps(positions["flood"])) == {1} and set(steps(positions["qos1"])) == {1}  # one batch record each
        assert min(steps(positions["retained"])) > 1 and min(steps(positions["qos2"])) > 1  # records of their own
        assert steps(positions["one too large"])[:2] == [1, 1] and steps(positions["one too large"])[4:] == [1, 1]
        assert steps(positions["one too large"])[2] > 1 and steps(positions["one too large"])[3] > 1
        cut = steps(positions["cut"])
        assert cut.count(1) >= 190 and 1 <= len(cut) - cut.count(1) <= 5  # a few batch records that fit the limit
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        sent = [(p, m) for name in appends for p, m in zip(positions[name], appends[name])]
        read = [record for _, record in node.read("tele/d1", 0, max_count=1000, max_bytes=16 << 20).messages]
        assert [(r.offset, r.payload, r.client_id, r.qos, r.retain, r.born_ms) for r in read] == [
            (p, m.payload, m.client_id, m.qos, m.retain, m.born_ms) for p, m in sent]


async def test_append_nowait_dispatches_its_records_and_routes_their_news_in_the_callers_step(tmp_path: Path):
    """A small append kept in memory is indexed in the step that made it (``Dispatcher.dispatch_now``): the node
    watching its queue can take the news at once (``events_nowait``), without a scheduling round of the event loop
    for dispatch's task. Nothing below yields between the append and the checks. While a step holds dispatch (here
    ``caught_up``, in this very thread), an append leaves its records to dispatch's task: it neither blocks nor
    steps inside the step in progress."""
    async with open_store(tmp_path, CONFIG) as node:
        local = LocalStore(node, "gw")
        local.watch("a/b")
        with pytest.raises(trio.WouldBlock):
            local.events_nowait()
        positions = local.append_nowait([NewMessage("a/b", b"now", qos=1)])
        assert node.dispatcher.dispatched_offset == node.log.log.written_offset > positions.offsets[0]
        assert local.events_nowait()["a/b"] == 1
        assert [r.payload for _, r in node.read("a/b", 0).messages] == [b"now"]
        with node.dispatcher.caught_up():
            local.append_nowait([NewMessage("a/b", b"held", qos=1)])
            assert node.dispatcher.dispatched_offset < node.log.log.written_offset
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
            assert (await local.events())["a/b"] == 2
        local.close()


def test_the_collection_policy_hides_startup_objects_from_the_collector():
    thresholds = gc.get_threshold()
    gc.unfreeze()
    try:
        before = len(gc.get_objects())
        set_collection_policy()
        assert gc.get_freeze_count() >= before // 2 and len(gc.get_objects()) < before // 2
        assert gc.get_threshold() == GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


async def test_a_large_pull_runs_in_the_callers_step_only_when_its_records_are_kept_in_memory(tmp_path: Path):
    messages = [NewMessage("tele/d1", b"%d" % i) for i in range(INLINE_PULL * 2)]
    large = [PullRequest("tele/#", 0, max_count=INLINE_PULL * 2)]
    async with open_store(tmp_path, CONFIG) as node:
        node.append_nowait(messages)
        with trio.fail_after(10):
            await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        client = LocalStore(node)
        assert node.in_memory("tele/#", 0)
        (result,) = client.pull_nowait(large)
        assert [r.payload for _, r in result.messages] == [m.payload for m in messages]
    async with open_store(tmp_path, CONFIG) as node:  # restarted: nothing is kept in memory
        client = LocalStore(node)
        assert not node.in_memory("tele/#", 0)
        # A read at the head (a new subscription's first) finds nothing: no worker thread for it.
        assert node.in_memory("tele/#", INLINE_PULL * 2) and node.in_memory("nobody/+", 0)
        assert client.pull_nowait([PullRequest("tele/#", INLINE_PULL * 2, max_count=INLINE_PULL * 2)])[0].messages == []
        with pytest.raises(trio.WouldBlock):  # the log must be read: a worker thread's job
            client.pull_nowait(large)
        ((result,),) = [await client.pull(large)]
        assert len(result.messages) == INLINE_PULL * 2
        assert client.pull_nowait([PullRequest("tele/#", 0, max_count=INLINE_PULL)])  # small: inline


_FRAGMENT = """
import os, sys
from gateway.app.process import return_freed_buffers
if sys.argv[1] == "fixed":
    return_freed_buffers()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
first = [bytearray(900_000) for _ in range(20)]
del first  # glibc raises its mmap threshold to 900 KB here, unless it is fixed
buffers = [bytearray(900_000) for _ in range(200)]  # 180 MB of partial packets
base = rss_mib()
keep = buffers[-1]
del buffers  # the connections are gone; one buffer at the top of the heap is still in use
print(base - rss_mib())
"""


def test_large_freed_buffers_go_back_to_the_system(tmp_path: Path):
    """After a churn of clients sending most of a 1 MB packet, the node's RSS stayed ~70 MB up although the
    memory was free: glibc served the buffers from a heap that could not shrink (issue 21)."""
    import subprocess
    import sys

    def returned(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        return float(out.stdout)

    assert returned("fixed") > 150  # MiB of the 180 given back
    assert returned("default") < 50  # what the default allocator does (the reason for the setting)


_HOLES = """
import os, sys, trio
from gateway.app.process import trim_freed_memory
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
chunks = [bytes(60_000) + b"%d" % n for n in range(3000)]  # 180 MB of WebSocket frames, from the heap
keep = chunks[-1]
del chunks  # freed, but the heap's top is in use: nothing goes back
before = rss_mib()
async def main():
    with trio.move_on_after(float(sys.argv[1])):
        await trim_freed_memory(0.05)
trio.run(main)
print(before - rss_mib())
"""


def test_free_heap_pages_go_back_to_the_system_within_the_trim_interval():
    import subprocess
    import sys

    def returned(wait_s: str) -> float:
        out = subprocess.run([sys.executable, "-c", _HOLES, wait_s], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        return float(out.stdout)

    assert returned("0.5") > 150  # MiB of the 180 given back by the trims
    assert returned("0") < 50  # without a trim the heap keeps them


async def test_a_save_that_arrives_after_the_sessions_end_writes_nothing(tmp_path: Path):
    """A node's save of a client no longer connected (delayed by a full disk: gateway/node/owed.py) updates the
    session while the store keeps it, and never brings it back once it ended."""
    async with open_store(tmp_path, CONFIG) as node:
        store = LocalStore(node, "gw")
        await store.open_session("c1", clean_start=False, expiry_s=60)
        await store.save_session("c1", b"one")
        await store.close_session("c1", expiry_s=60, will_delay_s=None)
        await store.save_session("c1", b"two")  # closed, not ended: the last state lands
        assert await store.load_session("c1") == b"two"
        assert await store.end_session("c1")
        await store.save_session("c1", b"late")
        assert await store.load_session("c1") is None
        await store.save_session("c2", b"new")  # a client connected nowhere whose session the store never had
        assert await store.load_session("c2") is None


async def test_a_session_a_full_disk_keeps_from_ending_at_its_close_ends_once_there_is_room(tmp_path: Path):
    """Session Expiry 0: the close is heard at once; the end the full disk refuses is retried by the store, and
    the session cannot resume meanwhile (store/leases.py)."""
    async with open_store(tmp_path, CONFIG) as node:
        store = LocalStore(node, "gw")
        await store.open_session("c1", clean_start=False, expiry_s=0)
        await store.activate("a/+", "c1")
        margin, node.space.margin = node.space.margin, 1 << 62  # every write is refused as on a full disk
        await store.close_session("c1", expiry_s=0, will_delay_s=None)  # returns: nothing waits for room
        with pytest.raises(LogFullError):
            await store.open_session("c1", clean_start=False, expiry_s=0)
        assert node.queues.held_by("c1") == ["a/+"]
        node.space.margin = margin
        with trio.fail_after(10):
            while node.queues.held_by("c1"):
                await trio.sleep(0.05)
        assert await store.open_session("c1", clean_start=False, expiry_s=0) is None
