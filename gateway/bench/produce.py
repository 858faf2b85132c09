"""Back-end producers: single sends vs ``send_batch`` vs AutoBatch, with a consumer group reading meanwhile.

For each target (``embedded``: a store node in this process, the producer on a ``LocalStore``; ``rpc``: a
``lightgate store`` process, the producer and the consumer on their own connections), each payload size and
each mode, a fresh store takes:

- ``single``: ``auto_batch=False``: every message its own request (up to ``IN_FLIGHT`` requests travel at once
  over the RPC, one in process);
- ``batch``: ``send_batch`` of ``--batch`` payloads at a time (its one-topic form: ``send_batch(payloads, topic=...)``);
- ``auto``: ``send`` with AutoBatch on (its defaults).

The producer sends to one topic for ``--seconds`` (or ``--messages``, whichever comes first), bounded by the
same ``--total-bytes`` of back-pressure in every mode, while one consumer group member claims (``CLAIM_COUNT`` at
a time, ``--claims`` claims in flight) and acknowledges each claim, as ``(base, count)`` ranges, while claiming the
next (``--reader consumer``: the back-end ``Consumer`` instead, with its defaults, over the RPC). One ``BENCH`` line per mode says: produced/s (acknowledged), consumed/s and their ratio (the seed's
consume/produce >= 1: consumption keeps up with production) over the production time after ``WARM_UP_S``: the
messages the consumer got then against those the producer had acknowledged then, so that a lag that stays the
same (a round trip's worth of messages travelling to the consumer) does not count against it and a lag that grows
does; the ratio over the whole production time as well (``in_window``: there the last round trip's messages count
as lag, 3 % of a 3 s window at 100 ms); how long the consumer took to catch up after the producer stopped, p99 send latency (send called -> handle done, every ``SAMPLE_EVERY``-th
message), bytes on disk per message (CommitLog record bytes; RocksDB index files once the store closed) and
CPU ms per 1,000 messages (this process, plus the store process for ``rpc``). The summary line compares AutoBatch
with single sends (issue 30's target: >= 3x).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import trio

from gateway.bench.common import emit
from gateway.bench.peers import HOST, store_process
from store.api import StoreApi, group_owner
from store.clients.consumer import Consumer
from store.clients.producer import Producer
from store.local import LocalStore
from store.offsetranges import ranges_of
from store.log.commitlog import BATCH_COMPRESSIONS, CommitLogConfig
from store.node import open_store
from store.rpc.client import RemoteStore

MODES = ("single", "batch", "auto")
READERS = ("claims", "consumer")
TARGETS = ("embedded", "rpc")

TOPIC = "bench/produce/telemetry"
GROUP_NAME = "bench-produce"
GROUP = group_owner(GROUP_NAME)

SAMPLE_EVERY = 16
"""Sends whose latency is measured: enough samples for a p99 at a cost every mode pays alike."""

CLAIM_COUNT = 16_384
"""Messages a consumer claim asks for: more than a 1 MiB batch record of 64 B messages (about 11,000), so that a
claim takes batch records whole rather than parts of one (a member holds at most ``store.groups.MAX_UNACKED``,
65,536: a claim gets the room its unacknowledged messages leave)."""

CLAIMS_IN_FLIGHT = 2
"""The consumer's claims in flight (``--claims``): with one, it takes at most ``CLAIM_COUNT`` per round trip; the
next claim travels (and waits at the store, a long poll answered as soon as dispatch indexed messages) while the
last one is decoded, as a RocketMQ consumer pulls ahead of its processing."""

WARM_UP_S = 1.0
"""Of the production time, what the consume/produce ratio leaves out (at most a third of it): the consumer's first
claim and the store's first batch records, before both run at their rate."""

CATCH_UP_S = 60.0
"""Longest wait for the consumer to reach the last acknowledged message once the producer stopped."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=5.0, help="production time of each mode")
    parser.add_argument("--messages", type=int, default=0, help="stop a mode after this many messages (0: no cap)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], help="payload bytes")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--batch", type=int, default=256, help="messages per send_batch in the batch mode")
    parser.add_argument("--claims", type=int, default=CLAIMS_IN_FLIGHT, help="the consumer's claims in flight")
    parser.add_argument("--reader", choices=READERS, default="claims",
                        help="the consumer: claims (--claims of CLAIM_COUNT in flight, on the store API) or consumer "
                             "(the back-end Consumer with its defaults, iterating with auto-commit; rpc only)")
    parser.add_argument("--total-bytes", type=int, default=1024 * 1024,
                        help="the producer's total_batch_max_bytes (its back-pressure) in every mode")
    parser.add_argument("--flush", choices=("async", "sync"), default="async", help="the store's commitlog.flush")
    parser.add_argument("--compression", choices=BATCH_COMPRESSIONS, default="off",
                        help="the store's commitlog.batch_compression; off by default: the payloads are zeros, which "
                             "zstd shrinks to nothing (lightgate bench compression measures real ones)")
    parser.add_argument("--durable", choices=("true", "policy", "false"), default="policy",
                        help="the producer's durable: policy (acknowledged per the flush policy, as RocketMQ's "
                             "figures are), true (on disk: the producer's default), false")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where the per-mode lines are appended (default: the checkout's bench/results)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One ``BENCH`` line per mode (emitted here); returns the summary."""
    if args.reader == "consumer" and "embedded" in args.targets:
        raise SystemExit("lightgate bench produce: --reader consumer reads over the RPC: give --targets rpc")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-produce-", dir=args.dir) as tmp:
        for n, (target, size, mode) in enumerate(itertools.product(args.targets, args.sizes, args.modes)):
            row = trio.run(_mode, Path(tmp) / f"run{n}", target, size, mode, args)
            emit("produce", row, args.results)
            rows.append(row)
    return {"summary": _summary(rows), "settings": _settings(args), "load_average": _load()}


@dataclass(slots=True)
class _Counts:
    acked: int = 0  # by the end of the production time
    sent: int = 0  # all acknowledged in the end (the producer flushes what it holds)
    consumed: int = 0
    consumed_in_window: int = 0
    warm: tuple[float, int, int] = (0.0, 0, 0)  # (when, acknowledged, consumed) at the end of the warm-up
    ended: float = 0.0  # when the production time ended
    producing_s: float = 0.0
    catch_up_s: float = 0.0
    log_bytes: int = 0


async def _mode(data: Path, target: str, size: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    counts = _Counts()
    latencies: list[float] = []
    opened = _embedded(data, args) if target == "embedded" else _remote(data, args)
    cpu = _Cpu()
    async with opened as (appender, consumer_store, store_cpu):
        cpu.start(store_cpu)
        async with trio.open_nursery() as nursery:
            if isinstance(consumer_store, RemoteStore) and args.reader == "consumer":  # run() refuses embedded
                await nursery.start(_iterate, consumer_store.address, counts)
            else:
                await consumer_store.join(GROUP, TOPIC, "", start="latest")
                for _ in range(args.claims):
                    nursery.start_soon(_consume, consumer_store, counts)
            await _produce(appender, mode, size, args, counts, latencies)
            start = time.perf_counter()
            with trio.move_on_after(CATCH_UP_S):
                while counts.consumed < counts.sent:
                    await trio.sleep(0.01)  # the consumer task counts; nothing to wait on but its next claim
            counts.catch_up_s = time.perf_counter() - start
            nursery.cancel_scope.cancel()
        counts.log_bytes = (await consumer_store.statistics()).written_offset
        cpu_s = cpu.stop(store_cpu)
    index_bytes = sum(f.stat().st_size for f in (data / "index").glob("*.sst"))
    return _row(target, size, mode, args, counts, latencies, index_bytes, cpu_s)


async def _produce(appender: Any, mode: str, size: int, args: argparse.Namespace, counts: _Counts,
                   latencies: list[float]) -> None:
    payload = bytes(size)
    durable = {"true": True, "policy": None, "false": False}[args.durable]
    cap = args.messages or sys.maxsize
    sent = 0
    start = time.perf_counter()
    deadline = start + args.seconds
    warm = start + min(WARM_UP_S, args.seconds / 3)
    counts.warm = (start, 0, 0)
    async with Producer.over(appender, client_id=f"bench-{mode}", auto_batch=mode == "auto", durable=durable,
                             total_batch_max_bytes=args.total_bytes) as producer:
        while sent < cap and time.perf_counter() < deadline:
            if mode == "batch":
                count = min(args.batch, cap - sent)
                sends = time.perf_counter()
                handles = await producer.send_batch([payload] * count, topic=TOPIC)
            else:
                count = 1
                sends = time.perf_counter()
                handles = [await producer.send(TOPIC, payload)]
            for index in range(-sent % SAMPLE_EVERY, count, SAMPLE_EVERY):  # every SAMPLE_EVERY-th message sent
                handles[index].add_done_callback(_latency(sends, latencies))
            sent += count
            if counts.warm[0] < warm <= time.perf_counter():
                counts.warm = (time.perf_counter(), producer.statistics().stored, counts.consumed)
        if sent >= cap:  # a count, not a time: until every message is acknowledged
            await producer.flush()
        counts.ended = time.perf_counter()
        counts.producing_s = counts.ended - start
        counts.acked = producer.statistics().stored
        counts.consumed_in_window = counts.consumed
        await producer.flush()  # what it holds still goes (a bounded backlog: --total-bytes), not counted
        counts.sent = producer.statistics().stored


def _latency(sent: float, into: list[float]) -> Callable[[Any], None]:
    return lambda handle: into.append(time.perf_counter() - sent)


async def _consume(store: StoreApi, counts: _Counts) -> None:
    """One of the member's claiming loops (``--claims`` of them): claim, count, and acknowledge each claim while
    claiming the next (one acknowledgement in flight: a consumer committing asynchronously, as RocketMQ's do),
    until cancelled."""
    acked = trio.Event()
    acked.set()
    async with trio.open_nursery() as nursery:
        while True:
            found = await store.claim(GROUP, TOPIC, "", CLAIM_COUNT, max_bytes=8 << 20, wait_s=0.05)
            if found.messages:
                counts.consumed += len(found.messages)
                await acked.wait()
                acked = trio.Event()
                nursery.start_soon(_ack, store, ranges_of(offset for offset, _ in found.messages), acked)


async def _iterate(address: str, counts: _Counts, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                   ) -> None:
    """The back-end ``Consumer`` (``--reader consumer``) with its defaults, joined before the producer starts:
    batches as it iterates (each acknowledged when it asks for the next), counted, until cancelled."""
    async with Consumer.connect(address, group=GROUP_NAME, filter=TOPIC,
                                start="latest") as consumer:
        task_status.started()
        async for batch in consumer:
            counts.consumed += len(batch)


async def _ack(store: StoreApi, ranges: list[tuple[int, int]], done: trio.Event) -> None:
    await store.ack(GROUP, TOPIC, "", ranges=ranges)
    done.set()


@asynccontextmanager
async def _embedded(data: Path, args: argparse.Namespace) -> AsyncIterator[tuple[Any, StoreApi, None]]:
    """A store node in this process; the producer and the consumer each on a ``LocalStore`` of their own."""
    async with open_store(data, CommitLogConfig(flush=args.flush, batch_compression=args.compression)) as node:
        producing, consuming = LocalStore(node, "bench-producer"), LocalStore(node, "bench-consumer")
        try:
            yield producing, consuming, None
        finally:
            producing.close()
            consuming.close()


@asynccontextmanager
async def _remote(data: Path, args: argparse.Namespace) -> AsyncIterator[tuple[Any, StoreApi, psutil.Process]]:
    """A ``lightgate store`` process; the producer and the consumer on connections of their own."""
    with store_process(data, args.flush, args.compression) as (port, store):
        async with RemoteStore.connect(HOST, port, node="bench-producer") as producing, \
                RemoteStore.connect(HOST, port, node="bench-consumer") as consuming:
            yield producing, consuming, psutil.Process(store.pid)


class _Cpu:
    """CPU seconds of this process, and of the store process when there is one."""

    def start(self, store: psutil.Process | None) -> None:
        self._mine = time.process_time()
        self._store = _cpu_of(store)

    def stop(self, store: psutil.Process | None) -> tuple[float, float]:
        return time.process_time() - self._mine, _cpu_of(store) - self._store


def _cpu_of(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return times.user + times.system


def _row(target: str, size: int, mode: str, args: argparse.Namespace, counts: _Counts, latencies: list[float],
         index_bytes: int, cpu_s: tuple[float, float]) -> dict[str, Any]:
    acked = max(counts.sent, 1)
    produced_per_s = counts.acked / counts.producing_s
    warm_at, warm_acked, warm_consumed = counts.warm
    warm_produced = counts.acked - warm_acked
    warm_consumed = counts.consumed_in_window - warm_consumed
    consumed_per_s = warm_consumed / (counts.ended - warm_at)
    in_window_per_s = counts.consumed_in_window / counts.producing_s
    latencies.sort()
    client_s, store_s = cpu_s
    return {
        "target": target, "payload": size, "mode": mode, "acked": counts.acked, "sent": counts.sent,
        "consumed": counts.consumed,
        "produced_per_s": round(produced_per_s), "consumed_per_s": round(consumed_per_s),
        "produced_after_warm_up_per_s": round(warm_produced / (counts.ended - warm_at)),
        "consume_produce_ratio": round(warm_consumed / warm_produced, 3) if warm_produced else None,
        "consumed_in_window_per_s": round(in_window_per_s),
        "consume_produce_in_window": round(in_window_per_s / produced_per_s, 3) if produced_per_s else None,
        "catch_up_s": round(counts.catch_up_s, 3),
        "p99_send_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2) if latencies else None,
        "disk_bytes_per_message": round((counts.log_bytes + index_bytes) / acked, 1),
        "log_bytes_per_message": round(counts.log_bytes / acked, 1),
        "index_bytes_per_message": round(index_bytes / acked, 1),
        "cpu_ms_per_1000": round((client_s + store_s) / acked * 1e6, 2),
        "store_cpu_ms_per_1000": round(store_s / acked * 1e6, 2) if target == "rpc" else None,
        "settings": _settings(args),
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target and size: AutoBatch and send_batch against single sends, from the same run."""
    summary = []
    for (target, size), group in itertools.groupby(rows, lambda r: (r["target"], r["payload"])):
        by_mode = {r["mode"]: r["produced_per_s"] for r in group}
        single = by_mode.get("single")
        entry: dict[str, Any] = {"target": target, "payload": size, **{f"{m}_per_s": v for m, v in by_mode.items()}}
        for mode in ("auto", "batch"):
            if single and mode in by_mode:
                entry[f"{mode}_vs_single"] = round(by_mode[mode] / single, 2)
        summary.append(entry)
    return summary


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"seconds": args.seconds, "messages": args.messages, "batch": args.batch, "total_bytes": args.total_bytes,
            "flush": args.flush, "durable": args.durable, "compression": args.compression, "claims": args.claims,
            "reader": args.reader}


def _load() -> float:
    """The 1-minute load average: other work on the machine slows wall-clock rates."""
    return round(psutil.getloadavg()[0], 2)
