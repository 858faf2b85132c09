"""The target-queues section of a CommitLog record: the wildcard filter queues it was matched to.

The appender asks the light queues for this section when it encodes a record
(``LightQueues.targets(topic)``), so the queues a record goes to are fixed at
append time and re-dispatch after a crash is deterministic. The exact-topic and
first-level queues are implied by the topic and are not listed.

Encoding: repeated (u16 big-endian length, UTF-8 name); an empty section is
``b""``. ``store.record`` imports this codec: this module is the one definition.
"""

from __future__ import annotations

import functools
import struct
from typing import Iterable

__all__ = ["CorruptTargets", "decode_queues", "encode_queues"]

_U16 = struct.Struct(">H")

DECODE_CACHE_SIZE = 4096
"""Sections repeat (one per topic and filter set), and decoding one costs more than hashing its bytes."""


class CorruptTargets(ValueError):
    """A target-queues section does not parse (truncated, or a name overruns it)."""


def encode_queues(queues: Iterable[str]) -> bytes:
    """Encode the target-queues section: repeated (u16 length, UTF-8 name)."""
    parts = []
    for name in queues:
        raw = name.encode()
        parts.append(_U16.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


@functools.lru_cache(maxsize=DECODE_CACHE_SIZE)
def decode_queues(raw: bytes) -> tuple[str, ...]:
    """Inverse of :func:`encode_queues` (cached: the same sections come back record after record).

    Raises:
        CorruptTargets: the section is truncated, a name overruns it or is not UTF-8.
    """
    names = []
    pos, end = 0, len(raw)
    while pos < end:
        if pos + 2 > end:
            raise CorruptTargets("target-queues section truncated")
        (n,) = _U16.unpack_from(raw, pos)
        pos += 2
        if pos + n > end:
            raise CorruptTargets("target-queue name overruns its section")
        try:
            names.append(raw[pos : pos + n].decode())
        except UnicodeDecodeError as exc:
            raise CorruptTargets(f"target-queue name at byte {pos} is not UTF-8: {exc.reason}") from None
        pos += n
    return tuple(names)
