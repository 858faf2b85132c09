"""Offline fan-out: broadcasts to persistent sessions that are all offline, delivered when they come back.

Three phases against one broker:

1. ``--sessions`` clients connect with clean session 0, subscribe at QoS 1 (half
   to ``bcast/#``, half to ``bcast/all``) and disconnect: persistent sessions,
   all offline;
2. one publisher sends ``--messages`` QoS 1 broadcasts of ``--payload`` bytes to
   ``bcast/all`` as fast as the broker acknowledges them. The broker's RSS
   (psutil) and the bytes allocated under its data directory are read before
   and after this phase, each time once the broker is idle again (under 5% of
   a core: LightGate indexes after it acknowledges);
3. every session reconnects with clean session 0 (no new SUBSCRIBE) and reads
   until it has every acknowledged broadcast, or nothing arrived for 60 s
   (``RESUME_QUIET_S``), or ``--drain`` seconds passed.

Figures: ``delivered`` = (session, broadcast) pairs acknowledged to the
publisher and delivered after the reconnect, of ``expected`` = sessions x
acknowledged broadcasts; ``drain_s`` = from the first reconnect attempt to the
last delivery; ``rss_growth_MiB`` and ``disk_growth_bytes`` over phase 2, the
latter also per broadcast payload byte (``disk_per_payload_byte``).
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.bench import compare
from gateway.bench.loadgen import Job, hold_connections, run_load, split
from gateway.bench.peers import Broker

TOPIC = "bcast/all"  # every broadcast goes to every session
FILTERS = ("bcast/#", "bcast/all")  # session i subscribes to FILTERS[i % 2]: half wildcard, half exact

RESUME_QUIET_S = 60.0
"""A resuming worker stops draining after this long without a delivery to any of its sessions. A broker serving
10,000 resumed sessions gives each its in-flight window (256 messages) in turn, so a session's next turn comes
after every other's: about 37 s apart at 10 million deliveries and 70,000/s. A worker's sessions can all wait
in the same stretch of that round, and at the default 10 s (``loadgen.QUIET_S``) workers stopped with 9-22% of
their messages still coming (LightGate, 2026-11-23; all 10 million arrived with 60 s)."""

PUBLISH_LIMIT_S = 600.0
"""The publisher stops after its ``--messages`` or after this long, whichever comes first."""

MiB = 2**20
RSS_GROWTH_TARGET_MiB = 5.0  # the bound for LightGate's memory growth while the sessions are offline
DISK_GROWTH_TARGET = 2.0  # ... and for its disk growth, per byte of broadcast payload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=10_000, help="persistent sessions that go offline")
    parser.add_argument("--messages", type=int, default=1_000, help="broadcasts published while they are offline")
    parser.add_argument("--payload", type=int, default=256, help="broadcast payload bytes (at least 16: the stamp)")
    parser.add_argument("--workers", type=int, default=8,  # 4 x 2,500 sessions could not keep up with the flood
                        help="generator worker processes for the sessions")
    parser.add_argument("--drain", type=float, default=900.0,
                        help="longest wait for the deliveries after the reconnect, in seconds "
                             "(10,000 x 1,000 is 10 million deliveries)")
    compare.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_broker = compare.measure_all(args, lambda broker: measure(broker, args), "delivered")
    result: dict[str, Any] = {
        "settings": {"sessions": args.sessions, "messages": args.messages, "payload": args.payload,
                     "workers": args.workers, "drain_s": args.drain, "runs": args.runs, "topic": TOPIC,
                     "filters": FILTERS},
        "brokers": per_broker,
        "ratios": {figure: compare.ratios(per_broker, lambda r, f=figure: r[f])
                   for figure in ("delivered", "rss_growth_MiB")},
        "warnings": compare.generator_warnings(per_broker),
    }
    if "lightgate" in per_broker:
        mine = per_broker["lightgate"]
        result["targets"] = {
            "lightgate_delivered_share": compare.target(mine["delivered_share"], 1.0),
            "lightgate_rss_growth_MiB": compare.target(mine["rss_growth_MiB"], RSS_GROWTH_TARGET_MiB, at_least=False),
            "lightgate_disk_per_payload_byte": compare.target(mine["disk_per_payload_byte"], DISK_GROWTH_TARGET,
                                                              at_least=False),
        }
    return result


def measure(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    """The three phases against ``broker`` (see the module docstring)."""
    shares = split(args.sessions, args.workers)
    hold_connections([Job("idle", broker.host, broker.port, first, count, prefix="off-", qos=1, filters=FILTERS,
                          clean_start=False) for first, count in shares], lambda: None)
    broker.wait_idle()
    rss_before, disk_before = broker.rss_bytes(), broker.disk_bytes()
    publisher = Job("publish", broker.host, broker.port, 0, 1, prefix="bcast-", qos=1, topic=TOPIC,
                    payload_bytes=args.payload, messages=args.messages, duration_s=PUBLISH_LIMIT_S)
    published = run_load([publisher], [])
    broker.wait_idle()
    rss_after, disk_after = broker.rss_bytes(), broker.disk_bytes()
    resume = run_load([], [Job("subscribe", broker.host, broker.port, first, count, prefix="off-", qos=1,
                               clean_start=False) for first, count in shares],
                      drain_s=args.drain, published=published.published, quiet_s=RESUME_QUIET_S)
    loss = resume.lost
    delivered = loss.expected - loss.lost
    drain_s = (resume.last_delivery_ns - resume.connected_ns) / 1e9 if resume.last_delivery_ns else None
    payload_bytes = published.acked * args.payload
    return {
        "sessions": args.sessions,
        "broadcasts_acked": published.acked,
        "publish_per_s": round(published.publish_rate),
        "sessions_resumed": resume.clients["subscribe"]["sessions_present"],
        "expected": loss.expected,
        "delivered": delivered,
        "delivered_share": round(delivered / loss.expected, 6) if loss.expected else None,
        "lost": loss.lost,
        "duplicates": loss.duplicates,
        "drain_s": None if drain_s is None else round(drain_s, 3),
        "drain_capped": resume.drain_capped,
        "delivered_per_s": round(delivered / drain_s) if drain_s else 0,
        "rss_MiB_offline": round(rss_before / MiB, 2),
        "rss_MiB_after_broadcasts": round(rss_after / MiB, 2),
        "rss_growth_MiB": round((rss_after - rss_before) / MiB, 2),
        "disk_bytes_offline": disk_before,
        "disk_growth_bytes": disk_after - disk_before,
        "broadcast_payload_bytes": payload_bytes,
        "disk_per_payload_byte": round((disk_after - disk_before) / payload_bytes, 3) if payload_bytes else None,
        "generator": resume.generator,
    }
