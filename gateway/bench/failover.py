"""Failover: a 3-replica store group under QoS 1 and QoS 2 load through 2 gateways while its leader is killed
``--kills`` times and frozen ``--freezes`` times.

The group is gateway/bench/peers.py's ``start_group`` (a one-member etcd and 3 ``lightgate store`` replicas,
``--acks`` quorum by default) with two gateway processes given the 3 replica addresses. The clients are the
spec-following ones of gateway/bench/crashclients.py, run in this process: ``--publishers`` QoS 1 and as many
QoS 2 publishers at ``--rate`` each on ``fail/<i>`` (persistent sessions; after a reconnect they resend what was
not acknowledged, with DUP and the same packet id), a persistent QoS 2 and a persistent QoS 1 subscriber of
``fail/#``; each client cycles over the two gateways, half of them starting on each.

Each fault waits ``--load`` seconds and until the group is whole (``peers.Group.whole``: etcd names a running
leader and its in-sync set holds all 3 replicas), reads the leader from etcd, then either SIGKILLs it and, once
etcd names another leader, starts it again (same data directory and flags: it comes back as a follower, cutting
what the new leader never had), or SIGSTOPs it for ``FREEZE_LEASES`` etcd leases and SIGCONTs it (it must find
itself fenced, step down and follow). A fault's
*unavailable* time runs from the signal to the first acknowledgement (PUBACK or PUBREC) of a message first sent
after it: only a leader of a later epoch can acknowledge that message, so the figure is how long publishing
stopped, as a device sees it. The fault is a *failover* once etcd names a leader of a higher epoch, and
*whole_s* is how long until the group is whole again with that leader, the faulted replica leading or logging
that it follows (``peers.FOLLOWING``).
After the last fault and another ``--load`` seconds the publishers stop and finish their flows, and the
subscribers read until they have every acknowledged message (or ``QUIET_S`` without a delivery).

With ``--kills 0 --freezes 0`` no group is faulted: the run is the throughput section alone. The throughput
section measures QoS 1 fan-in (gateway/bench/fanin.py's load) against the replicated peers
``lightgate-r3-leader|quorum|all`` and the unreplicated ``lightgate-cluster-1gw`` in the same run (median of
``--runs``), with the issue's targets.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from gateway.bench import compare, crashclients, etcd, fanin, peers

TOPIC = "fail/{i}"
FILTER = "fail/#"

FREEZE_LEASES = 3
"""A frozen leader stays stopped this many etcd leases (``peers.LEASE_S``): long past the lease, so the group
must elect another leader while it sleeps."""

WHOLE_S = 60.0
"""Longest wait for the group to be whole again after a fault; past it the run stops faulting and says so."""

DRAIN_S = 120.0
"""Longest the subscribers read after the publishers stopped."""

QUIET_S = 10.0
"""The subscribers stop waiting for missing messages after this long without a delivery."""

TARGETS = {"quorum/unreplicated": 0.7, "leader/unreplicated": 0.9}
"""The issue's throughput targets: QoS 1 fan-in of a replicated group over one unreplicated store."""

UNAVAILABLE_P99_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=20,
                        help="leader SIGKILLs (each restarted once another leader is elected); 0 with --freezes 0:"
                             " no faulted group, the throughput part alone")
    parser.add_argument("--freezes", type=int, default=5,
                        help=f"leader SIGSTOPs of {FREEZE_LEASES} x the {peers.LEASE_S} s etcd lease, then SIGCONT")
    parser.add_argument("--load", type=float, default=2.0, help="seconds of load before each fault (and after the last)")
    parser.add_argument("--acks", choices=peers.ACKS, default="quorum", help="replication.acks of the faulted group")
    parser.add_argument("--durable", action="store_true", help="the faulted group's replicas flush with sync")
    parser.add_argument("--publishers", type=int, default=2, help="QoS 1 publishers, and as many QoS 2 publishers")
    parser.add_argument("--rate", type=float, default=100.0, help="messages/s of each publisher")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (at least 16: the fan-in stamp)")
    parser.add_argument("--id-range", type=int, default=100, help="publishers cycle packet ids 1..N")
    parser.add_argument("--runs", type=int, default=1, help="throughput: fan-in runs per peer (0: not measured)")
    parser.add_argument("--fanin-publishers", type=int, default=50, help="throughput: fan-in publisher connections")
    parser.add_argument("--fanin-duration", type=float, default=10.0, help="throughput: seconds of fan-in per run")
    parser.add_argument("--fanin-workers", type=int, default=2, help="throughput: publisher worker processes")
    parser.add_argument("--workdir", type=_new_directory, default=None,
                        help="run the faulted group here (a new or empty directory) and keep its data and logs "
                             "(r<i>.log, gateways.log, etcd.log) for a look afterwards (default: a temporary "
                             "directory, removed)")


def _new_directory(text: str) -> Path:
    """``--workdir``: a directory the run can start its group in from nothing (an old group's data would be its
    starting state).

    Raises:
        argparse.ArgumentTypeError: it is a file, or a directory with something in it.
    """
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{text} is not a new or empty directory")
    return path


@dataclass
class Fault:
    """One fault and what followed it; times are trio's clock (``at``) and seconds after ``at``."""

    kind: str  # "kill" or "freeze"
    replica: str  # the leader it hit
    epoch: int  # that leader's epoch
    at: float
    elected_s: float | None = None  # until etcd named a leader of a later epoch (None: not within WHOLE_S)
    leader_after: str | None = None  # the leader once the group was whole again (None: it never was)
    epoch_after: int | None = None
    whole_s: float | None = None
    unavailable_s: float | None = None  # None: no message sent after the fault was ever acknowledged


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {name: getattr(args, name) for name in ("kills", "freezes", "load", "acks", "durable", "publishers",
                                                       "rate", "payload", "id_range", "runs", "fanin_publishers",
                                                       "fanin_duration", "fanin_workers")}
    settings |= {"replicas": peers.REPLICAS, "gateways": 2, "lease_s": peers.LEASE_S,
                 "leader_lease_s": peers.LEADER_LEASE_S, "freeze_s": FREEZE_LEASES * peers.LEASE_S,
                 "topic": TOPIC, "filter": FILTER}
    reason = etcd.missing()
    if reason:
        print(f"bench: skipping failover: {reason}", file=sys.stderr, flush=True)
        return {"settings": settings, "skipped": reason}
    if not args.kills and not args.freezes:  # nothing to fault: the throughput part alone
        result: dict[str, Any] = {}
    elif args.workdir is not None:
        result = _faulted(args.workdir, args)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
            result = _faulted(Path(tmp), args)
    result["throughput"] = throughput(args)
    result["targets"] = targets(result)
    return {"settings": settings, **result}


def _faulted(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    group = peers.start_group(workdir, args.acks, durable=args.durable)
    log = open(workdir / "gateways.log", "ab")
    ports = [peers.free_port(), peers.free_port()]
    gateways = []
    try:
        gateways = [peers.start_gateway(group.addresses(), port, workdir, log) for port in ports]
        for port, gateway in zip(ports, gateways):
            peers.wait_listening([gateway.pid], port, 1, "failover gateway", workdir / "gateways.log")
        return trio.run(_run, group, [(peers.HOST, port) for port in ports], args)
    finally:
        for gateway in gateways:
            peers.terminate(gateway)
        log.close()
        group.stop()


async def _run(group: peers.Group, gateways: list[crashclients.Address], args: argparse.Namespace
               ) -> dict[str, Any]:
    def addresses(client: crashclients.Publisher | crashclients.Subscriber) -> Callable[[], crashclients.Address]:
        """Client number i starts on gateway i % 2, then alternates."""
        first = client.number % 2
        return crashclients.address_cycle(gateways[first:] + gateways[:first])

    publishers = [crashclients.Publisher(i, 1 + i // args.publishers, TOPIC.format(i=i), rate=args.rate,
                                         id_range=args.id_range, payload_bytes=args.payload, prefix="fpub-")
                  for i in range(2 * args.publishers)]
    exact = crashclients.Subscriber(0, 2, FILTER, prefix="fsub2-")
    once = crashclients.Subscriber(1, 1, FILTER, prefix="fsub1-")
    faults: list[Fault] = []

    async def during() -> None:
        await _fault(group, args, faults)
        await trio.sleep(args.load)

    await crashclients.exchange(publishers, [exact, once], addresses, during, drain_s=DRAIN_S, quiet_s=QUIET_S)
    for fault in faults:
        fault.unavailable_s = unavailable_s(publishers, fault.at)
    return account(publishers, exact, once, faults) | {
        "unfinished_flows": sum(len(p.inflight) for p in publishers),
        "publisher_reconnects": sum(p.connects - 1 for p in publishers if p.connects),
        "publisher_resent": sum(p.resent for p in publishers),
        "sessions_lost": {"publishers": sum(p.sessions_lost for p in publishers),
                          "subscribers": exact.sessions_lost + once.sessions_lost},
    }


async def _fault(group: peers.Group, args: argparse.Namespace, faults: list[Fault]) -> None:
    """The kills, then the freezes, each once the group is whole; stops early (saying why) if it never is."""
    for kind in ["kill"] * args.kills + ["freeze"] * args.freezes:
        await trio.sleep(args.load)  # the load runs in the client tasks meanwhile
        try:
            found = await trio.to_thread.run_sync(group.wait_whole, WHOLE_S)
        except peers.PeerError as exc:  # a replica exited on its own
            found, why = None, str(exc)
        else:
            why = f"not whole within {WHOLE_S} s ({group.state()})"
        if found is None:
            print(f"bench: failover: stopping after {len(faults)} faults: the group is {why}", file=sys.stderr,
                  flush=True)
            return
        leader, epoch = found
        logged = leader.log_size()
        fault = Fault(kind, leader.name, epoch, trio.current_time())
        if kind == "kill":
            leader.kill()
            await _watch_election(group, fault)  # a machine that died comes back after the group moved on
            await trio.to_thread.run_sync(leader.start)
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_election, group, fault)
                await _freeze(leader)
        try:
            after = await trio.to_thread.run_sync(group.wait_whole, WHOLE_S, epoch, (leader, logged))
        except peers.PeerError as exc:
            after = None
            print(f"bench: failover: fault {len(faults) + 1} ({kind} of {leader.name}): {exc}", file=sys.stderr,
                  flush=True)
        if after is not None:
            fault.leader_after, fault.epoch_after = after[0].name, after[1]
            fault.whole_s = round(trio.current_time() - fault.at, 3)
        faults.append(fault)


async def _freeze(leader: peers.Replica) -> None:
    """SIGSTOP ``leader`` for ``FREEZE_LEASES`` etcd leases, then SIGCONT it."""
    assert leader.process is not None
    os.kill(leader.process.pid, signal.SIGSTOP)
    try:
        await trio.sleep(FREEZE_LEASES * peers.LEASE_S)
    finally:  # also when the run is interrupted: a stopped process would not act on its SIGTERM
        os.kill(leader.process.pid, signal.SIGCONT)


async def _watch_election(group: peers.Group, fault: Fault) -> None:
    """Set ``fault.elected_s`` once etcd names a leader of a later epoch than the faulted one's (during a freeze,
    too), polling for at most ``WHOLE_S``."""
    while trio.current_time() - fault.at < WHOLE_S:
        try:
            leader = await trio.to_thread.run_sync(group.etcd.leader, peers.GROUP)
        except etcd.EtcdError:
            leader = None  # etcd busy for a moment: look again
        if leader is not None and int(leader["epoch"]) > fault.epoch:
            fault.elected_s = round(trio.current_time() - fault.at, 3)
            return
        await trio.sleep(0.05)  # polling etcd's leader key: the benchmark does not watch it


def unavailable_s(publishers: Sequence[crashclients.Publisher], at: float) -> float | None:
    """Seconds from ``at`` to the first acknowledgement of a message first sent after ``at``; None if none was."""
    first = min((acked for p in publishers for sent, acked in p.ack_times if sent > at), default=None)
    return None if first is None else round(first - at, 3)


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``share`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def account(publishers: Sequence[crashclients.Publisher], exact: crashclients.Subscriber,
            once: crashclients.Subscriber, faults: Sequence[Fault]) -> dict[str, Any]:
    """The result's loss, duplicate and unavailability figures.

    ``acked_lost``: acknowledged messages one of the subscribers never got; ``duplicates_qos2``: messages of
    the QoS 2 publishers the QoS 2 subscriber got twice. A fault no acknowledgement followed counts as an
    infinite unavailability, so it shows in the percentiles as None (unmeasured: no target met).
    """
    acked: set[int] = set().union(*(p.acked for p in publishers))
    exactly_once = [p for p in publishers if p.qos == 2]
    times = [math.inf if f.unavailable_s is None else f.unavailable_s for f in faults]

    def spread(share: float) -> float | None:
        value = percentile(times, share) if times else None
        return None if value is None or math.isinf(value) else value

    return {
        "acked": len(acked),
        "acked_lost": sum(1 for key in acked if key not in exact.counts or key not in once.counts),
        "duplicates_qos2": crashclients.account(exactly_once, exact).duplicates,
        "qos2_subscriber": crashclients.account(publishers, exact).as_dict(),
        "qos1_subscriber": {"lost": (one := crashclients.account(publishers, once)).lost,
                            "duplicates": one.duplicates},
        "kills": sum(1 for f in faults if f.kind == "kill"),
        "freezes": sum(1 for f in faults if f.kind == "freeze"),
        "failovers": sum(1 for f in faults if f.epoch_after is not None and f.epoch_after > f.epoch),
        "never_available": sum(1 for f in faults if f.unavailable_s is None),
        "unavailable_s_p50": spread(0.5),
        "unavailable_s_p99": spread(0.99),
        "unavailable_s_max": spread(1.0),
        "faults": [{k: v for k, v in asdict(f).items() if k != "at"} for f in faults],
    }


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """QoS 1 fan-in against the replicated peers and the unreplicated one, same run; ``--runs 0``: not measured."""
    if not args.runs:
        return {}
    load = argparse.Namespace(publishers=args.fanin_publishers, duration=args.fanin_duration, messages=0,
                              payload=args.payload, workers=args.fanin_workers, runs=args.runs,
                              brokers=[peers.UNREPLICATED, *map(peers.replicated_name, peers.ACKS)])
    per_broker = compare.measure_all(load, lambda broker: fanin.measure(broker, load, 1, rate=0.0),
                                     "delivered_per_s")
    for result in per_broker.values():
        result["acked_per_s"] = round(result["publish_per_s"] * result["acked"] / result["sent"]) \
            if result["sent"] else 0
    return {"brokers": per_broker,
            "ratios": {"delivered_per_s": peers.replicated_ratios(per_broker, lambda r: r["delivered_per_s"]),
                       "acked_per_s": peers.replicated_ratios(per_broker, lambda r: r["acked_per_s"])},
            "warnings": compare.generator_warnings(per_broker)}


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: nothing acknowledged lost, no QoS 2 duplicate, p99 unavailability (when faults were
    made), throughput."""
    ratios = result["throughput"].get("ratios", {}).get("delivered_per_s", {})
    faulted = {
        "acked_lost": compare.target(result["acked_lost"], 0, at_least=False),
        "duplicates_qos2": compare.target(result["duplicates_qos2"], 0, at_least=False),
        "unavailable_s_p99": compare.target(result["unavailable_s_p99"], UNAVAILABLE_P99_S, at_least=False),
    } if "acked" in result else {}
    return faulted | {ratio: compare.target(ratios.get(ratio), limit) for ratio, limit in TARGETS.items()}
