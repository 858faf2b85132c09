"""What a replica shows its operator (store/replica/figures.py, ``Replication.statistics``): a follower's truncation
and its lag behind the leader's end as the leader's answers say it, and the leader's per-follower view in its
``StoreStatistics``. Real CommitLogs, RocksDB and sockets; the controller is the in-memory one of
test_replication.py."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import trio

from store.log.commitlog import CommitLog
from store.log.record import new_record
from store.node import open_follower
from store.replica.figures import RoleFigures
from store.replica.follower import follow
from tests.helpers.replication import CONFIG, leader, messages, start_epoch, until


def publish(data: Path, topic: str, n: int) -> None:
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        log.append_batch([new_record(topic, bytes([i]) * 300, 1_000, "pub", 1, True)[0] for i in range(n)])


async def test_a_follower_counts_its_truncation_and_its_lag_and_the_leader_shows_it(tmp_path):
    """b has epoch-1 records its old leader never replicated: following a's epoch 2 cuts them (one truncation),
    then b's lag behind a's end, as a's answers say it, goes to 0; a's statistics show b in sync, holding it all."""
    start_epoch(tmp_path / "a", 1)
    publish(tmp_path / "a", "t/common", 20)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    publish(tmp_path / "b", "t/lost", 30)
    figures = RoleFigures("g", "b")
    async with leader(tmp_path / "a", acks="quorum", epoch=2) as node, \
            open_follower(tmp_path / "b", CONFIG) as (alog, dispatcher), trio.open_nursery() as nursery:
        figures.log = alog.log
        figures.saw_leader("a", 2)
        assert figures.statistics().lag_bytes == 0 and figures.leader_end == -1  # no answer yet: no lag known
        await nursery.start(partial(follow, alog, dispatcher, ("127.0.0.1", node.port), name="b", epoch=2,
                                    figures=figures))
        await node.append(messages(40))  # acknowledged under quorum once b holds it
        end = node.log.log.written_offset
        await until(lambda: figures.leader_end == end == alog.log.written_offset, "b caught up with a's end")
        stats = figures.statistics()
        assert (stats.role, stats.group, stats.name, stats.epoch) == ("follower", "g", "b", 2)
        assert (stats.truncations, stats.elections, stats.leader_changes, stats.lag_bytes) == (1, 0, 0, 0)
        assert stats.written_offset == end
        view = node.statistics().replication  # what a gateway's /metrics and dashboard get over the RPC
        assert view is not None and (view.role, view.epoch, view.isr, view.written_offset) == ("leader", 2,
                                                                                               ["a", "b"], end)
        b = {f.name: f for f in view.followers}["b"]
        assert (b.held, b.lag_bytes, b.in_isr) == (end, 0, True)
        c = {f.name: f for f in view.followers}["c"]
        assert (c.held, c.lag_bytes, c.in_isr, c.since_fetch_s) == (0, end, False, None)  # never fetched
        nursery.cancel_scope.cancel()  # b stops following before its log closes


def test_a_leader_change_is_counted_from_the_second_leader_seen():
    figures = RoleFigures("g", "b")
    figures.saw_leader("a", 1)
    figures.saw_leader("a", 1)  # the same leader, seen again after a reconnection
    assert figures.leader_changes == 0 and figures.statistics() is None  # no log opened yet: nothing to show
    figures.saw_leader("c", 2)
    figures.saw_leader("b", 3)
    assert (figures.leader_changes, figures.epoch) == (2, 3)
