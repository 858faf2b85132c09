"""The crash test kit: QoS 1 and QoS 2 flows through SIGKILLs of a node, and what they cost.

A scenario runs spec-following clients (gateway/bench/crashclients.py) against a node
while it is killed ``kills`` times: a QoS 1 and a QoS 2 publisher, each with
a persistent session and packet ids cycling 1..100 (so every id is reused
within a second), and a QoS 1 and a QoS 2 persistent subscriber of both. A
kill comes once the publishers got ``ACKS_PER_KILL`` more acknowledgements
(a condition, not a timer); the killed process is started again at once on
the same port and data. After the last kill and another round of
acknowledgements the publishers stop, finish their flows, and the
subscribers read until they have every acknowledged message or nothing came
for ``QUIET_S``.

Nodes:

- ``EmbeddedNode``: ``lightgate serve``; a kill is the whole node.
- ``ClusterNodes``: one ``lightgate store`` and two ``lightgate gateway``
  processes; a kill is one gateway (in turn), whose clients reconnect to
  the other one; the store lives on.

The report (``CrashReport``) has one ``Accounting`` per (publisher QoS,
subscriber QoS) pair: acknowledged, lost (must be 0), duplicates, resends
and whether they carried DUP=1 and the first receipt's packet id, and new
messages a subscriber dropped because they came with an id it still held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import trio

from gateway.bench.crashclients import (Accounting, Address, Publisher, Subscriber, account, address_cycle,
                                        wait_delivered)
from tests.helpers.ports import free_port
from tests.helpers.processes import LightgateProcess

__all__ = ["ClusterNodes", "CrashReport", "EmbeddedNode", "Node", "run_crashes"]

HOST = "127.0.0.1"
WAIT_S = 60.0
"""Start-up and shutdown waits of the node processes (two busy cores, RocksDB opening, several processes)."""

RATE = 150.0
"""Messages/s of each publisher: the 100 packet ids of a publisher are all reused within a second."""

ACKS_PER_KILL = 300
"""Acknowledgements (both publishers together) between two kills: about a second of traffic."""

QUIET_S = 15.0
"""Subscribers stop waiting for missing messages after this long without any delivery."""

FILTER = "crash/#"


class Node(Protocol):
    addresses: list[Address]

    def crash(self) -> None:
        """SIGKILL a process of the node and start it again (blocking)."""

    def stop(self) -> None:
        """Stop every process (SIGTERM)."""

    def errors(self) -> list[dict[str, Any]]:
        """ERROR log lines of every process so far."""


class _Process:
    """A `lightgate` command that can be killed and started again with the same arguments."""

    def __init__(self, ready: str, *args: str) -> None:
        self.args = args
        self.ready = ready
        self.logs: list[dict[str, Any]] = []  # lines of processes killed before the current one
        self.proc = self._start()

    def _start(self) -> LightgateProcess:
        proc = LightgateProcess(*self.args, wait_s=WAIT_S)
        proc.wait_log(lambda doc: doc.get("msg") == self.ready)
        return proc

    def crash(self, between: Callable[[], None] | None = None) -> None:
        """SIGKILL, then ``between()`` (a power loss cuts the log there), then start again."""
        self.proc.kill()
        self.logs += self.proc.logs
        if between is not None:
            between()
        self.proc = self._start()

    def stop(self) -> None:
        self.proc.stop()

    def errors(self) -> list[dict[str, Any]]:
        return [doc for doc in (*self.logs, *self.proc.logs) if doc.get("level") == "error"]


class EmbeddedNode:
    """``lightgate serve`` on a fixed port; ``crash`` kills and restarts the whole node. ``admin``: its admin API
    on a fixed port too (``admin_port``; 0: off)."""

    def __init__(self, data: Path, flush: str = "sync", *, admin: bool = False) -> None:
        port = free_port()
        self.addresses = [(HOST, port)]
        self.admin_port = free_port() if admin else 0
        self.process = _Process("gateway node ready", "serve", "--data", str(data), "--host", HOST, "--port",
                                str(port), "--admin-port", str(self.admin_port), "--mqtt-sys-interval-s", "0",
                                "--commitlog-flush", flush)

    def crash(self, between: Callable[[], None] | None = None) -> None:
        self.process.crash(between)

    def stop(self) -> None:
        self.process.stop()

    def errors(self) -> list[dict[str, Any]]:
        return self.process.errors()


class ClusterNodes:
    """One store and two gateways on fixed ports; ``crash`` kills and restarts the gateways in turn."""

    def __init__(self, data: Path, flush: str = "sync") -> None:
        store_port = free_port()
        self.store = _Process("store node ready", "store", "--data", str(data), "--listen", f"{HOST}:{store_port}",
                              "--commitlog-flush", flush)
        ports = [free_port(), free_port()]
        self.addresses = [(HOST, port) for port in ports]
        self.gateways = [_Process("gateway node ready", "gateway", "--store", f"{HOST}:{store_port}", "--host", HOST,
                                  "--port", str(port), "--admin-port", "0", "--mqtt-sys-interval-s", "0")
                         for port in ports]
        self.kills = 0

    def crash(self) -> None:
        self.gateways[self.kills % 2].crash()
        self.kills += 1

    def stop(self) -> None:
        for process in (*self.gateways, self.store):
            process.stop()

    def errors(self) -> list[dict[str, Any]]:
        return [line for process in (self.store, *self.gateways) for line in process.errors()]


@dataclass
class CrashReport:
    """What a scenario cost: per (publisher QoS, subscriber QoS), the subscriber's accounting."""

    kills: int
    flows: dict[tuple[int, int], Accounting]
    publishers: dict[int, dict[str, int]] = field(default_factory=dict)  # QoS -> sent, resent, sessions lost
    subscribers: dict[int, dict[str, int]] = field(default_factory=dict)  # QoS -> connects, sessions lost

    def total(self, name: str) -> int:
        return sum(getattr(acc, name) for acc in self.flows.values())

    def as_dict(self) -> dict[str, Any]:
        return {"kills": self.kills,
                "flows": {f"qos{p}->sub{s}": acc.as_dict() for (p, s), acc in self.flows.items()},
                "publishers": self.publishers, "subscribers": self.subscribers}


def run_crashes(node: Node, kills: int, *, rate: float = RATE, acks_per_kill: int = ACKS_PER_KILL) -> CrashReport:
    """Run the scenario against ``node`` (already running) with ``kills`` crashes; the node is left running."""
    return trio.run(_scenario, node, kills, rate, acks_per_kill)


async def _scenario(node: Node, kills: int, rate: float, acks_per_kill: int) -> CrashReport:
    publishers = [Publisher(qos, qos, f"crash/q{qos}", rate=rate) for qos in (1, 2)]
    subscribers = [Subscriber(qos, qos, FILTER) for qos in (1, 2)]
    stop_publishing, stop_receiving = trio.Event(), trio.Event()

    async def acknowledgements(more: int) -> None:
        target = sum(len(p.acked) for p in publishers) + more
        while sum(len(p.acked) for p in publishers) < target:
            await trio.sleep(0.02)  # polling counters the client tasks update: nothing to wait on

    async with trio.open_nursery() as receiving:
        for sub in subscribers:
            receiving.start_soon(sub.run, address_cycle(node.addresses), stop_receiving)
        while not all(sub.connects for sub in subscribers):  # subscribed before anything is published
            await trio.sleep(0.02)
        async with trio.open_nursery() as publishing:
            for pub in publishers:
                publishing.start_soon(pub.run, address_cycle(node.addresses), stop_publishing)
            for _ in range(kills):
                await acknowledgements(acks_per_kill)
                await trio.to_thread.run_sync(node.crash)
            await acknowledgements(acks_per_kill)
            stop_publishing.set()
        await wait_delivered(subscribers, publishers, QUIET_S)
        stop_receiving.set()
    return CrashReport(
        kills=kills,
        flows={(pub.qos, sub.qos): account([pub], sub) for pub in publishers for sub in subscribers},
        publishers={pub.qos: {"sent": pub.seq, "acked": len(pub.acked), "resent": pub.resent,
                              "sessions_lost": pub.sessions_lost, "unfinished": len(pub.inflight)}
                    for pub in publishers},
        subscribers={sub.qos: {"connects": sub.connects, "sessions_lost": sub.sessions_lost,
                               "received": sub.received} for sub in subscribers},
    )
