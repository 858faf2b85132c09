"""The ``commitlog`` PySpark data source: batch and streaming reads of CommitLog segments.

    from spark_analytics.source import register
    register(spark)
    df = spark.read.format("commitlog").option("topicFilter", "fleet/+/telemetry").load("data/")

The driver plans partitions from listings only (see planning.py): the
Parquet tier's files, the local segments, or the store's bounds over its RPC;
each record is read once, from the tier when it holds the segment. Executors
decode segment bytes (framing.py), tier row groups (tier.py) or bytes read
over the RPC (live.py) into Arrow record batches and, with
``parse=telemetry``, parse the payloads in the same pass (telemetry.py).
Partitions and readers carry only paths and the parsed options, so they
pickle small and need nothing on the executor but the package and the files.

Streaming offsets are CommitLog positions ``{"segment": <base>, "position":
<byte position of a record boundary>}``; a micro-batch reads the records
between two of them. ``failOnDataLoss`` decides what happens when retention
deleted segments the stream had not read yet: an error (default), or a
logged warning and a skip to the oldest segment still there.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import (DataSource, DataSourceReader, DataSourceStreamReader, EqualTo, GreaterThan,
                                    GreaterThanOrEqual, InputPartition, LessThan, LessThanOrEqual)
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from store.tierfiles import file_name, list_tier, open_tier, read_meta

from .framing import RAW_SCHEMA, DecodeOptions, ScanRange, scan_range, valid_end
from .layout import list_segments, read_flushed
from .live import LogReader, read_live
from .options import ReaderOptions
from .planning import LogLayout, Range, plan_log, readable_limit
from .sink import MqttSink
from .telemetry import TelemetryParser
from .tier import TierRange, read_tier

try:  # Spark >= 4.2: availableNow runs the final no-data batch that emits closed windows; admission control
    from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxBytes, ReadMaxRows,
                                                  SupportsTriggerAvailableNow)
except ImportError:  # pragma: no cover - older Spark: no read limits (Spark calls latestOffset() without one)
    SupportsTriggerAvailableNow = object  # type: ignore[assignment,misc]
    ReadAllAvailable = ReadMaxBytes = ReadMaxRows = type("ReadLimit", (), {})  # type: ignore[assignment,misc]

__all__ = ["FORMAT", "CommitLogDataSource", "DataLossError", "register"]

FORMAT = "commitlog"
"""The short name for ``spark.read.format(...)``."""

LOG = logging.getLogger(__name__)


class DataLossError(RuntimeError):
    """Segments that a read needed were deleted by retention before it read them."""


FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
"""Off by default in PySpark 4.x; a reader that implements ``pushFilters`` fails unless it is on."""


def register(spark: Any) -> None:
    """Make ``format("commitlog")`` (with filter push-down on) and the ``mqtt`` sink (sink.py) available in
    ``spark`` (per session)."""
    spark.conf.set(FILTER_PUSHDOWN_CONF, "true")
    spark.dataSource.register(CommitLogDataSource)
    spark.dataSource.register(MqttSink)


def output_schema(opts: ReaderOptions) -> pa.Schema:
    """The Arrow schema every batch of a read with these options has."""
    return opts.telemetry.arrow_schema() if opts.telemetry is not None else RAW_SCHEMA


class CommitLogPartition(InputPartition):
    """What one Spark task reads (segment byte ranges, tier row groups, an RPC range); paths, offsets and
    addresses only."""

    def __init__(self, ranges: Sequence[Range]) -> None:
        super().__init__(None)
        self.ranges = tuple(ranges)

    def __repr__(self) -> str:
        return f"CommitLogPartition({self.ranges!r})"


def load_layout(opts: ReaderOptions) -> LogLayout:
    """What the driver lists: the tier's files, the local segments and ``flushed`` hint, or (``store``
    option) the store's bounds over the RPC; segment data is never read here."""
    tier_files = []
    if opts.tier is not None:
        tier_files = list_tier(*open_tier(opts.tier))
    if opts.store is None:
        directory = opts.directory or ""
        return LogLayout(list_segments(directory), read_flushed(directory), opts.tier, tier_files)
    with LogReader(opts.store, opts.store_token) as reader:
        bounds = reader.read(0, 0)
    live_start = bounds.min_offset
    if tier_files:
        fs, _root = open_tier(opts.tier or "")
        live_start = max(live_start, read_meta(fs, tier_files[-1].path)[0].end)
    return LogLayout([], bounds.flushed, opts.tier, tier_files, opts.store, opts.store_token, live_start)


def _frames(rng: Range, opts: ReaderOptions, columns: list[str]) -> Iterator[Any]:
    if isinstance(rng, ScanRange):
        return scan_range(rng, opts.decode)
    if isinstance(rng, TierRange):
        return read_tier(rng, opts.decode, columns)
    return read_live(rng, opts.decode)


def _in_tier(rng: ScanRange, opts: ReaderOptions) -> TierRange | None:
    """The tier's copy of a local range whose segment was deleted since planning (None without a tier)."""
    if opts.tier is None:
        return None
    fs, root = open_tier(opts.tier)
    path = f"{root}/{file_name(rng.base)}"
    if fs.get_file_info(path).type.name != "File":
        return None
    return TierRange(opts.tier, path, rng.base + rng.start, rng.base + rng.end, None, rng.nbytes)


def _describe(rng: Range) -> str:
    if isinstance(rng, ScanRange):
        return f"segment {rng.path} (CommitLog offsets {rng.base + rng.start} to {rng.base + rng.end})"
    if isinstance(rng, TierRange):
        return f"tier file {rng.path} (CommitLog offsets {rng.start} to {rng.end})"
    return f"CommitLog offsets {rng.start} to {rng.end} on the store {rng.address}"


def read_partition(ranges: Sequence[Range], opts: ReaderOptions,
                   projection: pa.Schema | None = None) -> Iterator[pa.RecordBatch]:
    """Decode ``ranges`` into record batches of :func:`output_schema`, or of
    ``projection`` (a subset of its columns) when given.

    Error handling: a segment deleted since planning is read from the tier
    when the tier has it; otherwise it raises DataLossError, or is skipped
    with a warning when ``failOnDataLoss`` is false; a corrupt record in a
    segment file is skipped with a warning naming the file and offsets, as
    the store skips it (spark_analytics/framing.py); corrupt bytes read over
    the store RPC raise CorruptRecord (from store.log.record) with the offset.
    """
    parser = TelemetryParser(opts.telemetry) if opts.telemetry is not None else None
    schema = projection or RAW_SCHEMA
    columns = schema.names if parser is None else ["offset", "store_ts", "topic", "payload"]  # what parsing reads
    for rng in ranges:
        try:
            try:
                source = _frames(rng, opts, columns)
                first = next(source, None)
            except FileNotFoundError:
                fallback = _in_tier(rng, opts) if isinstance(rng, ScanRange) else None
                if fallback is None:
                    raise
                source = read_tier(fallback, opts.decode, columns)
                first = next(source, None)
            if first is None:
                continue
            for frames in itertools.chain((first,), source):
                yield frames.raw_batch(schema) if parser is None else parser.parse(frames, projection)
        except FileNotFoundError:
            message = f"{_describe(rng)} was deleted, probably by retention, before it was read"
            if opts.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to skip deleted data") from None
            LOG.warning("%s; skipped (failOnDataLoss=false)", message)


ONLY_OFFSETS = pa.schema([RAW_SCHEMA.field("offset")])


def _from(rng: Range, begin: int) -> Range:
    """``rng`` without the records before ``begin`` (a segment's walk still starts at its anchor)."""
    if isinstance(rng, ScanRange) and rng.base + rng.start < begin:
        return dataclasses.replace(rng, start=begin - rng.base)
    if isinstance(rng, TierRange) and rng.start < begin:
        return dataclasses.replace(rng, start=begin)
    return rng


def _end(rng: Range) -> int:
    return rng.base + rng.end if isinstance(rng, ScanRange) else rng.end


def record_offsets(layout: LogLayout, opts: ReaderOptions, decode: DecodeOptions, begin: int,
                   end: int | None = None) -> Iterator[np.ndarray]:
    """The offsets of the records in ``[begin, end)`` that pass ``decode``, in log order, read on the driver
    with only the offset column built: how read positions and rate limits are found.

    ``begin`` need not be a record boundary: segments are walked from their start (four bytes per record)
    and tier files filtered by their offset statistics; the live tail is read over the RPC from its start.
    """
    anchors = [b for b in layout.bases() if b <= begin]
    raw = dataclasses.replace(opts, decode=decode, telemetry=None)
    for ranges in plan_log(layout, start=anchors[-1] if anchors else begin, end=end, from_ms=decode.from_ms,
                           to_ms=decode.to_ms, target_bytes=opts.partition_bytes):
        for batch in read_partition([_from(r, begin) for r in ranges if _end(r) > begin], raw, ONLY_OFFSETS):
            offsets = batch.column(0).to_numpy()
            yield offsets[offsets >= begin]


def admitted_end(chunks: Iterable[np.ndarray], begin: int, end: int, max_records: int | None,
                 max_bytes: int | None) -> int:
    """The record boundary where a micro-batch from ``begin`` reaches ``max_records`` rows or about ``max_bytes``
    log bytes (at least one record), or ``end``; ``chunks``: the offsets of the rows from ``begin``, in order.

    A batch record's rows (docs/storage.md, "Batch records") are at consecutive offsets, which single records
    never are (each is longer than one byte): a micro-batch never ends inside a batch, but after it, since a read
    from inside a record would start at the next one.
    """
    seen = 0
    previous = -2  # the offset of the row before the chunk: a row one past it continues a batch record
    cut: int | None = None  # once decided, where in the chunk the next record start is looked for
    for offsets in chunks:
        if not len(offsets):
            continue
        starts = np.diff(offsets, prepend=previous) != 1
        previous = int(offsets[-1])
        if cut is None:
            found = len(offsets)
            if max_records is not None and seen + len(offsets) > max_records:
                found = max_records - seen
            if max_bytes is not None:
                over = np.flatnonzero((offsets - begin >= max_bytes) & (offsets > begin))
                if len(over):
                    found = min(found, int(over[0]))
            if found >= len(offsets) or seen + found <= 0:
                seen += len(offsets)
                continue
            cut = max(found, 1 - seen)
        at = np.flatnonzero(starts[cut:])
        if len(at):
            return int(offsets[cut + at[0]])
        cut = 0  # the batch goes on in the next chunk
    return end


def first_record(layout: LogLayout, opts: ReaderOptions, begin: int, end: int | None = None, *,
                 from_ms: int | None = None) -> int | None:
    """The offset of the first record at or after ``begin`` (and before ``end``) stored at or after
    ``from_ms``, or None: whole sealed segments and tier row groups are skipped by their time bounds, the
    others' records by their store time (the topic filters play no part: a position is in the whole log)."""
    decode = DecodeOptions(verify_crc=opts.decode.verify_crc, from_ms=from_ms)
    for offsets in record_offsets(layout, opts, decode, begin, end):
        if len(offsets):
            return int(offsets[0])
    return None


def start_position(layout: LogLayout, opts: ReaderOptions) -> int | None:
    """Where a read from ``startingOffsets``/``startingTimestamp`` starts (a record boundary; None: no
    record there yet); 0 without them."""
    if opts.start_offset is not None:
        return first_record(layout, opts, opts.start_offset)
    if opts.start_ms is not None:
        return first_record(layout, opts, 0, from_ms=opts.start_ms)
    return 0


def end_position(layout: LogLayout, opts: ReaderOptions, begin: int, end: int | None = None) -> int | None:
    """Where ``endingOffsets``/``endingTimestamp`` end a read from ``begin`` (a record boundary, exclusive),
    looking at the records before ``end`` only; None: not in them (or no ending option)."""
    if opts.end_offset is not None:
        found = first_record(layout, opts, max(begin, opts.end_offset), end)
        reached = end is not None and opts.end_offset < end
        return found if found is not None else end if reached else None
    if opts.end_ms is not None:
        return first_record(layout, opts, begin, end, from_ms=opts.end_ms)
    return None


def retained_start(layout: LogLayout, opts: ReaderOptions, begin: int, stop: int, reader: str = "this read") -> int:
    """``begin``, or the oldest offset still readable when retention deleted the log from ``begin`` on.

    Raises:
        DataLossError: offsets ``begin``.. were deleted (unless ``failOnDataLoss`` is false: then a warning).
    """
    oldest = layout.oldest
    oldest = stop if oldest is None else oldest
    if begin >= oldest:
        return begin
    message = (f"CommitLog offsets {begin} to {min(oldest, stop)} were deleted by retention before "
               f"{reader} read them (oldest segment now starts at {oldest})")
    if opts.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to skip them and go on")
    LOG.warning("%s; skipping them (failOnDataLoss=false)", message)
    return oldest


def plan_read(opts: ReaderOptions) -> list[tuple[Range, ...]]:
    """The partitions of a batch read with these options: the positions, the time range and the
    partition size (the records the positions bound, read once each)."""
    layout = load_layout(opts)
    begin = start_position(layout, opts)
    if begin is None:
        return []
    if opts.start_offset is not None:  # fails (or warns) when retention deleted records from that offset on
        retained_start(layout, opts, min(begin, opts.start_offset), begin)
    return plan_log(layout, start=begin, end=end_position(layout, opts, begin), from_ms=opts.decode.from_ms,
                    to_ms=opts.decode.to_ms, target_bytes=opts.partition_bytes)


class CommitLogDataSource(DataSource):
    """``spark.read.format("commitlog")`` and ``spark.readStream.format("commitlog")``."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.parsed = ReaderOptions.parse(options)

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return from_arrow_schema(output_schema(self.parsed), prefer_timestamp_ntz=False)

    def reader(self, schema: StructType) -> DataSourceReader:
        if self.parsed.starting == "latest":
            raise ValueError("startingOffsets=latest is for streams: a batch read starts at earliest, an offset "
                             "or startingTimestamp")
        return CommitLogReader(self.parsed, _projection(schema, self.schema()))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CommitLogStreamReader(self.parsed, _projection(schema, self.schema()))


def _projection(given: StructType, ours: StructType) -> pa.Schema | None:
    """The Arrow schema to produce for a user-given schema: None for the full
    schema, else a subset of our columns (same names and types) in the given
    order. Spark does not push column pruning into Python data sources, so
    ``.schema("device string, temp double")`` is how a query asks for fewer
    columns: the others are neither built nor sent to the JVM.

    Raises:
        ValueError: a column that is not ours or has another type.
    """
    if [(f.name, f.dataType) for f in given.fields] == [(f.name, f.dataType) for f in ours.fields]:
        return None
    types = {f.name: f.dataType for f in ours.fields}
    for f in given.fields:
        if types.get(f.name) != f.dataType:
            raise ValueError(f"column {f.name} {f.dataType.simpleString()} is not one of the commitlog source's "
                             f"columns ({ours.simpleString()}); pass a subset of them, or no schema")
    return to_arrow_schema(given, timezone="UTC")


def _micros(value: Any) -> int | None:
    """A pushed-down timestamp literal in microseconds since the epoch (None: not a timestamp)."""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # Spark hands session-time-zone literals over as naive local times
            value = value.astimezone()
        delta = value - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return None


def _time_bound(flt: Any) -> tuple[str, int] | None:
    """``("from", ms)`` or ``("to", ms)`` (store times are whole ms: ``[from, to)``) for a filter on store_ts."""
    if getattr(flt, "attribute", None) != ("store_ts",):
        return None
    us = _micros(flt.value)
    if us is None:
        return None
    ceil_ms = -(-us // 1000)
    if isinstance(flt, GreaterThan):
        return "from", us // 1000 + 1
    if isinstance(flt, GreaterThanOrEqual):
        return "from", ceil_ms
    if isinstance(flt, LessThan):
        return "to", ceil_ms
    if isinstance(flt, LessThanOrEqual):
        return "to", us // 1000 + 1
    return None


class CommitLogReader(DataSourceReader):
    """A batch read: all durable records, within the time and topic push-down.

    ``.where()`` conditions are pushed down (PySpark >= 4.1, ``pushFilters``)
    when they are comparisons of ``store_ts`` with a timestamp (they become
    ``fromTime``/``toTime``: whole segments, tier row groups and records are
    skipped) or ``topic = '<name>'`` without a topic filter option; Spark
    evaluates the others. Column pruning is not offered to Python data sources:
    a schema naming fewer columns is how a query reads fewer (see ``_projection``).
    """

    def __init__(self, opts: ReaderOptions, projection: pa.Schema | None = None) -> None:
        self.opts = opts
        self.projection = projection

    def pushFilters(self, filters: list[Any]) -> Iterator[Any]:
        decode = self.opts.decode
        bounds = {"from": decode.from_ms, "to": decode.to_ms}
        topics = decode.topic_filters
        for flt in filters:
            bound = _time_bound(flt)
            if bound is not None:
                side, ms = bound
                old = bounds[side]
                bounds[side] = ms if old is None else max(old, ms) if side == "from" else min(old, ms)
                continue
            if (isinstance(flt, EqualTo) and flt.attribute == ("topic",) and isinstance(flt.value, str)
                    and not topics and flt.value and not set(flt.value) & {"+", "#"}):
                topics = (flt.value,)  # a topic name is a filter that matches only itself
                continue
            yield flt
        self.opts = dataclasses.replace(self.opts, decode=dataclasses.replace(
            decode, from_ms=bounds["from"], to_ms=bounds["to"], topic_filters=topics))

    def partitions(self) -> list[CommitLogPartition]:
        return [CommitLogPartition(r) for r in plan_read(self.opts)] or [CommitLogPartition(())]

    def read(self, partition: CommitLogPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition.ranges, self.opts, self.projection)


def _offset(segment: int, position: int) -> dict[str, int]:
    return {"segment": segment, "position": position}


class CommitLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream over the CommitLog whose offsets are record positions.

    The end of the readable data is the ``flushed`` hint (the store's flushed
    offset over the RPC), or, without a valid hint, the end of the last
    CRC-valid record: a half-written record at the tail is not read until it
    is complete (and flushed). Records the tier holds are read from the tier.

    ``maxRecordsPerTrigger`` / ``maxBytesPerTrigger`` bound each micro-batch
    (Spark's admission control: ``getDefaultReadLimit`` and ``latestOffset(start,
    limit)``); ``reportLatestOffset`` gives the end of the log, so the query's
    progress shows the lag (``latestOffset`` - ``endOffset``, in log bytes).
    Past ``admitUntil`` no micro-batch admits a record, so a stop then
    interrupts no micro-batch (Spark has no "stop after this batch").
    """

    def __init__(self, opts: ReaderOptions, projection: pa.Schema | None = None) -> None:
        self.opts = opts
        self.projection = projection
        self._target: int | None = None  # availableNow: never read past this global offset
        self._ending: int | None = None  # endingOffsets/endingTimestamp, once the log holds it

    def _available_end(self, start: int, layout: LogLayout | None = None) -> int:
        """The global offset after the last durable record at or after ``start``."""
        layout = layout or load_layout(self.opts)
        if layout.flushed is not None:
            return max(start, layout.flushed)
        segments = layout.segments
        if not segments:
            if not layout.tier:
                return start
            fs, _root = open_tier(layout.tier_uri or "")
            return max(start, read_meta(fs, layout.tier[-1].path)[0].end)
        end = start
        for seg in segments:
            if seg.base + seg.size <= start:
                continue
            first = max(0, start - seg.base)
            limit, _strict = readable_limit(seg, None)
            if seg.end is not None:  # sealed: its end is known without reading it
                end = seg.end
                continue
            pos, rolled = valid_end(ScanRange(seg.path, seg.base, first, first, limit, limit, False),
                                    verify_crc=self.opts.decode.verify_crc)
            end = seg.base + pos
            if not rolled:  # the data ends inside this segment
                break
        return max(start, end)

    @staticmethod
    def _as_offset(global_offset: int, layout: LogLayout) -> dict[str, int]:
        bases = [b for b in sorted({s.base for s in layout.segments} | {f.base for f in layout.tier})
                 if b <= global_offset]
        base = bases[-1] if bases else 0
        return _offset(base, global_offset - base)

    def initialOffset(self) -> dict[str, int]:
        layout = load_layout(self.opts)
        if self.opts.starting == "latest":
            return self._as_offset(self._available_end(0, layout), layout)
        if self.opts.start_offset is not None or self.opts.start_ms is not None:
            end = self._available_end(0, layout)
            begin = start_position(layout, self.opts)
            if begin is None and self.opts.start_offset is not None and self.opts.start_offset > end:
                raise ValueError(f"startingOffsets {self.opts.start_offset} is past the end of the log ({end})")
            return self._as_offset(end if begin is None else begin, layout)  # no record since then: what comes
        oldest = layout.oldest or 0
        return self._as_offset(oldest, layout)

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_records is not None:
            return ReadMaxRows(self.opts.max_records)
        if self.opts.max_bytes is not None:
            return ReadMaxBytes(self.opts.max_bytes)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
        if self.opts.admit_until_ms is not None and time.time() * 1000 >= self.opts.admit_until_ms:
            return start if start is not None else self.initialOffset()  # no new data: no micro-batch starts
        begin = start["segment"] + start["position"] if start else 0
        layout = load_layout(self.opts)
        end = self._available_end(begin, layout)
        if self._target is not None:
            end = max(begin, min(end, self._target))
        if self._ending is None and end > begin:
            self._ending = end_position(layout, self.opts, begin, end)
        if self._ending is not None:
            end = max(begin, min(end, self._ending))
        max_records = self.opts.max_records
        max_bytes = self.opts.max_bytes
        if isinstance(limit, ReadMaxRows):
            max_records = min(limit.max_rows, max_records or limit.max_rows)
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = min(limit.max_bytes, max_bytes or limit.max_bytes)
        if (max_records is not None or max_bytes is not None) and end > begin:
            end = self._admit(layout, begin, end, max_records, max_bytes)
        return self._as_offset(end, layout)

    def _admit(self, layout: LogLayout, begin: int, end: int, max_records: int | None, max_bytes: int | None) -> int:
        """The record boundary where a micro-batch from ``begin`` ends (:func:`admitted_end`): the offsets are read
        to find it."""
        return admitted_end(record_offsets(layout, self.opts, self.opts.decode, begin, end), begin, end, max_records,
                            max_bytes)

    def reportLatestOffset(self) -> dict[str, int]:
        layout = load_layout(self.opts)
        return self._as_offset(self._available_end(0, layout), layout)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._available_end(0)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[CommitLogPartition]:
        stop = end["segment"] + end["position"]
        layout = load_layout(self.opts)
        begin = retained_start(layout, self.opts, start["segment"] + start["position"], stop, "this stream")
        ranges = plan_log(layout, start=begin, end=stop, from_ms=self.opts.decode.from_ms,
                          to_ms=self.opts.decode.to_ms, target_bytes=self.opts.partition_bytes)
        return [CommitLogPartition(r) for r in ranges]

    def read(self, partition: CommitLogPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition.ranges, self.opts, self.projection)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: the CommitLog's own retention decides what is kept."""
