"""What this process uses: its pid, CPU time and resident memory, for the admin API's view of the cluster's nodes.

Each node measures itself (the store node in its ``statistics()``, a gateway
node when its admin API is asked), from the kernel's own accounting: the CPU
seconds of ``resource.getrusage`` and the resident pages of
``/proc/self/statm`` (the peak RSS where there is no /proc). A CPU share needs
two measurements; gateway/ops/nodes.py keeps the previous one.
"""

from __future__ import annotations

import os
import resource

import msgspec

__all__ = ["ProcessUsage", "process_usage"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
"""Bytes per page: /proc/self/statm counts pages."""

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""/proc/self/stat gives the process's start in clock ticks since boot."""


class ProcessUsage(msgspec.Struct, frozen=True, array_like=True):
    """One process's figures at one moment (the store node's travel in ``StoreStatistics``)."""

    pid: int
    cpu_s: float  # user + system CPU seconds since the process started, all its threads
    rss_bytes: int  # resident memory now
    age_s: float  # seconds since the process started (0 where the kernel does not say)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the peak, in KiB on Linux


def _age_s() -> float:
    try:
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            started_ticks = int(stat.read().rpartition(b")")[2].split()[19])  # field 22; the name may hold spaces
            return max(0.0, float(uptime.read().split()[0]) - started_ticks / CLOCK_TICKS)
    except (OSError, IndexError, ValueError):
        return 0.0


def process_usage() -> ProcessUsage:
    """This process's figures now (a few microseconds: two small /proc reads and one system call)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return ProcessUsage(os.getpid(), usage.ru_utime + usage.ru_stime, _rss_bytes(), _age_s())
