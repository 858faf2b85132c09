"""Durability: QoS 1 (or 2) under load while the broker is SIGKILLed and restarted, ``--cycles`` times.

``--publishers`` clients publish QoS 1 messages to ``dur/<i>`` at ``--rate``
each and record every sequence number the broker acknowledged (PUBACK). One
persistent subscriber (clean session 0) reads ``dur/#`` at QoS 1. Each cycle
lets the load run for ``--load`` seconds, then SIGKILLs the broker process and
starts it again on the same port and data directory; every client reconnects
on its own (the subscriber resuming its session, or subscribing again when
the broker forgot it). After the last restart and another ``--load`` seconds
the publishers stop and the subscriber reads until it has every acknowledged
message, or nothing arrived for 10 s.

Brokers run in their crash-safe configuration (``gateway/bench/peers.py``): LightGate
with the ``sync`` flush policy (PUBACK after fsync), Mosquitto with
persistence on and ``autosave_interval 1``. amqtt is skipped (``skipped`` in
the result says why).

Figures: ``lost`` = acknowledged to a publisher and never delivered;
``duplicates`` = delivered more than once; ``unacknowledged_received`` =
delivered although its PUBACK never reached the publisher (in flight at a
kill); ``restart_s`` = SIGKILL -> the new process accepts connections;
``reconnect_s`` = SIGKILL -> every client connected again;
``subscriber_sessions_lost`` = reconnects of the subscriber that found no
session (session present = 0).

``--qos 2`` (the result's ``qos2`` section) runs the spec-following clients of
gateway/bench/crashclients.py in this process instead: ``--publishers`` QoS 2
publishers with persistent sessions and packet ids cycling 1..``--id-range``
(resending with DUP and the same id after each reconnect), a persistent QoS 2
subscriber and a persistent QoS 1 subscriber of ``dur/#``. Figures are those
of the QoS 2 subscriber (``lost``: PUBREC'd and never delivered;
``duplicates``: delivered twice, which exactly once forbids), the QoS 1
subscriber's ``lost`` and ``duplicates`` (at least once allows duplicates),
the resends to subscribers (``resends``, and how many lacked DUP=1 or came
with another packet id than the first receipt: [MQTT-3.3.1-1],
[MQTT-4.4.0-1]), ``dropped_held`` (new messages a QoS 2 subscriber did not
deliver because they came with a packet id it still held) and the sessions
the broker lost.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from gateway.bench import compare, crashclients, peers
from gateway.bench.loadgen import Job, run_load, split
from gateway.bench.peers import Broker

TOPIC = "dur/{i}"  # one topic per publisher
FILTER = "dur/#"  # the one subscriber reads them all

RECONNECT_WAIT_S = 60.0
"""Longest wait for every client to be connected again after a restart; past it the cycle goes on regardless."""

POLL_S = 0.05
"""How often the broker's connections are counted while waiting for the clients to come back."""

DRAIN_S = 120.0
"""Longest the subscriber reads after the publishers stopped (it stops after 10 s without a delivery anyway)."""

QUIET_S = 10.0
"""QoS 2 mode: the subscribers stop waiting for missing messages after this long without a delivery."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=10, help="SIGKILL-and-restart cycles")
    parser.add_argument("--load", type=float, default=2.0, help="seconds of load before each kill (and after the last)")
    parser.add_argument("--publishers", type=int, default=4, help="QoS 1 publisher connections")
    parser.add_argument("--rate", type=float, default=250.0, help="messages/s of each publisher")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the stamp)")
    parser.add_argument("--workers", type=int, default=2, help="publisher worker processes (QoS 1)")
    parser.add_argument("--qos", type=int, default=1, choices=(1, 2),
                        help="2: QoS 2 publishers, a QoS 2 and a QoS 1 subscriber (exactly once, DUP, packet ids)")
    parser.add_argument("--id-range", type=int, default=100, help="QoS 2: publishers cycle packet ids 1..N")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.qos == 2:
        return run_exactly_once(args)
    per_broker, skipped = _measure_durable(args, measure)
    result: dict[str, Any] = {
        "settings": {"cycles": args.cycles, "load_s": args.load, "publishers": args.publishers, "rate": args.rate,
                     "payload": args.payload, "workers": args.workers, "runs": args.runs, "topic": TOPIC,
                     "filter": FILTER},
        "brokers": per_broker,
        "skipped": skipped,
        "ratios": {"lost": compare.ratios(per_broker, lambda r: r["lost"]),
                   "restart_s": compare.ratios(per_broker, lambda r: r["restart_s"]["median"])},
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        result["targets"] = {"lightgate_lost": compare.target(per_broker["lightgate"]["lost"], 0, at_least=False)}
    return result


def _measure_durable(args: argparse.Namespace, measure_one: Callable[[str, argparse.Namespace], dict[str, Any]]
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """The median run (by ``lost``) of every broker that can run durable, and why the others were skipped."""
    names = peers.available(args.brokers)
    skipped = {name: peers.NOT_DURABLE[name] for name in names if name in peers.NOT_DURABLE}
    for name, reason in skipped.items():
        print(f"bench: skipping {name} for durability: {reason}", file=sys.stderr, flush=True)
    per_broker = {}
    for name in names:
        if name not in skipped:
            per_broker[name] = compare.median_run([measure_one(name, args) for _ in range(args.runs)], "lost")
    return per_broker, skipped


class _Crashes:
    """The kill-and-restart cycles, run while the load goes on; holds the broker that is running now."""

    def __init__(self, broker: Broker, clients: int, args: argparse.Namespace) -> None:
        self.broker = broker
        self.clients = clients
        self.args = args
        self.restart_s: list[float] = []
        self.reconnect_s: list[float | None] = []

    def __call__(self) -> None:
        for _ in range(self.args.cycles):
            time.sleep(self.args.load)  # the load runs in the worker processes meanwhile
            killed = time.monotonic()
            self.broker.kill()
            self.broker = peers.restart(self.broker)
            self.restart_s.append(time.monotonic() - killed)
            self.reconnect_s.append(time.monotonic() - killed if self._all_connected() else None)
        time.sleep(self.args.load)

    def _all_connected(self) -> bool:
        deadline = time.monotonic() + RECONNECT_WAIT_S
        while self.broker.clients() < self.clients:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)  # polling the broker's sockets: there is nothing to wait on
        return True


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One durability run against a fresh ``name`` broker in its crash-safe configuration."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        crashes = _Crashes(peers.start(name, Path(tmp), durable=True), args.publishers + 1, args)
        host, port = crashes.broker.host, crashes.broker.port
        try:
            publishers = [Job("publish", host, port, first, count, prefix="dpub-", qos=1, topic=TOPIC,
                              payload_bytes=args.payload, rate=args.rate, reconnect=True)
                          for first, count in split(args.publishers, args.workers)]
            subscriber = Job("subscribe", host, port, 0, 1, prefix="dsub-", qos=1, filters=(FILTER,),
                             clean_start=False, reconnect=True)
            load = run_load(publishers, [subscriber], DRAIN_S, during=crashes)
        finally:
            crashes.broker.stop()
    loss, sub = load.lost, load.clients["subscribe"]
    reconnects = [s for s in crashes.reconnect_s if s is not None]
    return {
        "cycles": len(crashes.restart_s),
        "sent": load.sent,
        "acked": load.acked,
        "received": loss.received,
        "lost": loss.lost,
        "duplicates": loss.duplicates,
        "unacknowledged_received": loss.received - (loss.expected - loss.lost),
        "drain_capped": load.drain_capped,
        "publish_per_s": round(load.publish_rate),
        "restart_s": _spread(crashes.restart_s),
        "reconnect_s": _spread(reconnects) | {"not_reconnected": len(crashes.reconnect_s) - len(reconnects)},
        "subscriber_sessions_lost": sub["connects"] - sub["clients"] - sub["sessions_present"],
        "publisher_reconnects": load.clients["publish"]["connects"] - args.publishers,
        "latency_ms": load.latency_ms,
        "generator": load.generator,
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 3) if values else None,
            "max": round(max(values), 3) if values else None, "runs": [round(v, 3) for v in values]}


def run_exactly_once(args: argparse.Namespace) -> dict[str, Any]:
    """``--qos 2``: the result has ``settings`` and the ``qos2`` section (gateway/bench/history.py charts it apart)."""
    per_broker, skipped = _measure_durable(args, measure_exactly_once)
    section: dict[str, Any] = {
        "brokers": per_broker,
        "skipped": skipped,
        "ratios": {"lost": compare.ratios(per_broker, lambda r: r["lost"]),
                   "duplicates": compare.ratios(per_broker, lambda r: r["duplicates"])},
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        mine = per_broker["lightgate"]
        section["targets"] = {"lightgate_lost": compare.target(mine["lost"], 0, at_least=False),
                              "lightgate_duplicates": compare.target(mine["duplicates"], 0, at_least=False)}
    return {"settings": {"qos": 2, "cycles": args.cycles, "load_s": args.load, "publishers": args.publishers,
                         "rate": args.rate, "payload": args.payload, "id_range": args.id_range, "runs": args.runs,
                         "topic": TOPIC, "filter": FILTER},
            "qos2": section}


class _Running:
    """The broker running now (a restart replaces it)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def address(self) -> crashclients.Address:
        return self.broker.host, self.broker.port

    def crash(self) -> float:
        """SIGKILL and restart the broker; the seconds until it accepts connections again."""
        killed = time.monotonic()
        self.broker.kill()
        self.broker = peers.restart(self.broker)
        return time.monotonic() - killed


def measure_exactly_once(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One QoS 2 durability run against a fresh ``name`` broker in its crash-safe configuration."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        running = _Running(peers.start(name, Path(tmp), durable=True))
        try:
            return trio.run(_exactly_once, running, args)
        finally:
            running.broker.stop()


async def _exactly_once(running: _Running, args: argparse.Namespace) -> dict[str, Any]:
    publishers = [crashclients.Publisher(i, 2, TOPIC.format(i=i), rate=args.rate, id_range=args.id_range,
                                         payload_bytes=args.payload, prefix="dpub-") for i in range(args.publishers)]
    exact, once = crashclients.Subscriber(0, 2, FILTER, prefix="dsub2-"), crashclients.Subscriber(1, 1, FILTER,
                                                                                                    prefix="dsub1-")
    restart_s = []

    async def crashes() -> None:
        for _ in range(args.cycles):
            await trio.sleep(args.load)  # the load runs in the client tasks meanwhile
            restart_s.append(await trio.to_thread.run_sync(running.crash))
        await trio.sleep(args.load)

    cpu0, wall0 = _cpu_s(), time.perf_counter()
    await crashclients.exchange(publishers, [exact, once], lambda client: running.address, crashes, drain_s=DRAIN_S,
                                quiet_s=QUIET_S, poll_s=POLL_S)
    cpu, wall = _cpu_s() - cpu0, time.perf_counter() - wall0
    two, one = crashclients.account(publishers, exact), crashclients.account(publishers, once)
    return {
        "cycles": len(restart_s),
        "sent": sum(p.seq for p in publishers),
        "acked": two.acknowledged,
        "received": exact.received,
        "lost": two.lost,
        "duplicates": two.duplicates,
        "unacknowledged_received": two.unacknowledged_delivered,
        "qos1_subscriber": {"lost": one.lost, "duplicates": one.duplicates},
        "resends": {"to_qos2": two.resends, "to_qos1": one.resends,
                    "without_dup": two.resends_without_dup + one.resends_without_dup,
                    "with_new_id": two.resends_with_new_id + one.resends_with_new_id},
        "dropped_held": two.dropped_held,
        "publisher_resent": sum(p.resent for p in publishers),
        "unfinished_flows": sum(len(p.inflight) for p in publishers),
        "restart_s": _spread(restart_s),
        "subscriber_sessions_lost": exact.sessions_lost + once.sessions_lost,
        "publisher_sessions_lost": sum(p.sessions_lost for p in publishers),
        "generator": {"processes": 1, "cpu_s": round(cpu, 2), "busiest_process_core_share": round(cpu / wall, 2),
                      "per_process_core_share": [round(cpu / wall, 2)]},
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
