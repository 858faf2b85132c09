"""Fan-out: one publisher at 300 msg/s -> 1,000 subscribers, half on ``cmd/+`` and half on ``cmd/broadcast``.

Issue 31's scenario and target: LightGate delivers (deliveries to all
subscribers per second, from the start signal to the last delivery) at least
5x what Mosquitto does, and loses nothing. Publisher and subscriptions use QoS
1 (``--qos 0`` too), so "lost" means acknowledged by the broker (QoS 0: sent)
and never delivered to some subscriber; every subscriber acknowledges what it
gets. A peer that lost any message has its ratio say so (``caveats``): its
delivered/s is not a rate of the same work.

At 300,000 deliveries/s on two shared cores the generator must cost little
per delivery: the subscriber workers read raw frames in one epoll thread each
(``loadgen``), and every run reports each generator process's share of a core.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare, peers
from gateway.bench.loadgen import Job, run_load, split
from gateway.bench.peers import Broker

TOPIC = "cmd/broadcast"
FILTERS = ("cmd/+", "cmd/broadcast")  # subscriber i takes FILTERS[i % 2]: half wildcard, half exact
DELIVERED_VS_MOSQUITTO = 5.0  # issue 31: keep >= 5x


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subscribers", type=int, default=1000, help="subscriber connections")
    parser.add_argument("--rate", type=float, default=300.0, help="messages/s of the one publisher")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of publishing per run")
    parser.add_argument("--messages", type=int, default=0, help="messages to publish (0: for --duration)")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the stamp)")
    parser.add_argument("--qos", type=int, default=1, choices=(0, 1), help="QoS of the publisher and subscriptions")
    parser.add_argument("--workers", type=int, default=2, help="subscriber worker processes")
    compare.add_arguments(parser)
    peers.add_mode_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.brokers = peers.with_cluster(args)
    per_broker = compare.measure_all(args, lambda broker: measure(broker, args), "delivered_per_s")
    ratios = compare.ratios(per_broker, lambda r: r["delivered_per_s"])
    ratios.update(peers.cluster_ratios(per_broker, lambda r: r["delivered_per_s"]))
    result: dict[str, Any] = {
        "settings": {"subscribers": args.subscribers, "rate": args.rate, "duration_s": args.duration,
                     "messages": args.messages, "payload": args.payload, "qos": args.qos,
                     "subscriber_workers": args.workers, "runs": args.runs, "topic": TOPIC, "filters": FILTERS,
                     "mode": args.mode, "gateways": args.gateways},
        "brokers": per_broker,
        "ratios": ratios,
        "caveats": compare.caveats(per_broker, most=0.0),
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        result["targets"] = {
            "lightgate_lost": compare.target(per_broker["lightgate"]["lost"], 0, at_least=False),
            "delivered_vs_mosquitto": compare.target(ratios.get("lightgate/mosquitto"), DELIVERED_VS_MOSQUITTO),
        }
    for name in per_broker:
        if peers.cluster_gateways(name) is not None:
            result.setdefault("targets", {})[f"{name}_lost"] = compare.target(per_broker[name]["lost"], 0,
                                                                              at_least=False)
    return result


def measure(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    """One fan-out run against ``broker``."""
    publisher = Job("publish", broker.host, broker.port, 0, 1, prefix="pub-", qos=args.qos, topic=TOPIC,
                    payload_bytes=args.payload, rate=args.rate, duration_s=args.duration, messages=args.messages)
    subscribers = [Job("subscribe", broker.host, broker.port, first, count, prefix="sub-", qos=args.qos,
                       filters=FILTERS)
                   for first, count in split(args.subscribers, args.workers)]
    return run_load([publisher], subscribers).as_dict()
