"""``lightgate analytics batch|stream``: telemetry aggregates from the CommitLog with Spark.

gateway/cli.py adds these as ``lightgate analytics``; this module owns the
flags and the run. Spark starts quietly (see session.py); progress and the
summary are shown with rich on stderr/stdout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from .outputs import FORMATS, delta_available
from .session import DEFAULT_MASTER
from .times import parse_duration, parse_time
from lightqueue.topics import validate_filter

if TYPE_CHECKING:  # pyspark, pyarrow and numpy load only when a command runs, not for `lightgate --help`
    from .aggregate import AggregationConfig
    from .telemetry import TelemetryMapping

__all__ = ["add_arguments", "run"]


def _duration_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_duration(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration(text: str) -> int:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _time(text: str) -> int:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _topic_filter(text: str) -> str:
    try:
        validate_filter(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, type=Path, help="the gateway's data directory (with commitlog/) or a CommitLog directory")
    p.add_argument("--out", required=True, type=Path, help="output directory for the tables (and the chart)")
    p.add_argument("--master", default=DEFAULT_MASTER, help=f"Spark master URL (default {DEFAULT_MASTER})")
    p.add_argument("--metrics", default=None,
                   help="comma-separated numeric payload fields (default: the numeric fields of the first payloads)")
    p.add_argument("--device", default="topic:1", help="device id from topic:<level> (default topic:1) or payload:<field>")
    p.add_argument("--time", dest="time_source", default="store", help="event time: store (default) or payload:<field>")
    p.add_argument("--time-unit", default="ms", choices=("ms", "s", "iso"), help="unit of a payload time field (default ms)")
    p.add_argument("--topic", type=_topic_filter, default=None, help="only records whose topic matches this MQTT filter")
    p.add_argument("--windows", type=_duration_list, default=(60, 3600), help="window lengths, e.g. 1m,1h (the default)")
    p.add_argument("--silence", type=_duration, default=300, help="report gaps longer than this (default 5m)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="parquet",
                   help="output table format (delta needs the optional delta-spark package)")
    p.add_argument("--no-crc", action="store_true", help="skip CRC checks of records (faster; framing is still checked)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``batch`` and ``stream`` subcommands and their flags to ``parser``."""
    sub = parser.add_subparsers(dest="analytics_command", required=True, metavar="{batch,stream}")
    batch = sub.add_parser("batch", help="aggregate the CommitLog once and write tables, a summary and a chart")
    _common(batch)
    batch.add_argument("--from", dest="from_ms", type=_time, default=None, help="store time from (ISO-8601 or epoch ms)")
    batch.add_argument("--to", dest="to_ms", type=_time, default=None, help="store time to, exclusive (ISO-8601 or epoch ms)")
    batch.add_argument("--no-chart", action="store_true", help="do not draw fleet_metrics.png")
    stream = sub.add_parser("stream", help="aggregate new CommitLog records continuously (Structured Streaming)")
    _common(stream)
    stream.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (one subdirectory per output)")
    stream.add_argument("--watermark", type=_duration, default=600, help="how late an event may arrive (default 10m)")
    stream.add_argument("--interval", type=_duration, default=None,
                        help="run a micro-batch every interval until stopped (default: process what is there and stop)")
    stream.add_argument("--timeout", type=_duration, default=None, help="with --interval: stop after this long")


def _mapping(args: argparse.Namespace) -> TelemetryMapping:
    from .jobs import infer_metrics
    from .telemetry import TelemetryMapping

    if args.metrics:
        metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    else:
        exclude = tuple(x.partition(":")[2] for x in (args.device, args.time_source) if x.startswith("payload:"))
        metrics = infer_metrics(args.data, exclude=exclude, topic_filter=args.topic)
    return TelemetryMapping(metrics=metrics, device=args.device, time=args.time_source, time_unit=args.time_unit)


def run(args: argparse.Namespace) -> int:
    """Run ``lightgate analytics batch`` or ``stream``; returns the exit code."""
    from .aggregate import AggregationConfig

    console = Console(stderr=True)
    if args.fmt == "delta" and not delta_available():
        console.print("[red]error:[/] --format delta needs the optional delta-spark package (pip install delta-spark)")
        return 2
    try:
        mapping = _mapping(args)
        config = AggregationConfig(windows=args.windows, silence_s=args.silence,
                                   **({"watermark_s": args.watermark} if args.analytics_command == "stream" else {}))
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    options = {"verifyCrc": "false" if args.no_crc else "true"}
    if args.topic:
        options["topicFilter"] = args.topic
    if getattr(args, "from_ms", None) is not None:
        options["fromTime"] = str(args.from_ms)
    if getattr(args, "to_ms", None) is not None:
        options["toTime"] = str(args.to_ms)
    console.print(f"metrics: {', '.join(mapping.metrics)}; device from {mapping.device}; time from {mapping.time}")
    if args.analytics_command == "batch":
        return _run_batch(args, mapping, config, options, console)
    return _run_stream(args, mapping, config, options, console)


def _start_spark(args: argparse.Namespace, console: Console) -> tuple[Any, bool]:
    """The session and whether we started it (a session that was already
    running, as in an embedding program or the tests, is left running)."""
    from pyspark.sql import SparkSession

    from .session import spark_session

    owned = SparkSession.getActiveSession() is None
    with console.status(f"starting Spark ({args.master})"):
        return spark_session(args.master, delta=args.fmt == "delta"), owned


def _run_batch(args: argparse.Namespace, mapping: TelemetryMapping, config: AggregationConfig,
               options: dict[str, str], console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .jobs import run_batch, spark_progress
    from .outputs import summary_table

    spark, owned = _start_spark(args, console)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("starting", total=None)

            def step(label: str) -> None:
                progress.update(task, description=label, completed=0, total=None)

            def tasks(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            with spark_progress(spark, tasks):
                summary = run_batch(spark, data=args.data, out=args.out, mapping=mapping, config=config,
                                    reader_options=options, fmt=args.fmt, chart=not args.no_chart, step=step)
        Console().print(summary_table(summary))
        for name, path in summary.tables.items():
            console.print(f"{name}: {path}")
        if summary.chart:
            console.print(f"chart: {summary.chart}")
        return 0
    finally:
        if owned:
            spark.stop()


def _run_stream(args: argparse.Namespace, mapping: TelemetryMapping, config: AggregationConfig,
                options: dict[str, str], console: Console) -> int:
    from .jobs import start_streams

    trigger = {"availableNow": True} if args.interval is None else {"processingTime": f"{args.interval} seconds"}
    spark, owned = _start_spark(args, console)
    queries = []
    try:
        queries = start_streams(spark, data=args.data, out=args.out, checkpoint=args.checkpoint, mapping=mapping,
                                config=config, trigger=trigger, reader_options=options, fmt=args.fmt)
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        with console.status("streaming") as status:
            while any(q.isActive for q in queries):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                rows = {q.name: (q.lastProgress or {}).get("numInputRows", 0) for q in queries}
                status.update("streaming: " + ", ".join(f"{k} {v} rows" for k, v in rows.items()))
                queries[0].awaitTermination(1)
        failed = [q for q in queries if q.exception() is not None]
        for q in failed:
            console.print(f"[red]query {q.name} failed:[/] {q.exception()}")
        console.print(f"outputs in {args.out}")
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 130
    finally:
        for q in queries:
            q.stop()
        if owned:
            spark.stop()
