"""RocksDB's background work held back, so that a memtable a flush switched stays unwritten until released.

The thread pools of RocksDB's default environment (every database of the process runs its flushes and compactions
there) are emptied: the real RocksDB, whose flushes are just not scheduled yet. ``store.rocks.open_db`` sizes them
(``increase_parallelism(2)``: two low-priority threads, one high-priority); releasing gives them back.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import rocksdict

LOW_THREADS = 2
HIGH_THREADS = 1

UNWRITTEN = "rocksdb.num-immutable-mem-table"


@contextmanager
def flushes_held() -> Iterator[None]:
    """No memtable is written while inside (a ``flush(wait=True)`` blocks in RocksDB); all are written after."""
    env = rocksdict.Env()
    env.set_low_priority_background_threads(0)
    env.set_high_priority_background_threads(0)
    try:
        yield
    finally:
        env.set_low_priority_background_threads(LOW_THREADS)
        env.set_high_priority_background_threads(HIGH_THREADS)


def unwritten(*families: rocksdict.Rdict) -> int:
    """Memtables switched by a flush and not written yet, over ``families``."""
    return sum(family.property_int_value(UNWRITTEN) or 0 for family in families)
