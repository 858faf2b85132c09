"""Process-wide settings of a node process (``lightgate serve``, ``lightgate gateway``, ``lightgate store``)."""

from __future__ import annotations

import ctypes
import gc

import trio

__all__ = ["GC_THRESHOLDS", "return_freed_buffers", "set_collection_policy", "trim_freed_memory"]

MMAP_THRESHOLD = 128 * 1024
"""Blocks this large or larger are their own mappings, given back to the system when freed (glibc's initial
threshold, kept fixed)."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

GC_THRESHOLDS = (5_000, 10, 10)
"""The cyclic garbage collector's thresholds (``gc.set_threshold``): a young collection after 5,000 more
container objects made than freed (Python's default is 700), a middle one after 10 young ones, a full one after
10 middle ones once the objects that survived into the old generation have grown by a quarter. 10,000 and
20,000 took no less collector CPU under 50 x 1,000 filters but longer middle collections (47 and 107 ms, the
middle generation being up to 10 young thresholds; 28 ms at 5,000)."""

TRIM_INTERVAL_S = 10.0
"""How often ``trim_freed_memory`` gives free heap pages back: a burst's memory returns within this. A trim costs
about 25 ms of a worker thread after a burst (freeing 120 MB) and 0.2 ms otherwise."""


def set_collection_policy() -> None:
    """Take what start-up allocated out of the cyclic garbage collector's sight and have it run less often.

    ``gc.freeze`` moves the start-up objects (modules, classes, functions: about 90,000) to the permanent
    generation: a full collection walked all of them every time, pauses of up to 76 ms under the fixed-rate
    fan-in; frozen, it walks only what the node made since (3 ms). A cycle among them is never collected,
    but start-up made them to keep.

    ``GC_THRESHOLDS`` raises the young generation's threshold: at Python's 700, 50 sessions subscribing
    1,000 filters each made about 900 young, 80 middle and 7-8 full collections, 1.1 s of the node's 8-9 s of
    CPU, two thirds of it in the full ones (up to 167 ms each), which walk every subscription's objects; now
    one full collection, 0.4 s in all. Objects that die by reference count (nearly all a packet makes) do not
    count towards it; only cyclic garbage and objects kept do, so a garbage cycle waits at most
    ``GC_THRESHOLDS[0]`` new objects longer to be freed.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


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

