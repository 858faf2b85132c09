"""Process-wide settings of a node process (``lightgate serve``, ``lightgate gateway``, ``lightgate store``)."""

from __future__ import annotations

import ctypes
import gc

import trio

__all__ = ["freeze_startup_objects", "return_freed_buffers", "trim_freed_memory"]

MMAP_THRESHOLD = 128 * 1024
"""Blocks this large or larger are their own mappings, given back to the system when freed (glibc's initial
threshold, kept fixed)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

TRIM_INTERVAL_S = 10.0
"""How often ``trim_freed_memory`` gives free heap pages back: a burst's memory returns within this. A trim costs
about 25 ms of a worker thread after a burst (freeing 120 MB) and 0.2 ms otherwise."""


def freeze_startup_objects() -> None:
    """Take what start-up allocated (modules, classes, functions: about 90,000 objects) out of the cyclic
    garbage collector's sight (``gc.freeze``).

    A full collection walked all of them every time: pauses of up to 76 ms under the fixed-rate fan-in,
    more than a message's whole latency budget. Frozen, it walks only what the node made since (3 ms).
    """
    gc.collect()
    gc.freeze()


def return_freed_buffers() -> None:
    """Keep glibc's mmap threshold at ``MMAP_THRESHOLD`` instead of letting it rise.

    glibc raises the threshold to the size of each mapped block freed, so after
    the first 1 MB partial packet is freed, the next ones come from the heap,
    and a heap whose top is in use does not shrink: 450 clients that each sent
    most of a 1 MB PUBLISH and left kept the node's RSS 70 MB up after they
    were gone (the memory itself was free). Fixed, connection buffers of 128 KiB
    or more go back to the system when freed. No-op where the C library has no
    ``mallopt`` (its allocator returns large blocks already).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


async def trim_freed_memory(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Every ``interval_s``, have the C allocator give back the free pages inside its heaps (``malloc_trim``).

    Buffers under ``MMAP_THRESHOLD`` (64 KiB reads, WebSocket frames) come from
    heaps, and a heap gives back only its free top: after 450 WebSocket clients
    sent most of a 1 MB packet each and left, the node's RSS stayed 100 MB up,
    all of it free. Runs in a worker thread (the call releases the GIL). Returns
    at once where the C library has no ``malloc_trim``.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    while True:
        await trio.sleep(interval_s)
        await trio.to_thread.run_sync(trim, 0)

