"""The ``$SYS/broker/`` tree: a node's figures under the names Mosquitto publishes, with its load averages.

``SysTopics`` takes a snapshot of the node's figures (``SysFigures``) every ``mqtt.sys_interval_s``;
``SysTree`` (sans-IO) turns it into topics, appended as retained QoS 0 messages through the normal path, so
the dashboards and scripts operators already have find them (docs/operations.md lists the tree). The
``load/`` figures are moving averages of a counter's rate per minute over 1, 5 and 15 minutes, as
Mosquitto's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import final

import trio

from gateway import __version__
from gateway.mqtt.reasons import ReasonCode
from gateway.node.appends import Appends
from gateway.node.connection import Traffic
from gateway.node.registry import Registry
from gateway.node.sessions import Sessions
from store.api import NewMessage, StoreApi

__all__ = ["LOAD_WINDOWS_S", "SYS_PREFIX", "LoadAverage", "SysFigures", "SysTopics", "SysTree"]

LOGGER = logging.getLogger(__name__)

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


@final
class SysTopics:
    """The ``$SYS`` publisher of one node: its figures gathered from its parts, published through its appends.

    Args:
        store: the store (retained count, log size, the stored sessions).
        appends: the node's publish path.
        traffic: the node's connection counters.
        registry: the clients connected here.
        sessions: the sessions' subscription counts as this node last saved them.
    """

    def __init__(self, store: StoreApi, appends: Appends, traffic: Traffic, registry: Registry,
                 sessions: Sessions) -> None:
        self._store = store
        self._appends = appends
        self._traffic = traffic
        self._registry = registry
        self._sessions = sessions
        self.started = time.monotonic()
        self._tree = SysTree(self.started)

    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    async def figures(self) -> SysFigures:
        """A snapshot of the node's figures. Disconnected: the stored sessions whose clients are not connected
        here; their subscriptions as this node last saved them (a session another node saved counts none)."""
        registry = self._registry
        statistics = await self._store.statistics()
        stored = set(await self._store.sessions())
        offline = [client_id for client_id in stored if client_id not in registry]
        live = sum(session.subscription_count for connection in registry
                   if (session := connection.channel.session) is not None)
        saved = self._sessions.saved_subscriptions
        for client_id in saved.keys() - stored:  # sessions that ended since (expired at the store)
            del saved[client_id]
        traffic = self._traffic
        return SysFigures(
            uptime_s=self.uptime_s(), connected=len(registry), disconnected=len(offline), maximum=registry.peak,
            subscriptions=live + sum(saved.get(client_id, 0) for client_id in offline),
            retained=statistics.retained, store_bytes=statistics.log_bytes,
            messages_received=traffic.messages_in, messages_sent=traffic.messages_out,
            bytes_received=traffic.bytes_in, bytes_sent=traffic.bytes_out)

    async def messages(self) -> list[NewMessage]:
        """The node's ``$SYS/broker/`` tree as retained QoS 0 messages."""
        topics = self._tree.topics(await self.figures(), time.monotonic())
        now_ms = int(time.time() * 1000)
        return [NewMessage(topic, payload, retain=True, born_ms=now_ms) for topic, payload in topics.items()]

    async def run(self, interval_s: float) -> None:
        """Append the tree now and every ``interval_s`` until cancelled."""
        while True:
            try:
                reason = await self._appends.own(await self.messages())
            except ConnectionError:  # the store is unreachable: its client logs the outage once
                reason = None
            if reason is not None and reason is not ReasonCode.QUOTA_EXCEEDED:  # a full disk: logged by the store
                LOGGER.error("$SYS statistics not published: %s", reason.name)
            await trio.sleep(interval_s)
