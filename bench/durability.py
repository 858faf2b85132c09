"""Durability: QoS 1 under load while the broker is SIGKILLed and restarted, ``--cycles`` times.

``--publishers`` clients publish QoS 1 messages to ``dur/<i>`` at ``--rate``
each and record every sequence number the broker acknowledged (PUBACK). One
persistent subscriber (clean session 0) reads ``dur/#`` at QoS 1. Each cycle
lets the load run for ``--load`` seconds, then SIGKILLs the broker process and
starts it again on the same port and data directory; every client reconnects
on its own (the subscriber resuming its session, or subscribing again when
the broker forgot it). After the last restart and another ``--load`` seconds
the publishers stop and the subscriber reads until it has every acknowledged
message, or nothing arrived for 10 s.

Brokers run in their crash-safe configuration (``bench/peers.py``): LightGate
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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import compare, peers
from bench.loadgen import Job, run_load, split
from bench.peers import Broker

TOPIC = "dur/{i}"  # one topic per publisher
FILTER = "dur/#"  # the one subscriber reads them all

RECONNECT_WAIT_S = 60.0
"""Longest wait for every client to be connected again after a restart; past it the cycle goes on regardless."""

POLL_S = 0.05
"""How often the broker's connections are counted while waiting for the clients to come back."""

DRAIN_S = 120.0
"""Longest the subscriber reads after the publishers stopped (it stops after 10 s without a delivery anyway)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=10, help="SIGKILL-and-restart cycles")
    parser.add_argument("--load", type=float, default=2.0, help="seconds of load before each kill (and after the last)")
    parser.add_argument("--publishers", type=int, default=4, help="QoS 1 publisher connections")
    parser.add_argument("--rate", type=float, default=250.0, help="messages/s of each publisher")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the stamp)")
    parser.add_argument("--workers", type=int, default=2, help="publisher worker processes")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = peers.available(args.brokers)
    skipped = {name: peers.NOT_DURABLE[name] for name in names if name in peers.NOT_DURABLE}
    for name, reason in skipped.items():
        print(f"bench: skipping {name} for durability: {reason}", file=sys.stderr, flush=True)
    per_broker = {}
    for name in names:
        if name not in skipped:
            runs = [measure(name, args) for _ in range(args.runs)]
            per_broker[name] = compare.median_run(runs, "lost")
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
