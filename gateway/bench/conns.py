"""Idle connections: the broker's memory per open MQTT connection (5,000 by default).

The issue's target: LightGate's node uses at most 10 KiB per connection. The
broker's RSS is read (psutil) once it accepts connections and again while all
of ``--connections`` clients are connected (CONNECT/CONNACK done, keep-alive
off, nothing else sent); the difference divided by the count is the figure.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare
from gateway.bench.loadgen import Job, hold_connections, split
from gateway.bench.peers import Broker

KiB = 1024
TARGET_KIB = 10.0  # the bound for LightGate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=5000, help="idle connections to hold open")
    parser.add_argument("--workers", type=int, default=4, help="generator worker processes")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_broker = compare.measure_all(args, lambda broker: measure(broker, args), "KiB_per_connection")
    result: dict[str, Any] = {
        "settings": {"connections": args.connections, "workers": args.workers, "runs": args.runs},
        "brokers": per_broker,
        "ratios": compare.ratios(per_broker, lambda r: r["KiB_per_connection"]),
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        result["targets"] = {"lightgate_KiB_per_connection": compare.target(
            per_broker["lightgate"]["KiB_per_connection"], TARGET_KIB, at_least=False)}
    return result


def measure(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    """RSS before and while ``args.connections`` idle clients are connected to ``broker``."""
    before = broker.rss_bytes()
    jobs = [Job("idle", broker.host, broker.port, first, count, prefix="idle-")
            for first, count in split(args.connections, args.workers)]
    during, generator = hold_connections(jobs, broker.rss_bytes)
    return {
        "connections": args.connections,
        "rss_MiB_before": round(before / 2**20, 1),
        "rss_MiB_connected": round(during / 2**20, 1),
        "KiB_per_connection": round((during - before) / args.connections / KiB, 2),
        "generator": generator,
    }
