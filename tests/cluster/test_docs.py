"""docs/cluster.md's "Two gateways on one host" and "Three replicas and two gateways on one host" run as written:
the commands are read from the page.

The store and both gateways are started with exactly the documented lines (``lightgate`` is this checkout's
``python -m gateway.app.cli``), in a network namespace of their own where the documented ports are free
(the machine's own may be taken by other work); without namespaces (not root, no ``unshare``) the ports
are swapped for free ones. Both gateways must serve: their admin APIs are ready, and a message published
on one reaches a subscriber on the other. Starting a gateway twice stops the second with the one line the
page shows (the admin port is taken), exit status 1. The replicated recipe must also survive its leader's SIGKILL:
another replica leads (a later epoch) and messages cross the gateways again.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import ExitStack, contextmanager

import pytest

from tests.helpers.mqtt_fixtures import wait_until
from tests.helpers.processes import ROOT, LightgateProcess

pytestmark = pytest.mark.slow

WAIT_S = 30.0  # three processes on two busy cores
DOC = ROOT / "docs" / "cluster.md"
HEADING = "### Two gateways on one host"
REPLICATED = "### Three replicas and two gateways on one host"

PROBE = """
import json, queue, sys, urllib.request
import paho.mqtt.client as mqtt
mqtt_a, mqtt_b, admin_a, admin_b = map(int, sys.argv[1:])
ready = [json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30))["status"]
         for port in (admin_a, admin_b)]
received, subscribed = queue.Queue(), queue.Queue()
sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="doc-sub")
sub.on_message = lambda client, userdata, message: received.put(message.payload.decode())
sub.on_subscribe = lambda *args: subscribed.put(True)
sub.connect("127.0.0.1", mqtt_a)
sub.loop_start()
sub.subscribe("docs/hello", 1)
subscribed.get(timeout=30)
pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="doc-pub")
pub.connect("127.0.0.1", mqtt_b)
pub.loop_start()
pub.publish("docs/hello", b"across gateways", 1).wait_for_publish(timeout=30)
print(json.dumps({"ready": ready, "received": received.get(timeout=30)}))
"""
"""Run inside the namespace: both admin APIs ready, and a message from one gateway to the other."""


def documented_commands(heading: str = HEADING) -> list[list[str]]:
    """The section's ``lightgate ...`` lines, as argument lists without ``lightgate``, and its ``etcd ...`` lines
    as they are."""
    section = DOC.read_text().split(heading, 1)[1].split("\n#", 1)[0]
    return [shlex.split(line, comments=True)[line.startswith("    lightgate "):] for line in section.splitlines()
            if line.startswith(("    lightgate ", "    etcd "))]


@contextmanager
def network_namespace():
    """A command prefix that runs in a fresh network namespace (its own loopback: every port free), or None where
    this process may not make one."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")):
        yield None
        return
    holder = subprocess.Popen(["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec cat"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"] if holder.stdout.readline() == "up\n" else None
    finally:
        holder.stdin.close()  # cat ends, and the namespace with it
        holder.wait(timeout=WAIT_S)


def with_free_ports(commands: list[list[str]]) -> list[list[str]]:
    """The commands with every documented port replaced by a free one (the same one wherever it recurs)."""
    from tests.helpers.cluster import free_port

    ports: dict[str, str] = {}

    def swap(match: re.Match) -> str:
        return ports.setdefault(match.group(0), str(free_port()))

    return [[",".join(re.sub(r"(?<=:)\d+$|^\d+$", swap, part) for part in arg.split(",")) for arg in command]
            for command in commands]


def test_two_gateways_on_one_host_run_as_documented(tmp_path):
    commands = documented_commands()
    assert [command[0] for command in commands] == ["store", "gateway", "gateway"], commands
    with network_namespace() as prefix, ExitStack() as stack:
        if prefix is None:
            commands = with_free_ports(commands)
        lightgate = [*(prefix or []), sys.executable, "-m", "gateway.app.cli"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}

        def start(args: list[str], ready: str) -> LightgateProcess:
            process = LightgateProcess(*args, wait_s=WAIT_S, command=lightgate, cwd=tmp_path, env=env)
            stack.callback(process.stop)
            process.ready(ready)
            return process

        store = start(commands[0], "store node ready")
        gateways = [start(args, "gateway node ready") for args in commands[1:]]
        mqtt_ports = [gateway.ready("gateway node ready") for gateway in gateways]
        admin_ports = [gateway.ready("admin API ready") for gateway in gateways]
        for args, mqtt_port, admin_port in zip(commands[1:], mqtt_ports, admin_ports):
            assert (mqtt_port, admin_port) == (int(args[args.index("--port") + 1]),
                                               int(args[args.index("--admin-port") + 1]))
        probe = subprocess.run([*lightgate[:-2], "-c", PROBE, *map(str, mqtt_ports + admin_ports)], env=env,
                               capture_output=True, text=True, timeout=4 * WAIT_S, stdin=subprocess.DEVNULL)
        assert probe.returncode == 0, probe.stderr
        assert json.loads(probe.stdout) == {"ready": ["ready", "ready"], "received": "across gateways"}

        again = subprocess.run([*lightgate, *commands[2]], env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=2 * WAIT_S, stdin=subprocess.DEVNULL)
        errors = [line for line in again.stderr.splitlines() if " ERROR " in line]
        assert again.returncode == 1, again.stderr
        assert len(errors) == 1 and "Traceback" not in again.stderr, again.stderr
        assert f"cannot listen on 127.0.0.1:{admin_ports[1]} (admin API)" in errors[0], errors
        assert "change admin.port (--admin-port)" in errors[0], errors
    for process in (store, *gateways):
        assert process.proc.returncode == 0 and not process.errors(), process.errors()


def test_three_replicas_and_two_gateways_run_as_documented_and_survive_a_leader_kill(tmp_path):
    commands = documented_commands(REPLICATED)
    assert [command[0] for command in commands] == ["etcd", "store", "store", "store", "gateway", "gateway"], commands
    with network_namespace() as prefix, ExitStack() as stack:
        if prefix is None:
            commands = with_free_ports(commands)
        lightgate = [*(prefix or []), sys.executable, "-m", "gateway.app.cli"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(tmp_path / "etcd.log", "wb") as etcd_log:
            etcd = subprocess.Popen([*(prefix or []), *commands[0]], cwd=tmp_path, stdout=etcd_log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        stack.callback(etcd.wait, timeout=WAIT_S)
        stack.callback(etcd.terminate)

        def start(args: list[str], ready: str) -> LightgateProcess:
            process = LightgateProcess(*args, wait_s=WAIT_S, command=lightgate, cwd=tmp_path, env=env)
            stack.callback(process.stop)
            process.wait_log(lambda doc: doc.get("msg") == ready)
            return process

        replicas = [start(args, "store replica ready") for args in commands[1:4]]
        gateways = [start(args, "gateway node ready") for args in commands[4:]]
        mqtt_ports = [gateway.ready("gateway node ready") for gateway in gateways]
        admin_ports = [gateway.ready("admin API ready") for gateway in gateways]

        def across() -> dict:
            probe = subprocess.run([*lightgate[:-2], "-c", PROBE, *map(str, mqtt_ports + admin_ports)], env=env,
                                   capture_output=True, text=True, timeout=4 * WAIT_S, stdin=subprocess.DEVNULL)
            assert probe.returncode == 0, probe.stderr
            return json.loads(probe.stdout)

        assert across() == {"ready": ["ready", "ready"], "received": "across gateways"}
        serving = [doc for replica in replicas for doc in replica.logs if doc.get("msg") == "store group leader serving"]
        assert [doc["epoch"] for doc in serving] == [1]
        leader = next(replica for replica in replicas if serving[0] in replica.logs)
        leader.kill()
        others = [replica for replica in replicas if replica is not leader]

        def next_leader() -> LightgateProcess | None:
            return next((replica for replica in others if any(
                doc.get("msg") == "store group leader serving" and doc.get("epoch") == 2 for doc in replica.logs)), None)

        wait_until(lambda: next_leader() is not None, WAIT_S, "a leader of epoch 2")
        address = next_leader().args[next_leader().args.index("--listen") + 1]
        for gateway in gateways:
            gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect")
                             and doc.get("store") == address)
        assert across() == {"ready": ["ready", "ready"], "received": "across gateways"}
