"""The outbound PUBLISH template: a message encoded once for every subscriber that gets it (design.md section 6).

Delivery writes each subscriber's packet from its message's template (``Message.template``), patching in only what
differs between subscribers; ``codec.encode`` writes a ``Publish`` packet through it too, so PUBLISH has one encoder.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import msgspec

from gateway.mqtt.packets import MQTT_5, MQTT_311
from gateway.mqtt.properties import (
    EMPTY_PROPERTIES, MAX_UINT16, MAX_VARINT, PacketType, Properties, encode_properties, encode_string, encode_varint,
    with_length,
)
from gateway.mqtt.reasons import LocalProtocolError

__all__ = ["PublishTemplate"]

_CACHED_TOPIC_CHARS = 128
"""Topics up to this long keep their encoded form (``_topic_string``): devices publish on the same few names, and
4,096 of them hold about 1 MB; longer ones are encoded per message."""

_topic_string = functools.lru_cache(maxsize=4096)(encode_string)


class PublishTemplate(msgspec.Struct, gc=False):
    """A message's PUBLISH encoded once for every subscriber that gets it, whatever its QoS and protocol level.

    The topic, the payload and the MQTT 5 properties a subscriber cannot change are encoded once; what differs
    between subscribers is patched in when a packet is written: the first byte (QoS, RETAIN, DUP), the packet
    id, and (MQTT 5) the Message Expiry Interval as the subscriber waited for it, its Subscription Identifiers
    and its Topic Alias (``patched``), which sit between the others in the spec's table order. Written as
    parts (``write``) that the caller joins with the rest of its write, so delivering a message adds no bytes
    object of its own but its packet id (and a fixed header, for a packet of 128 bytes or more).

    A msgspec struct the cyclic garbage collector does not track, like the ``Message`` that holds it (nothing it
    refers to refers back): the queue cache keeps thousands.

    Raises (on construction):
        LocalProtocolError: the topic contains U+0000 or a lone surrogate, or is over 65535 bytes.
    """

    topic: str
    payload: bytes = b""
    properties: Properties = EMPTY_PROPERTIES
    _topic: bytes = b""  # the encoded topic name
    _before: bytes = b""  # MQTT 5: the encoded properties before, between and after the patched ones
    _between: bytes = b""
    _after: bytes = b""
    _plain: bytes = b"\x00"  # MQTT 5: the property block (length included) with nothing patched

    def __post_init__(self) -> None:
        topic = self.topic
        self._topic = _topic_string(topic) if len(topic) <= _CACHED_TOPIC_CHARS else encode_string(topic)
        if self.properties is not EMPTY_PROPERTIES and self.properties:  # ``is`` first: no __bool__ call
            self._before, self._between, self._after = _split(self.properties)
            self._plain = with_length(self._before + self._between + self._after)

    def patched(self, expiry: int | None, subscription_ids: tuple[int, ...], alias: int | None) -> bytes:
        """The MQTT 5 property block (length included) with this subscriber's Message Expiry Interval,
        Subscription Identifiers and Topic Alias (None, (), None: the block every such subscriber shares).

        Raises:
            LocalProtocolError: a value out of range.
        """
        if expiry is None and not subscription_ids and alias is None:
            return self._plain
        own = Properties(message_expiry_interval=expiry)
        ids = Properties(subscription_identifiers=subscription_ids, topic_alias=alias)
        return with_length(b"".join((self._before, encode_properties(own, PacketType.PUBLISH), self._between,
                                     encode_properties(ids, PacketType.PUBLISH), self._after)))

    def head(self, level: int, qos: int, retain: bool, dup: bool = False, block: bytes | None = None,
             by_alias: bool = False) -> bytes:
        """The fixed header of this message at ``level`` (4: 3.1.1, 5: 5.0) with these flags and MQTT 5 property
        block (None: the shared one; ``patched`` makes another); ``by_alias``: with an empty topic name (the
        subscriber knows the topic by its alias, MQTT 5). Pass the same ``block`` and ``by_alias`` to ``write``.

        Raises:
            LocalProtocolError: bad QoS or level, a packet over the size limit.
        """
        if level == MQTT_5:
            rest = len(block if block is not None else self._plain)
        elif level == MQTT_311:
            rest = 0
        else:
            raise LocalProtocolError(f"protocol level {level!r} is not 4 (3.1.1) or 5 (5.0)")
        if qos not in (0, 1, 2):
            raise LocalProtocolError(f"PUBLISH QoS {qos!r} is not 0, 1 or 2")
        length = (2 if by_alias else len(self._topic)) + (2 if qos else 0) + rest + len(self.payload)
        first = qos << 1 | (0x08 if dup else 0) | (0x01 if retain else 0)
        if length < 128:
            return _SHORT_HEADERS[first][length]
        if length > MAX_VARINT:
            raise LocalProtocolError(f"PUBLISH of {length} bytes exceeds the maximum remaining length")
        return _SHORT_HEADERS[first][0][:1] + encode_varint(length)

    def write(self, out: list[bytes], head: bytes, level: int, packet_id: int | None = None,
              block: bytes | None = None, by_alias: bool = False) -> int:
        """Append the packet that ``head`` starts to ``out`` as parts: the topic name, the packet id (QoS 1/2),
        the property block (MQTT 5), the payload. Returns the packet's size. ``packet_id`` is trusted (``render``
        checks it)."""
        topic = b"\x00\x00" if by_alias else self._topic
        out += (head, topic)
        size = len(head) + len(topic) + len(self.payload)
        if packet_id is not None:
            out.append(packet_id.to_bytes(2, "big"))
            size += 2
        if level == MQTT_5:
            if block is None:
                block = self._plain
            out.append(block)
            size += len(block)
        out.append(self.payload)
        return size

    def write_plain(self, out: list[bytes], level: int, qos: int, retain: bool, packet_id: int | None) -> int:
        """Append the packet of a subscriber that patches nothing in (no Message Expiry Interval, Subscription
        Identifier or Topic Alias; no DUP) to ``out`` as parts and return its size: ``head`` and ``write`` in one
        call, for the delivery most subscribers get. ``level`` is 4 or 5 (a link's, checked at CONNECT), ``qos``
        0, 1 or 2 with ``packet_id`` None on QoS 0 and trusted otherwise (``render`` checks them).

        Raises:
            LocalProtocolError: a packet over the size limit.
        """
        topic, payload = self._topic, self.payload
        block = self._plain if level == MQTT_5 else b""
        length = len(topic) + len(block) + len(payload)
        if packet_id is None:
            head = _SHORT_HEADERS[retain][length] if length < 128 else self.head(level, qos, retain)
            out += (head, topic, block, payload)
        else:
            length += 2
            head = _SHORT_HEADERS[qos << 1 | retain][length] if length < 128 else self.head(level, qos, retain)
            out += (head, topic, packet_id.to_bytes(2, "big"), block, payload)
        return len(head) + length

    def render(self, level: int, qos: int, retain: bool = False, dup: bool = False, packet_id: int | None = None,
               block: bytes | None = None, by_alias: bool = False) -> bytes:
        """The whole packet as one bytes object (``head`` and ``write``, joined).

        Raises:
            LocalProtocolError: what ``head`` raises; a packet id on QoS 0, none or one outside 1..65535 on
                QoS 1/2, or DUP on QoS 0 ([MQTT-3.3.1-2]).
        """
        if not qos:
            if packet_id is not None or dup:
                raise LocalProtocolError("a QoS 0 PUBLISH has no packet identifier and no DUP flag")
        elif packet_id is None or not 0 < packet_id <= MAX_UINT16:
            raise LocalProtocolError(f"PUBLISH packet identifier {packet_id!r} is outside 1..65535")
        out: list[bytes] = []
        self.write(out, self.head(level, qos, retain, dup, block, by_alias), level, packet_id, block, by_alias)
        return b"".join(out)

    def size(self, head: bytes, level: int, qos: int, block: bytes | None = None, by_alias: bool = False) -> int:
        """The size of the packet ``head`` starts, without writing it (to compare with a Maximum Packet Size)."""
        rest = len(block if block is not None else self._plain) if level == MQTT_5 else 0
        return len(head) + (2 if by_alias else len(self._topic)) + (2 if qos else 0) + rest + len(self.payload)


def _split(properties: Properties) -> tuple[bytes, bytes, bytes]:
    """The encoded properties around the patched ones: a PUBLISH's table order is Payload Format Indicator,
    Message Expiry Interval, Content Type, Response Topic, Correlation Data, Subscription Identifiers, Topic
    Alias, User Properties (section 2.2.2.2). Raises what ``encode_properties`` raises."""
    kept = replace(properties, message_expiry_interval=None, subscription_identifiers=(), topic_alias=None)
    whole = encode_properties(kept, PacketType.PUBLISH)
    before = encode_properties(Properties(payload_format_indicator=kept.payload_format_indicator),
                               PacketType.PUBLISH)
    after = encode_properties(Properties(user_properties=kept.user_properties), PacketType.PUBLISH)
    return before, whole[len(before):len(whole) - len(after)], after


_SHORT_HEADERS = tuple(tuple(bytes((0x30 | flags, length)) for length in range(128)) for flags in range(16))
"""The fixed header of every PUBLISH under 128 bytes, by its flags (DUP, QoS, RETAIN) and Remaining Length: 4 KB
made once, so that writing a small message costs no bytes object for it."""
