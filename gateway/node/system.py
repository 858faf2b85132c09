"""``$SYS/broker/...``: a node's statistics, appended every ``mqtt.sys_interval_s`` through the normal path.

Retained QoS 0 messages under Mosquitto's names, so existing dashboards find them; wildcards starting with
``+`` or ``#`` do not match them (``$`` topics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import final

import trio

from gateway.mqtt.reasons import ReasonCode
from gateway.node.appends import Appends
from gateway.node.connection import Traffic
from store.api import NewMessage

__all__ = ["SYS_PREFIX", "SysTopics"]

LOGGER = logging.getLogger(__name__)

SYS_PREFIX = "$SYS/broker/"
"""Where the node's statistics are published (Mosquitto's names, so existing dashboards find them)."""


@final
class SysTopics:
    """The ``$SYS`` publisher of one node.

    Args:
        appends: the node's publish path.
        traffic: the node's connection counters.
        connected: how many clients are connected now.
    """

    def __init__(self, appends: Appends, traffic: Traffic, connected: Callable[[], int]) -> None:
        self._appends = appends
        self._traffic = traffic
        self._connected = connected
        self.started = time.monotonic()

    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def messages(self) -> list[NewMessage]:
        """The node's statistics as retained QoS 0 messages under ``$SYS/broker/``."""
        traffic = self._traffic
        figures = {
            "uptime": int(self.uptime_s()),
            "clients/connected": self._connected(),
            "messages/received": traffic.messages_in,
            "messages/sent": traffic.messages_out,
            "bytes/received": traffic.bytes_in,
            "bytes/sent": traffic.bytes_out,
        }
        now_ms = int(time.time() * 1000)
        return [NewMessage(SYS_PREFIX + name, str(value).encode(), retain=True, born_ms=now_ms)
                for name, value in figures.items()]

    async def run(self, interval_s: float) -> None:
        """Append the statistics now and every ``interval_s`` until cancelled."""
        while True:
            reason = await self._appends.own(self.messages())
            if reason is not None and reason is not ReasonCode.QUOTA_EXCEEDED:  # a full disk: logged by the store
                LOGGER.error("$SYS statistics not published: %s", reason.name)
            await trio.sleep(interval_s)
