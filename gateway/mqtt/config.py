"""What the server offers its clients (advertised in the MQTT 5 CONNACK) and the bounds of each connection's memory.

One ``ChannelConfig`` is shared by every channel of a node (gateway/mqtt/channel.py); the packet handlers read it
(gateway/mqtt/handlers/), and the composition root builds it from the ``mqtt.*`` settings (gateway/app/serve.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gateway.mqtt.properties import MAX_UINT16, MAX_VARINT, RepeatLimit
from lightqueue.topics import DEFAULT_LIMITS, MAX_TOPIC_BYTES

__all__ = ["ChannelConfig"]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """What the server offers its clients (advertised in the MQTT 5 CONNACK) and the channel's memory bounds.

    ``max_packet_size`` must equal the decoder's limit (the server enforces it
    on input), as must ``max_connect_size`` (the largest CONNECT) and the
    User Property bounds (``max_user_properties``, ``max_user_property_bytes``
    per property block; 0 = none: ``repeat_limit``). ``receive_maximum`` bounds inbound QoS 1/2 messages awaiting
    acknowledgement; ``default_receive_maximum`` is the outbound window of
    3.1.1 clients (which cannot say), ``max_inflight`` caps any client's. A
    subscriber's acknowledgements are read once per read round of the node
    (gateway/node/poller.py, in arrival order), so its window must hold what
    a round stores for it: at 256 a 50-publisher QoS 1 fan-in delivered
    8-20k/s seconds behind 40k/s of publishes; 4096 (more than 50 publishers'
    windows of 64) keeps up (docs/benchmarks.md). It costs memory only while
    a subscriber lags, as unacknowledged entries; a persistent session has at
    most ``LANE_PIDS`` of one subscription in flight (gateway/mqtt/session.py).
    ``max_keepalive`` None honours any keep alive; otherwise an MQTT 5 client
    asking for more (or for none, 0) is told this value as Server Keep Alive.
    ``reason_strings`` adds the error's text as Reason String to the CONNACKs
    and DISCONNECTs that refuse or close an MQTT 5 client.

    Per-client limits (docs/security.md, "Limits"): ``max_topic_length`` (UTF-8
    bytes) and ``max_topic_levels`` bound topic names and filters (at most the
    protocol's 65535 bytes and the store's 128 levels); ``max_subscriptions``
    per session, ``publish_rate`` (messages/s, banking ``publish_burst``, 0 =
    one second's worth), ``publish_bytes_rate`` (payload bytes/s) and
    ``qos0_queue_bytes`` (delivery bytes waiting for the socket, beyond which
    QoS 0 messages drop) and ``max_unwritten_bytes`` (beyond which delivery
    waits for the socket) are off at 0. ``receive_maximum`` is also the in-flight limit of 3.1.1
    clients, as the number of their QoS 1/2 messages stored at once.
    ``pull_batch`` messages per pull bounds a slow stream's buffer; it is one turn of
    deliveries (``gateway.mqtt.session.DELIVER_BUDGET``), so a subscriber draining a
    backlog from the store pulls once per step. ``max_delay_s`` is the longest delay of a PUBLISH
    to ``$delayed/<seconds>/<topic>`` (gateway/mqtt/delayed.py). ``shared_invisible_s`` is how long a shared
    subscription's member has to acknowledge a message before its group gives it to another member
    (gateway/node/subscriptions.py).
    """

    max_packet_size: int = 1024 * 1024 + 1024
    max_connect_size: int = 128 * 1024
    receive_maximum: int = 128
    default_receive_maximum: int = 4096
    max_inflight: int = 4096
    topic_alias_maximum: int = 64
    max_keepalive: int | None = None
    max_session_expiry_s: int = 7 * 24 * 3600
    session_expiry_311_s: int = 7 * 24 * 3600
    max_qos: int = 2
    retain_available: bool = True
    wildcard_available: bool = True
    shared_available: bool = True
    subscription_ids_available: bool = True
    assigned_id_prefix: str = "lightgate-"
    pull_batch: int = 1024
    max_unwritten: int = 1024
    commit_interval_s: float = 1.0
    commit_every: int = 256
    max_queued_packets: int = 256
    reason_strings: bool = False
    max_topic_length: int = MAX_TOPIC_BYTES
    max_topic_levels: int = DEFAULT_LIMITS.max_levels
    max_subscriptions: int = 0
    max_user_properties: int = 0
    max_user_property_bytes: int = 0
    publish_rate: float = 0.0
    publish_burst: float = 0.0
    publish_bytes_rate: float = 0.0
    qos0_queue_bytes: int = 0
    max_unwritten_bytes: int = 0
    max_delay_s: int = 7 * 24 * 3600
    shared_invisible_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("receive_maximum", "default_receive_maximum", "max_inflight"):
            if not 1 <= getattr(self, name) <= MAX_UINT16:
                raise ValueError(f"{name} must be 1..{MAX_UINT16}, not {getattr(self, name)}")
        if not 0 <= self.topic_alias_maximum <= MAX_UINT16:
            raise ValueError(f"topic_alias_maximum must be 0..{MAX_UINT16}, not {self.topic_alias_maximum}")
        if self.max_qos not in (0, 1, 2):
            raise ValueError(f"max_qos must be 0, 1 or 2, not {self.max_qos}")
        if self.max_keepalive is not None and not 1 <= self.max_keepalive <= MAX_UINT16:
            raise ValueError(f"max_keepalive must be 1..{MAX_UINT16}, not {self.max_keepalive}")
        for name in ("pull_batch", "max_unwritten", "commit_every", "max_queued_packets", "max_packet_size",
                     "max_connect_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("commit_interval_s", "shared_invisible_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if not 1 <= self.max_topic_length <= MAX_TOPIC_BYTES:
            raise ValueError(f"max_topic_length must be 1..{MAX_TOPIC_BYTES}, not {self.max_topic_length}")
        if not 1 <= self.max_topic_levels <= DEFAULT_LIMITS.max_levels:
            raise ValueError(f"max_topic_levels must be 1..{DEFAULT_LIMITS.max_levels} (the store's limit), "
                             f"not {self.max_topic_levels}")
        for name in ("max_subscriptions", "publish_rate", "publish_burst", "publish_bytes_rate", "qos0_queue_bytes",
                     "max_unwritten_bytes", "max_user_properties", "max_user_property_bytes", "max_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")

    @property
    def repeat_limit(self) -> RepeatLimit:
        """The decoder's bounds of the repeated properties of one property block (0: none)."""
        return _repeat_limit(self.max_user_properties or MAX_VARINT, self.max_user_property_bytes or MAX_VARINT)


@functools.lru_cache(maxsize=8)
def _repeat_limit(count: int, size: int) -> RepeatLimit:
    """One (immutable) ``RepeatLimit`` shared by every connection's decoder: 48 B each otherwise (issue 31)."""
    return RepeatLimit(count, size)
