"""Per-client limits: their names, the node's counters of hits, and which hits are worth a log line.

The checks themselves live where the protocol decisions are made (the
channel and the session, sans-IO); they report each hit as a ``LimitHit``
action (gateway/mqtt/actions.py) naming a ``Limit``. The node adds it to its
``LimitCounters`` (what the metrics export) and logs the lines a ``HitLog``
lets through: the first hit of each limit per connection, then at most one
line per ``LOG_INTERVAL_S`` with the number of hits since, so a client
flooding over a limit does not flood the log too. docs/security.md ("Limits")
says what the client sees for each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import final

from lightqueue.topics import MAX_TOPIC_BYTES, TopicLimits

__all__ = ["LOG_INTERVAL_S", "SYNTAX_ONLY", "HitLog", "Limit", "LimitCounters"]

LOG_INTERVAL_S = 10.0
"""After its first hit, a limit of one connection is logged at most this often: a flood of hits becomes one line
per interval with a count, which says as much and keeps the log readable."""

SYNTAX_ONLY = TopicLimits(MAX_TOPIC_BYTES, MAX_TOPIC_BYTES + 1)
"""Topic validation with the protocol's bounds only: the configured length and level limits are checked apart, so
a topic over them is a counted limit hit answered per message, not a malformed packet."""


class Limit(Enum):
    """One limit a client can run into; the value is its counter's name in ``LimitCounters``."""

    PACKET_SIZE = "packet_size"  # mqtt.max_packet_size: the decoder refused a packet
    TOPIC_LENGTH = "topic_length"  # limits.max_topic_length: a topic name or filter too long
    TOPIC_LEVELS = "topic_levels"  # limits.max_topic_levels: a topic name or filter too deep
    SUBSCRIPTIONS = "subscriptions"  # limits.max_subscriptions: a filter beyond the session's quota
    INFLIGHT = "inflight"  # mqtt.receive_maximum: too many inbound QoS 1/2 messages unacknowledged
    PUBLISH_RATE = "publish_rate"  # limits.publish_rate / publish_burst: a message over the rate
    PUBLISH_BYTES_RATE = "publish_bytes_rate"  # limits.publish_bytes_rate: a message over the byte rate
    QOS0_QUEUE = "qos0_queue"  # limits.qos0_queue_bytes: a QoS 0 delivery dropped, the writer was too far behind
    USER_PROPERTIES = "user_properties"  # limits.max_user_properties / max_user_property_bytes: the decoder refused
    DELAYED = "delayed"  # delayed.max_delay_s: a $delayed/<seconds>/<topic> name malformed or over the longest delay


@dataclass(slots=True)
class LimitCounters:
    """Hits of each limit since the node started, summed over its connections (one field per ``Limit``)."""

    packet_size: int = 0
    topic_length: int = 0
    topic_levels: int = 0
    subscriptions: int = 0
    inflight: int = 0
    publish_rate: int = 0
    publish_bytes_rate: int = 0
    qos0_queue: int = 0
    user_properties: int = 0
    delayed: int = 0

    def add(self, limit: Limit, count: int = 1) -> int:
        """Count ``count`` hits of ``limit``; returns the new total."""
        total = getattr(self, limit.value) + count
        setattr(self, limit.value, total)
        return total


@final
class HitLog:
    """Which hits of one connection get a log line (time passed in).

    Args:
        interval_s: after a limit's first logged hit, the least time between two lines about it.
    """

    __slots__ = ("interval_s", "_last", "_quiet")

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[Limit, float] = {}  # limit -> when its last line was let through
        self._quiet: dict[Limit, int] = {}  # limit -> hits since that line, not logged

    def due(self, limit: Limit, count: int, now: float) -> int | None:
        """Record ``count`` hits of ``limit`` at ``now``.

        Returns:
            The hits the log line should report (these and the ones kept quiet
            since the last line), or None when no line is due yet.
        """
        last = self._last.get(limit)
        if last is not None and now - last < self.interval_s:
            self._quiet[limit] = self._quiet.get(limit, 0) + count
            return None
        self._last[limit] = now
        return self._quiet.pop(limit, 0) + count
