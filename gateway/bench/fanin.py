"""Fan-in: many publishers -> one subscriber on ``tele/#``, as fast as possible, QoS 0 and QoS 1.

The issue's targets: LightGate's QoS 0 delivery rate at least 0.33x
Mosquitto's, and QoS 1 with zero messages lost (acknowledged by the broker
but never delivered). Each publisher ``i`` publishes on ``tele/dev<i>``
through its own connection; the subscriber subscribes to ``tele/#`` at the
run's QoS and acknowledges QoS 1 deliveries. Rates: ``publish_per_s`` is what
the publishers got out, ``delivered_per_s`` what reached the subscriber
(counted from the start signal to the last delivery).
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare, peers
from gateway.bench.loadgen import Job, run_load, split
from gateway.bench.peers import Broker

TOPIC = "tele/dev{i}"  # one topic per device, as fleets publish
FILTER = "tele/#"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser, duration=10.0)
    parser.add_argument("--qos", type=int, nargs="+", default=[0, 1], choices=(0, 1), help="QoS levels to run")
    compare.add_arguments(parser)
    peers.add_mode_arguments(parser)


def add_load_arguments(parser: argparse.ArgumentParser, duration: float) -> None:
    """The fan-in load's shape (shared with ``fanin-rate``)."""
    parser.add_argument("--publishers", type=int, default=50, help="publisher connections")
    parser.add_argument("--duration", type=float, default=duration, help="seconds of publishing per run")
    parser.add_argument("--messages", type=int, default=0,
                        help="messages per publisher (0: publish for --duration)")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the stamp)")
    parser.add_argument("--workers", type=int, default=2, help="publisher worker processes")


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"settings": settings(args, rate=0.0)}
    targets = {}
    args.brokers = peers.with_cluster(args)
    cluster = peers.cluster_name(peers.CLUSTER_TARGET_GATEWAYS)
    for qos in args.qos:
        per_broker = compare.measure_all(args, lambda broker: measure(broker, args, qos, rate=0.0), "delivered_per_s")
        ratios = compare.ratios(per_broker, lambda r: r["delivered_per_s"])
        ratios.update(peers.cluster_ratios(per_broker, lambda r: r["delivered_per_s"]))
        ratios.update(peers.replicated_ratios(per_broker, lambda r: r["delivered_per_s"]))
        result[f"qos{qos}"] = {"brokers": per_broker, "ratios": ratios, "caveats": compare.caveats(per_broker),
                               "warnings": compare.generator_warnings(per_broker)}
        if qos == 0:
            targets["qos0_delivered_vs_mosquitto"] = compare.target(ratios.get("lightgate/mosquitto"), 0.33)
        elif "lightgate" in per_broker:
            targets["qos1_lightgate_lost"] = compare.target(per_broker["lightgate"]["lost"], 0, at_least=False)
        if cluster in per_broker:
            targets[f"qos{qos}_{cluster}_vs_embedded"] = compare.target(ratios.get(f"{cluster}/lightgate"),
                                                                       peers.CLUSTER_TARGET)
            if qos == 1:
                targets[f"qos1_{cluster}_lost"] = compare.target(per_broker[cluster]["lost"], 0, at_least=False)
    result["targets"] = targets
    return result


def measure(broker: Broker, args: argparse.Namespace, qos: int, rate: float) -> dict[str, Any]:
    """One fan-in run against ``broker``; ``rate`` is messages/s per publisher (0: as fast as possible)."""
    publishers = [
        Job("publish", broker.host, broker.port, first, count, prefix="pub-", qos=qos, topic=TOPIC,
            payload_bytes=args.payload, rate=rate, duration_s=args.duration, messages=args.messages)
        for first, count in split(args.publishers, args.workers)
    ]
    subscriber = Job("subscribe", broker.host, broker.port, 0, 1, prefix="sub-", qos=qos, filters=(FILTER,))
    return run_load(publishers, [subscriber]).as_dict()


def settings(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    return {"publishers": args.publishers, "duration_s": args.duration, "messages": args.messages,
            "payload": args.payload, "publisher_workers": args.workers, "rate_per_publisher": rate,
            "runs": args.runs, "topic": TOPIC, "filter": FILTER, "mode": getattr(args, "mode", "embedded"),
            "gateways": getattr(args, "gateways", [])}
