"""Wills a node publishes itself: those due at once when their connection closes.

The store holds every connected client's will (store/leases.py) and publishes it when the will is due later: a
will delay, a session expiry, the node's lease ending. A will due at once (no delay) is published here, in the
closing connection's worker, through the node's publish path: a takeover waits for that connection to finish,
so the will is out before the new connection's session opens [MQTT-3.1.2-8], and after the messages its
connection published. On a full data disk it waits for room, due as it is.
"""

from __future__ import annotations

import logging
from typing import final

import trio

from gateway.mqtt.actions import PublishWill
from gateway.mqtt.reasons import ReasonCode
from gateway.node.appends import Appends
from store.api import FULL_RETRY_S

__all__ = ["Wills"]

LOGGER = logging.getLogger(__name__)


@final
class Wills:
    """Publishes the wills due at a connection's close (see the module docstring)."""

    def __init__(self, appends: Appends) -> None:
        self._appends = appends
        self.published = 0

    async def publish(self, action: PublishWill) -> None:
        reason = await self._appends.own([action.message])
        while reason is ReasonCode.QUOTA_EXCEEDED:  # a full disk: the will, due now, waits for room
            await trio.sleep(FULL_RETRY_S)
            reason = await self._appends.own([action.message], count=False)
        if reason is None:
            self.published += 1
        elif reason is not ReasonCode.SESSION_TAKEN_OVER:  # the node's lease ended: the store published it
            LOGGER.error("will not published: %s", reason.name, extra={"ctx": {"client_id": action.client_id}})
