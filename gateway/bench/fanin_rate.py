"""Fan-in at a fixed rate: many publishers -> one ``tele/#`` subscriber at 5,000 msg/s in total, QoS 1.

The issue's targets for LightGate: zero messages lost and a p99 end-to-end
latency (publisher's send to subscriber's receive, one shared clock) under
10 ms. The load is ``fanin``'s, paced by a token bucket per publisher.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare, fanin

LATENCY_TARGET_MS = 10.0  # the p99 bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fanin.add_load_arguments(parser, duration=10.0)
    parser.add_argument("--rate", type=float, default=5000.0, help="messages/s over all publishers")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_publisher = args.rate / args.publishers
    per_broker = compare.measure_all(args, lambda broker: fanin.measure(broker, args, 1, per_publisher),
                                     "delivered_per_s")
    result: dict[str, Any] = {
        "settings": {**fanin.settings(args, per_publisher), "rate": args.rate, "qos": 1},
        "brokers": per_broker,
        "ratios": compare.ratios(per_broker, lambda r: r["delivered_per_s"]),
        "p99_ms_ratios": compare.ratios(per_broker, lambda r: r["latency_ms"].get("p99", 0.0)),
        "caveats": compare.caveats(per_broker),
        "warnings": compare.generator_warnings(per_broker),
    }
    mine = per_broker.get("lightgate")
    if mine is not None:
        result["targets"] = {
            "lightgate_lost": compare.target(mine["lost"], 0, at_least=False),
            "lightgate_p99_ms": compare.target(mine["latency_ms"].get("p99"), LATENCY_TARGET_MS, at_least=False),
        }
    return result
