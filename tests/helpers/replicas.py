"""A replicated store group of real processes: etcd, `lightgate store` replicas, `lightgate gateway`s over them.

The group's state is read from etcd itself (the v3 JSON gateway, with urllib: independent of the controller code
under test), so a test waits on what the controller holds (a leader of a later epoch, an in-sync set) rather than on
any one replica's account of it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import paho.mqtt.client as mqtt

from tests.helpers.cluster import WAIT_S, Gateway, Process, free_port
from tests.helpers.mqtt_fixtures import connected, wait_until
from tests.helpers.prometheus import scraped
from tests.helpers.processes import ROOT

GROUP = "g"

LEASE_FLAGS = ("--replication-lease-s", "2", "--replication-leader-lease-s", "1.4", "--replication-max-lag-s", "2")
"""Short leases, so a failover takes seconds: a replica's etcd lease of 2 s (etcd's floor is 1.5 s with its
default timing), its leader lease 1.4 s."""


class Replica(Process):
    """One `lightgate store` replica of the group (ready once it runs its role loop); ``metrics_port``: its
    ``/metrics`` endpoint's (0: none)."""

    def __init__(self, data: Path, port: int, name: str, names: Sequence[str], etcd: Sequence[str],
                 *flags: str, metrics_port: int = 0) -> None:
        self.data, self.port, self.name, self.names, self.etcd, self.flags = data, port, name, names, etcd, flags
        self.metrics_port = metrics_port
        args = ["store", "--data", str(data), "--listen", f"127.0.0.1:{port}", "--replication-group", GROUP,
                "--replication-name", name, *(f for n in names for f in ("--replica", n)),
                *(f for url in etcd for f in ("--etcd", url)), *LEASE_FLAGS, *flags,
                *(("--store-metrics-port", str(metrics_port)) if metrics_port else ())]
        super().__init__(*args, ready="store replica ready")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restarted(self) -> Replica:
        """A new process of this replica: same data, port, name and flags (this one must have exited)."""
        return Replica(self.data, self.port, self.name, self.names, self.etcd, *self.flags,
                       metrics_port=self.metrics_port)


def etcd_get(endpoints: Sequence[str], key: str) -> bytes | None:
    """The value of ``key`` in etcd (the first endpoint that answers), or None."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    error: Exception | None = None
    for url in endpoints:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/v3/kv/range", data=body), timeout=5) as answer:
                kvs = json.load(answer).get("kvs") or []
                return base64.b64decode(kvs[0]["value"]) if kvs else None
        except OSError as exc:
            error = exc
    raise AssertionError(f"no etcd endpoint of {endpoints} answered: {error}")


class Group:
    """``names`` replicas of one group over ``etcd``, each with its own data directory under ``root`` (and its
    own ``/metrics`` port with ``metrics``)."""

    def __init__(self, root: Path, etcd: Sequence[str], names: Sequence[str] = ("r0", "r1", "r2"),
                 *flags: str, metrics: bool = False) -> None:
        self.etcd = list(etcd)
        self.names = list(names)
        self.replicas: dict[str, Replica] = {}
        try:
            for name in names:
                self.replicas[name] = Replica(root / name, free_port(), name, names, self.etcd, *flags,
                                              metrics_port=free_port() if metrics else 0)
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self) -> str:
        """The ``--store`` value of a gateway: every replica's address."""
        return ",".join(replica.address for replica in self.replicas.values())

    def state(self, key: str) -> dict | None:
        raw = etcd_get(self.etcd, f"/lightgate/groups/{GROUP}/{key}")
        return json.loads(raw) if raw is not None else None

    def leader(self) -> tuple[str, int] | None:
        """(name, epoch) of the leader etcd names now, or None."""
        found = self.state("leader")
        return (found["name"], found["epoch"]) if found else None

    def isr(self) -> list[str]:
        found = self.state("isr")
        return sorted(found["members"]) if found else []

    def wait_leader(self, after_epoch: int = 0) -> tuple[str, int]:
        """The leader of the first epoch above ``after_epoch``, once it serves (its log says so)."""
        wait_until(lambda: (self.leader() or ("", 0))[1] > after_epoch, WAIT_S, f"a leader after epoch {after_epoch}")
        name, epoch = self.leader()
        self.replicas[name].wait_log(lambda doc: doc.get("msg") == "store group leader serving"
                                     and doc.get("epoch") == epoch)
        return name, epoch

    def wait_isr(self, members: Sequence[str]) -> None:
        wait_until(lambda: self.isr() == sorted(members), WAIT_S, f"the in-sync set {sorted(members)}")

    def settled_end(self) -> int:
        """The leader's written end once every replica's log ends there too, as each replica's ``/metrics`` says (a
        group made with ``metrics``): the end the leader shows again after the followers' is the same, so all of
        them held it at once. What a test compares the stopped logs up to: past it a replica stopped later may hold
        more (what the leader appends on its own, like the end of the leases it restored 5 s after its election,
        and what the next leader appends while the group stops)."""
        seen: list[float] = []

        def settled() -> bool:
            leader = (self.leader() or ("", 0))[0]
            if leader not in self.replicas:
                return False
            written = [scraped(self.replicas[name].metrics_port, "lightgate_replication_written_offset")
                       for name in (leader, *(n for n in self.replicas if n != leader), leader)]
            seen[:] = written[:1]
            return written[0] is not None and len(set(written)) == 1

        wait_until(settled, WAIT_S, "every replica's log ending at the leader's end")
        return int(seen[0])

    def restart(self, name: str) -> Replica:
        self.replicas[name] = self.replicas[name].restarted()
        return self.replicas[name]

    def gateway(self, *flags: str) -> Gateway:
        return Gateway(self.addresses, *flags)

    def stop(self) -> None:
        for replica in self.replicas.values():
            replica.stop()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    wait_until(condition, WAIT_S, what)


def publish_acked(port: int, topic: str, count: int, qos: int = 1, prefix: str = "m",
                  payload: bytes = b"") -> list[bytes]:
    """Publish ``count`` messages (MQTT 5) through the gateway at ``port``, one at a time; the payloads acknowledged
    as stored (PUBACK / PUBREC reason code 0: [MQTT-3.4.2-1], a code of 0x80 or more is a refusal)."""
    codes: dict[int, int] = {}
    acked: list[bytes] = []
    with connected(port, protocol=mqtt.MQTTv5) as client:
        client.paho.on_publish = lambda c, u, mid, rc, props: codes.__setitem__(mid, int(getattr(rc, "value", rc)))
        for i in range(count):
            body = f"{prefix}{i}".encode() + payload
            info = client.paho.publish(topic, body, qos)
            info.wait_for_publish(timeout=WAIT_S)
            wait_for(lambda: info.mid in codes, "the acknowledgement")
            if codes[info.mid] < 0x80:
                acked.append(body)
    return acked


def store_command(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "gateway.app.cli", "store", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
