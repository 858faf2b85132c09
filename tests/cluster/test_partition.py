"""A leader cut off from etcd and from its followers, still reachable by one gateway (network namespaces).

The leader replica and one gateway run in a network namespace of their own, joined to the host by a veth pair;
etcd, the two other replicas and a second gateway run on the host. Taking the host's end of the pair down cuts the
leader off from etcd and its followers while its own gateway (and that gateway's devices, in the namespace too)
still reach it: the situation a leader lease exists for. What must hold: the old leader acknowledges nothing that
the new leader does not have (every publish acknowledged to a device of the cut-off gateway is in the new leader's
log), the host's side elects a new leader and acknowledges again, and once the link is back the old leader follows
the new one and its log ends byte for byte equal. Skips (saying why) where namespaces cannot be made (not root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.log.commitlog import CommitLog, CommitLogConfig
from tests.helpers.cluster import WAIT_S, Process, free_port
from tests.helpers.mqtt_fixtures import run_id, wait_until
from tests.helpers.processes import LightgateProcess
from tests.helpers.replicas import GROUP, LEASE_FLAGS, etcd_get

pytestmark = pytest.mark.slow

HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"

DEVICE = """
import json, sys, time
import paho.mqtt.client as mqtt
port, topic, count, gap = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
codes = {}
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ns-dev-" + topic, protocol=mqtt.MQTTv5)
client.on_publish = lambda c, u, mid, rc, props: codes.__setitem__(mid, int(getattr(rc, "value", rc)))
client.connect("127.0.0.1", port)
client.loop_start()
sent = {}
for i in range(count):
    sent[client.publish(topic, f"<p{i}>".encode(), 1).mid] = f"p{i}"
    time.sleep(gap)  # the device's publishing pace (the stimulus), not a synchronisation
deadline = time.monotonic() + 30
while len(codes) < len(sent) and time.monotonic() < deadline:
    time.sleep(0.05)  # polling paho's callbacks for the last acknowledgements
print(json.dumps({"acked": [p for mid, p in sent.items() if codes.get(mid) == 0],
                  "refused": [p for mid, p in sent.items() if codes.get(mid, 0) >= 0x80]}))
"""
"""A device inside the namespace: QoS 1 publishes at a pace, then which were acknowledged (PUBACK 0) or refused."""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=WAIT_S)


@pytest.fixture
def namespace():
    """A network namespace joined to the host by a veth pair (host HOST_IP, namespace NS_IP); yields its name."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip`)")
    name = f"lgp{os.getpid()}"
    host_end, ns_end = f"lgh{os.getpid() % 100000}", f"lgn{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        sh("ip", "link", "set", ns_end, "netns", name)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_end)
        sh("ip", "link", "set", host_end, "up")
        sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{NS_IP}/30", "dev", ns_end)
        sh("ip", "netns", "exec", name, "ip", "link", "set", ns_end, "up")
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, host_end
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Etcd:
    """One etcd member listening on the host's end of the pair (both sides reach it while the link is up)."""

    def __init__(self, directory: Path) -> None:
        client, peer = f"http://{HOST_IP}:{free_port()}", f"http://{HOST_IP}:{free_port()}"
        self.url = client
        with open(directory / "etcd.log", "wb") as log:
            self.process = subprocess.Popen(
                ["etcd", "--name", "e0", "--data-dir", str(directory / "etcd"), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"e0={peer}"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(self.healthy, WAIT_S, "etcd healthy")

    def healthy(self) -> bool:
        try:
            return etcd_get([self.url], "/health-probe") is None
        except AssertionError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=WAIT_S)


class InNamespace(LightgateProcess):
    """A `lightgate` process inside the network namespace ``ns``, waited for until it logs ``ready``."""

    def __init__(self, ns: str, *args: str, ready: str) -> None:
        super().__init__(*args, wait_s=WAIT_S, command=["ip", "netns", "exec", ns, sys.executable, "-m",
                                                        "gateway.app.cli"])
        self.ready_line = self.wait_log(lambda doc: doc.get("msg") == ready)


def replica_args(data: Path, listen: str, name: str, etcd: str) -> list[str]:
    return ["store", "--data", str(data), "--listen", listen, "--replication-group", GROUP, "--replication-name",
            name, "--replica", "r0", "--replica", "r1", "--replica", "r2", "--etcd", etcd, *LEASE_FLAGS]


def group_key(etcd: Etcd, key: str) -> dict:
    return json.loads(etcd_get([etcd.url], f"/lightgate/groups/{GROUP}/{key}") or b"{}")


def log_bytes(data: Path) -> bytes:
    with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
        return log.read_frames(log.min_offset, 1 << 30) if log.written_offset else b""


def test_a_leader_cut_off_from_etcd_and_followers_acknowledges_nothing_the_new_leader_lacks(tmp_path, namespace):
    ns, host_end = namespace
    etcd = Etcd(tmp_path)
    started: list[LightgateProcess] = []
    try:
        ports = [free_port() for _ in range(3)]
        cut_off = InNamespace(ns, *replica_args(tmp_path / "r0", f"{NS_IP}:{ports[0]}", "r0", etcd.url),
                              ready="store replica ready")
        started.append(cut_off)
        cut_off.wait_log(lambda doc: doc.get("msg") == "store group leader serving")  # alone: it wins epoch 1
        for i in (1, 2):
            started.append(Process(*replica_args(tmp_path / f"r{i}", f"{HOST_IP}:{ports[i]}", f"r{i}", etcd.url),
                                   ready="store replica ready"))
        wait_until(lambda: sorted(group_key(etcd, "isr").get("members", [])) == ["r0", "r1", "r2"], WAIT_S,
                   "the in-sync set of three")
        addresses = f"{NS_IP}:{ports[0]},{HOST_IP}:{ports[1]},{HOST_IP}:{ports[2]}"
        inside = InNamespace(ns, "gateway", "--store", addresses, "--port", "0", "--mqtt-sys-interval-s", "0",
                             "--admin-port", "0", ready="gateway node ready")
        started.append(inside)
        topic = f"cut{run_id()}"
        device = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", DEVICE,
                                   str(inside.ready_line["port"]), topic, "120", "0.05"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the device publishes through the leader for a second first: the fault's timing
        subprocess.run(["ip", "link", "set", host_end, "down"], check=True)
        try:
            cut_off.wait_log(lambda doc: doc.get("msg") == "replication leader fenced: it acknowledges nothing "
                                                           "from now on")
            wait_until(lambda: group_key(etcd, "leader").get("epoch", 0) >= 2, WAIT_S, "a leader of epoch 2")
            new = group_key(etcd, "leader")["name"]
            assert new in ("r1", "r2")
        finally:
            subprocess.run(["ip", "link", "set", host_end, "up"], check=True)
        out, err = device.communicate(timeout=4 * WAIT_S)
        assert device.returncode == 0, err
        result = json.loads(out)
        cut_off.wait_log(lambda doc: doc.get("msg") == "following the leader" and doc.get("leader") == new)
        wait_until(lambda: sorted(group_key(etcd, "isr").get("members", [])) == ["r0", "r1", "r2"], WAIT_S,
                   "the old leader back in the in-sync set")
    finally:
        for process in reversed(started):
            process.stop()
        etcd.stop()
    new_log = log_bytes(tmp_path / new)
    assert result["acked"], result  # before the cut, through the leader
    missing = [p for p in result["acked"] if f"<{p}>".encode() not in new_log]
    assert not missing, f"acknowledged by the cut-off leader and lost: {missing}"
    assert log_bytes(tmp_path / "r0") == new_log  # the old leader truncated what the new one lacks, and caught up
