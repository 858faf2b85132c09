"""POP consumption next to the claim/ack groups, with members that hang or crash: ``lightgate bench pop``.

For each mode a fresh ``lightgate store`` process; this process appends ``--rate`` messages/s to one topic for
``--seconds`` (in bursts every ``--burst-ms``, so a pop or a claim finds a batch waiting), and ``--consumers``
members, each a process of its own with its own connection, read the topic as one group:

- ``pop``: ``PopConsumer`` (store/clients/pop.py) pops ``--batch`` messages (invisible ``--invisible-s``), handles
  each (``--work-ms``, a sleep: I/O-bound work) and acknowledges each;
- ``claim``: ``Consumer`` (store/clients/consumer.py) claims ``--batch``, handles each and commits each.

``--hang`` of the members take one batch after a quarter of the production time and never acknowledge it (the
process lives on, connected: a hung handler); ``--crash`` of them SIGKILL themselves halfway through it, in the
middle of a batch (half of it acknowledged: never while an acknowledgement is on its way, so the logs say exactly
what counted). The hung ones are SIGKILLed when production ends: a claim/ack group hands a member's messages to
the others only when it leaves, so they would be held for ever. Then the run drains until
every message is acknowledged, or for ``DRAIN_S``.

Each member logs what it was handed and what it acknowledged to a file (a SIGKILLed one keeps what it wrote); one
``BENCH`` line per mode says: delivered/s over the production time, acked (distinct messages), lost (published but
never acknowledged: must be 0), redelivered (deliveries beyond each message's first), dead-lettered (POP: the
messages of ``$dlq/<group>``), and the time from publish to first acknowledgement (p50, p99, p99.9, max, and how
many took over ``LATE_S``): what the hung and crashed members cost the others' messages. The summary compares them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil
import trio

from gateway.bench.common import emit
from gateway.bench.peers import HOST, store_process
from store.api import NewMessage, dlq_topic
from store.clients.consumer import Consumer
from store.clients.pop import PopConsumer
from store.rpc.client import RemoteStore

__all__ = ["MODES", "MemberJob", "add_arguments", "member_main", "run"]

MODES = ("pop", "claim")

TOPIC = "bench/pop/jobs"
GROUP = "bench-pop"

STAMP = struct.Struct(">Qq")
"""A message's payload: its sequence number and the wall-clock ns it was published at (members are processes on
this machine: one clock)."""

READY_S = 60.0
"""Longest wait for the members to connect (each imports the store client in a fresh process)."""

DRAIN_S = 60.0
"""Longest wait, once production ended, for every message to be acknowledged."""

LATE_S = 1.0
"""A message acknowledged more than this after its publish counts as late."""

ROLES = ("work", "hang", "crash")


@dataclass(frozen=True, slots=True)
class MemberJob:
    """What one member process does: its ``role`` in ``mode``, against the store on ``port``, logging to ``log``."""

    mode: str
    role: str
    index: int
    port: int
    log: str
    batch: int
    work_s: float
    invisible_s: float
    fail_after_s: float  # a hang or crash member fails at its first batch after this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, help="production time of each mode")
    parser.add_argument("--rate", type=int, default=200, help="messages published per second")
    parser.add_argument("--burst-ms", type=int, default=100, help="the producer appends a burst this often")
    parser.add_argument("--consumers", type=int, default=4, help="members of the group")
    parser.add_argument("--hang", type=int, default=1, help="members that take a batch and never acknowledge it")
    parser.add_argument("--crash", type=int, default=1, help="members SIGKILLed mid-batch halfway through")
    parser.add_argument("--work-ms", type=float, default=2.0, help="handling time per message")
    parser.add_argument("--batch", type=int, default=32, help="messages per pop or claim")
    parser.add_argument("--invisible-s", type=float, default=3.0, help="the POP members' invisible time")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--flush", choices=("async", "sync"), default="async", help="the store's commitlog.flush")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where the per-mode lines are appended (default: the checkout's bench/results)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One ``BENCH`` line per mode (emitted here); returns the summary."""
    if args.hang + args.crash >= args.consumers:
        raise SystemExit("--hang plus --crash must leave at least one member that works")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-pop-", dir=args.dir) as tmp:
        for mode in args.modes:
            row = _mode(Path(tmp) / mode, mode, args)
            emit("pop", row, args.results)
            rows.append(row)
    return {"summary": _summary(rows), "settings": _settings(args), "load_average": round(psutil.getloadavg()[0], 2)}


def _mode(work: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    work.mkdir(parents=True)
    roles = ["hang"] * args.hang + ["crash"] * args.crash
    roles += ["work"] * (args.consumers - len(roles))
    context = multiprocessing.get_context("spawn")
    with store_process(work / "data", args.flush) as (port, _):
        jobs = [MemberJob(mode, role, n, port, str(work / f"member{n}.log"), args.batch, args.work_ms / 1000,
                          args.invisible_s, args.seconds / (4 if role == "hang" else 2))
                for n, role in enumerate(roles)]
        members = [context.Process(target=member_main, args=(job,), daemon=True) for job in jobs]
        try:
            for member in members:
                member.start()
            _wait_ready(jobs)
            published, producing_s = trio.run(_produce, port, args)
            for job, member in zip(jobs, members):
                if job.role == "hang":
                    member.kill()
            drain_s = _drain(jobs, published)
            dead = trio.run(_dead_letters, port) if mode == "pop" else None
        finally:
            for member in members:
                member.kill()
                member.join()
    return _row(mode, args, _read(jobs), published, producing_s, drain_s, dead)


async def _produce(port: int, args: argparse.Namespace) -> tuple[int, float]:
    """Publish ``--rate`` messages/s for ``--seconds`` in bursts; returns the count published and the production
    time."""
    per_burst = max(1, round(args.rate * args.burst_ms / 1000))
    bursts = max(1, round(args.seconds * 1000 / args.burst_ms))
    start = trio.current_time()
    seq = 0
    async with RemoteStore.connect(HOST, port, node="bench-pop-producer") as store:
        for burst in range(bursts):
            await trio.sleep_until(start + burst * args.burst_ms / 1000)
            now = time.time_ns()
            await store.append([NewMessage(TOPIC, STAMP.pack(seq + n, now), "bench-pop-producer", 1)
                                for n in range(per_burst)])
            seq += per_burst
    return seq, trio.current_time() - start


async def _dead_letters(port: int) -> int:
    async with RemoteStore.connect(HOST, port, node="bench-pop-dlq") as store:
        (count,) = await store.max_offsets([dlq_topic(GROUP)])
    return count


def _wait_ready(jobs: list[MemberJob]) -> None:
    """Until every member logged that it is connected (this is a benchmark's start, not a test's condition)."""
    deadline = time.monotonic() + READY_S
    while not all(Path(job.log).exists() and Path(job.log).read_text().startswith("R") for job in jobs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"members not connected within {READY_S} s: see {Path(jobs[0].log).parent}")
        time.sleep(0.05)


def _drain(jobs: list[MemberJob], published: int) -> float:
    """Until every message is acknowledged, or ``DRAIN_S``; returns the time it took."""
    start = time.monotonic()
    while len(_read(jobs).first_ack) < published and time.monotonic() - start < DRAIN_S:
        time.sleep(0.1)
    return time.monotonic() - start


@dataclass(slots=True)
class _Log:
    deliveries: int
    first_ack: dict[int, int]  # seq -> publish-to-ack µs of its first acknowledgement
    delivered: set[int]


def _read(jobs: list[MemberJob]) -> _Log:
    """What the members' logs say (a SIGKILLed member's last line may be cut: it is skipped)."""
    log = _Log(0, {}, set())
    for job in jobs:
        for line in Path(job.log).read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "D":
                log.deliveries += 1
                log.delivered.add(int(fields[1]))
            elif len(fields) == 3 and fields[0] == "A":
                log.first_ack.setdefault(int(fields[1]), int(fields[2]))
    return log


def _row(mode: str, args: argparse.Namespace, log: _Log, published: int, producing_s: float, drain_s: float,
         dead: int | None) -> dict[str, Any]:
    latencies = sorted(log.first_ack.values())

    def quantile(q: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(len(latencies) * q))] / 1000, 1) if latencies else None

    return {
        "mode": mode, "published": published, "acked": len(log.first_ack),
        "lost": published - len(log.first_ack) - (dead or 0),
        "delivered_per_s": round(len(log.delivered) / producing_s), "deliveries": log.deliveries,
        "redelivered": log.deliveries - len(log.delivered), "dead_lettered": dead,
        "p50_ms": quantile(0.5), "p99_ms": quantile(0.99), "p999_ms": quantile(0.999), "max_ms": quantile(1.0),
        "late": sum(1 for us in latencies if us > LATE_S * 1e6), "drain_s": round(drain_s, 2),
        "settings": _settings(args),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """POP against the claim/ack group, from the same run: the slow tail the hung and crashed members made."""
    by_mode = {row["mode"]: row for row in rows}
    if set(by_mode) != set(MODES):
        return {}
    pop, claim = by_mode["pop"], by_mode["claim"]
    return {figure: {"pop": pop[figure], "claim": claim[figure]}
            for figure in ("p99_ms", "p999_ms", "max_ms", "late", "redelivered", "lost", "delivered_per_s")}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ("seconds", "rate", "burst_ms", "consumers", "hang", "crash",
                                                   "work_ms", "batch", "invisible_s", "flush")}


# --- the member processes ----------------------------------------------------------------------------------


def member_main(job: MemberJob) -> None:
    """A member process (multiprocessing's spawn target): runs until SIGKILLed."""
    trio.run(_member, job)


async def _member(job: MemberJob) -> None:
    name = f"bench-{job.mode}-{job.index}"
    with open(job.log, "w", buffering=1) as log:
        if job.mode == "pop":
            async with PopConsumer.connect(HOST, job.port, group=GROUP, filter=TOPIC, client_id=name,
                                           invisible_s=job.invisible_s, max_count=job.batch, wait_s=1.0) as popper:
                await _serve(job, log, popper.pop, popper.ack)
        else:
            async with Consumer.connect(HOST, job.port, group=GROUP, filter=TOPIC, client_id=name,
                                        max_count=job.batch, wait_s=1.0, auto_commit=False) as claimer:
                async def commit(message: Any) -> bool:
                    await claimer.commit([message.offset])
                    return True  # a claimed offset stays this member's: it is never handed out again

                await _serve(job, log, claimer.poll, commit)


async def _serve(job: MemberJob, log: TextIO, take: Callable[[], Awaitable[Sequence[Any]]],
                 ack: Callable[[Any], Awaitable[bool]]) -> None:
    """Take batches, handle each message, acknowledge it; log ``D seq`` per delivery and ``A seq µs`` per
    acknowledgement that counted. At its first batch after ``fail_after_s`` a ``hang`` member stops (connected),
    a ``crash`` member SIGKILLs itself once half of the batch is acknowledged."""
    log.write("R\n")
    fail_at = trio.current_time() + job.fail_after_s
    while True:
        batch = list(await take())
        for message in batch:
            log.write(f"D {STAMP.unpack(message.payload)[0]}\n")
        failing = bool(batch) and job.role != "work" and trio.current_time() >= fail_at
        if failing and job.role == "hang":
            await trio.sleep_forever()
        for n, message in enumerate(batch):
            if failing and n == len(batch) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            await trio.sleep(job.work_s)
            if await ack(message):
                seq, sent_ns = STAMP.unpack(message.payload)
                log.write(f"A {seq} {(time.time_ns() - sent_ns) // 1000}\n")
