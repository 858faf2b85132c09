"""``lightgate bench timers``: delayed messages in the store (store/timer/), scheduled, held, and dequeued.

An in-process store schedules ``--messages`` delayed messages due over ``--spread`` seconds (or at ``--due-rate``
per second) after a lead time that covers the scheduling; it reports the scheduling rate (appended and applied by
dispatch), the process's RSS (its peak, as the OS counts it) and the disk growth with all of them pending, then
closes the store and opens it again (the open's time and the TimerLog entries it read: none, the wheel is kept
with the checkpoint), waits until the last message is delivered and reports the dequeue rate (delivered messages
over the time from the first delivery to the last: with ``--spread 0`` all are due at once and it is the step's
capacity), the lateness of every message (its delivered record's store time minus its due time: p50, p99, max)
and the RSS peak of the whole run (the dequeue's working set included). The CPU per dequeued message is the
process's CPU time (every thread: the dequeue step, dispatch, RocksDB, the probe) from the first due time until the
last message fired, over the messages delivered: what the process needs of a core at a due rate, whatever its
share (not from the reopen: the wait until the first due time holds RocksDB's compactions of the scheduling).

Undelayed traffic meanwhile (``--probe-hz``): a probe appends a QoS 1 message to a topic of its own at that rate
and times its round trip (append acknowledged, then indexed by dispatch: readable by a subscriber), while the
delayed messages wait (``idle``), while they fire (``firing``), and in a control phase after them (``busy``): as
many undelayed messages as were fired, to the same topics with the same payloads, appended at the due rate in
writes shaped like the dequeue step's (one per ``TICK_MS`` of what fell due meanwhile: 200 at 10,000 a second)
through ``StoreNode.append``, the path of a gateway's or a producer's write of many messages. A fired write is
indexed before an undelayed message appended after it, as any write of its size would be: the firing figure
against the busy one is what the timer costs other traffic beyond the traffic it makes. The busy phase's CPU per
message is counted as the firing's.
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from store.api import NewMessage
from store.log.commitlog import CommitLogConfig
from store.log.record import now_ms
from store.node import StoreNode, open_store
from store.timer.dequeue import TICK_MS
from store.usage import process_usage

DUE = struct.Struct(">Q")
"""Each payload starts with its due time (ms), so lateness is read back from the delivered records."""

BATCH = 1000
"""Delayed messages per append."""

PROBE_TOPIC = "bench-probe"

PROBE_HZ = 100.0
"""Probe round trips a second: about 1,000 in each 10 s phase at 100,000 messages and 10,000 due a second, so the
p99 is the 10th worst, not the 2nd (20 a second gave 195); 1% of the traffic the phases carry, one message at a
time."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=int, default=100_000, help="delayed messages scheduled")
    parser.add_argument("--spread", type=float, default=10.0, help="seconds their due times are spread over")
    parser.add_argument("--due-rate", type=float, default=None,
                        help="messages due per second (sets the spread to messages / rate)")
    parser.add_argument("--lead", type=float, default=None,
                        help="seconds from the start to the first due time (default: 5 + 1 per 10,000 messages)")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes of each message")
    parser.add_argument("--topics", type=int, default=100, help="topics the messages go to, in turn")
    parser.add_argument("--probe-hz", type=float, default=PROBE_HZ,
                        help="undelayed QoS 1 round trips timed per second (0: none)")
    parser.add_argument("--no-busy", dest="busy", action="store_false",
                        help="skip the control phase (undelayed traffic at the due rate after the firing)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-timers-", dir=args.dir) as tmp:
        return trio.run(_run, Path(tmp), args)


async def _run(data: Path, args: argparse.Namespace) -> dict[str, Any]:
    count = args.messages
    spread_s = count / args.due_rate if args.due_rate else args.spread
    spread_ms = int(spread_s * 1000)
    filler = b"x" * max(0, args.payload - DUE.size)
    lead_ms = int(args.lead * 1000) if args.lead is not None else 5000 + count // 10
    rss_before = process_usage().rss_bytes
    async with open_store(data, CommitLogConfig()) as node:
        disk_before = _disk(data)
        first_due = now_ms() + lead_ms
        started = time.perf_counter()
        for start in range(0, count, BATCH):
            batch = []
            for i in range(start, min(count, start + BATCH)):
                due = first_due + i * spread_ms // count
                batch.append(NewMessage(f"bench/{i % args.topics}", DUE.pack(due) + filler, "bench", 1, deliver_at_ms=due))
            await node.append(batch)
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        scheduled_s = time.perf_counter() - started
        pending = node.timers.pending
        rss_pending = process_usage().rss_bytes
        disk_pending = _disk(data)
    late_at_scheduled = max(0, now_ms() - first_due)
    opened = time.perf_counter()
    async with open_store(data, CommitLogConfig()) as node:
        reopen_s = time.perf_counter() - opened
        entries_read = node.timers.entries_read
        probe = _Probe(node, first_due, first_due + spread_ms)
        cpu_from: float | None = None
        with trio.fail_after(lead_ms / 1000 + spread_s + 600):
            async with trio.open_nursery() as nursery:
                if args.probe_hz:
                    nursery.start_soon(probe.run, 1 / args.probe_hz)
                while node.timers.pending:
                    if cpu_from is None and now_ms() >= first_due:
                        cpu_from = time.process_time()
                    await trio.sleep(0.1)  # polling the figure the bench reports on, not a synchronisation
                nursery.cancel_scope.cancel()
        firing_cpu_s = time.process_time() - (cpu_from or time.process_time())
        lateness, first_went, last_went = await trio.to_thread.run_sync(_delivered, node, args.topics)
        busy = await _busy(node, probe, args, count, spread_s) if args.busy and spread_s else None
    delivered = sum(lateness.values())
    return {
        "messages": count, "topics": args.topics, "due_per_s": round(count / spread_s) if spread_s else None,
        "pending_after_scheduling": pending, "delivered": delivered,
        "scheduled_per_s": round(count / scheduled_s),
        "dequeued_per_s": round(delivered * 1000 / max(1, last_went - first_went)) if delivered else 0,
        "lateness_ms": _percentiles(lateness), "first_due_passed_while_scheduling_ms": late_at_scheduled,
        "rss_growth_bytes": rss_pending - rss_before, "disk_growth_bytes": disk_pending - disk_before,
        "rss_peak_growth_bytes": process_usage().rss_bytes - rss_before,
        "disk_bytes_per_pending": round((disk_pending - disk_before) / max(1, count)),
        "reopen_s": round(reopen_s, 3), "timer_entries_read_on_open": entries_read,
        "probe_round_trip_ms": probe.figures() if args.probe_hz else None, "probe_hz": args.probe_hz,
        "cpu_us_per_dequeued": round(firing_cpu_s * 1e6 / delivered, 1) if delivered else None,
        "busy": busy,
        "load_average": round(os.getloadavg()[0], 2),
    }


async def _busy(node: StoreNode, probe: _Probe, args: argparse.Namespace, count: int, spread_s: float
                ) -> dict[str, Any]:
    """The control phase: ``count`` undelayed messages at the due rate in the dequeue's writes, probed as the firing
    was; the messages appended, the rate they went at, the process's CPU per message, and the messages the topics
    then hold (the fired ones and these)."""
    filler = b"x" * max(0, args.payload - DUE.size)
    rate_per_ms = count / (spread_s * 1000)
    with trio.fail_after(spread_s + 600):
        async with trio.open_nursery() as nursery:
            probe.busy = True
            if args.probe_hz:
                nursery.start_soon(probe.run, 1 / args.probe_hz)
            cpu_from = time.process_time()
            began_ms, sent, writes = now_ms(), 0, 0
            while sent < count:
                now = now_ms()
                due = min(count, int((now - began_ms) * rate_per_ms))
                if due > sent:  # what fell due since the last write, as the dequeue's batch: one write, indexed
                    offsets = await node.append([NewMessage(f"bench/{i % args.topics}", DUE.pack(now) + filler,
                                                            "bench", 1) for i in range(sent, due)])
                    await node.dispatcher.wait_dispatched(offsets[-1] + 1)
                    sent, writes = due, writes + 1
                await trio.sleep(max(0, now + TICK_MS - now_ms()) / 1000)
            took_ms = now_ms() - began_ms
            cpu_s = time.process_time() - cpu_from
            probe.busy = False
            nursery.cancel_scope.cancel()
    return {"messages": sent, "writes": writes, "per_s": round(sent * 1000 / max(1, took_ms)),
            "cpu_us_per_message": round(cpu_s * 1e6 / sent, 1),
            "indexed_on_topics": sum(node.queues.max_offset(f"bench/{t}") for t in range(args.topics))}


class _Probe:
    """Undelayed QoS 1 messages, one at a time at a fixed rate: append, then wait until dispatch indexed it. A round
    trip counts in the phase it began in: ``busy`` while that is set, else ``idle`` before the first due time and
    ``firing`` from it until the due times end and nothing is pending."""

    def __init__(self, node: StoreNode, firing_from: int, firing_to: int) -> None:
        self._node = node
        self._firing = (firing_from, firing_to)
        self.busy = False
        self._ms: dict[str, Counter[float]] = {"idle": Counter(), "firing": Counter(), "busy": Counter()}  # 0.1 ms

    async def run(self, interval_s: float) -> None:
        node = self._node
        while True:
            phase = self._phase(now_ms())
            started = time.perf_counter()
            (offset,) = await node.append([NewMessage(PROBE_TOPIC, b"probe", "bench-probe", 1)])
            await node.dispatcher.wait_dispatched(offset + 1)
            took = round((time.perf_counter() - started) * 1000, 1)
            self._ms[phase][took] += 1
            await trio.sleep(max(0.0, interval_s - (time.perf_counter() - started)))

    def _phase(self, began_ms: int) -> str:
        if self.busy:
            return "busy"
        if began_ms < self._firing[0]:
            return "idle"
        return "firing" if began_ms <= self._firing[1] or self._node.timers.pending else "idle"

    def figures(self) -> dict[str, Any]:
        return {phase: _percentiles(ms) for phase, ms in self._ms.items()}


def _percentiles(counts: Counter[int] | Counter[float]) -> dict[str, float] | None:
    """p50, p99 and max of the values counted in ``counts`` (value -> how many), and their number."""
    total = sum(counts.values())
    if not total:
        return None
    found: dict[str, float] = {"n": total}
    seen = 0
    marks = [("p50", (total - 1) // 2), ("p99", (total - 1) * 99 // 100)]
    for value in sorted(counts):
        seen += counts[value]
        while marks and seen > marks[0][1]:
            found[marks.pop(0)[0]] = value
    found["max"] = max(counts)
    return found


def _delivered(node: StoreNode, topics: int) -> tuple[Counter[int], int, int]:
    """The lateness (ms -> messages) of every delivered message, and the store times of the first and the last
    (blocking: reads the topics' queues; counts, not a list: 10 M messages would be a gigabyte of tuples)."""
    lateness: Counter[int] = Counter()
    first, last = 1 << 63, 0
    for topic in range(topics):
        offset = 0
        while True:
            result = node.read(f"bench/{topic}", offset, max_count=4096, max_bytes=16 << 20)
            if not result.messages:
                break
            for queue_offset, record in result.messages:
                lateness[record.store_ms - DUE.unpack_from(record.payload)[0]] += 1
                first, last = min(first, record.store_ms), max(last, record.store_ms)
                offset = queue_offset + 1
    return lateness, first, last


def _disk(data: Path) -> int:
    """Bytes the store's files take on disk (allocated blocks: the wheel is sparse)."""
    return sum(path.stat().st_blocks * 512 for path in data.rglob("*") if path.is_file())
