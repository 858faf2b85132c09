"""The target-queues section of a CommitLog record: the wildcard filter queues it was matched to.

The appender asks the light queues for this section when it encodes a record
(``LightQueues.targets(topic)``), so the queues a record goes to are fixed at
append time and re-dispatch after a crash is deterministic. The exact-topic and
first-level queues are implied by the topic and are not listed.

Encoding: the filters' queue ids (the compact ids of ``N name -> id``, allocated
when a filter is activated), each a u32 big-endian, sorted ascending, without
duplicates; an empty section is ``b""``. Ids instead of names keep the section
at 4 bytes per filter, whatever the filter's length. ``store.log.record`` imports
this codec: this module is the one definition.
"""

from __future__ import annotations

import functools
import struct
from typing import Iterable

__all__ = ["MAX_QUEUE_ID", "QUEUE_ID_SIZE", "CorruptTargets", "decode_queues", "encode_queues"]

QUEUE_ID_SIZE = 4
"""Bytes per listed queue id: a u32 covers 4 billion allocated ids, and 10 filters cost 40 bytes."""

MAX_QUEUE_ID = 0xFFFF_FFFF
"""The largest id a section can list; activating a filter whose id is larger fails."""

DECODE_CACHE_SIZE = 4096
"""Sections repeat (one per topic and filter set): a cache hit returns the same tuple, which the
dispatcher's per-batch route cache then compares by identity."""

CACHED_SECTION_BYTES = 1024
"""Only sections of up to 256 filters are cached, so the cache holds at most 4 MiB (sections of thousands of
filters, all matching one topic, are made by clients: their decoding costs in proportion, once per record)."""


class CorruptTargets(ValueError):
    """A target-queues section does not parse (its length is not a whole number of queue ids)."""


def encode_queues(qids: Iterable[int]) -> bytes:
    """Encode the target-queues section: the ids as u32 big-endian, sorted, without duplicates.

    Raises:
        ValueError: an id is negative or larger than MAX_QUEUE_ID.
    """
    ids = sorted(set(qids))
    if ids and (ids[0] < 0 or ids[-1] > MAX_QUEUE_ID):
        raise ValueError(f"queue ids in a target-queues section must be 0-{MAX_QUEUE_ID}, not {ids[0]}-{ids[-1]}")
    return struct.pack(f">{len(ids)}I", *ids)


def decode_queues(raw: bytes) -> tuple[int, ...]:
    """Inverse of :func:`encode_queues`: the listed queue ids, in section order.

    Raises:
        CorruptTargets: the section's length is not a multiple of QUEUE_ID_SIZE.
    """
    return _decode_cached(raw) if len(raw) <= CACHED_SECTION_BYTES else _decode(raw)


def _decode(raw: bytes) -> tuple[int, ...]:
    count, rest = divmod(len(raw), QUEUE_ID_SIZE)
    if rest:
        raise CorruptTargets(
            f"target-queues section of {len(raw)} bytes is not a whole number of {QUEUE_ID_SIZE}-byte queue ids")
    return struct.unpack(f">{count}I", raw)


_decode_cached = functools.lru_cache(maxsize=DECODE_CACHE_SIZE)(_decode)
