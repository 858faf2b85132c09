"""gateway/bench/peers.py's replicated group: when the benchmarks call it whole, read from a real etcd.

The replicas here are ``sleep`` processes, and the group's keys and log lines are written by the test: what is
tested is the benchmark's reading of a group (which the failover bench waits on before and after each fault),
not the replicated store, which tests/cluster/ tests.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from gateway.bench import etcd, peers

pytestmark = [pytest.mark.slow, pytest.mark.skipif(etcd.missing() is not None, reason=str(etcd.missing()))]


@pytest.fixture
def group(tmp_path):
    server = etcd.start(tmp_path / "etcd", peers.free_port(), peers.free_port(), tmp_path / "etcd.log")
    replicas = [peers.Replica(f"r{i}", peers.free_port(), ["sleep", "600"], tmp_path) for i in range(3)]
    group = peers.Group(server, replicas, "quorum")
    for replica in replicas:
        replica.start()
    yield group
    for replica in replicas:
        replica.kill()
    server.stop()


def _put(group: peers.Group, key: str, value: dict) -> None:
    subprocess.run([shutil.which("etcdctl") or "etcdctl", "--endpoints", group.etcd.client_url, "put",
                    f"/lightgate/groups/g/{key}", json.dumps(value)],
                   check=True, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"})


def _log(replica: peers.Replica, msg: str) -> None:
    with open(replica.log_path, "a") as log:
        log.write(json.dumps({"ts": 1.0, "level": "info", "msg": msg}) + "\nTraceback: not JSON\n")


def test_a_group_is_whole_with_a_running_leader_and_every_replica_in_sync(group):
    r0, r1, r2 = group.replicas
    assert group.whole() is None  # no leader yet
    _put(group, "leader", {"name": "r1", "epoch": 2, "address": r1.address})
    assert group.whole() is None  # no in-sync set yet
    _put(group, "isr", {"epoch": 2, "members": ["r1", "r0"]})
    assert group.whole() is None  # r2 not in sync
    _put(group, "isr", {"epoch": 2, "members": ["r1", "r0", "r2"]})
    assert group.whole() == (r1, 2)
    assert group.whole(above=2) is None  # a fault of epoch 2 is over only with a later leader
    r1.kill()
    assert group.whole() is None  # its key outlives it until its lease runs out


def test_after_a_fault_the_faulted_replica_must_lead_or_follow_again(group):
    r0, r1, r2 = group.replicas
    _put(group, "isr", {"epoch": 3, "members": ["r0", "r1", "r2"]})
    _log(r0, peers.FOLLOWING)  # before the fault: does not count
    since = r0.log_size()
    _put(group, "leader", {"name": "r2", "epoch": 4, "address": r2.address})
    assert group.whole(above=3, faulted=(r0, since)) is None
    _log(r0, "store group leader serving")
    assert group.whole(above=3, faulted=(r0, since)) is None
    _log(r0, peers.FOLLOWING)
    assert group.whole(above=3, faulted=(r0, since)) == (r2, 4)
    assert group.whole(above=3, faulted=(r2, r2.log_size())) == (r2, 4)  # the faulted replica leads again


def test_waiting_for_a_group_whose_replica_exited_says_why(group):
    r0 = group.replicas[0]
    r0.kill()
    r0.command = [sys.executable, "-c", "import sys; print('no etcd for me'); sys.exit(3)"]
    r0.start()
    with pytest.raises(peers.PeerError, match="(?s)replica r0 exited with status 3: .*no etcd for me"):
        group.wait_whole(timeout_s=30)
