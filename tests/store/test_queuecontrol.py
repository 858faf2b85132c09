"""The light queues' state as control records: written by the store node, applied by dispatch, derived again from
the log alone (a rebuild after the index was deleted, a crash before dispatch, an index from before the records)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import trio

from lightqueue import keys
from lightqueue.queues import TOPIC_IDS, LightQueues
from lightqueue.targets import decode_queues
from store.api import NewMessage
from store.control import (Activated, ActivatedRun, ClientForgotten, Committed, Released, SessionEnded,
                           decode_control)
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record
from store.node import open_store
from store.rocks import open_db
from tests.helpers.dispatch import Node, decode, dump
from tests.helpers.processes import ROOT

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)
WRITER = ROOT / "tests" / "helpers" / "control_writer.py"


def controls(data: Path) -> list:
    """Every control record of the log under ``data``, decoded, in log order."""
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        return [decode_control(r) for r in log.scan(log.min_offset, 1 << 30).records if r.control]


def index_dump(data: Path) -> dict[bytes, bytes]:
    """The light-queue keys of the index under ``data``, runs expanded."""
    db = open_db(data / "index")
    try:
        return dump(db)
    finally:
        db.close()


async def settle(node) -> None:
    with trio.fail_after(10):
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)


def topics(node, queue: str, start: int = 0) -> list[str]:
    return [r.topic for _, r in node.read(queue, start, 1000, 1 << 30).messages]


async def test_activation_release_commit_and_session_end_are_control_records(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        assert await node.activate("a/+", "c1") == 0
        await node.activate("a/+", "c2")  # a second holder: the filter keeps its id
        await node.activate("a/b", "c2")  # exact: no id
        await node.append([NewMessage("a/b", b"1", "p")])
        await settle(node)
        await node.commit_offsets({"c1": {"a/+": 1}, "$group/g": {}})
        assert await node.release("a/+", "c2") and not await node.release("a/+", "c2")
        assert await node.sessions.end_session("c1")
        assert not await node.sessions.end_session("c1")  # nothing held any more: nothing written
        assert node.queues.holders("a/+") == [] and node.queues.get_offsets("c1") == {}
        assert node.queues.holders("a/b") == ["c2"]
    assert [c for c in controls(tmp_path) if not isinstance(c, ClientForgotten)] == [  # the ledger's: store/leases.py
        ActivatedRun("c1", ["a/+"], [1]), ActivatedRun("c2", ["a/+"], [1]), ActivatedRun("c2", ["a/b"], [0]),
        Committed("c1", {"a/+": 1}), Released("a/+", "c2"), SessionEnded("c1"),
    ]


async def test_topic_queue_ids_never_meet_the_filter_ids_the_writer_chooses(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        await node.append([NewMessage(f"t{i}/x", b"1", "p") for i in range(5)])
        await settle(node)
        ids = [await node.activate(f"t{i}/+", "c") for i in range(3)]  # chosen while topic queues exist
        assert ids == [0, 0, 0]
        filter_ids = sorted(node.queues.queue_id(f"t{i}/+") for i in range(3))
        assert filter_ids == [1, 2, 3]
        assert min(node.queues.queue_id(f"t{i}/x") for i in range(5)) >= TOPIC_IDS
        assert decode_queues(node.queues.targets("t1/x")) == (node.queues.queue_id("t1/+"),)


async def test_a_subscription_gets_exactly_what_is_appended_after_its_activation_returns(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        await node.activate("+/b", "s1")
        await node.append([NewMessage("a/b", b"before", "p")])
        start = await node.activate("+/b", "s2")
        await node.append([NewMessage("c/b", b"after", "p")])
        await settle(node)
        assert start == 1 and topics(node, "+/b", start) == ["c/b"]
        assert await node.release("+/b", "s2") and await node.release("+/b", "s1")
        assert node.queues.max_offset("+/b") == 0 and node.queues.targets("z/b") == b""


async def activity(node) -> None:
    """Subscriptions, messages, commits, a release and re-activation, a session's end."""
    await node.activate("dev/+/temp", "app")
    await node.activate("dev/#", "app")
    await node.activate("dev/1/temp", "d1")
    await node.activate("+/+/hum", "tmp")
    for round in range(3):
        await node.append([NewMessage(f"dev/{i}/{kind}", b"%d" % round, f"d{i}") for i in range(4)
                           for kind in ("temp", "hum")])
        await settle(node)
    await node.commit_offsets({"app": {"dev/+/temp": 5, "dev/#": 2}, "d1": {"dev/1/temp": 1}})
    assert await node.release("+/+/hum", "tmp")
    await node.activate("+/+/hum", "tmp2")  # re-activated: a new id, only what comes next
    await node.append([NewMessage("dev/9/hum", b"late", "d9")])
    await node.activate("x/+", "gone")
    await node.commit_offsets({"gone": {"x/+": 0}})
    await node.sessions.end_session("gone")
    await settle(node)


async def test_dispatch_from_an_empty_index_derives_identical_light_queue_state(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        await activity(node)
        hum = node.queues.queue_id("+/+/hum")
    before = index_dump(tmp_path)
    assert keys.active_key("+/+/hum") in before and keys.holder_key("dev/1/temp", "d1") in before
    shutil.rmtree(tmp_path / "index")
    async with open_store(tmp_path, CONFIG) as node:
        assert node.queues.queue_id("+/+/hum") == hum == 3  # the released filter had 2
        assert topics(node, "+/+/hum") == ["dev/9/hum"]  # not what listed the released id
        assert node.queues.get_offsets("app") == {"dev/+/temp": 5, "dev/#": 2} and node.queues.holders("x/+") == []
    assert index_dump(tmp_path) == before


async def test_a_release_and_re_activation_after_a_rebuild_continue_the_filter_ids(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        await activity(node)
    shutil.rmtree(tmp_path / "index")
    async with open_store(tmp_path, CONFIG) as node:
        assert await node.release("+/+/hum", "tmp2")
        await node.activate("+/+/hum", "tmp3")
        await node.append([NewMessage("dev/3/hum", b"new", "d3")])
        await settle(node)
        assert node.queues.queue_id("+/+/hum") == 5  # after x/+'s 4: never an id a record may still list
        assert topics(node, "+/+/hum") == ["dev/3/hum"]
    before = index_dump(tmp_path)
    shutil.rmtree(tmp_path / "index")
    async with open_store(tmp_path, CONFIG):
        pass
    assert index_dump(tmp_path) == before


def test_control_records_appended_by_a_process_killed_before_dispatch_are_applied_at_the_next_start(tmp_path):
    proc = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()  # pytest's timeout guards a hung writer
        assert line.startswith("appended "), f"writer stopped early: {line!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "index").exists()  # nothing was dispatched
    n = Node(tmp_path)
    try:
        while n.dispatcher.dispatch_once():
            pass
        assert n.dispatcher.dispatched_offset == int(line.split()[1])
        assert n.lq.holders("s/+") == ["h1", "h2"] and n.lq.queue_id("s/+") == 1
        assert n.lq.get_offsets("h1") == {"s/+": 2, "s/1": 1}
        pulled = n.lq.pull("s/+", 0, 100, 1 << 20, n.log, decode)
        assert [m.payload for _, m in pulled.messages] == [b"after"] * 3  # not what was appended before
    finally:
        n.close()


def write_legacy_index(data: Path) -> None:
    """An index as the store wrote it before control records (9cb2293): ids from one counter, activations,
    holders and offsets written with the WAL, no control record in the log."""
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        log.append_batch([encode_record("a/b", b"old", queues=b"\x00\x00\x00\x02")] * 3)
        end = log.written_offset
    db = open_db(data / "index")
    try:
        for name, qid in (("a/b", 1), ("a/+", 2), ("a/#", 3), ("z/+", 4)):
            db.put(keys.name_key(name), keys.U64.pack(qid))
            db.put(keys.id_key(qid), name.encode())
        db.put(keys.NEXT_ID, keys.U64.pack(5))
        for qid, head in ((1, 3), (2, 3), (3, 3)):
            db.put(keys.max_key(qid), keys.U64.pack(head))
        db.put(keys.active_key("a/+"), keys.U64.pack(0))
        db.put(keys.active_key("z/+"), keys.U64.pack(0))
        for filter, holder in (("a/+", "c1"), ("a/b", "c2"), ("z/+", "c2")):
            db.put(keys.holder_key(filter, holder), b"")
            db.put(keys.held_by_key(holder, filter), b"")
        db.put(keys.offset_key("c1", 2), keys.U64.pack(2))
        db.put(keys.ref_key(2, "c1"), b"")
        db.put(keys.CHECKPOINT, keys.U64.pack(end))
    finally:
        db.close()


async def test_an_index_from_before_control_records_is_restated_in_the_log_once(tmp_path):
    write_legacy_index(tmp_path)
    async with open_store(tmp_path, CONFIG) as node:
        assert node.queues.holders("a/+") == ["c1"] and node.queues.get_offsets("c1") == {"a/+": 2}
        start = await node.activate("b/+", "c3")
        await node.append([NewMessage("b/x", b"new", "p")])
        await settle(node)
        assert node.queues.queue_id("b/+") == 5 and node.queues.queue_id("b/x") >= TOPIC_IDS  # no legacy id reused
        assert topics(node, "b/+", start) == ["b/x"]
    restated = [ActivatedRun("c1", ["a/+"], [2]), ActivatedRun("c2", ["a/b", "z/+"], [0, 4]),
                Committed("c1", {"a/+": 2})]
    assert controls(tmp_path) == restated + [ActivatedRun("c3", ["b/+"], [5])]
    async with open_store(tmp_path, CONFIG):
        pass
    assert controls(tmp_path) == restated + [ActivatedRun("c3", ["b/+"], [5])]  # once
    shutil.rmtree(tmp_path / "index")
    async with open_store(tmp_path, CONFIG) as node:  # the log alone holds them now
        assert node.queues.holders("a/+") == ["c1"] and node.queues.holders("z/+") == ["c2"]
        assert node.queues.get_offsets("c1") == {"a/+": 2} and node.queues.queue_id("z/+") == 4
        assert decode_queues(node.queues.targets("b/y")) == (5,)


def test_restate_lists_every_holding_with_its_id_and_every_owner_s_offsets(tmp_path):
    from store.queuecontrol import QueueControls

    db = open_db(tmp_path / "index")
    try:
        lq = LightQueues(db)
        lq.activate("a/+", "c1", 0)
        lq.activate("a/+", "c2", 0)
        lq.activate("a/b", "c1", 0)
        lq.commit_offsets("c1", {"a/+": 3, "a/b": 1})
        lq.commit_offsets("$group/g", {"a/b": 2})
        assert sorted(QueueControls(lq).restate(), key=repr) == sorted([
            ActivatedRun("c1", ["a/+", "a/b"], [1, 0]), ActivatedRun("c2", ["a/+"], [1]),
            Committed("c1", {"a/+": 3, "a/b": 1}), Committed("$group/g", {"a/b": 2})], key=repr)
    finally:
        db.close()


async def test_first_activations_of_new_filters_go_to_the_log_without_waiting_for_each_others_dispatch(tmp_path):
    # Issue 31: they went one at a time, each held until dispatch applied its record (a log write and its dispatch
    # per new wildcard filter: 50 sessions x 500 new filters took a minute). Their ids stay distinct.
    async with open_store(tmp_path, CONFIG) as node:
        log = node.log.log
        log.hold_confirm()  # dispatch applies nothing past the confirm offset until it is released

        def activations() -> list[ActivatedRun]:
            records = log.scan(log.min_offset, 1 << 30).records
            return [c for c in (decode_control(r) for r in records if r.control) if isinstance(c, ActivatedRun)]

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(node.activate, f"f{i}/+", "c")
            with trio.fail_after(10):
                while len(activations()) < 20:  # all written while none is applied
                    await trio.sleep(0.01)
            log.release_confirm()
            node.dispatcher.wake()
        assert sorted(qid for a in activations() for qid in a.qids) == list(range(1, 21))
        assert sorted(node.queues.queue_id(f"f{i}/+") for i in range(20)) == list(range(1, 21))
        await node.activate("f0/+", "d")  # an active filter keeps its id; a new one takes the next
        await node.activate("new/+", "d")
        assert node.queues.queue_id("f0/+") in range(1, 21) and node.queues.queue_id("new/+") == 21


async def test_concurrent_first_activations_get_distinct_ids_and_a_racing_release_leaves_a_consistent_filter(tmp_path):
    async with open_store(tmp_path, CONFIG) as node:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(node.activate, f"f{i}/+", "c")
        assert sorted(node.queues.queue_id(f"f{i}/+") for i in range(20)) == list(range(1, 21))
        for round in range(10):  # the last holder leaves while another arrives: whichever record lands first
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.release, "f0/+", f"h{round - 1}" if round else "c")
                nursery.start_soon(node.activate, "f0/+", f"h{round}")
            assert node.queues.holders("f0/+") == [f"h{round}"] and node.queues.is_active("f0/+")
            assert decode_queues(node.queues.targets("f0/x")) == (node.queues.queue_id("f0/+"),)
        assert node.queues.filter_id("new/+") == 21  # a released filter's id was never given to another


async def test_runs_of_activations_between_messages_apply_in_log_order_and_derive_again_identically(tmp_path):
    """A call's activations are ONE ``ActivatedRun`` record (issue 31: a record, a header, a CRC, a decode per
    filter made 50 x 1,000 filters CPU-bound); dispatch applies consecutive activation records, of either kind (the
    ``Activated`` records of a log written before), as one run (one RocksDB write), between the messages around
    them in log order; a rebuild from the log alone derives the same index."""
    async with open_store(tmp_path, CONFIG) as node:
        await node.activate("run/+/m", "early")
        log = node.log.log
        log.hold_confirm()  # one dispatch scan sees every record below
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.activate_all, [f"run/{i}/+" for i in range(10)] + ["run/0/+", "run/x"], "a")
            await wait_controls(log, 2)
            await node.append([NewMessage("run/1/m", b"between the runs", "p")])
            old = [Activated("old/+", "c", 100), Activated("run/1/+", "c", 101), Activated("run/x", "c", 0)]
            nursery.start_soon(node.append_control, old)  # what a version before wrote
            await wait_controls(log, 5)
            nursery.start_soon(node.activate_all, ["run/1/+", "late/+", "run/+/m"], "b")
            await wait_controls(log, 6)
            await node.append([NewMessage("run/2/m", b"after them", "p")])
            log.release_confirm()
            node.dispatcher.wake()
        assert controls_in(log) == [
            ActivatedRun("early", ["run/+/m"], [1]),
            ActivatedRun("a", [f"run/{i}/+" for i in range(10)] + ["run/0/+", "run/x"], [*range(2, 12), 2, 0]),
            *old, ActivatedRun("b", ["run/1/+", "late/+", "run/+/m"], [12, 13, 1])]
        await node.append([NewMessage("run/1/m", b"after the apply", "p"), NewMessage("late/m", b"late", "p"),
                           NewMessage("old/m", b"old", "p")])
        await settle(node)
        assert topics(node, "run/+/m") == ["run/1/m", "run/2/m", "run/1/m"]
        assert topics(node, "run/1/+") == ["run/1/m"] and topics(node, "late/+") == ["late/m"]
        assert node.queues.holders("run/1/+") == ["a", "b", "c"] and node.queues.holders("run/+/m") == ["b", "early"]
        assert sorted(node.queues.queue_id(f"run/{i}/+") for i in range(10)) == list(range(2, 12))
        # run/1/+ in the later runs took an id too (not active when written): skipped, never reused
        assert node.queues.holders("run/x") == ["a", "c"] and node.queues.queue_id("late/+") == 13
        assert node.queues.queue_id("old/+") == 100 and topics(node, "old/+") == ["old/m"]
    before = index_dump(tmp_path)
    shutil.rmtree(tmp_path / "index")
    async with open_store(tmp_path, CONFIG) as node:
        assert topics(node, "run/1/+") == ["run/1/m"] and node.queues.queue_id("late/+") == 13
    assert index_dump(tmp_path) == before


async def wait_controls(log: CommitLog, count: int) -> None:
    with trio.fail_after(10):
        while len(controls_in(log)) < count:
            await trio.sleep(0.01)


def controls_in(log: CommitLog) -> list:
    return [decode_control(r) for r in log.scan(log.min_offset, 1 << 30).records if r.control]
