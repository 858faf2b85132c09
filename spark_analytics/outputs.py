"""Where the aggregates go: tables on disk, a summary on the terminal, a PNG chart.

Tables are Parquet (zstd, INT64 microsecond timestamps with statistics, row
groups of at most 64 MiB) partitioned by ``date`` (dynamic partition overwrite:
a batch run over some days replaces those days only, see jobs.py), or Delta
Lake when ``delta-spark`` is installed and asked for. The stream moves the files
each micro-batch wrote into the tables (:func:`publish`, microbatch.py). The summary is a rich table; the
chart is matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the CLI imports this module for FORMATS before Spark is needed
    from pyspark.sql import DataFrame

__all__ = ["FORMATS", "BatchSummary", "delta_available", "fleet_chart", "publish", "summary_table", "write_table"]

FORMATS = ("parquet", "delta")

PARQUET_OPTIONS = {"compression": "zstd", "parquet.block.size": str(64 * 1024 * 1024)}
"""Output Parquet: zstd (smaller than snappy at similar speed), row groups of at most 64 MiB (a unit readers
can split and skip by statistics); timestamps as INT64 microseconds (TIMESTAMP_MICROS), which carry min/max
statistics, instead of Spark's default INT96, which is deprecated and has none."""


def delta_available() -> bool:
    """True when delta-spark can be imported (it is optional, never a dependency)."""
    return importlib.util.find_spec("delta") is not None


def write_table(df: "DataFrame", path: Path, *, fmt: str = "parquet", partition_by: Sequence[str] = ("date",),
                mode: str = "overwrite") -> None:
    """Write ``df`` to ``path`` as ``fmt``, partitioned by ``partition_by``.

    Raises:
        ValueError: an unknown format, or ``delta`` without delta-spark installed.
    """
    if fmt not in FORMATS:
        raise ValueError(f"output format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "delta" and not delta_available():
        raise ValueError("--format delta needs the optional delta-spark package (pip install delta-spark)")
    writer = df.write.format(fmt).mode(mode)
    if fmt == "parquet":
        df.sparkSession.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        writer = writer.options(**PARQUET_OPTIONS)
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    writer.save(str(path))


def _move(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically; across file systems, copy beside the target and rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        temp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, temp)
        os.replace(temp, target)
        source.unlink()


def publish(pending: Path, out: Path, batch_id: int, tables: Sequence[str]) -> None:
    """Move a streaming micro-batch's files into its tables, then drop the earlier micro-batches' open files.

    ``pending/<table>/kind=<kind>/[date=<d>/]*.parquet`` becomes ``out/<table>/[date=<d>/]<kind>-<batch>-<name>``:
    ``final`` files stay for ever, ``open`` ones (windows the watermark has not passed) are replaced by the
    next micro-batch's, so a table is always its final files plus the open files of its last micro-batch. A
    reader listing a table during the moves may see a micro-batch's open windows twice, or not yet.

    Idempotent: a re-run after a kill finishes the moves it finds and deletes what is still to delete.
    A micro-batch that read no record has no ``pending`` directory and leaves the tables as they are.
    """
    if not pending.exists():
        return
    for table in tables:
        for kind_dir in sorted((pending / table).glob("kind=*")):
            kind = kind_dir.name.partition("=")[2]
            for source in sorted(kind_dir.rglob("*.parquet")):
                if not source.name.startswith((".", "_")):
                    relative = source.parent.relative_to(kind_dir)
                    _move(source, out / table / relative / f"{kind}-{batch_id:010d}-{source.name}")
        for old in (out / table).rglob("open-*.parquet"):
            if int(old.name.split("-")[1]) < batch_id:
                old.unlink(missing_ok=True)


@dataclass
class BatchSummary:
    """What a batch run found, for the terminal summary and the CLI's exit."""

    records: int = 0
    """Records read (repeats and quarantined ones included)."""
    repeats: int = 0
    """Repeated messages ``--dedup`` left out."""
    parsed: int = 0
    quarantined: int = 0
    quarantine_reasons: list[tuple[str, int]] = field(default_factory=list)
    devices: int = 0
    silent_devices: int = 0
    gaps: int = 0
    first_ts: Any = None
    last_ts: Any = None
    metrics: list[tuple[str, float | None, float | None, float | None]] = field(default_factory=list)
    top_topics: list[tuple[str, int, float]] = field(default_factory=list)
    tables: dict[str, str] = field(default_factory=dict)
    chart: str | None = None


def summary_table(summary: BatchSummary) -> Any:
    """A rich renderable of ``summary``: fleet counts, metric ranges, busiest topics, quarantine reasons."""
    from rich.console import Group
    from rich.table import Table

    overview = Table(title="Fleet telemetry", show_header=False)
    overview.add_column("what")
    overview.add_column("value", justify="right")
    overview.add_row("records read", f"{summary.records:,}")
    if summary.repeats:
        overview.add_row("repeats dropped (--dedup)", f"{summary.repeats:,}")
    overview.add_row("telemetry rows", f"{summary.parsed:,}")
    overview.add_row("quarantined", f"{summary.quarantined:,}")
    overview.add_row("devices", f"{summary.devices:,}")
    overview.add_row("silent devices", f"{summary.silent_devices:,}")
    overview.add_row("silence gaps", f"{summary.gaps:,}")
    overview.add_row("event time", f"{summary.first_ts} .. {summary.last_ts}")
    parts: list[Any] = [overview]
    if summary.metrics:
        metrics = Table(title="Metrics over all devices")
        for name in ("metric", "min", "mean", "max"):
            metrics.add_column(name, justify="left" if name == "metric" else "right")
        for name, lo, mean, hi in summary.metrics:
            metrics.add_row(name, *("-" if v is None else f"{v:.4g}" for v in (lo, mean, hi)))
        parts.append(metrics)
    if summary.top_topics:
        topics = Table(title="Busiest topics")
        for name in ("topic", "messages", "msg/s"):
            topics.add_column(name, justify="left" if name == "topic" else "right")
        for topic, count, rate in summary.top_topics:
            topics.add_row(topic, f"{count:,}", f"{rate:.3g}")
        parts.append(topics)
    if summary.quarantine_reasons:
        reasons = Table(title="Quarantine reasons")
        reasons.add_column("reason")
        reasons.add_column("rows", justify="right")
        for reason, count in summary.quarantine_reasons:
            reasons.add_row(reason, f"{count:,}")
        parts.append(reasons)
    return Group(*parts)


def fleet_chart(series: Any, metrics: Sequence[str], path: Path, *, title: str = "Fleet metrics") -> Path:
    """Plot the fleet series (pandas: window_start, messages, devices, one column
    per metric) as stacked panels sharing the time axis; save a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["messages", "devices", *metrics]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 1.8 * len(panels) + 1), squeeze=False)
    for ax, name in zip(axes[:, 0], panels):
        ax.plot(series["window_start"], series[name], linewidth=1.2)
        ax.set_ylabel(name if name in ("messages", "devices") else f"mean {name}")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("window start (UTC)")
    fig.autofmt_xdate()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
