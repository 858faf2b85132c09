"""The Parquet tier's files: where they are, what they are called, what they hold.

Shared by the converter that writes them (store/tier.py, in the store node)
and the readers (spark_analytics, DuckDB, polars): only pyarrow is imported,
so Spark executors need nothing else of the store to read the tier.

A tier is a directory, local or on any file system ``pyarrow.fs`` opens by
URI (``file:///...``, ``s3://bucket/prefix?region=...``, ``gs://...``,
``hdfs://...``). It holds one Parquet file per converted CommitLog segment,
named by the segment's base offset like the segment itself,
``<20-digit base>.parquet``, with the record columns of :data:`RECORD_SCHEMA`
in offset order. Each file's key-value metadata says which segment it is
(``lightgate.base``, ``lightgate.end``, ``lightgate.records`` and the store
time bounds), so a reader needs neither the CommitLog nor the store.

Files are written under a temporary name (:data:`TEMP_PREFIX`, not ending in
``.parquet``) and renamed when complete, so a half-written file is never seen
by a reader that lists ``*.parquet``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = [
    "FILE_SUFFIX",
    "RECORD_SCHEMA",
    "TEMP_PREFIX",
    "TierFile",
    "TierMeta",
    "file_name",
    "list_tier",
    "open_tier",
    "read_meta",
]

UTC_MICROS = pa.timestamp("us", tz="UTC")

RECORD_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("store_ts", UTC_MICROS, nullable=False),
        pa.field("born_ts", UTC_MICROS, nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("client_id", pa.string(), nullable=False),
        pa.field("qos", pa.int8(), nullable=False),
        pa.field("retain", pa.bool_(), nullable=False),
        pa.field("properties", pa.binary(), nullable=False),
        pa.field("payload", pa.binary(), nullable=False),
    ]
)
"""The columns of one CommitLog record (docs/storage.md), as the tier stores them and Spark reads them;
``offset`` is the global CommitLog offset, ``properties`` the MQTT 5 property bytes."""

FILE_SUFFIX = ".parquet"
BASE_DIGITS = 20
"""A tier file is named like its segment: the 20-digit zero-padded base offset, so names sort like offsets."""

TEMP_PREFIX = "_tmp-"
"""A file being written: Spark and Hive-style readers skip names starting with ``_``, and it does not end
in ``.parquet``, so ``read_parquet('<tier>/*.parquet')`` (DuckDB, polars) does not match it either."""

META_PREFIX = "lightgate."
FORMAT_VERSION = 1
"""``lightgate.format`` in each file; a reader refuses a version it does not know."""


def file_name(base: int) -> str:
    return f"{base:0{BASE_DIGITS}d}{FILE_SUFFIX}"


def open_tier(location: str) -> tuple[pafs.FileSystem, str]:
    """The file system and root path of a tier given as a local path or a ``pyarrow.fs`` URI.

    Raises:
        ValueError: an empty location; pyarrow's errors for a URI it cannot open.
    """
    if not location:
        raise ValueError("the tier location is empty")
    if "://" in location:
        fs, root = pafs.FileSystem.from_uri(location)
        return fs, root.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(location)


@dataclass(frozen=True, slots=True)
class TierFile:
    """One converted segment in the tier: its base offset, path on the tier's file system and size in bytes."""

    base: int
    path: str
    size: int


def list_tier(fs: pafs.FileSystem, root: str) -> list[TierFile]:
    """The complete tier files under ``root``, in offset order (temporary files are not listed)."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except FileNotFoundError:
        return []
    found = []
    for info in infos:
        name = info.base_name
        stem = name[: -len(FILE_SUFFIX)]
        if info.type == pafs.FileType.File and name.endswith(FILE_SUFFIX) and len(stem) == BASE_DIGITS \
                and stem.isdigit():
            found.append(TierFile(int(stem), info.path, info.size or 0))
    found.sort(key=lambda f: f.base)
    return found


@dataclass(frozen=True, slots=True)
class TierMeta:
    """What a tier file's footer says about its segment: offsets ``[base, end)``, records, store-time bounds (ms)."""

    base: int
    end: int
    records: int
    min_store_ms: int | None
    max_store_ms: int | None

    def to_metadata(self, *, records: bool = True) -> dict[bytes, bytes]:
        """The footer's key-value pairs; ``records=False`` leaves the count out (a writer adds it once known)."""
        values: dict[str, Any] = {"format": FORMAT_VERSION, "base": self.base, "end": self.end,
                                  "min_store_ms": self.min_store_ms, "max_store_ms": self.max_store_ms}
        if records:
            values["records"] = self.records
        return {(META_PREFIX + k).encode(): str("" if v is None else v).encode() for k, v in values.items()}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None, where: str) -> TierMeta:
        """Raises ValueError: not a tier file of a format version this code reads."""
        values = {k.decode()[len(META_PREFIX):]: v.decode() for k, v in (metadata or {}).items()
                  if k.startswith(META_PREFIX.encode())}
        if values.get("format") != str(FORMAT_VERSION):
            raise ValueError(f"{where} is not a LightGate tier file of format {FORMAT_VERSION} "
                             f"(lightgate.format={values.get('format')!r})")

        def number(key: str) -> int | None:
            return int(values[key]) if values.get(key) else None

        return cls(number("base") or 0, number("end") or 0, number("records") or 0,
                   number("min_store_ms"), number("max_store_ms"))


def read_meta(fs: pafs.FileSystem, path: str) -> tuple[TierMeta, pq.FileMetaData]:
    """The footer of one tier file: its segment metadata and the Parquet metadata (row groups, statistics)."""
    with fs.open_input_file(path) as handle:
        parquet = pq.read_metadata(handle)
    return TierMeta.from_metadata(parquet.metadata, path), parquet
