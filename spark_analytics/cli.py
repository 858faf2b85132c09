"""``lightgate analytics batch|stream``: telemetry aggregates from the CommitLog with Spark.

gateway/app/cli.py adds these as ``lightgate analytics``; this module owns the
flags and the run. Spark starts quietly (see session.py); progress and the
summary are shown with rich on stderr/stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
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

LOG = logging.getLogger(__name__)


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


def _offset(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a CommitLog offset (the offset column's value)")
    return int(text)


def _conf(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=None,
                   help="the gateway's data directory (with commitlog/) or a CommitLog directory (or --store)")
    p.add_argument("--tier", default=None, help="the store's Parquet tier (tier.uri): a directory or a pyarrow.fs URI")
    p.add_argument("--store", default=None,
                   help="HOST:PORT of the store node (a replicated store: its replicas HOST:PORT,HOST:PORT,..., read"
                        " from a follower): read the live tail over its RPC, no --data needed")
    p.add_argument("--store-token", default="", help="the store's store.token, with --store")
    p.add_argument("--out", required=True, type=Path, help="output directory for the tables (and the chart)")
    p.add_argument("--master", default=DEFAULT_MASTER, help=f"Spark master URL (default {DEFAULT_MASTER})")
    p.add_argument("--conf", type=_conf, action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting (repeatable), e.g. spark.executor.memory=2g")
    p.add_argument("--py-files", default="", help="comma-separated .zip/.py files for the executors' Python path "
                   "(on a cluster master the project's own code is shipped anyway)")
    p.add_argument("--dedup", default=None, metavar="FIELD",
                   help="drop repeated messages: the same payload FIELD (e.g. seq) from the same device")
    p.add_argument("--metrics", default=None,
                   help="comma-separated numeric payload fields (default: the numeric fields of the first payloads)")
    p.add_argument("--device", default="topic:1", help="device id from topic:<level> (default topic:1) or payload:<field>")
    p.add_argument("--time", dest="time_source", default="store", help="event time: store (default) or payload:<field>")
    p.add_argument("--time-unit", default="ms", choices=("ms", "s", "iso"), help="unit of a payload time field (default ms)")
    p.add_argument("--topic", type=_topic_filter, action="append", default=None,
                   help="only records whose topic matches this MQTT filter (repeatable: those matching any)")
    start, end = p.add_mutually_exclusive_group(), p.add_mutually_exclusive_group()
    start.add_argument("--start-offset", type=_offset, default=None,
                       help="start at the first record at or after this CommitLog offset (a new stream only)")
    start.add_argument("--start-time", type=_time, default=None,
                       help="start at the first record stored at or after this time (ISO-8601 or epoch ms; "
                            "a new stream only)")
    end.add_argument("--end-offset", type=_offset, default=None, help="end before this CommitLog offset")
    end.add_argument("--end-time", type=_time, default=None,
                     help="end before the first record stored at or after this time (ISO-8601 or epoch ms)")
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
    stream.add_argument("--checkpoint", required=True, type=Path,
                        help="checkpoint directory (Spark's offsets, staged rows, the state of open windows)")
    stream.add_argument("--watermark", type=_duration, default=600, help="how late an event may arrive (default 10m)")
    stream.add_argument("--interval", type=_duration, default=None,
                        help="run a micro-batch every interval until stopped (default: process what is there and stop)")
    stream.add_argument("--timeout", type=_duration, default=None,
                        help="stop after this long: the running micro-batch finishes, no other starts")
    stream.add_argument("--max-records-per-trigger", type=_positive, default=None,
                        help="at most this many records per micro-batch (a backlog is read in steps)")
    stream.add_argument("--max-bytes-per-trigger", type=_positive, default=None,
                        help="about this many log bytes per micro-batch at most")


DEFAULT_TOPIC = "#"
"""Without --topic every topic is read but ``$SYS/...``: a leading ``#`` does not match ``$`` topics (MQTT 4.7.2)."""


def _reader_options(args: argparse.Namespace) -> dict[str, str]:
    """The source's options for the flags (the telemetry mapping aside)."""
    topics = args.topic or [DEFAULT_TOPIC]
    options = {"verifyCrc": "false" if args.no_crc else "true",
               **({"topicFilter": topics[0]} if len(topics) == 1 else {"topicFilters": json.dumps(topics)})}
    if args.data is not None:
        options["path"] = str(args.data)
    for key, value in (("tier", args.tier), ("store", args.store), ("storeToken", args.store_token),
                       ("maxRecordsPerTrigger", getattr(args, "max_records_per_trigger", None)),
                       ("maxBytesPerTrigger", getattr(args, "max_bytes_per_trigger", None)),
                       ("startingOffsets", args.start_offset), ("endingOffsets", args.end_offset),
                       ("startingTimestamp", args.start_time), ("endingTimestamp", args.end_time)):
        if value is not None and value != "":
            options[key] = str(value)
    return options


def _mapping(args: argparse.Namespace, options: dict[str, str]) -> TelemetryMapping:
    from .jobs import check_metrics, infer_metrics
    from .telemetry import TelemetryMapping

    sample = {k: v for k, v in options.items() if k not in ("maxRecordsPerTrigger", "maxBytesPerTrigger")}
    if args.metrics:
        metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
        check_metrics(sample, metrics)
    else:
        exclude = tuple(x.partition(":")[2] for x in (args.device, args.time_source) if x.startswith("payload:"))
        metrics = infer_metrics(sample, exclude=exclude + ((args.dedup,) if args.dedup else ()))
    return TelemetryMapping(metrics=metrics, device=args.device, time=args.time_source, time_unit=args.time_unit,
                            key=args.dedup)


def run(args: argparse.Namespace) -> int:
    """Run ``lightgate analytics batch`` or ``stream``; returns the exit code."""
    from .aggregate import AggregationConfig

    from .jobs import check_rerun_range

    console = Console(stderr=True)
    if args.analytics_command == "stream" and args.fmt != "parquet":
        console.print("[red]error:[/] the stream writes Parquet tables only (--format delta is for batch runs)")
        return 2
    if args.fmt == "delta" and not delta_available():
        console.print("[red]error:[/] --format delta needs the optional delta-spark package (pip install delta-spark)")
        return 2
    if args.data is None and args.store is None:
        console.print("[red]error:[/] give --data (the data directory) or --store (HOST:PORT of the store node)")
        return 2
    options = _reader_options(args)
    try:
        config = AggregationConfig(windows=args.windows, silence_s=args.silence,
                                   **({"watermark_s": args.watermark} if args.analytics_command == "stream" else {}))
        check_rerun_range(getattr(args, "from_ms", None), getattr(args, "to_ms", None), config.windows)
        mapping = _mapping(args, options)
    except (ValueError, OSError) as exc:  # OSError: no CommitLog there, the store or the tier unreachable
        console.print(f"[red]error:[/] {exc}")
        return 2
    options.pop("path", None)
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
    py_files = [Path(f) for f in args.py_files.split(",") if f.strip()]
    with console.status(f"starting Spark ({args.master})"):
        return spark_session(args.master, conf=dict(args.conf), delta=args.fmt == "delta", py_files=py_files), owned


def _run_batch(args: argparse.Namespace, mapping: TelemetryMapping, config: AggregationConfig,
               options: dict[str, str], console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .jobs import NoTelemetry, run_batch, spark_progress
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
                                    reader_options=options, fmt=args.fmt, chart=not args.no_chart, step=step,
                                    from_ms=args.from_ms, to_ms=args.to_ms, dedup=args.dedup is not None)
        Console().print(summary_table(summary))
        for name, path in summary.tables.items():
            console.print(f"{name}: {path}")
        if summary.chart:
            console.print(f"chart: {summary.chart}")
        return 0
    except NoTelemetry as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    finally:
        if owned:
            spark.stop()


def _global(offset: Any) -> int | None:
    """A stream offset of the progress (JSON text, a dict, or ``"null"``/None) as a global CommitLog offset."""
    offset = json.loads(offset) if isinstance(offset, str) else offset
    return None if not offset else offset["segment"] + offset["position"]


def _positions(progress: Any) -> tuple[int | None, int | None, int | None]:
    """The micro-batch's start and end and the log's end, as global CommitLog offsets (None: not reported:
    the first micro-batch has no start; one re-run from Spark's offset log after a restart has no latest)."""
    source = (progress.get("sources") or [{}])[0]
    return _global(source.get("startOffset")), _global(source.get("endOffset")), _global(source.get("latestOffset"))


def _progress_line(progress: Any) -> str:
    """One line per micro-batch: its records, log bytes and positions, the lag behind the log's end, the rate."""
    if not progress:
        return "streaming: first micro-batch"
    start, end, latest = _positions(progress)
    read = "" if start is None or end is None else f", {end - start:,} log bytes"
    span = "" if end is None else f", offsets {'' if start is None else start}..{end}"
    lag = "" if end is None or latest is None else f", {latest - end:,} log bytes behind"
    return (f"streaming: micro-batch {progress.get('batchId')}, {progress.get('numInputRows', 0):,} records"
            f"{read}{span}{lag}, {progress.get('processedRowsPerSecond') or 0:,.0f} records/s")


def _log_progress(query: Any, logged: int) -> int:
    """Log a line for each micro-batch that ended after micro-batch ``logged``; returns the last one logged."""
    for progress in query.recentProgress:
        if progress.get("batchId", -1) > logged:
            logged = progress["batchId"]
            LOG.info(_progress_line(progress))
    return logged


def _run_stream(args: argparse.Namespace, mapping: TelemetryMapping, config: AggregationConfig,
                options: dict[str, str], console: Console) -> int:
    from .jobs import start_stream
    from .microbatch import read_state

    trigger = {"availableNow": True} if args.interval is None else {"processingTime": f"{args.interval} seconds"}
    spark, owned = _start_spark(args, console)
    query = None
    deadline = None if args.timeout is None else time.time() + args.timeout
    if deadline is not None:  # the source admits no record past it: the stop below interrupts no micro-batch
        options = {**options, "admitUntil": str(int(deadline * 1000))}
    try:
        try:
            query = start_stream(spark, data=args.data, out=args.out, checkpoint=args.checkpoint, mapping=mapping,
                                 config=config, trigger=trigger, reader_options=options,
                                 dedup=args.dedup is not None)
        except ValueError as exc:
            console.print(f"[red]error:[/] {exc}")
            return 2
        logged = -1
        with console.status("streaming") as status:  # shown on a terminal only; the log has every line
            while query.isActive:
                if deadline is not None and time.time() >= deadline:
                    status.update("stopping after the running micro-batch")
                    stop_between_batches(query)
                    break
                status.update(_progress_line(query.lastProgress))
                logged = _log_progress(query, logged)
                query.awaitTermination(1)
        _log_progress(query, logged)
        if query.exception() is not None:
            console.print(f"[red]the stream failed:[/] {query.exception()}")
            return 1
        if deadline is not None and time.time() >= deadline:
            console.print(f"stopped after --timeout {args.timeout} s (no micro-batch started after it)")
        state = read_state(args.checkpoint)
        kept = f" ({state.repeats:,} repeats dropped by --dedup, {state.rows - state.repeats:,} kept)" \
            if args.dedup else ""
        console.print(f"{state.rows:,} records read{kept}; outputs in {args.out}")
        if state.late:
            console.print(f"{state.late:,} telemetry records came later than --watermark {config.watermark_s} s "
                          "and were not aggregated (they are in no event-time table)")
        return 0
    except KeyboardInterrupt:
        if query is not None:
            stop_between_batches(query)
        return 130
    finally:
        if query is not None:
            query.stop()
        if owned:
            spark.stop()


STOP_WAIT_S = 300.0
"""How long a stop waits for the running micro-batch to finish before it interrupts it."""


def stop_between_batches(query: Any) -> None:
    """Stop the query when it has started and no micro-batch of it is running, so nothing is interrupted
    (an interrupted batch or start fills the terminal with Java and Python tracebacks, fails the query, and
    the batch is redone at the next start)."""
    deadline = time.monotonic() + STOP_WAIT_S
    while (query.isActive and (query.lastProgress is None or query.status.get("isTriggerActive"))
           and time.monotonic() < deadline):
        time.sleep(0.1)
    query.stop()
