"""Run one measurement against every broker in the same run and report LightGate's ratio to each peer.

The gateway scenarios (``gateway/bench/fanin.py``, ``fanin_rate.py``, ``fanout.py``,
``conns.py``) each describe a load; this module starts a fresh broker per run
(``gateway/bench/peers.py``), measures the broker's CPU time during the load and its RSS at the end of the
load, keeps the median run, and adds the ratios and the generator warning.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.bench import peers
from gateway.bench.peers import Broker

GENERATOR_LIMIT = 0.8
"""A generator process busier than this share of a core may have set the pace instead of the broker."""


DROPPED_MOST = 0.5
"""A peer that lost more than this share of its messages: LightGate's ratio to it says so beside it (a rate of what
is left after dropping most is no rate of the same work)."""


def add_arguments(parser: argparse.ArgumentParser, runs: int = 1) -> None:
    """The flags every gateway scenario shares."""
    parser.add_argument("--brokers", nargs="+", default=list(peers.PEERS), type=peers.peer_name,
                        help=f"brokers to measure: {', '.join(peers.PEERS)}, {peers.CLUSTER_PREFIX}<N>gw (cluster "
                             f"mode), {', '.join(map(peers.replicated_name, peers.ACKS))} (3 replicas and etcd: "
                             f"compared with {peers.UNREPLICATED}); LightGate's ratios need lightgate in the list")
    parser.add_argument("--runs", type=int, default=runs, help="runs per broker; the median run is reported")


def measure_all(args: argparse.Namespace, measure: Callable[[Broker], dict[str, Any]], key: str) -> dict[str, Any]:
    """``{broker: median run of measure(broker)}``; each run gets a fresh broker in a temporary directory.

    ``key`` names the figure (a top-level key of measure's result) that picks the median run.
    """
    results = {}
    for name in peers.available(args.brokers):
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp, peers.start(name, Path(tmp)) as broker:
                cpu0 = broker.cpu_s()
                result = measure(broker)
                result["broker"] = {"cpu_s": round(broker.cpu_s() - cpu0, 2),
                                    "rss_MiB_end": round(broker.rss_bytes() / 2**20, 1)}
            runs.append(result)
        results[name] = median_run(runs, key)
    return results


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose ``key`` is the (lower) median, with every run's ``key`` listed under ``runs``."""
    values = [run[key] for run in runs]
    middle = statistics.median_low(values)
    chosen = dict(runs[values.index(middle)])
    chosen["runs"] = values
    return chosen


def ratios(results: dict[str, dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> dict[str, float | None]:
    """``lightgate/<peer>`` of the figure ``get`` extracts, for every peer measured with LightGate."""
    if "lightgate" not in results:
        return {}
    mine = get(results["lightgate"])
    out: dict[str, float | None] = {}
    for name, result in results.items():
        if name != "lightgate":
            theirs = get(result)
            out[f"lightgate/{name}"] = round(mine / theirs, 3) if theirs else None
    return out


def dropped(run: Any, most: float = DROPPED_MOST) -> str | None:
    """"dropped N%" when a broker's ``run`` lost more than ``most`` of the messages it was sent (``lost`` of
    ``expected``); else None. A loss under 1% is given as a count ("dropped 12 of 1,500,000")."""
    lost, expected = (run.get(key) if isinstance(run, dict) else None for key in ("lost", "expected"))
    if not isinstance(lost, (int, float)) or not isinstance(expected, (int, float)) or not expected \
            or lost <= most * expected:
        return None
    share = lost / expected
    return f"dropped {share:.0%}" if share >= 0.01 else f"dropped {lost:,} of {expected:,}"


def caveats(results: dict[str, dict[str, Any]], most: float = DROPPED_MOST) -> dict[str, str]:
    """``lightgate/<peer>`` -> why LightGate's ratio to that peer is no like-for-like figure (it dropped more than
    ``most`` of its messages)."""
    if "lightgate" not in results:
        return {}
    return {f"lightgate/{name}": caveat for name, result in results.items()
            if name != "lightgate" and (caveat := dropped(result, most))}


def generator_warnings(results: dict[str, dict[str, Any]]) -> list[str]:
    """One warning per broker run in which a generator process used more than ``GENERATOR_LIMIT`` of a core.

    The warnings are printed to stderr as well as returned (they go into the result).
    """
    warnings = []
    for name, result in results.items():
        for label, run in _generator_sections(result):
            share = run["busiest_process_core_share"]
            if share > GENERATOR_LIMIT:
                warnings.append(f"{name}{label}: a generator process used {share:.0%} of a core "
                                f"(> {GENERATOR_LIMIT:.0%}): the generator may have set the pace")
    for warning in warnings:
        print(f"bench: warning: {warning}", file=sys.stderr, flush=True)
    return warnings


def _generator_sections(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if "generator" in result:
        return [("", result["generator"])]
    return [(f" {key}", value["generator"]) for key, value in result.items()
            if isinstance(value, dict) and "generator" in value]


def target(value: float | None, limit: float, at_least: bool = True) -> dict[str, Any]:
    """A target check: ``value >= limit`` (or ``<=`` when ``at_least`` is False); unmeasured is not met."""
    met = value is not None and (value >= limit if at_least else value <= limit)
    return {"value": value, "target": (">= " if at_least else "<= ") + str(limit), "met": met}
