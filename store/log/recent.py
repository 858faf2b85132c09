"""The records this process appended last, kept decoded: what the dispatcher and the pulls at the head read.

A message is written once, then read back twice at once: the dispatcher
indexes it, and the queue cache of every gateway with a session on its queues
reads it. Both read the newest records, which this process built itself a
moment ago. Kept here decoded, they cost neither a pread, nor a CRC check,
nor a decode (about 5 us a record; the whole ingest of a QoS 0 message is
about 20). Records leave in append order, bounded in count and bytes; a read
that misses goes to the CommitLog as before, so nothing depends on a record
still being here (a restart starts empty).

Appends add records in the trio thread; the dispatcher reads them in a worker
thread. Single dict operations are atomic under the GIL, and a record that is
evicted between two reads is simply read from the log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import final

from store.log.record import Record

__all__ = ["RecentRecords"]

MiB = 1024 * 1024


@final
class RecentRecords:
    """The last appended records by CommitLog offset, oldest evicted first.

    Args:
        max_records, max_bytes: the bounds (record sizes as stored).
    """

    def __init__(self, max_records: int = 65536, max_bytes: int = 32 * MiB) -> None:
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._by_offset: dict[int, Record] = {}
        # The record at a CommitLog offset, if it is still here: the dict's own get, without a Python frame
        # (pulls call it per entry).
        self.get: Callable[[int], Record | None] = self._by_offset.get
        self._order: deque[Record] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._by_offset)

    def add(self, records: list[Record]) -> None:
        """Keep just-appended records (their offsets set), then evict the oldest beyond the bounds."""
        by_offset = self._by_offset
        for record in records:
            by_offset[record.offset] = record
        order = self._order
        order.extend(records)
        self._bytes += sum(record.size for record in records)
        while order and (len(order) > self._max_records or self._bytes > self._max_bytes):
            old = order.popleft()
            by_offset.pop(old.offset, None)
            self._bytes -= old.size

    def drop_from(self, offset: int) -> None:
        """Forget the records at or past ``offset``: the CommitLog was cut there (``CommitLog.truncate``) and
        the records appended next reuse those offsets."""
        order = self._order
        while order and order[-1].offset >= offset:
            old = order.pop()
            self._by_offset.pop(old.offset, None)
            self._bytes -= old.size

    @property
    def oldest(self) -> int | None:
        """The CommitLog offset of the oldest record kept (None: none is): every later record is kept too."""
        return self._order[0].offset if self._order else None

    def run(self, from_offset: int, max_bytes: int) -> tuple[list[Record], int]:
        """The records that follow each other from ``from_offset`` (about ``max_bytes`` of them), and the
        offset after the last; ``([], from_offset)`` when the record there is not kept (or not yet appended).

        The run stops where the next record is not here: at a segment's end (the next record starts in
        the next segment), at an evicted record, or at the log's end.
        """
        get = self._by_offset.get
        records: list[Record] = []
        offset = from_offset
        budget = max_bytes
        record = get(offset)
        while record is not None and budget > 0:
            records.append(record)
            offset += record.size
            budget -= record.size
            record = get(offset)
        return records, offset
