"""The dispatcher over a real CommitLog and RocksDB: batches, notification, trio driving, crashes."""

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from lightqueue.queues import LightQueues, is_implicit
from lightqueue.targets import decode_queues
from lightqueue.topics import first_level_queue, is_wildcard, matches
from store.control import Activated, Committed, Released, encode_control
from store.dispatch import Dispatcher, DispatchStopped
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import decode_record, encode_record
from store.queuecontrol import QueueControls
from store.rocks import open_db
from tests.helpers.dispatch import SEGMENT, Node, decode
from tests.helpers.processes import ROOT

WAIT_S = 30  # a waiter left waiting fails the test after this, not a hang

WORKER = ROOT / "tests" / "helpers" / "dispatch_worker.py"


@pytest.fixture
def dispatch_node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def test_nothing_to_dispatch(dispatch_node):
    assert dispatch_node.dispatcher.dispatch_once() is None
    assert dispatch_node.dispatcher.lag == 0


def test_listener_runs_after_the_batch_commits(tmp_path):
    seen = []

    def listener(changes):
        # Notified queues can already be read: the write batch is committed.
        seen.append({q: (m, n.lq.max_offset(q)) for q, m in changes.items()})

    n = Node(tmp_path, listener)
    try:
        n.lq.activate("+/t", "s1", n.log.written_offset)
        n.append("a/t", "b/t", "a/t")
        assert n.dispatcher.lag == n.log.written_offset
        batch = n.dispatcher.dispatch_once()
        assert batch.records == 3 and batch.from_offset == 0 and batch.next_offset == n.log.written_offset
        assert seen == [{"a/t": (2, 2), "a/#": (2, 2), "+/t": (3, 3), "b/t": (1, 1), "b/#": (1, 1)}]
        assert n.dispatcher.lag == 0 and n.dispatcher.dispatch_once() is None
        stats = n.dispatcher.statistics()
        assert (stats.batches, stats.records, stats.lag) == (1, 3, 0)
    finally:
        n.close()


def test_small_steps_write_the_same_index_as_one_big_step(tmp_path):
    topics = [f"d/{i % 13}/m{i % 3}" for i in range(3000)]
    dumps = []
    for name, step in (("big", 1 << 30), ("small", 2000)):
        n = Node(tmp_path / name)
        try:
            n.lq.activate("d/+/m1", "s", 0)
            for i in range(0, len(topics), 100):
                n.append(*topics[i : i + 100])
            batches = 0
            while n.dispatcher.dispatch_once(step) is not None:
                batches += 1
            assert batches == 1 if name == "big" else batches > n.log.written_offset // 2000 - 1
            dumps.append(n.dump())
        finally:
            n.close()
    # store timestamps differ between the two logs; the keys and the offsets/sizes do not
    strip = [{k: v[:12] if k[:1] == b"E" else v for k, v in d.items()} for d in dumps]
    assert strip[0] == strip[1]


def test_restart_continues_from_the_checkpoint(tmp_path):
    n = Node(tmp_path)
    n.append("a", "b")
    n.dispatcher.dispatch_once()
    n.close()
    n = Node(tmp_path)
    try:
        assert n.dispatcher.dispatched_offset == n.log.written_offset
        assert n.dispatcher.dispatch_once() is None
        n.append("a")
        n.dispatcher.dispatch_once()
        r = n.lq.pull("a/#", 0, 10, 1 << 20, n.log, decode)
        assert [(o, m.topic) for o, m in r.messages] == [(0, "a"), (1, "a")]
    finally:
        n.close()


def test_retention_that_outruns_dispatch_skips_the_lost_records(tmp_path):
    """A dispatcher without control appliers (the store's has them, and retention then catches dispatch up before
    it deletes anything: tests/store/test_restate.py)."""
    n = Node(tmp_path, controls=False, retention_hours=0, retention_max_bytes=SEGMENT)
    try:
        for _ in range(12):
            n.append(*["t"] * 100, payload=b"x" * 500)
        assert n.log.delete_expired()
        assert n.lq.retained_offset == n.log.min_offset  # the listener was registered
        while n.dispatcher.dispatch_once() is not None:
            pass
        assert n.dispatcher.statistics().expired_skips == 1
        r = n.lq.pull("t", 0, 10_000, 1 << 30, n.log, decode)
        assert r.messages[0][1].offset == n.log.min_offset
        assert len(r.messages) == n.lq.max_offset("t") < 1200
    finally:
        n.close()


def test_index_ahead_of_the_log_is_rewound(tmp_path):
    n = Node(tmp_path)
    n.append("a", "a")
    n.dispatcher.dispatch_once()
    n.close()
    # Simulate an OS crash that lost CommitLog data the index had seen: a fresh, shorter log.
    shutil.rmtree(tmp_path / "commitlog")
    n = Node(tmp_path)
    try:
        assert n.lq.checkpoint == 0 and n.lq.max_offset("a") == 0
        n.append("a")
        n.dispatcher.dispatch_once()
        r = n.lq.pull("a", 0, 10, 1 << 20, n.log, decode)
        assert [(o, m.offset) for o, m in r.messages] == [(0, 0)]
    finally:
        n.close()


async def test_run_dispatches_on_wake_and_serves_waiters(dispatch_node):
    notified = []
    dispatch_node.dispatcher._listener = notified.append
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatch_node.dispatcher.run)
        for i in range(5):
            dispatch_node.append(f"k/{i}")
            dispatch_node.dispatcher.wake()
            with trio.fail_after(5):
                await dispatch_node.dispatcher.wait_dispatched(dispatch_node.log.written_offset)
            assert dispatch_node.lq.max_offset("k/#") == i + 1
        nursery.cancel_scope.cancel()
    assert sum(len(n) for n in notified) == 5 * 2  # each batch: the topic queue and k/#


@pytest.mark.parametrize("wait", ["wait_dispatched", "wait_lag"])
async def test_waiters_for_records_never_confirmed_are_released_when_run_stops(dispatch_node, wait):
    """A fenced replicated leader closes with a tail its followers never confirmed: dispatch stops below it. A task
    waiting for that tail (a session's end, which is shielded) must be told, else it holds the node open for ever;
    a waiter arriving after the stop is told at once."""
    dispatcher, log = dispatch_node.dispatcher, dispatch_node.log
    log.hold_confirm()  # a leader's log: its followers confirm it (here: never)
    dispatch_node.append("k/1", "k/2")
    waiting = partial(dispatcher.wait_dispatched, log.written_offset) if wait == "wait_dispatched" \
        else partial(dispatcher.wait_lag, 0)
    raised = []

    async def waiter() -> None:
        with pytest.raises(DispatchStopped):
            await waiting()
        raised.append(wait)

    with trio.move_on_after(WAIT_S):  # a waiter never told is cancelled here, and the test fails below
        async with trio.open_nursery() as nursery:
            run = trio.CancelScope()

            async def dispatching() -> None:
                with run:
                    await dispatcher.run()

            nursery.start_soon(dispatching)
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            run.cancel()
    assert raised == [wait]
    with pytest.raises(DispatchStopped):
        await waiting()


def prepare_log(data: Path) -> int:
    """A log whose records list filters activated, and released, at various points by control records (their
    writer's state applied as it appends, as ``StoreNode`` does); nothing dispatched, no index."""
    log = CommitLog.open(data / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT))
    db = open_db(data / "writer")
    lq = LightQueues(db)
    controls = QueueControls(lq)

    def control(made):
        raw, record = encode_control(made, 0, SEGMENT)
        record.offset = log.append(raw)
        controls.apply(record, made)

    control(Activated("dev/+/t1", "app", lq.filter_id("dev/+/t1")))
    control(Activated("dev/#", "app", 0))
    for i in range(60):
        if i == 15:
            control(Activated("+/+/t2", "app", lq.filter_id("+/+/t2")))
            control(Activated("dev/3/#", "tmp", lq.filter_id("dev/3/#")))
        if i == 30:
            control(Released("dev/3/#", "tmp"))
            control(Committed("app", {"dev/+/t1": 7, "dev/1/t1": 3}))
        if i == 40:
            control(Activated("#", "audit", lq.filter_id("#")))
        topics = [f"dev/{j % 50}/t{j % 7}" for j in range(i, i + 1000)]
        log.append_batch([encode_record(t, b"v" * 40, client_id="c", queues=lq.targets(t)) for t in topics])
    end = log.written_offset
    db.close()
    shutil.rmtree(data / "writer")
    log.close()
    return end


@pytest.mark.slow
def test_sigkill_during_dispatch_then_redispatch_gives_identical_entries(tmp_path):
    end = prepare_log(tmp_path / "killed")
    shutil.copytree(tmp_path / "killed", tmp_path / "reference")

    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "killed"), "100"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # this tree's code
    try:
        line = proc.stdout.readline()  # pytest's timeout guards a hung worker
        assert line.startswith("paused "), f"worker stopped early: {line!r}"
        _, dispatched, flushed = line.split()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert 0 < int(flushed) < int(dispatched) < end  # batches after the last flush were only in memory

    dumps = []
    for name in ("killed", "reference"):
        n = Node(tmp_path / name)
        try:
            if name == "killed":
                assert n.lq.checkpoint == int(flushed)  # the crash lost exactly the unflushed batches
            while n.dispatcher.dispatch_once() is not None:
                pass
            assert n.dispatcher.dispatched_offset == end
            assert sorted(n.lq.active_filters()) == ["#", "+/+/t2", "dev/+/t1"] and n.lq.holders("dev/3/#") == []
            assert n.lq.get_offsets("app") == {"dev/+/t1": 7, "dev/1/t1": 3}
            dumps.append(n.dump())
        finally:
            n.close()
    killed, reference = dumps
    assert killed.keys() == reference.keys()
    assert killed == reference
    assert sum(1 for k in reference if k[:1] == b"E") > 60_000 * 2


@pytest.mark.slow
async def test_idle_dispatcher_flushes_the_index_on_its_timer(tmp_path):
    n = Node(tmp_path)
    n.dispatcher = Dispatcher(n.log, n.lq, flush_bytes=1 << 40, flush_interval_s=1.5)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(n.dispatcher.run)
            n.append("a")
            n.dispatcher.wake()
            with trio.fail_after(5):
                await n.dispatcher.wait_dispatched(n.log.written_offset)
                assert n.dispatcher.statistics().flushed_offset == 0  # too soon for the timer
                while n.dispatcher.statistics().flushed_offset < n.log.written_offset:
                    await trio.sleep(0.05)  # polling a condition; the timer fires within ~2.5 s
            nursery.cancel_scope.cancel()
    finally:
        n.close()


def test_filters_change_while_a_thread_appends_and_dispatches(dispatch_node):
    """Activations, releases and pulls on one thread while another appends and dispatches."""
    dispatch_node.lq.activate("+/x", "steady", 0)
    errors = []

    def traffic():
        try:
            for i in range(300):
                dispatch_node.append(f"t{i % 7}/x", f"t{i % 7}/y")
                dispatch_node.dispatcher.dispatch_once()
        except Exception as exc:  # reported to the main thread, which fails the test
            errors.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    churn = 0
    while worker.is_alive():
        dispatch_node.lq.activate("t1/+", f"s{churn}", dispatch_node.log.written_offset)
        dispatch_node.lq.pull("t1/+", 0, 32, 1 << 20, dispatch_node.log, decode)
        assert dispatch_node.lq.release("t1/+", f"s{churn}")
        churn += 1
    worker.join()
    assert not errors and churn > 0
    r = dispatch_node.lq.pull("+/x", 0, 1000, 1 << 30, dispatch_node.log, decode)
    assert [m.topic for _, m in r.messages] == [f"t{i % 7}/x" for i in range(300)]
    assert dispatch_node.lq.max_offset("t1/+") == 0 and list(dispatch_node.lq.active_filters()) == ["+/x"]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_model(tmp_path, seed):
    """Appends, activations, releases and dispatches in random order; every queue equals the model's."""
    rng = random.Random(seed)
    topics = ["a", "a/b", "a/c", "b/b", "$s/b", "a/b/c", "/b"]
    filters = ["+/b", "a/+", "#", "a/#", "+/+/c", "a/b", "$s/#", "+"]
    n = Node(tmp_path)
    try:
        holders: dict[str, set] = {f: set() for f in filters}
        since: dict[str, int] = {}
        model: dict[str, list[int]] = {}
        pending: list[tuple[int, str, tuple[str, ...]]] = []
        for _ in range(300):
            op = rng.random()
            if op < 0.5:
                t = rng.choice(topics)
                (offset,) = n.append(t)
                section = tuple(f for f in since if matches(f, t))
                pending.append((offset, t, section))
            elif op < 0.7:
                f, h = rng.choice(filters), rng.choice("xyz")
                if is_wildcard(f) and not is_implicit(f) and f not in since:
                    since[f] = n.log.written_offset
                holders[f].add(h)
                n.lq.activate(f, h, n.log.written_offset)
            elif op < 0.85:
                f, h = rng.choice(filters), rng.choice("xyz")
                assert n.lq.release(f, h) == (h in holders[f])
                holders[f].discard(h)
                if not holders[f] and f in since:
                    del since[f]
                    model.pop(f, None)
            else:
                n.dispatcher.dispatch_once(rng.choice([200, 1 << 20]))
                done = [p for p in pending if p[0] < n.dispatcher.dispatched_offset]
                pending = pending[len(done):]
                for offset, t, section in done:
                    names = [t, first_level_queue(t)] + [f for f in section if f in since and since[f] <= offset]
                    for name in names:
                        model.setdefault(name, []).append(offset)
        while n.dispatcher.dispatch_once() is not None:
            pass
        for offset, t, section in pending:
            for name in [t, first_level_queue(t)] + [f for f in section if f in since and since[f] <= offset]:
                model.setdefault(name, []).append(offset)
        for name in set(model) | set(topics) | set(filters) | {first_level_queue(t) for t in topics}:
            r = n.lq.pull(name, 0, 10_000, 1 << 30, n.log, decode)
            assert [m.offset for _, m in r.messages] == model.get(name, []), name
        assert sorted(n.lq.active_filters()) == sorted(since)
    finally:
        n.close()


class RetainNode(Node):
    """A Node whose dispatcher also keeps retained messages (or not, with retain=False)."""

    def __init__(self, path, retain=True):
        from retain.store import RetainedStore

        self.path = path
        self.log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT))
        self.db = open_db(path / "index")
        self.lq = LightQueues(self.db)
        self.retained = RetainedStore(self.db) if retain else None
        self.dispatcher = Dispatcher(self.log, self.lq, retained=self.retained, activations=QueueControls(self.lq))

    def publish(self, topic, payload, retain=True):
        return self.log.append(encode_record(topic, payload, retain=retain, queues=self.lq.targets(topic)))

    def close(self):
        self.dispatcher.close()
        if self.retained is not None:
            self.retained.close()
        self.db.close()
        self.log.close()


def retained_payloads(store, filter="#"):
    return {r.topic: decode_record(r.record, 0, r.log_offset).payload for r in store.lookup(filter)}


def test_dispatch_keeps_the_latest_retained_message_per_topic(tmp_path):
    n = RetainNode(tmp_path)
    try:
        n.publish("status/d1", b"online")
        n.publish("status/d2", b"online")
        n.publish("status/d1", b"offline")
        n.publish("status/d2", b"")  # an empty retained payload deletes the topic's message
        n.publish("status/d3", b"not retained", retain=False)
        while n.dispatcher.dispatch_once():
            pass
        assert retained_payloads(n.retained) == {"status/d1": b"offline"}
        assert n.retained.checkpoint == n.log.written_offset
        assert n.lq.max_offset("status/d1") == 2  # indexing is unaffected
    finally:
        n.close()


def test_batches_without_retained_records_leave_the_retained_checkpoint_until_the_flush(tmp_path):
    """No RocksDB write of the retained family per plain batch: its checkpoint catches up when the index flushes,
    and a restart after that starts from the log's end."""
    n = RetainNode(tmp_path)
    n.publish("cfg/a", b"1")
    while n.dispatcher.dispatch_once():
        pass
    after_retained = n.retained.checkpoint
    assert after_retained == n.log.written_offset
    for i in range(5):
        n.publish(f"tele/{i}", b"x", retain=False)
    while n.dispatcher.dispatch_once():
        pass
    assert n.retained.checkpoint == after_retained < n.log.written_offset
    end = n.log.written_offset
    n.close()  # flushes: the checkpoint written with it
    n = RetainNode(tmp_path)
    try:
        assert n.retained.checkpoint == end
        assert n.dispatcher.dispatched_offset == end  # nothing to feed again
        assert retained_payloads(n.retained) == {"cfg/a": b"1"}
    finally:
        n.close()


def test_a_retained_family_behind_the_index_is_fed_again_without_reindexing(tmp_path):
    n = RetainNode(tmp_path, retain=False)  # the index advances; the retained family never sees the records
    n.publish("cfg/a", b"1")
    n.publish("cfg/b", b"2")
    while n.dispatcher.dispatch_once():
        pass
    index_before = {k: v for k, v in n.dump().items()}
    n.close()
    n = RetainNode(tmp_path)
    try:
        assert n.dispatcher.dispatched_offset == 0  # starts from the retained family's checkpoint
        while n.dispatcher.dispatch_once():
            pass
        assert retained_payloads(n.retained) == {"cfg/a": b"1", "cfg/b": b"2"}
        assert {k: v for k, v in n.dump().items()} == index_before  # no entry written twice
        assert n.lq.max_offset("cfg/a") == 1
    finally:
        n.close()


def test_recover_after_a_power_loss_leaves_no_position_past_the_shortened_log(tmp_path):
    """A power loss under the async policy after the index memtable was flushed: the index checkpoint, queue
    max offsets, retained messages, and the state of the control records past the cut (an activation, consumer
    offsets) were persisted past the log's end. The control records' state is derived again from the log, so
    nothing the lost records made survives; records appended after recovery reuse the lost offsets, none skipped."""
    n = RetainNode(tmp_path)
    n.control(Activated("a/+", "s1", 1))
    n.dispatcher.dispatch_once()  # applied: the messages appended from now on list the filter
    for i in range(5):
        n.publish("a/x", b"kept%d" % i)
    n.control(Committed("s1", {"a/+": 2}))
    while n.dispatcher.dispatch_once():
        pass
    cut = n.log.written_offset
    for i in range(5):
        n.publish("a/x", b"lost%d" % i)
    n.control(Activated("b/+", "s2", 2))
    n.publish("b/y", b"lost")
    n.control(Committed("s1", {"a/+": 10, "a/x": 10}), Committed("s2", {"b/+": 1}))
    while n.dispatcher.dispatch_once():
        pass
    assert n.lq.get_offsets("s1") == {"a/+": 10, "a/x": 10} and n.lq.holders("b/+") == ["s2"]
    n.close()  # the index is flushed: its checkpoints, max offsets, holders and offsets are past what the log keeps
    segment = tmp_path / "commitlog" / "00000000000000000000"
    with open(segment, "r+b") as f:  # the page cache that never reached the disk: zeros from the cut on
        size = f.seek(0, 2)
        f.truncate(cut)
        f.truncate(size)

    n = RetainNode(tmp_path)
    try:
        found = n.dispatcher.recover()
        assert found["log_end"] == cut and found["checkpoint_from"] > cut and found["retained_dropped"] == 2
        assert n.lq.get_offsets("s1") == {"a/+": 2} and n.lq.get_offsets("s2") == {}
        assert n.lq.holders("a/+") == ["s1"] and n.lq.holders("b/+") == [] and list(n.lq.active_filters()) == ["a/+"]
        assert n.lq.max_offset("a/+") == n.lq.max_offset("a/x") == 5
        assert retained_payloads(n.retained) == {}  # lost updates go; the ones they replaced stay replaced (docs)
        n.publish("a/x", b"new")
        n.publish("b/y", b"new")
        while n.dispatcher.dispatch_once():
            pass
        pulled = n.lq.pull("a/+", 5, 100, 1 << 20, n.log, decode)
        assert [m.payload for _, m in pulled.messages] == [b"new"]
        assert n.dispatcher.recover() == {}  # nothing is past the end any more
    finally:
        n.close()
