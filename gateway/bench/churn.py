"""Churn: persistent sessions connecting, publishing, disconnecting and resuming, over and over.

``--clients`` clients connect with clean session 0 and subscribe at QoS 1 to
their own topic ``churn/<i>``. Then, ``--cycles`` times, each publishes
``--messages`` QoS 1 messages to that topic, waits for the PUBACKs,
disconnects at once (its own messages are often still on their way back) and
reconnects with clean session 0, expecting the broker to resume its session
(CONNACK session present = 1) and deliver what it queued meanwhile. After the
last cycle each client stays connected until every message the broker
acknowledged to it has come back (or nothing arrived for 10 s).

Figures: ``connects_per_s`` is the reconnects of the cycling phase over its
wall time (each cycle also publishes and waits for its PUBACKs, so it is
session cycles per second); ``resumed`` counts reconnects that came back with
session present = 1 (``not_resumed`` the others: those clients subscribe
again); ``lost`` counts messages acknowledged to their publisher and never
delivered back, across all the cycles; ``reconnect_ms`` is CONNECT -> CONNACK.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare
from gateway.bench.loadgen import Job, account, generator_summary, latency_ms, run_clients, split
from gateway.bench.peers import Broker

TOPIC = "churn/{i}"  # client i publishes to and subscribes to its own topic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=500, help="persistent-session clients")
    parser.add_argument("--cycles", type=int, default=5, help="publish/disconnect/resume cycles per client")
    parser.add_argument("--messages", type=int, default=3, help="QoS 1 messages each client publishes per cycle")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the stamp)")
    parser.add_argument("--workers", type=int, default=2, help="generator worker processes")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_broker = compare.measure_all(args, lambda broker: measure(broker, args), "connects_per_s")
    result: dict[str, Any] = {
        "settings": {"clients": args.clients, "cycles": args.cycles, "messages_per_cycle": args.messages,
                     "payload": args.payload, "workers": args.workers, "runs": args.runs, "topic": TOPIC},
        "brokers": per_broker,
        "ratios": {"connects_per_s": compare.ratios(per_broker, lambda r: r["connects_per_s"])},
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        mine = per_broker["lightgate"]
        result["targets"] = {
            "lightgate_lost": compare.target(mine["lost"], 0, at_least=False),
            "lightgate_not_resumed": compare.target(mine["not_resumed"], 0, at_least=False),
        }
    return result


def measure(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    """One churn run against ``broker``."""
    jobs = [Job("churn", broker.host, broker.port, first, count, prefix="churn-", qos=1, topic=TOPIC,
                filters=(TOPIC,), payload_bytes=args.payload, messages=args.messages, cycles=args.cycles,
                clean_start=False)
            for first, count in split(args.clients, args.workers)]
    reports = run_clients(jobs)
    published = {p: bits for r in reports for p, bits in r.published.items()}
    # Each client's topic is its own: the union of what came back, per publisher, is what each one got.
    received = {p: bits for r in reports for got in r.received for p, bits in got.items()}
    loss = account(published, [received], sum(r.duplicates for r in reports))
    reconnects = sum(r.connects for r in reports) - args.clients  # every client's first connect made its session
    resumed = sum(r.sessions_present for r in reports)
    phase_s = max(r.publish_s for r in reports)
    return {
        "clients": args.clients,
        "reconnects": reconnects,
        "connects_per_s": round(reconnects / phase_s, 1) if phase_s else 0.0,
        "cycling_s": round(phase_s, 3),
        "resumed": resumed,
        "not_resumed": reconnects - resumed,
        "sent": sum(r.sent for r in reports),
        "acked": loss.expected,
        "received": loss.received,
        "lost": loss.lost,
        "duplicates": loss.duplicates,
        "drain_capped": any(r.drain_capped for r in reports),
        "reconnect_ms": latency_ms([r.histogram for r in reports]),
        "generator": generator_summary(reports),
    }
