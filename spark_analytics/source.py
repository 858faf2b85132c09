"""The ``commitlog`` PySpark data source: batch and streaming reads of CommitLog segments.

    from spark_analytics.source import register
    register(spark)
    df = spark.read.format("commitlog").option("topicFilter", "fleet/+/telemetry").load("data/")

The driver plans partitions from the directory listing (see planning.py);
executors decode their byte ranges into Arrow record batches (framing.py) and,
with ``parse=telemetry``, parse the payloads in the same pass (telemetry.py).
Partitions and readers carry only paths and the parsed options, so they
pickle small and need nothing on the executor but the package and the files.

Streaming offsets are CommitLog positions ``{"segment": <base>, "position":
<byte position of a record boundary>}``; a micro-batch reads the records
between two of them. ``failOnDataLoss`` decides what happens when retention
deleted segments the stream had not read yet: an error (default), or a
logged warning and a skip to the oldest segment still there.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from .framing import RAW_SCHEMA, ScanRange, scan_range, valid_end
from .layout import list_segments, read_flushed
from .options import ReaderOptions
from .planning import plan_ranges, readable_limit
from .telemetry import TelemetryParser

try:  # Spark >= 4.2: lets availableNow run the final no-data batch that emits closed windows
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - older Spark
    SupportsTriggerAvailableNow = object  # type: ignore[assignment,misc]

__all__ = ["FORMAT", "CommitLogDataSource", "DataLossError", "register"]

FORMAT = "commitlog"
"""The short name for ``spark.read.format(...)``."""

LOG = logging.getLogger(__name__)


class DataLossError(RuntimeError):
    """Segments that a read needed were deleted by retention before it read them."""


def register(spark: Any) -> None:
    """Make ``format("commitlog")`` available in ``spark`` (per session)."""
    spark.dataSource.register(CommitLogDataSource)


def output_schema(opts: ReaderOptions) -> pa.Schema:
    """The Arrow schema every batch of a read with these options has."""
    return opts.telemetry.arrow_schema() if opts.telemetry is not None else RAW_SCHEMA


class CommitLogPartition(InputPartition):
    """The byte ranges one Spark task reads; paths and positions only."""

    def __init__(self, ranges: Sequence[ScanRange]) -> None:
        super().__init__(None)
        self.ranges = tuple(ranges)

    def __repr__(self) -> str:
        return f"CommitLogPartition({self.ranges!r})"


def read_partition(ranges: Sequence[ScanRange], opts: ReaderOptions,
                   projection: pa.Schema | None = None) -> Iterator[pa.RecordBatch]:
    """Decode ``ranges`` into record batches of :func:`output_schema`, or of
    ``projection`` (a subset of its columns) when given.

    Error handling: a segment deleted since planning raises DataLossError,
    or is skipped with a warning when ``failOnDataLoss`` is false; corrupt
    durable bytes raise CorruptRecord (from store.record) with file and offset.
    """
    parser = TelemetryParser(opts.telemetry) if opts.telemetry is not None else None
    for rng in ranges:
        try:
            for frames in scan_range(rng, opts.decode):
                if parser is None:
                    yield frames.raw_batch(projection or RAW_SCHEMA)
                else:
                    yield parser.parse(frames, projection)
        except FileNotFoundError:
            message = (f"segment {rng.path} (CommitLog offsets {rng.base + rng.start} to {rng.base + rng.end}) "
                       "was deleted, probably by retention, before it was read")
            if opts.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to skip deleted data") from None
            LOG.warning("%s; skipped (failOnDataLoss=false)", message)


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


class CommitLogReader(DataSourceReader):
    """A batch read: all durable records, within the time and topic push-down."""

    def __init__(self, opts: ReaderOptions, projection: pa.Schema | None = None) -> None:
        self.opts = opts
        self.projection = projection

    def partitions(self) -> list[CommitLogPartition]:
        directory = self.opts.directory
        ranges = plan_ranges(list_segments(directory), read_flushed(directory),
                             from_ms=self.opts.decode.from_ms, to_ms=self.opts.decode.to_ms,
                             target_bytes=self.opts.partition_bytes)
        return [CommitLogPartition(r) for r in ranges] or [CommitLogPartition(())]

    def read(self, partition: CommitLogPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition.ranges, self.opts, self.projection)


def _offset(segment: int, position: int) -> dict[str, int]:
    return {"segment": segment, "position": position}


class CommitLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream over the CommitLog whose offsets are record positions.

    The end of the readable data is the ``flushed`` hint, or, without a valid
    hint, the end of the last CRC-valid record: a half-written record at the
    tail is not read until it is complete (and flushed).
    """

    def __init__(self, opts: ReaderOptions, projection: pa.Schema | None = None) -> None:
        self.opts = opts
        self.projection = projection
        self._target: int | None = None  # availableNow: never read past this global offset

    def _available_end(self, start: int) -> int:
        """The global offset after the last durable record at or after ``start``."""
        directory = self.opts.directory
        segments = list_segments(directory)
        flushed = read_flushed(directory)
        if not segments:
            return start
        if flushed is not None:
            return max(start, flushed)
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

    def _as_offset(self, global_offset: int) -> dict[str, int]:
        bases = [s.base for s in list_segments(self.opts.directory) if s.base <= global_offset]
        base = bases[-1] if bases else 0
        return _offset(base, global_offset - base)

    def initialOffset(self) -> dict[str, int]:
        if self.opts.starting == "latest":
            return self._as_offset(self._available_end(0))
        segments = list_segments(self.opts.directory)
        return _offset(segments[0].base if segments else 0, 0)

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
        begin = start["segment"] + start["position"] if start else 0
        end = self._available_end(begin)
        if self._target is not None:
            end = max(begin, min(end, self._target))
        return self._as_offset(end)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._available_end(0)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[CommitLogPartition]:
        begin = start["segment"] + start["position"]
        stop = end["segment"] + end["position"]
        segments = list_segments(self.opts.directory)
        oldest = segments[0].base if segments else stop
        if begin < oldest:
            message = (f"CommitLog offsets {begin} to {min(oldest, stop)} were deleted by retention before "
                       f"this stream read them (oldest segment now starts at {oldest})")
            if self.opts.fail_on_data_loss:
                raise DataLossError(message + "; set failOnDataLoss=false to skip them and go on")
            LOG.warning("%s; skipping them (failOnDataLoss=false)", message)
            begin = oldest
        ranges = plan_ranges(segments, read_flushed(self.opts.directory), start=begin, end=stop,
                             from_ms=self.opts.decode.from_ms, to_ms=self.opts.decode.to_ms,
                             target_bytes=self.opts.partition_bytes)
        return [CommitLogPartition(r) for r in ranges]

    def read(self, partition: CommitLogPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition.ranges, self.opts, self.projection)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: the CommitLog's own retention decides what is kept."""
