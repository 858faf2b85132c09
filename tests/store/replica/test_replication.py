"""The replication data path (store/replica/): a leader StoreNode served by serve_rpc, followers over real sockets,
real CommitLogs and RocksDB; the controller (etcd, outside this part) is an in-memory one."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from store.api import NewMessage, LeaderFenced
from lightqueue.queues import LightQueues
from store.control import Activated, ActivatedRun, decode_control
from store.dump import dump
from store.log.commitlog import CommitLog
from store.log.record import FLAG_ZSTD, decode_record, new_record, now_ms
from store.node import open_follower, open_store
from store.repair import repair
from store.replica.follower import LeaderChanged, follow
from store.replica.leader import Replication
from store.rpc import wire as rpc
from store.rpc.access import StoreAccess
from store.rocks import open_db
from store.rpc.server import serve_rpc
from tests.helpers.processes import LightgateProcess
from tests.helpers.replication import (CONFIG, REPLICAS, SEGMENT, WAIT_S, Controller, Follower, leader, log_bytes,
                                       messages, start_epoch, until)

@pytest.mark.parametrize("flush", ["async", "sync"])
async def test_followers_copy_the_log_byte_for_byte_and_derive_the_same_state(tmp_path, nursery, flush):
    """Under the sync flush policy a follower holds what it fsynced: acks=all then means on three disks."""
    config = dataclasses.replace(CONFIG, flush=flush)
    followers = [Follower(tmp_path / name, name, config) for name in ("b", "c")]
    async with leader(tmp_path / "a", acks="all", config=config) as node:
        for f in followers:
            await nursery.start(f.run, node.port)
        offsets = await node.append(messages(50))
        if flush == "sync":
            assert all(f.log.flushed_offset > offsets[-1] for f in followers)
        end = await node.activate("t/#", "holder")
        await node.commit_offsets({"holder": {"t/1": 3}})
        run = ["t/+", "x/+/y", "t/1", "x/+/y"]
        await node.activate_all(run, "runner")  # one ActivatedRun record (issue 31)
        await node.append_control([Activated("old/+", "runner", 90), Activated("t/+", "old", 91)])  # a log before
        await node.append(messages(2000, 50))  # rolls segments
        await node.append([NewMessage("t/later", b"%d" % i, "pub", 1, deliver_at_ms=now_ms() + 3_600_000 + i)
                           for i in range(30)])  # pending in every copy's timer, which the dump covers
        written = node.log.log.written_offset
        await until(lambda: all(f.written == written and f.log.confirm_offset == written for f in followers),
                    "both followers hold and confirm the whole log")
        await until(lambda: all(f.dispatcher.dispatched_offset == written for f in followers)
                    and node.dispatcher.dispatched_offset == written, "every dispatch is done")
        assert end > 0 and node.replication.figures()["isr_size"] == 3
        for f in followers:
            await f.stop()
        log = node.log.log
        activations = [c for c in (decode_control(r) for r in log.scan(0, 1 << 30).records if r.control)
                       if isinstance(c, (Activated, ActivatedRun))]
        assert activations[1:] == [ActivatedRun("runner", run, [1, 2, 0, 2]), Activated("old/+", "runner", 90),
                                   Activated("t/+", "old", 91)]
    leader_log = log_bytes(tmp_path / "a")
    assert len(leader_log) > 1  # the copies rolled and sealed segments where the leader's did
    for name in ("b", "c"):
        assert log_bytes(tmp_path / name) == leader_log
        assert dump(tmp_path / name / "index") == dump(tmp_path / "a" / "index")
    assert dump(tmp_path / "a" / "index")["timer"]["pending"] == 30


class Pending:
    """An append running in its own task: ``acked`` once it returned, ``error`` if it raised."""

    def __init__(self, node, nursery, batch) -> None:
        self.acked = trio.Event()
        self.error: BaseException | None = None
        self.offsets: list[int] = []
        nursery.start_soon(self._run, node, batch)

    async def _run(self, node, batch) -> None:
        try:
            self.offsets = await node.append(batch)
        except OSError as exc:
            self.error = exc
        self.acked.set()


async def written_and_settled(node, end: int) -> None:
    """The leader wrote up to ``end`` and every task is waiting: an append the gate did not hold has returned."""
    await until(lambda: node.log.log.written_offset >= end, "the leader wrote the append")
    await trio.testing.wait_all_tasks_blocked()


@pytest.mark.parametrize("acks, followers_needed", [("leader", 0), ("quorum", 1), ("all", 2)])
async def test_an_append_is_acknowledged_once_the_acks_mode_holds_it(tmp_path, nursery, acks, followers_needed):
    async with leader(tmp_path / "a", acks=acks) as node:
        before = node.log.log.written_offset
        pending = Pending(node, nursery, messages(3))
        await written_and_settled(node, before + 1)
        for started, name in enumerate(("b", "c")):
            assert pending.acked.is_set() == (started >= followers_needed), f"acks={acks}, {started} followers"
            follower = Follower(tmp_path / name, name)
            await nursery.start(follower.run, node.port)
            if started + 1 >= followers_needed:
                with trio.fail_after(WAIT_S):
                    await pending.acked.wait()
        assert pending.error is None
        if acks == "quorum":  # the first follower joined the ISR locally at once, and the controller was told
            await until(lambda: ["a", "b"] in node.controller.writes, "the controller recorded the grown ISR")


async def test_a_quorum_needs_a_majority_in_sync(tmp_path, nursery):
    """3 replicas: the leader alone is no majority, however durable its own write."""
    async with leader(tmp_path / "a", acks="quorum") as node:
        pending = Pending(node, nursery, messages(1))
        await written_and_settled(node, 1)
        assert node.dispatcher.dispatched_offset == node.log.log.written_offset  # its ISR of one confirms it...
        assert not pending.acked.is_set()  # ...but does not acknowledge it
        with pytest.raises(trio.WouldBlock):
            node.append_nowait(messages(1))


MAX_LAG_S = 1.0
"""The leader's ``max_lag_s`` where a test pauses a follower: the other one, fetching, must never lag this long
(one fetch round trip; at 0.3 s a loaded machine came close)."""


async def all_in_sync(node, controller: Controller, followers) -> None:
    """Wait until every follower holds the leader's whole log and the ISR, as the controller last recorded it, is
    every replica: a follower that started slower than ``max_lag_s`` left the ISR at once (the controller recorded
    that) and joins again only once it caught up, so a test that pauses it must wait for that first."""
    await until(lambda: all(f.written == node.log.log.written_offset for f in followers)
                and node.replication.figures()["isr"] == REPLICAS and controller.writes[-1:] in ([], [REPLICAS]),
                "every follower caught up and in the ISR the controller recorded")


async def test_the_confirm_offset_waits_for_a_paused_follower_until_the_controller_removed_it(tmp_path, nursery):
    controller = Controller()
    b, c = Follower(tmp_path / "b", "b"), Follower(tmp_path / "c", "c")
    async with leader(tmp_path / "a", isr=REPLICAS, max_lag_s=MAX_LAG_S, controller=controller) as node:
        for f in (b, c):
            await nursery.start(f.run, node.port)
        await node.append(messages(10))
        await all_in_sync(node, controller, (b, c))
        shrinks = node.replication.figures()["shrinks"]
        controller.gate = trio.Event()  # the controller answers the shrink only when the test says
        await c.stop()  # paused: it fetches no more
        pending = Pending(node, nursery, messages(10, 10))
        await until(lambda: controller.writes[-1:] == [["a", "b"]], "the leader asked the controller to shrink")
        await until(lambda: b.written == node.log.log.written_offset, "b holds the new records")
        await trio.testing.wait_all_tasks_blocked()
        # what the leader last heard c holds: read now, since c's last fetch may be taken after its stop returned
        held_by_c = node.replication.figures()["followers"]["c"]["held"]
        assert node.log.log.confirm_offset == held_by_c < node.log.log.written_offset
        assert node.dispatcher.dispatched_offset == held_by_c  # nothing past what c holds is dispatched
        assert not pending.acked.is_set()
        controller.gate.set()
        with trio.fail_after(WAIT_S):
            await pending.acked.wait()
        assert pending.error is None and node.log.log.confirm_offset == node.log.log.written_offset
        figures = node.replication.figures()
        assert figures["isr"] == ["a", "b"] and figures["shrinks"] == shrinks + 1 and not figures["followers"]["c"]["in_isr"]


async def test_a_leader_whose_lease_ended_acknowledges_nothing(tmp_path, nursery):
    async with leader(tmp_path / "a", acks="quorum") as node:
        pending = Pending(node, nursery, messages(1))
        await written_and_settled(node, 1)
        node.controller.lease = False
        with trio.fail_after(WAIT_S):
            await pending.acked.wait()
        assert isinstance(pending.error, LeaderFenced)
        await nursery.start(Follower(tmp_path / "b", "b").run, node.port)  # a majority now, too late
        with pytest.raises(LeaderFenced):
            await node.append(messages(1))
        with pytest.raises(LeaderFenced):
            await node.commit_offsets({"holder": {"t/1": 1}})  # control records (session saves...) alike
        with pytest.raises(trio.WouldBlock):
            node.append_nowait(messages(1))


async def test_a_leader_the_controller_refuses_an_isr_change_acknowledges_nothing(tmp_path, nursery):
    controller = Controller()
    b, c = Follower(tmp_path / "b", "b"), Follower(tmp_path / "c", "c")
    async with leader(tmp_path / "a", acks="quorum", isr=REPLICAS, max_lag_s=MAX_LAG_S,
                      controller=controller) as node:
        for f in (b, c):
            await nursery.start(f.run, node.port)
        await node.append(messages(5))
        await all_in_sync(node, controller, (b, c))
        controller.accept = False  # a newer leader's epoch is the group's now
        await c.stop()
        pending = Pending(node, nursery, messages(5))  # waits for c, in the ISR until the shrink is recorded
        with trio.fail_after(WAIT_S):
            await pending.acked.wait()
        assert isinstance(pending.error, LeaderFenced) and controller.writes[-1] == ["a", "b"]
        assert node.replication.figures()["isr"] == ["a", "b", "c"]  # not shrunk: the controller did not record it
        with pytest.raises(LeaderFenced):
            await node.append(messages(1))
        with pytest.raises(trio.WouldBlock):
            node.append_nowait(messages(1))


async def test_an_unreachable_controller_keeps_the_isr_and_is_asked_again(tmp_path, nursery):
    class Unreachable(Controller):
        async def set_isr(self, epoch: int, members: list[str]) -> bool:
            self.writes.append(members)
            if len(self.writes) < 3:
                raise ConnectionError("etcd is away")
            return True

    controller = Unreachable()
    async with leader(tmp_path / "a", acks="quorum", max_lag_s=0.4, controller=controller) as node:
        pending = Pending(node, nursery, messages(1))
        await nursery.start(Follower(tmp_path / "b", "b").run, node.port)
        with trio.fail_after(WAIT_S):
            await pending.acked.wait()  # b counts at once; the controller is told when it can be
        await until(lambda: len(controller.writes) == 3, "the grown ISR was recorded at the third try")
        assert pending.error is None and not node.replication.fenced
        assert controller.writes == [["a", "b"]] * 3


async def test_a_fetch_of_a_later_epoch_fences_the_leader(tmp_path, nursery):
    async with leader(tmp_path / "a", acks="quorum") as node:
        pending = Pending(node, nursery, messages(1))
        stale = Follower(tmp_path / "b", "b")
        await nursery.start(stale.run, node.port, 2)  # it follows epoch 2: this leader of epoch 1 is an old one
        with trio.fail_after(WAIT_S):
            await pending.acked.wait()
            await stale.done.wait()
        assert isinstance(pending.error, LeaderFenced) and node.replication.fenced
        assert isinstance(stale.error, LeaderChanged)


async def test_frames_of_a_lower_epoch_are_refused(tmp_path, nursery):
    """A store still answering for epoch 1 (an old leader) sends real frames to a follower of epoch 2: nothing is
    appended, and the follower says its leader changed."""
    start_epoch(tmp_path / "old", 1)
    with CommitLog.open(tmp_path / "old" / "commitlog", CONFIG) as old:
        old.append_batch([new_record("t/1", b"x" * 100, 1_000, "pub", 1, False)[0] for _ in range(5)])
        frames = old.read_frames(0, 1 << 20)

    async def old_leader(stream: trio.SocketStream) -> None:
        decoder = rpc.FrameDecoder(rpc.CLIENT_MESSAGES)
        async for data in stream:
            decoder.receive_data(data)
            while (message := decoder.next_message()) is not rpc.NEED_DATA:
                if type(message) is rpc.Hello:
                    answer = rpc.Welcome(rpc.PROTOCOL_VERSION, message.node, 1.0, 5.0, "old", 1)
                else:
                    answer = rpc.Frames(message.id, 1, frames, len(frames), [(1, 0)])
                await stream.send_all(rpc.encode(answer))

    listeners = await nursery.start(partial(trio.serve_tcp, old_leader, 0, host="127.0.0.1"))
    async with open_follower(tmp_path / "b", CONFIG) as (alog, dispatcher):
        with pytest.raises(LeaderChanged, match="leads epoch 1, not 2; its frames are refused"):
            await follow(alog, dispatcher, ("127.0.0.1", listeners[0].socket.getsockname()[1]), name="b", epoch=2)
        assert alog.log.written_offset == 0 and alog.log.epochs.entries == []


async def test_a_follower_with_records_the_leader_lacks_is_cut_where_its_epoch_ends(tmp_path, nursery):
    """b was in epoch 1 with records its leader never replicated (it crashed); a leads epoch 2 from where their
    logs agree. b's extra records, and what its dispatch derived from them, go; its log ends as a's."""
    def publish(data: Path, topic: str, n: int) -> None:
        with CommitLog.open(data / "commitlog", CONFIG) as log:
            log.append_batch([new_record(topic, bytes([i]) * 300, 1_000, "pub", 1, True)[0]
                              for i in range(n)])

    start_epoch(tmp_path / "a", 1)
    publish(tmp_path / "a", "t/common", 20)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    publish(tmp_path / "b", "t/lost", 30)  # epoch 1's records a never had
    b = Follower(tmp_path / "b", "b")
    async with leader(tmp_path / "a", acks="quorum", epoch=2) as node:
        cut = node.log.log.written_offset
        await nursery.start(b.run, node.port, 2)
        await node.append(messages(40))  # acknowledged: b joined the ISR after its cut
        assert b.log.epochs.entries == [(1, 0), (2, cut)]
        await until(lambda: b.dispatcher.dispatched_offset == node.log.log.written_offset ==
                    node.dispatcher.dispatched_offset, "b dispatched a's log")
        await b.stop()
    assert log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a")
    derived = dump(tmp_path / "b" / "index")
    assert derived == dump(tmp_path / "a" / "index") and "t/lost" not in str(derived)  # topic ids included


async def hello(port: int, node: str, token: str = ""):
    """Open a connection with a Hello of ``node``: the stream and the store's first answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(rpc.encode(rpc.Hello(rpc.PROTOCOL_VERSION, node, token)))
    return stream, await answer(stream)


async def answer(stream, decoder=None):
    decoder = decoder or rpc.FrameDecoder(rpc.SERVER_MESSAGES)
    with trio.fail_after(WAIT_S):
        while (message := decoder.next_message()) is rpc.NEED_DATA:
            decoder.receive_data(await stream.receive_some(1 << 16))
    return message


@asynccontextmanager
async def served(node, access):
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(serve_rpc, node, "127.0.0.1", 0, access=access))
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def test_a_replica_connection_presents_the_token_and_takes_no_gateway_lease(tmp_path):
    async with leader(tmp_path / "a") as node, served(node, StoreAccess(token="secret")) as port:
        _, refused = await hello(port, "$replica/b", "wrong")
        assert refused == rpc.Error(0, rpc.ErrorKind.DENIED, "not authorized")
        _, refused = await hello(port, "$replica/b")  # no token: a password does not make a replica
        assert refused == rpc.Error(0, rpc.ErrorKind.DENIED, "not authorized")
        stream, welcome = await hello(port, "$replica/b", "secret")
        assert type(welcome) is rpc.Welcome and welcome.epoch == 1
        await stream.send_all(rpc.encode(rpc.Fetch(1, 1, 1, 0, 0, 1 << 20)))
        frames = await answer(stream)
        assert type(frames) is rpc.Frames and frames.epoch == 1 and frames.truncate_to == -1
        assert node.leases.statistics().nodes == 0 and not node.attached  # no lease, no gateway node
        assert node.replication.figures()["followers"]["b"]["since_fetch_s"] is not None  # its fetch counted


async def test_a_gateway_connection_may_not_fetch_and_a_store_that_does_not_lead_says_so(tmp_path):
    async with leader(tmp_path / "a") as node, served(node, StoreAccess(token="secret")) as port:
        stream, welcome = await hello(port, "gw-1", "secret")
        decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        await stream.send_all(rpc.encode(rpc.Fetch(7, 1, 1, 0, 0, 1 << 20)))
        while type(refused := await answer(stream, decoder)) is rpc.Heartbeat:
            pass
        assert refused == rpc.Error(7, rpc.ErrorKind.DENIED, "Fetch is for replicas only")
    async with open_store(tmp_path / "plain", CONFIG) as node, served(node, None) as port:
        _, refused = await hello(port, "$replica/b")
        assert refused == rpc.Error(0, rpc.ErrorKind.NOT_LEADER, "")


@pytest.mark.slow
async def test_a_follower_killed_mid_stream_catches_up_after_its_restart(tmp_path, nursery):
    c = Follower(tmp_path / "c", "c")
    stop, stopped = trio.Event(), trio.Event()
    acked: list[int] = []

    async def writer(node) -> None:
        i = 0
        while not stop.is_set():
            acked.extend(await node.append(messages(20, i)))
            i += 20
        stopped.set()

    def start_b(port: int) -> LightgateProcess:
        process = LightgateProcess(str(tmp_path / "b"), str(port), "b", "1", str(SEGMENT), json_logs=False,
                                   command=[sys.executable, "-m", "tests.helpers.replica_follower"])
        process.wait_log(lambda doc: doc["msg"] == "following")
        return process

    async with leader(tmp_path / "a", isr=REPLICAS, max_lag_s=0.5) as node:
        await nursery.start(c.run, node.port)
        nursery.start_soon(writer, node)
        b = await trio.to_thread.run_sync(start_b, node.port)

        def held() -> int:
            return node.replication.figures()["followers"]["b"]["held"]

        await until(lambda: held() > 2 * SEGMENT, "b copied two segments")
        b.kill()  # mid-stream: the writer goes on, acknowledged by a and c once b left the ISR
        killed_at = held()
        await until(lambda: "b" not in node.replication.figures()["isr"], "b left the ISR")
        b = await trio.to_thread.run_sync(start_b, node.port)
        await until(lambda: held() > killed_at + SEGMENT and "b" in node.replication.figures()["isr"],
                    "b caught up and is in sync again")
        stop.set()
        await stopped.wait()
        await until(lambda: held() == node.log.log.written_offset, "b holds the whole log")
        b.kill()
        await c.stop()
    assert acked and log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a") == log_bytes(tmp_path / "c")


async def test_a_follower_reopens_as_the_leader_of_the_next_epoch(tmp_path, nursery):
    """The role loop's promotion: the follower's directory opens in leader mode, with everything it copied."""
    b = Follower(tmp_path / "b", "b")
    async with leader(tmp_path / "a", acks="quorum") as node:
        await nursery.start(b.run, node.port)
        offsets = await node.append(messages(30))
        await node.activate("t/#", "holder")
        end = node.log.log.written_offset
        await until(lambda: b.dispatcher.dispatched_offset == end, "b dispatched everything")
        await b.stop()
    async with leader(tmp_path / "b", acks="leader", epoch=2) as promoted:
        assert promoted.log.log.epochs.entries == [(1, 0), (2, end)]
        more = await promoted.append(messages(5, 30))
        assert more[0] == end and offsets[-1] < end
        await promoted.dispatcher.wait_dispatched(promoted.log.log.written_offset)
        assert promoted.queues.max_offset("t/1") == 7  # the 6 it copied and the one it appended
        assert await trio.to_thread.run_sync(promoted.queues.holders, "t/#") == ["holder"]


@pytest.mark.parametrize("compression", ["off", "zstd"])
async def test_a_follower_copies_batch_records_and_serves_their_messages_once_promoted(tmp_path, nursery, compression):
    """A batch record (docs/storage.md, "Batch records") is a frame like any other: the follower copies it byte
    for byte, derives the same index (one entry per batch), and promoted, serves its messages one by one. A
    compressed body (``FLAG_ZSTD``) is copied as stored and inflated by each reader."""
    config = dataclasses.replace(CONFIG, batch_compression=compression)
    b = Follower(tmp_path / "b", "b", config)
    async with leader(tmp_path / "a", acks="quorum", config=config) as node:
        await nursery.start(b.run, node.port)
        batch = [NewMessage("t/b", b"%d" % i, f"pub{i % 3}", qos=1, retain=i == 4) for i in range(25)]
        positions = await node.append(batch, batch=True)
        assert bool(node.log.log.read(positions[0]).flags & FLAG_ZSTD) == (compression == "zstd")
        await node.append(messages(3))
        end = node.log.log.written_offset
        await until(lambda: b.dispatcher.dispatched_offset == end and node.dispatcher.dispatched_offset == end,
                    "both dispatched everything")
        await b.stop()
    assert log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a")
    assert dump(tmp_path / "b" / "index") == dump(tmp_path / "a" / "index")
    async with leader(tmp_path / "b", acks="leader", epoch=2, config=config) as promoted:
        result = promoted.read("t/b", 10, 100)
        assert [(qoff, r.offset, r.payload, r.client_id) for qoff, r in result.messages] == [
            (q, positions[q], b"%d" % q, f"pub{q % 3}") for q in range(10, 25)]
        assert [r.log_offset for r in promoted.retained.lookup("t/b")] == [positions[4]]


async def test_a_follower_is_cut_where_an_epoch_its_leader_never_had_starts(tmp_path, nursery):
    """b led epoch 2 for a moment and wrote records nobody copied; a, which had more of epoch 1, leads epoch 3.
    b's log ends before a's epoch 1 does, so a's answer alone (the end of epoch 2 is the end of epoch 1 in its
    log) would let it fetch from inside a record: b cuts where its epoch 2 began."""
    def publish(data: Path, topic: str, n: int) -> None:
        with CommitLog.open(data / "commitlog", CONFIG) as log:
            log.append_batch([new_record(topic, bytes([i]) * 300, 1_000, "pub", 1, True)[0] for i in range(n)])

    start_epoch(tmp_path / "a", 1)
    publish(tmp_path / "a", "t/common", 10)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    publish(tmp_path / "a", "t/more", 30)
    start_epoch(tmp_path / "b", 2)
    publish(tmp_path / "b", "t/lost", 5)
    b = Follower(tmp_path / "b", "b")
    async with leader(tmp_path / "a", acks="quorum", epoch=3) as node:
        await nursery.start(b.run, node.port, 3)
        await node.append(messages(10))
        assert b.log.epochs.entries == node.log.log.epochs.entries
        await until(lambda: b.dispatcher.dispatched_offset == node.log.log.written_offset ==
                    node.dispatcher.dispatched_offset, "b dispatched a's log")
        await b.stop()
    assert log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a")


async def test_a_promoted_follower_serves_its_unconfirmed_tail_only_once_the_isr_holds_it(tmp_path, nursery):
    """A follower copied records its leader had not confirmed (in no other replica yet), then was elected: until a
    follower of the new epoch holds them, its dispatch does not index them, so no subscriber sees a message the next
    leader could lack (if this one died too) and no publisher's resend of it could be delivered twice."""
    async with leader(tmp_path / "old", acks="leader") as old:
        follower = Follower(tmp_path / "b", "b")
        await nursery.start(follower.run, old.port)
        await old.append(messages(10))
        await until(lambda: follower.written == old.log.log.written_offset, "the copy")
        confirmed = follower.log.confirm_offset
        await follower.stop()
    tail = messages(5, start=10)
    with CommitLog.open(tmp_path / "b" / "commitlog", CONFIG) as log:  # records its leader never confirmed
        end = log.written_offset
        log.append_batch([new_record(m.topic, m.payload, 1_000, m.client_id, 1, False)[0] for m in tail])
        log.flush()
    start_epoch(tmp_path / "b", 2)
    replication = Replication(name="b", epoch=2, replicas=REPLICAS, isr=["b", "c"], acks="quorum",
                              max_lag_s=60.0, controller=Controller(), confirmed=confirmed)
    async with open_store(tmp_path / "b", CONFIG, replication=replication) as node:
        assert node.log.log.confirm_offset == confirmed <= end
        assert node.dispatcher.dispatched_offset <= end  # the tail waits for the ISR
        listeners = await nursery.start(partial(serve_rpc, node, "127.0.0.1", 0))
        c = Follower(tmp_path / "c", "c")
        await nursery.start(c.run, listeners[0].socket.getsockname()[1], 2)
        await until(lambda: node.dispatcher.dispatched_offset > end, "the tail indexed once c holds it")
        assert c.written > end
        await c.stop()
RETAINED = dataclasses.replace(CONFIG, retention_hours=0, retention_max_bytes=3 * SEGMENT)
"""Retention by bytes: about three segments kept (run by the test, ``delete_expired``, not by a timer)."""


async def retention(node) -> list[int]:
    """The leader's retention run (its restatement waits, in the worker thread, for the followers to confirm)."""
    return await trio.to_thread.run_sync(node.log.log.delete_expired)


async def test_a_follower_deletes_the_segments_its_leader_deleted(tmp_path, nursery):
    """No retention of its own (it would append a restatement): the leader's ``min_offset`` travels with its
    ``Frames`` and the follower deletes its sealed segments below it, so both hold the same segment files."""
    b = Follower(tmp_path / "b", "b", RETAINED)
    async with leader(tmp_path / "a", acks="quorum", isr=("a", "b"), config=RETAINED) as node:
        await nursery.start(b.run, node.port)
        await node.activate("t/#", "holder")
        await node.append(messages(3000, size=1000))  # about a dozen segments
        assert await retention(node)
        await node.append(messages(10, 3000))  # restated, and more after it: both copied
        first = node.log.log.min_offset
        assert first > 0
        await until(lambda: b.log.min_offset == first and b.written == node.log.log.written_offset,
                    "b deleted what a deleted and copied the rest")
        await b.stop()
    assert sorted(log_bytes(tmp_path / "b")) == sorted(log_bytes(tmp_path / "a"))  # the same names
    assert log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a")  # and bytes


def pull_at(data: Path, queue: str, offset: int) -> list[tuple[int, object]]:
    """Two messages of ``queue`` from queue ``offset``, pulled from a stopped node's index and log."""
    db = open_db(data / "index")
    try:
        with CommitLog.open(data / "commitlog", RETAINED) as log:
            found = LightQueues(db).pull(queue, offset, 2, 1 << 20, log, lambda raw, at: decode_record(raw, 0, at))
            return [(qoff, record) for qoff, record in found.messages]
    finally:
        db.close()


async def test_a_new_replica_joins_after_retention_cut_the_leaders_log_and_numbers_its_queues_the_same(tmp_path,
                                                                                                       nursery):
    """An empty replica starts its log at the leader's ``min_offset`` (a fetch at 0 would have expired) and its
    dispatch takes the queues' numbering from the restatement at the cut (``QueueBases``): the same queue offsets
    and topic ids as the leader's for the same records, though it never saw the records retention deleted."""
    async with leader(tmp_path / "a", acks="leader", config=RETAINED) as node:
        await node.activate_all(["t/1", "t/2"], "owner")  # in a segment retention deletes: restated, one record
        await node.append(messages(3000, size=1000))
        await node.commit_offsets({"owner": {"t/1": 5}})
        assert await retention(node)
        log = node.log.log
        restated = [c for c in (decode_control(r) for r in log.scan(log.min_offset, 1 << 30).records if r.control)
                    if isinstance(c, ActivatedRun)]
        assert restated == [ActivatedRun("owner", ["t/1", "t/2"], [0, 0])]
        await node.append(messages(20, 3000) + [NewMessage("t/new", b"late", "pub", qos=1)])
        first = node.log.log.min_offset
        b = Follower(tmp_path / "b", "b", RETAINED)
        await nursery.start(b.run, node.port)
        end = node.log.log.written_offset
        await until(lambda: b.written == end and b.dispatcher.dispatched_offset == end
                    and node.dispatcher.dispatched_offset == end, "b copied and dispatched a's log")
        assert b.log.min_offset == first > 0
        await b.stop()
    assert log_bytes(tmp_path / "b") == log_bytes(tmp_path / "a")
    a_state, b_state = dump(tmp_path / "a" / "index"), dump(tmp_path / "b" / "index")
    queue = a_state["queues"]["t/1"]
    assert queue["min"] > 0  # retention took the queue's first entries: the numbering does not start at 0
    assert b_state == a_state  # queue ids, min and max offsets, every entry (queue offset -> record)
    pulled = [pull_at(tmp_path / name, "t/1", queue["min"] + 3) for name in ("a", "b")]
    assert pulled[0] == pulled[1] and pulled[0][0][1].topic == "t/1"  # the same queue offset: the same record
    repair(tmp_path / "b", RETAINED)  # the index deleted and derived again from the cut log: the same numbering
    assert dump(tmp_path / "b" / "index") == a_state
