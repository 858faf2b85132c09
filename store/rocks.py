"""The node's RocksDB handle (``<data>/index/``) and the options it runs with.

One place for the tuning so every opener (store node, tests, benchmarks) gets
the same database. The write-ahead log is not configured here: it is chosen per
write, because the light queues write derived index batches without it and
their own state (queue ids, filter holders, consumer offsets) with it (see
lightqueue/index.py). Everything lives in the default column family, so a
memtable flush always persists a consistent prefix of the writes.
"""

from __future__ import annotations

from pathlib import Path

import rocksdict

__all__ = ["open_db", "open_family"]

MiB = 1024 * 1024

WRITE_BUFFER_BYTES = 64 * MiB
"""Large memtables: index entries are small and arrive in big batches, and the
dispatcher flushes on its own schedule; a bigger buffer means fewer, larger L0 files."""

BLOCK_CACHE_BYTES = 64 * MiB
"""Pulls read recent entries, which stay hot; 64 MiB holds millions of them."""


def open_db(path: Path) -> rocksdict.Rdict:
    """Open (creating if missing) the index database at ``path`` in raw (bytes) mode.

    Resource handling: the caller owns the returned handle and closes it
    (``close()`` flushes the memtable, so a clean shutdown re-dispatches nothing).
    """
    path.mkdir(parents=True, exist_ok=True)
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.increase_parallelism(2)  # background flush + compaction on a two-core machine
    opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
    opts.set_max_write_buffer_number(3)
    opts.set_level_compaction_dynamic_level_bytes(True)
    # Entries of one queue are neighbours with similar values: LZ4 for hot levels, ZSTD at the bottom.
    opts.set_compression_type(rocksdict.DBCompressionType.lz4())
    opts.set_bottommost_compression_type(rocksdict.DBCompressionType.zstd())
    opts.set_keep_log_file_num(3)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)  # name -> id and metadata lookups are point gets
    table.set_block_cache(rocksdict.Cache(BLOCK_CACHE_BYTES))
    table.set_cache_index_and_filter_blocks(True)
    opts.set_block_based_table_factory(table)
    return rocksdict.Rdict(str(path), opts)


def open_family(db: rocksdict.Rdict, name: str) -> rocksdict.Rdict:
    """The column family ``name`` of ``db`` (raw mode), created on first use.

    Resource handling: the returned handle keeps the database open; close it before ``db``.
    """
    if name in rocksdict.Rdict.list_cf(db.path()):
        return db.get_column_family(name)
    return db.create_column_family(name, rocksdict.Options(raw_mode=True))
