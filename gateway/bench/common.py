"""What every benchmark shares: the result line, the results file, medians and timing.

A benchmark prints exactly one machine-readable line per run, ``BENCH <json>``,
and appends the same document to ``bench/results/<date>.jsonl`` so runs can be
compared over time. Timings are never asserted in tests; they live here.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from gateway import checkout

RESULTS_DIR = (checkout() or Path()) / "bench" / "results"
"""The checkout's bench/results when the benchmarks run from one, so results travel with the repository when
committed; bench/results under the working directory for an installed wheel (site-packages is no place for data)."""


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare numbers across runs."""
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def emit(name: str, result: dict[str, Any], results_dir: Path | None = None) -> dict[str, Any]:
    """Print the ``BENCH`` line and append it to today's results file.

    Returns the full document (name, time, machine, result).
    """
    doc = {
        "bench": name,
        "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "result": result,
    }
    line = json.dumps(doc, sort_keys=True, default=str)
    print("BENCH " + line, flush=True)
    directory = results_dir or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{doc['at'][:10]}.jsonl", "a") as fh:
        fh.write(line + "\n")
    return doc


def median_of(runs: int, fn: Callable[[], float]) -> dict[str, Any]:
    """Run ``fn`` (which returns one measurement) ``runs`` times; report the median and all values."""
    values = [fn() for _ in range(runs)]
    return {"median": statistics.median(values), "runs": values}


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``; uses perf_counter."""

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
