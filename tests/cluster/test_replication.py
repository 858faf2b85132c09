"""A replicated store group of real processes: etcd, three `lightgate store` replicas, gateways, MQTT clients.

Faults are real signals (SIGKILL, SIGSTOP) and a real full disk (a small tmpfs); the group's state is read from etcd
itself (tests/helpers/replicas.py). What must hold: one leader at a time, gateways follow it, nothing acknowledged is
lost, a fenced leader rejoins as a follower with its log cut to the new leader's, followers hold the leader's log
byte for byte. The leader kills under QoS 1 and QoS 2 load are `lightgate bench failover`'s (gateway/bench/failover.py),
run here small.
"""

from __future__ import annotations

import argparse
import time
from signal import SIGCONT, SIGSTOP

import pytest

from gateway.bench import failover
from store.log.commitlog import CommitLog, CommitLogConfig
from store.rpc.connection import STALLED_LEASES
from tests.helpers.cluster import free_port
from tests.helpers.etcd import running_etcd
from tests.helpers.fulldisk import tmpfs
from tests.helpers.mqtt_fixtures import connected, run_id
from tests.helpers.replicas import Group, Replica, publish_acked, store_command, wait_for

pytestmark = pytest.mark.slow

NAMES = ("r0", "r1", "r2")


def log_bytes(data, end: int | None = None) -> bytes:
    """A stopped replica's CommitLog (below ``end``, a record boundary: ``Group.settled_end``), frame by frame as
    replication copies it."""
    with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
        parts, offset = [], log.min_offset
        stop = log.written_offset if end is None else min(end, log.written_offset)
        while offset < stop:
            chunk = log.read_frames(offset, min(1 << 20, stop - offset))
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)[:stop - log.min_offset]


def test_one_leader_serves_gateways_given_every_replica_and_status_shows_the_group(tmp_path):
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES)
        try:
            leader, epoch = group.wait_leader()
            group.wait_isr(NAMES)  # the followers caught up and joined
            gateway = group.gateway()
            try:
                run = run_id()
                with connected(gateway.port, client_id=f"sub-{run}") as sub:
                    sub.subscribe(f"t{run}/#", 1)
                    assert publish_acked(gateway.port, f"t{run}/a", 5) == [f"m{i}".encode() for i in range(5)]
                    assert [m.payload for m in sub.receive(5)] == [f"m{i}".encode() for i in range(5)]
            finally:
                gateway.stop()
            status = store_command("status", "--replication-group", "g", *(f for e in etcd.endpoints
                                                                             for f in ("--etcd", e)))
            assert (status["leader"], status["epoch"]) == (leader, epoch)
            assert sorted(status["isr"]) == sorted(NAMES) and sorted(status["members"]) == sorted(NAMES)
            followers = [name for name in NAMES if name != leader]
            for name in followers:  # a follower refuses gateways, naming the leader
                assert group.replicas[name].wait_log(lambda doc: doc.get("msg") == "following the leader")
        finally:
            group.stop()


def freeze_leader(group: Group, gateway, epoch: int, topic: str, prefix: str) -> tuple[str, str, int, list[bytes]]:
    """SIGSTOP the leader of ``epoch`` past its etcd lease: another replica is elected, the gateway (its link
    silent) moves to it, and publishes are acknowledged there; then SIGCONT: the old leader is fenced and follows
    the new one. Returns (old, new, new epoch, the payloads acknowledged during the freeze)."""
    old = group.leader()[0]
    frozen = group.replicas[old]
    stopped_at = len(frozen.logs)
    frozen.proc.send_signal(SIGSTOP)
    try:
        new, new_epoch = group.wait_leader(after_epoch=epoch)
        assert new != old
        # Within half the stalled-link limit (6 store leases: 30 s), after which any client gives up on a silent
        # store: a gateway must leave the frozen leader because another replica leads, not because it waited.
        gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store"
                         and doc.get("store") == group.replicas[new].address, timeout=STALLED_LEASES * 5.0 / 2)
        during = publish_acked(gateway.port, topic, 20, prefix=prefix)
        assert during  # the group serves without its old leader
    finally:
        frozen.proc.send_signal(SIGCONT)
    frozen.wait_log(lambda doc: doc.get("msg") == "no longer the store group's leader: following again",
                    after=stopped_at)
    frozen.wait_log(lambda doc: doc.get("msg") == "following the leader" and doc.get("leader") == new,
                    after=stopped_at)
    group.wait_isr(NAMES)
    return old, new, new_epoch, during


def test_frozen_leaders_are_replaced_then_fenced_and_rejoin_as_followers(tmp_path):
    """SIGSTOP past the etcd lease, twice (the second time the gateway's link is one it was redirected to): another
    replica is elected (epoch + 1) and acknowledges; the old leader, woken, acknowledges nothing more, follows the
    new one, and the group's logs, once the followers hold the leader's end, are byte for byte equal."""
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES, metrics=True)
        try:
            _, epoch = group.wait_leader()
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                run = run_id()
                acked = publish_acked(gateway.port, f"f{run}", 20, prefix="before")
                _, _, epoch, during = freeze_leader(group, gateway, epoch, f"f{run}", "first")
                acked += during
                _, new, epoch, during = freeze_leader(group, gateway, epoch, f"f{run}", "second")
                acked += during + publish_acked(gateway.port, f"f{run}", 5, prefix="after")
            finally:
                gateway.stop()
            end = group.settled_end()
        finally:
            group.stop()
        logs = {name: log_bytes(tmp_path / name, end) for name in NAMES}
        assert len(logs[new]) == end and logs["r0"] == logs["r1"] == logs["r2"]
        for payload in acked:
            assert payload in logs[new]


def test_a_follower_restarted_catches_up_and_holds_the_leaders_log_byte_for_byte(tmp_path):
    """The logs are compared up to the end all the replicas held at once (``Group.settled_end``): a follower joins
    the in-sync set once it holds the leader's confirm offset (store/replica/leader.py), which may be below the
    leader's written end (the client ledger records the leader writes on its own as the publisher leaves), and the
    replicas are stopped one after another."""
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES, metrics=True)
        try:
            leader, _ = group.wait_leader()
            group.wait_isr(NAMES)
            follower = next(name for name in NAMES if name != leader)
            group.replicas[follower].kill()
            gateway = group.gateway()
            try:
                acked = publish_acked(gateway.port, f"c{run_id()}", 50)  # quorum: the leader and one follower
                assert len(acked) == 50
                group.restart(follower)
                group.wait_isr(NAMES)
            finally:
                gateway.stop()
            end = group.settled_end()
        finally:
            group.stop()
        logs = {name: log_bytes(tmp_path / name, end) for name in NAMES}
        assert len(logs[leader]) == end and logs["r0"] == logs["r1"] == logs["r2"]
        assert all(payload in logs[follower] for payload in acked)


def test_a_replica_added_to_a_running_group_catches_up_from_the_log_under_load(tmp_path):
    """The logs are compared up to the end all the replicas held at once (``Group.settled_end``), as in the test
    above: the new replica joins the in-sync set before it holds the leader's end."""
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES, metrics=True)
        try:
            leader, _ = group.wait_leader()
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                first = publish_acked(gateway.port, f"n{run_id()}", 100, prefix="first")
                status = store_command("add-replica", "r3", "--replication-group", "g",
                                       *(f for e in etcd.endpoints for f in ("--etcd", e)))
                assert "r3" in status["replicas"]
                group.replicas["r3"] = Replica(tmp_path / "r3", free_port(), "r3", (*NAMES, "r3"), etcd.endpoints,
                                               metrics_port=free_port())
                second = publish_acked(gateway.port, f"n{run_id()}", 100, prefix="second")
                group.wait_isr((*NAMES, "r3"))
            finally:
                gateway.stop()
            end = group.settled_end()
        finally:
            group.stop()
        logs = {name: log_bytes(tmp_path / name, end) for name in group.replicas}
        assert len(logs[leader]) == end and len(set(logs.values())) == 1
        assert all(p in logs["r3"] for p in first + second)


def test_a_follower_whose_disk_is_full_leaves_the_in_sync_set_and_quorum_carries_on(tmp_path):
    with running_etcd(tmp_path) as etcd, tmpfs(tmp_path / "small", "8m") as small:
        group = Group(tmp_path, etcd.endpoints, NAMES, "--commitlog-segment-bytes", str(1 << 20))
        try:
            leader, _ = group.wait_leader()
            group.wait_isr(NAMES)
            follower = next(name for name in NAMES if name != leader)
            group.replicas[follower].stop()
            group.replicas[follower] = Replica(small / "data", group.replicas[follower].port, follower, NAMES,
                                               etcd.endpoints, "--commitlog-segment-bytes", str(1 << 20))
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                acked = publish_acked(gateway.port, f"d{run_id()}", 200, payload=b"x" * 60_000)  # 12 MB > 8 MB
                assert len(acked) == 200  # the leader and the other follower hold each: a quorum
                wait_for(lambda: follower not in group.isr(), "the full follower leaving the in-sync set")
                assert len(publish_acked(gateway.port, "after/full", 10)) == 10  # quorum: the other two
            finally:
                gateway.stop()
        finally:
            group.stop()


def test_losing_one_of_three_etcd_members_still_fails_the_leader_over(tmp_path):
    with running_etcd(tmp_path, size=3) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES)
        try:
            old, epoch = group.wait_leader()
            group.wait_isr(NAMES)
            etcd.kill(0)
            group.replicas[old].kill()
            new, _ = group.wait_leader(after_epoch=epoch)
            assert new != old
            gateway = group.gateway()
            try:
                assert len(publish_acked(gateway.port, f"e{run_id()}", 10)) == 10
            finally:
                gateway.stop()
        finally:
            group.stop()


def test_leader_kills_and_freezes_under_qos1_and_qos2_load_through_two_gateways_lose_and_repeat_nothing():
    """`lightgate bench failover` (its measurement, without writing a result line), small: QoS 1 and QoS 2 publishers and persistent subscribers (the spec-following
    clients of gateway/bench/crashclients.py) through two gateways to a 3-replica group whose leader is SIGKILLed 3
    times and SIGSTOPped past its lease once. Nothing acknowledged (PUBACK, PUBREC) is lost, no QoS 2 message
    reaches the QoS 2 subscriber twice ([MQTT-4.3.3]), and every fault ends with a new leader that acknowledges."""
    parser = argparse.ArgumentParser()
    failover.add_arguments(parser)
    result = failover.run(parser.parse_args(["--kills", "3", "--freezes", "1", "--load", "1", "--runs", "0"]))
    assert result["acked"] > 0 and result["failovers"] == 4, result
    assert (result["acked_lost"], result["duplicates_qos2"]) == (0, 0), result
    assert result["never_available"] == 0 and result["qos1_subscriber"]["lost"] == 0, result


DELAY_S = 6
"""The delay of the messages pending at the kill: longer than publishing them takes, so none is due before it."""


def test_delayed_messages_pending_at_a_leader_kill_are_delivered_once_by_the_next_leader(tmp_path):
    """The timer's state is derived from the log every replica copies (store/timer/), so the next leader's wheel
    holds what the killed one scheduled: each acknowledged delayed message is delivered once, at or after its due
    time, by the new leader (issue 28, "a new leader continues the wheel")."""
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES)
        try:
            old, epoch = group.wait_leader()
            group.wait_isr(NAMES)
            gateway = group.gateway()
            try:
                run = run_id()
                topic = f"later{run}/cmd"
                with connected(gateway.port, client_id=f"sub-{run}", clean=False) as sub:
                    sub.subscribe(topic, 1)
                    scheduled = time.monotonic()
                    acked = publish_acked(gateway.port, f"$delayed/{DELAY_S}/{topic}", 5, prefix="due")
                    assert len(acked) == 5
                    group.replicas[old].kill()
                    assert time.monotonic() - scheduled < DELAY_S  # before any was due: the next leader fires them
                    new, _ = group.wait_leader(after_epoch=epoch)
                    assert new != old
                    got = sorted(m.payload for m in sub.receive(5))
                    assert got == sorted(acked)
                    publish_acked(gateway.port, topic, 1, prefix="sentinel")
                    assert sub.receive(1)[0].payload == b"sentinel0"  # each delayed message came once
            finally:
                gateway.stop()
        finally:
            group.stop()
