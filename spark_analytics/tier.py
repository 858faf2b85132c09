"""Reading the Parquet tier (store/tierfiles.py) in the ``commitlog`` source.

A tier file is a converted segment: the record columns in offset order, with
row groups of ~128k rows carrying offset and store-time statistics. A
partition reads whole files, or, for a file larger than the partition size,
some of its row groups (the driver reads only that file's footer), so the
cost of a partition is proportional to its bytes. Inside a read, row groups
whose offset or store-time statistics miss the range are skipped, and only
the columns the query needs are decoded (Parquet's column pruning).

The rows then look like the framing's :class:`~spark_analytics.framing.Frames`
(:class:`ArrowFrames`), so the telemetry parser and the raw projection work
on both alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store.tierfiles import RECORD_SCHEMA, TierFile, open_tier

from .framing import DecodeOptions

__all__ = ["ArrowFrames", "TierRange", "plan_tier_file", "read_tier"]

_MS_TO_US = 1000
_OFFSET_COLUMN = RECORD_SCHEMA.get_field_index("offset")
_STORE_TS_COLUMN = RECORD_SCHEMA.get_field_index("store_ts")


@dataclass(frozen=True, slots=True)
class TierRange:
    """Records of one tier file with offsets in ``[start, end)``: all row groups, or those listed."""

    uri: str
    path: str
    start: int
    end: int
    row_groups: tuple[int, ...] | None
    nbytes: int


def plan_tier_file(uri: str, tier_file: TierFile, start: int, end: int, target_bytes: int) -> list[TierRange]:
    """The ranges of one tier file for partitions of about ``target_bytes``: the whole file when it is
    smaller, else runs of its row groups (sized by their compressed bytes, from the footer)."""
    if tier_file.size <= target_bytes:
        return [TierRange(uri, tier_file.path, start, end, None, tier_file.size)]
    fs, _root = open_tier(uri)
    with fs.open_input_file(tier_file.path) as handle:
        meta = pq.read_metadata(handle)
    ranges: list[TierRange] = []
    group: list[int] = []
    size = 0
    for i in range(meta.num_row_groups):
        rg_size = meta.row_group(i).total_byte_size
        if group and size + rg_size > target_bytes:
            ranges.append(TierRange(uri, tier_file.path, start, end, tuple(group), size))
            group, size = [], 0
        group.append(i)
        size += rg_size
    if group:
        ranges.append(TierRange(uri, tier_file.path, start, end, tuple(group), size))
    return ranges


class ArrowFrames:
    """Tier rows with the interface of the framing's ``Frames`` (the parts the readers use)."""

    __slots__ = ("_batch", "offset", "_payload")

    def __init__(self, batch: pa.RecordBatch) -> None:
        self._batch = batch
        self.offset = batch.column("offset").to_numpy()
        self._payload: tuple[bytes, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self._batch.num_rows

    def _payload_parts(self) -> tuple[bytes, np.ndarray, np.ndarray]:
        if self._payload is None:
            payload = self._batch.column("payload")
            offsets = np.frombuffer(payload.buffers()[1], np.int32)[payload.offset : payload.offset + len(payload) + 1]
            data = payload.buffers()[2]
            self._payload = (data.to_pybytes() if data is not None else b"", offsets[:-1].astype(np.int64),
                             offsets[1:].astype(np.int64))
        return self._payload

    @property
    def buffer(self) -> bytes:
        return self._payload_parts()[0]

    def payload_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        _buf, lo, hi = self._payload_parts()
        return lo, hi

    def topic(self) -> pa.Array:
        return self._batch.column("topic")

    def store_ts(self) -> pa.Array:
        return self._batch.column("store_ts")

    def raw_batch(self, schema: pa.Schema = RECORD_SCHEMA) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays([self._batch.column(name) for name in schema.names], schema=schema)


def _skip(meta: pq.RowGroupMetaData, rng: TierRange, opts: DecodeOptions) -> bool:
    """True when the row group's statistics show none of its rows is in the offset or store-time range."""
    offsets = meta.column(_OFFSET_COLUMN).statistics
    if offsets is not None and offsets.has_min_max and (offsets.max < rng.start or offsets.min >= rng.end):
        return True
    times = meta.column(_STORE_TS_COLUMN).statistics
    if times is None or not times.has_min_max:
        return False
    lo_ms, hi_ms = (int(t.timestamp() * 1000) for t in (times.min, times.max))
    return (opts.from_ms is not None and hi_ms < opts.from_ms) or (opts.to_ms is not None and lo_ms >= opts.to_ms)


def _keep(batch: pa.RecordBatch, rng: TierRange, opts: DecodeOptions) -> pa.RecordBatch:
    """The rows of ``batch`` in the offset range, the store-time range and the topic filter."""
    offset = batch.column("offset")
    mask = pc.and_(pc.greater_equal(offset, rng.start), pc.less(offset, rng.end))
    if opts.from_ms is not None:
        mask = pc.and_(mask, pc.greater_equal(batch.column("store_ts"),
                                              pa.scalar(opts.from_ms * _MS_TO_US, RECORD_SCHEMA.field("store_ts").type)))
    if opts.to_ms is not None:
        mask = pc.and_(mask, pc.less(batch.column("store_ts"),
                                     pa.scalar(opts.to_ms * _MS_TO_US, RECORD_SCHEMA.field("store_ts").type)))
    if opts.topic_filters:
        encoded = batch.column("topic").dictionary_encode()
        wanted = pa.array(opts.wanted(encoded.dictionary.to_pylist()), pa.bool_())
        mask = pc.and_(mask, pc.take(wanted, encoded.indices))
    if mask.false_count == 0:
        return batch
    return batch.filter(mask)


def read_tier(rng: TierRange, opts: DecodeOptions, columns: list[str]) -> Iterator[ArrowFrames]:
    """The rows of ``rng`` that pass the push-down, with ``columns`` (plus what the filters need).

    Error handling: a tier file deleted since planning raises FileNotFoundError
    (the caller decides whether that is data loss).
    """
    needed = [c for c in RECORD_SCHEMA.names if c in columns or c == "offset"
              or (c == "store_ts" and (opts.from_ms is not None or opts.to_ms is not None))
              or (c == "topic" and opts.topic_filters)]
    fs, _root = open_tier(rng.uri)
    with fs.open_input_file(rng.path) as handle:
        parquet = pq.ParquetFile(handle)
        groups = rng.row_groups if rng.row_groups is not None else range(parquet.num_row_groups)
        for g in groups:
            if _skip(parquet.metadata.row_group(g), rng, opts):
                continue
            table = parquet.read_row_group(g, columns=needed)
            for batch in table.to_batches():
                kept = _keep(batch, rng, opts)
                if kept.num_rows:
                    yield ArrowFrames(kept)
