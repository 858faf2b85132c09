"""The ``$SYS/broker/`` tree: a node's figures under the names Mosquitto publishes, with its load averages.

Sans-IO: the node hands a snapshot of its figures (``SysFigures``) every ``mqtt.sys_interval_s`` and appends
the returned topics as retained QoS 0 messages through the normal path, so the dashboards and scripts
operators already have find them (docs/operations.md lists the tree). The ``load/`` figures are moving
averages of a counter's rate per minute over 1, 5 and 15 minutes, as Mosquitto's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

from gateway import __version__

__all__ = ["LOAD_WINDOWS_S", "SYS_PREFIX", "LoadAverage", "SysFigures", "SysTree"]

SYS_PREFIX = "$SYS/broker/"
"""Where the node's statistics are published (Mosquitto's names, so existing dashboards find them)."""

LOAD_WINDOWS_S = {"1min": 60.0, "5min": 300.0, "15min": 900.0}
"""The windows of the ``load/`` moving averages, by the name of their topic level (Mosquitto's)."""


@final
class LoadAverage:
    """A counter's rate per minute, averaged over each of ``LOAD_WINDOWS_S`` (exponentially, like ``uptime``'s
    load averages): each update weighs the rate since the last one by how much of the window has passed."""

    __slots__ = ("_count", "_at_s", "averages")

    def __init__(self, count: int, now_s: float) -> None:
        self._count = count
        self._at_s = now_s
        self.averages = dict.fromkeys(LOAD_WINDOWS_S, 0.0)

    def update(self, count: int, now_s: float) -> None:
        """The counter is ``count`` at ``now_s`` (monotonic seconds)."""
        elapsed = now_s - self._at_s
        if elapsed <= 0:
            return
        per_minute = (count - self._count) * 60.0 / elapsed
        for name, window in LOAD_WINDOWS_S.items():
            kept = math.exp(-elapsed / window)
            self.averages[name] = self.averages[name] * kept + per_minute * (1.0 - kept)
        self._count = count
        self._at_s = now_s


@dataclass(frozen=True, slots=True)
class SysFigures:
    """One snapshot of what the tree reports."""

    uptime_s: float
    connected: int  # clients connected to this node
    disconnected: int  # persistent sessions saved by this node whose clients are not connected
    maximum: int  # the most clients connected at once since the node started
    subscriptions: int  # of every session this node keeps (connected or not)
    retained: int  # retained messages in the store
    store_bytes: int  # bytes of records the CommitLog holds
    messages_received: int
    messages_sent: int
    bytes_received: int
    bytes_sent: int


@final
class SysTree:
    """The ``$SYS/broker/`` topics of one node; keeps the load averages between snapshots."""

    __slots__ = ("_loads",)

    def __init__(self, now_s: float) -> None:
        self._loads = {name: LoadAverage(0, now_s) for name in _COUNTERS}

    def topics(self, figures: SysFigures, now_s: float) -> dict[str, bytes]:
        """``{topic: payload}`` for ``figures`` taken at ``now_s`` (monotonic seconds)."""
        counters = {name: getattr(figures, field) for name, field in _COUNTERS.items()}
        values: dict[str, object] = {
            "version": f"lightgate {__version__}",
            "uptime": f"{int(figures.uptime_s)} seconds",
            "clients/connected": figures.connected,
            "clients/disconnected": figures.disconnected,
            "clients/maximum": figures.maximum,
            "clients/total": figures.connected + figures.disconnected,
            "subscriptions/count": figures.subscriptions,
            "retained messages/count": figures.retained,
            "store/messages/bytes": figures.store_bytes,
            **counters,
        }
        for name, count in counters.items():
            load = self._loads[name]
            load.update(count, now_s)
            for window, average in load.averages.items():
                values[f"load/{name}/{window}"] = f"{average:.2f}"
        return {SYS_PREFIX + name: str(value).encode() for name, value in values.items()}


_COUNTERS = {"messages/received": "messages_received", "messages/sent": "messages_sent",
             "bytes/received": "bytes_received", "bytes/sent": "bytes_sent"}
"""The counters with ``load/`` averages: their topic, and their ``SysFigures`` field."""
