"""Costs in proportion (issue 31): filters, long topics and a subscriber that never reads, against their targets.

Three of ``lightgate bench hostile``'s attacks, each against a fresh broker
beside its canary (``hostile.measure``), LightGate and Mosquitto in the same run:

- ``session-filters``: 50 persistent sessions x 1,000 filters: the attack's
  seconds and the broker's RSS growth (peak over before), and the broker's and
  the attack client's CPU seconds (``warnings`` says when the client's were more);
- ``long-topics``: one client, 30,000 distinct 4 KB topics: seconds, RSS
  growth, the canary's p99 during it;
- ``never-reads``: a QoS 0 flood (3,000 x 64 KB) with a subscriber that never
  reads, beside the same flood without it (``flood``): RSS growth over the
  flood's, at its peak and 5 s after (the stalled connection is closed at the
  end, so what it made the node take is still counted then and freed by the
  +12 s sample), and the canary's p99 during it over its p99 during the plain flood.

Each scenario's figures are set beside the issue's targets (``TARGETS``); the
result says which hold. Nothing is asserted (tests/gateway/bench/test_proportion.py
runs it at tiny sizes).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from gateway.bench import hostile, peers

SCENARIOS = ("session-filters", "long-topics", "flood", "never-reads")
"""``flood`` is ``never-reads``'s baseline: the same flood with every subscriber reading."""

TARGETS: dict[str, dict[str, float]] = {
    "session-filters": {"attack_s": 2.0, "rss_growth_MiB": 150.0},
    "long-topics": {"attack_s": 10.0, "rss_growth_MiB": 200.0, "canary_p99_ms": 500.0},
    "never-reads": {"rss_growth_over_flood_MiB": 20.0, "rss_after_over_flood_MiB": 20.0, "canary_p99_over_flood": 2.0},
}
"""Issue 31's table, at ``--scale 1``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    hostile.add_arguments(parser)
    parser.set_defaults(attacks=list(SCENARIOS))


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for attack in args.attacks:
        for name in peers.available(args.brokers):
            print(f"bench proportion: {attack} against {name}", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"bench-proportion-{name}-") as tmp, \
                    peers.start(name, Path(tmp), websocket=True) as broker:
                results.setdefault(name, {})[attack] = hostile.measure(broker, attack, args)
    return {
        "settings": {"attacks": args.attacks, "scale": args.scale, "canary_rate": args.canary_rate,
                     "phase_s": args.phase_s, "settle_s": args.settle_s,
                     "sizes": {a: hostile._sizes(a, args.scale) for a in args.attacks}},
        "runs": results,
        "figures": {name: figures(runs) for name, runs in results.items()},
        "targets": TARGETS,
        "warnings": hostile.client_warnings({(attack, name): run for name, runs in results.items()
                                             for attack, run in runs.items()}),
    }


def figures(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each scenario's figures in ``TARGETS``' terms, with ``met`` (None when a figure is missing)."""
    out: dict[str, dict[str, Any]] = {}
    for attack in ("session-filters", "long-topics"):
        if attack in runs:
            run = runs[attack]
            out[attack] = {"attack_s": run["attack_s"], "rss_growth_MiB": _growth(run),
                           "canary_p99_ms": run["canary"]["during"]["p99_ms"],
                           "broker_cpu_s": run["broker_cpu_s_during"], "client_cpu_s": run["client_cpu_s_during"]}
    if "never-reads" in runs and "flood" in runs:
        stalled, flood = runs["never-reads"], runs["flood"]
        p99, base = stalled["canary"]["during"]["p99_ms"], flood["canary"]["during"]["p99_ms"]
        out["never-reads"] = {
            "rss_growth_over_flood_MiB": round(_growth(stalled) - _growth(flood), 1),
            "rss_after_over_flood_MiB": round(_growth(stalled, "after") - _growth(flood, "after"), 1),
            "canary_p99_over_flood": round(p99 / base, 2) if p99 is not None and base else None,
            "canary_p99_ms": p99, "flood_canary_p99_ms": base}
    for attack, figure in out.items():
        wanted = TARGETS[attack]
        values = [figure.get(key) for key in wanted]
        figure["met"] = None if None in values else all(v <= wanted[k] for k, v in zip(wanted, values))
    return out


def _growth(run: dict[str, Any], sample: str = "peak_during") -> float:
    rss = run["rss_MiB"]
    return round(rss[sample] - rss["before"], 1)
