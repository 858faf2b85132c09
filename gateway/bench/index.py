"""Light queues: dispatch rate, filter match time, pull latency and bytes stored per fanned-out message.

Measures, on real files (a CommitLog and a RocksDB in a temporary directory):

- dispatch: records/s indexed for 1, 5 and 20 queues per record. A record
  always goes to its topic queue and its first-level queue, so "1" is that
  minimum (2 index entries); 5 and 20 add active wildcard filters (median of 3
  runs, each into a fresh copy of the set-up index: its filters and their ids);
- match: microseconds per topic to find the matching filters among 10, 10,000
  and 1,000,000 active filters (should stay flat), and the trie's RSS;
- pull: latency of 32-message pulls (index range scan + CommitLog reads);
- storage: a 256-byte message fanned out to 10,000 sessions over 10 wildcard
  filters; bytes on disk per message (CommitLog + RocksDB after compaction)
  next to the single stored copy and the write-amplified models.

Targets (issue 3): >= 100,000 records/s with one queue per record, >= 50,000
with five; storage per fanned-out message <= 1.5x the single-copy size.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from gateway.bench.common import Stopwatch, median_of
from lightqueue.filters import FilterIndex
from lightqueue.queues import LightQueues, is_implicit
from lightqueue.topics import matches
from store.log.commitlog import CommitLog, CommitLogConfig
from store.dispatch import Dispatcher
from store.log.record import HEADER_SIZE, decode_record, encode_record
from store.rocks import open_db

MiB = 1024 * 1024

SEGMENT_BYTES = 64 * MiB
"""Benchmark logs are a few hundred MiB at most; smaller segments than production keep set-up fast."""

TOPIC_LEVELS = ("fleet", "dev", "+", "telemetry")
"""Shape of the dispatch benchmark's topics: ``fleet/dev/<n>/telemetry``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=200_000,
                        help="records appended for the 1-queue dispatch run (fewer for 5 and 20 queues)")
    parser.add_argument("--payload", type=int, default=100, help="payload bytes of dispatch records")
    parser.add_argument("--filters", type=int, nargs="+", default=[10, 10_000, 1_000_000],
                        help="active filter counts for the match benchmark")
    parser.add_argument("--fanout-messages", type=int, default=20_000,
                        help="messages published in the storage benchmark")
    parser.add_argument("--sessions", type=int, default=10_000, help="subscriber sessions in the storage benchmark")
    parser.add_argument("--runs", type=int, default=3, help="runs per dispatch measurement (median reported)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lightgate-bench-index-", dir=args.dir) as tmp:
        root = Path(tmp)
        result = {
            "dispatch": [_dispatch(root / f"dispatch{q}", q, args) for q in (1, 5, 20)],
            "match": [_match(n) for n in args.filters],
            "pull": _pull(root / "pull"),
            "storage": _storage(root / "storage", args.fanout_messages, args.sessions),
        }
    # Other work on the machine slows wall-clock rates; the 1-minute load average says how much there was.
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def _wildcards_matching(topic_levels: list[str], count: int) -> list[str]:
    """``count`` distinct wildcard filters, none implicit, that match every topic of the given shape."""
    choices = [(lvl, "+") if lvl != "+" else ("+",) for lvl in topic_levels]
    found: list[str] = ["#"]
    for depth in range(1, len(topic_levels) + 1):
        prefixes = [[]]
        for options in choices[:depth]:
            prefixes = [p + [o] for p in prefixes for o in options]
        for p in prefixes:
            exact = ["/".join(p)] if depth == len(topic_levels) else []
            for f in [*exact, "/".join(p) + "/#"]:
                if "+" in f or "#" in f:
                    if not is_implicit(f) and f not in found:
                        found.append(f)
    if len(found) < count:
        raise ValueError(f"only {len(found)} filters match topics shaped {topic_levels}, {count} wanted")
    return found[:count]


def _dispatch(path: Path, queues_per_record: int, args: argparse.Namespace) -> dict[str, Any]:
    """Append once, then dispatch the same log ``runs`` times into fresh copies of the set-up index.

    The copies hold the filter activations (and so the queue ids the records
    list) and no entries.
    """
    records = {1: args.records, 5: args.records // 2, 20: args.records // 5}[queues_per_record]
    extra = max(0, queues_per_record - 2)
    filters = _wildcards_matching(list(TOPIC_LEVELS), extra) if extra else []
    sample = "fleet/dev/0/telemetry"
    assert all(matches(f, sample) for f in filters)
    log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT_BYTES))
    try:
        db = open_db(path / "setup-index")
        lq = LightQueues(db)
        for f in filters:
            lq.activate(f, "bench", 0)
        payload = b"x" * args.payload
        batch = 256
        for start in range(0, records, batch):
            log.append_batch([
                encode_record(f"fleet/dev/{i % 1000}/telemetry", payload, client_id=f"d{i % 1000}",
                              queues=lq.targets(f"fleet/dev/{i % 1000}/telemetry"))
                for i in range(start, min(records, start + batch))
            ])
        db.close()

        def one_run() -> float:
            run_dir = path / f"index-{time.monotonic_ns()}"
            shutil.copytree(path / "setup-index", run_dir)
            db = open_db(run_dir)
            lq = LightQueues(db)
            dispatcher = Dispatcher(log, lq, lambda changes: None)
            gc.collect()
            cpu = time.process_time()
            with Stopwatch() as sw:
                while dispatcher.dispatch_once() is not None:
                    pass
            cpu_rates.append(records / (time.process_time() - cpu))
            entries = lq.statistics().entries_indexed
            db.close()
            assert entries == records * (2 + len(filters)), entries
            return records / sw.seconds

        cpu_rates: list[float] = []
        rates = median_of(args.runs, one_run)
    finally:
        log.close()
    return {
        "queues_per_record": queues_per_record,
        "index_entries_per_record": 2 + len(filters),
        "records": records,
        "records_per_s": round(rates["median"]),
        "entries_per_s": round(rates["median"] * (2 + len(filters))),
        "runs": [round(r) for r in rates["runs"]],
        # Per CPU-second of this process (RocksDB threads included): robust on a shared, busy machine.
        "records_per_cpu_s": round(statistics.median(cpu_rates)),
        "target_records_per_s": {1: 100_000, 5: 50_000}.get(queues_per_record),
    }


def _match(count: int) -> dict[str, Any]:
    """Per-topic match time with ``count`` per-device filters of mixed shapes, and the trie's memory."""
    rng = random.Random(count)
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    index = FilterIndex()
    shapes = ("fleet/{r}/dev{i}/+", "fleet/+/dev{i}/cmd/#", "fleet/{r}/+/dev{i}", "site{i}/#")
    with Stopwatch() as build:
        for i in range(count):
            index.add(shapes[i % len(shapes)].format(i=i, r=i % 64))
    gc.collect()
    rss = psutil.Process().memory_info().rss - rss_before
    samples = ("fleet/{r}/dev{i}/status", "fleet/{r}/dev{i}/cmd/reboot", "fleet/{r}/x/dev{i}", "site{i}/door")
    topics = []
    for _ in range(10_000):  # each topic hits the filter it was made from (and any other that matches)
        i = rng.randrange(count)
        topics.append(samples[i % len(samples)].format(i=i, r=i % 64))
    per_topic = []
    matched = 0
    for chunk in range(0, len(topics), 1000):
        part = topics[chunk : chunk + 1000]
        start = time.perf_counter()
        for t in part:
            matched += len(index.match(t))
        per_topic.append((time.perf_counter() - start) / len(part) * 1e6)
    result = {
        "filters": count,
        "match_us_per_topic": round(statistics.median(per_topic), 2),
        "matches_per_topic": round(matched / len(topics), 2),
        "build_s": round(build.seconds, 2),
        "rss_mb": round(rss / MiB, 1),
        "bytes_per_filter": round(rss / count) if count >= 100_000 else None,  # RSS is too coarse below
    }
    del index
    gc.collect()
    return result


def _pull(path: Path) -> dict[str, Any]:
    """Latency of 32-message pulls at random offsets of a 100,000-entry queue."""
    log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT_BYTES))
    db = open_db(path / "index")
    try:
        lq = LightQueues(db)
        for start in range(0, 100_000, 500):
            log.append_batch([encode_record("fleet/dev/1/cmd", b"x" * 200) for _ in range(500)])
        dispatcher = Dispatcher(log, lq)
        while dispatcher.dispatch_once() is not None:
            pass
        lq.flush()
        rng = random.Random(7)

        def decode(raw: bytes, offset: int) -> Any:
            return decode_record(raw, 0, offset)

        samples = []
        for _ in range(3000):
            offset = rng.randrange(100_000 - 32)
            start = time.perf_counter()
            result = lq.pull("fleet/dev/1/cmd", offset, 32, MiB, log, decode)
            samples.append((time.perf_counter() - start) * 1e6)
            assert len(result.messages) == 32
        samples.sort()
        return {
            "batch": 32,
            "median_us": round(statistics.median(samples), 1),
            "p99_us": round(samples[int(len(samples) * 0.99)], 1),
            "us_per_message": round(statistics.median(samples) / 32, 2),
        }
    finally:
        db.close()
        log.close()


def _sst_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.sst"))


def _storage(path: Path, messages: int, sessions: int) -> dict[str, Any]:
    """Bytes on disk per message fanned out to ``sessions`` sessions over 10 wildcard filters."""
    topic = "fleet/broadcast/cmd"
    filters = _wildcards_matching(topic.split("/"), 10)
    payload = b"c" * 256
    log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT_BYTES))
    db = open_db(path / "index")
    try:
        lq = LightQueues(db)
        for s in range(sessions):
            lq.activate(filters[s % len(filters)], f"session-{s}", log.written_offset)
        lq.commit_offsets("warm-up", {f: 0 for f in filters})
        dispatcher = Dispatcher(log, lq)
        lq.flush()
        db.compact_range(None, None)
        baseline = _sst_bytes(path / "index")
        section = lq.targets(topic)
        for start in range(0, messages, 500):
            log.append_batch([encode_record(topic, payload, client_id="ops-console", queues=section)
                              for _ in range(min(500, messages - start))])
        while dispatcher.dispatch_once() is not None:
            pass
        lq.flush()
        db.compact_range(None, None)
        index_bytes = _sst_bytes(path / "index") - baseline
        log_bytes = log.written_offset
        pull = lq.pull(filters[0], 0, 1, MiB, log, lambda raw, offset: decode_record(raw, 0, offset))
        record_size = pull.messages[0][1].size
    finally:
        db.close()
        log.close()
    single_copy = record_size - len(section)
    stored = (log_bytes + index_bytes) / messages
    reference_bytes = 16  # a message id or pointer per subscriber queue, the leanest write-amplified form
    return {
        "payload_bytes": len(payload),
        "sessions": sessions,
        "filters": len(filters),
        "index_entries_per_message": 2 + len(filters),
        "record_bytes": record_size,
        "target_section_bytes": len(section),
        "single_copy_bytes": single_copy,
        "commitlog_bytes_per_message": round(log_bytes / messages, 1),
        "index_bytes_per_message": round(index_bytes / messages, 1),
        "index_bytes_per_entry": round(index_bytes / messages / (2 + len(filters)), 2),
        "stored_bytes_per_message": round(stored, 1),
        "ratio_to_single_copy": round(stored / single_copy, 3),
        "target_ratio": 1.5,
        "write_amplified_copies_bytes_per_message": single_copy * sessions,
        "write_amplified_references_bytes_per_message": single_copy + reference_bytes * sessions,
        "subscriber_state_bytes": baseline,
        "header_bytes": HEADER_SIZE,
    }
