"""The MQTT 5 PUBLISH properties back-end clients write and read: the property block a record keeps, both ways.

A record stores the PUBLISH property block as on the wire, without its length
prefix (store/log/record.py). Producers encode the common properties into it
(:func:`encode_properties`); consumers get them decoded into a typed
:class:`MessageProperties` (:func:`decode_properties`) instead of raw bytes.
The store does not import the gateway's codec (imports point down), so this
small module knows the handful of properties a publisher can set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightqueue.topics import validate_topic

__all__ = ["NO_PROPERTIES", "MessageProperties", "decode_properties", "encode_properties"]

PAYLOAD_FORMAT = 0x01
MESSAGE_EXPIRY = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_IDENTIFIER = 0x0B  # set by the server on delivery, never stored by a publisher: skipped if found
TOPIC_ALIAS = 0x23  # a connection's shorthand, meaningless in a record: skipped if found
USER_PROPERTY = 0x26


@dataclass(frozen=True, slots=True)
class MessageProperties:
    """The MQTT 5 properties of a stored message; None (or ``()``) where the publisher set none."""

    payload_format_indicator: int | None = None  # 1: the payload is UTF-8 text
    message_expiry_interval: int | None = None  # seconds from the store time (``ConsumerMessage.expires_ms``)
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()  # in order; a name may repeat


NO_PROPERTIES = MessageProperties()
"""What a message without properties (every MQTT 3.1.1 publish) decodes to."""


def _string(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) > 0xFFFF:
        raise ValueError(f"an MQTT string or binary property is at most 65535 bytes, not {len(raw)}")
    return len(raw).to_bytes(2, "big") + raw


def encode_properties(
    *,
    payload_format_indicator: int | None = None,
    message_expiry_interval: int | None = None,
    content_type: str | None = None,
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
    user_properties: Iterable[tuple[str, str]] = (),
) -> bytes:
    """The MQTT 5 PUBLISH property block (no length prefix) of the common properties, in identifier order.

    Raises:
        ValueError: a value out of range (the payload format indicator is 0 or 1,
            the expiry interval a u32, strings at most 65535 bytes).
        TopicError: ``response_topic`` is not a valid topic name.
    """
    parts: list[bytes] = []
    if payload_format_indicator is not None:
        if payload_format_indicator not in (0, 1):
            raise ValueError(f"payload_format_indicator must be 0 or 1, not {payload_format_indicator!r}")
        parts.append(bytes((PAYLOAD_FORMAT, payload_format_indicator)))
    if message_expiry_interval is not None:
        if not 0 <= message_expiry_interval <= 0xFFFFFFFF:
            raise ValueError(f"message_expiry_interval must be 0..4294967295 s, not {message_expiry_interval!r}")
        parts.append(bytes((MESSAGE_EXPIRY,)) + message_expiry_interval.to_bytes(4, "big"))
    if content_type is not None:
        parts.append(bytes((CONTENT_TYPE,)) + _string(content_type))
    if response_topic is not None:
        parts.append(bytes((RESPONSE_TOPIC,)) + _string(validate_topic(response_topic)))
    if correlation_data is not None:
        parts.append(bytes((CORRELATION_DATA,)) + _string(correlation_data))
    for name, value in user_properties:
        parts.append(bytes((USER_PROPERTY,)) + _string(name) + _string(value))
    return b"".join(parts)


def decode_properties(block: bytes) -> MessageProperties:
    """The properties of a record's block (``b""``: ``NO_PROPERTIES``).

    Raises:
        ValueError: the block is truncated, has an identifier a PUBLISH cannot carry, or a string is not UTF-8.
    """
    if not block:
        return NO_PROPERTIES
    reader = _Reader(block)
    found: dict[str, object] = {}
    users: list[tuple[str, str]] = []
    while reader.pos < len(block):
        identifier = reader.take(1)[0]
        if identifier == PAYLOAD_FORMAT:
            found["payload_format_indicator"] = reader.take(1)[0]
        elif identifier == MESSAGE_EXPIRY:
            found["message_expiry_interval"] = int.from_bytes(reader.take(4), "big")
        elif identifier == CONTENT_TYPE:
            found["content_type"] = reader.text()
        elif identifier == RESPONSE_TOPIC:
            found["response_topic"] = reader.text()
        elif identifier == CORRELATION_DATA:
            found["correlation_data"] = reader.binary()
        elif identifier == USER_PROPERTY:
            users.append((reader.text(), reader.text()))
        elif identifier == SUBSCRIPTION_IDENTIFIER:
            reader.varint()
        elif identifier == TOPIC_ALIAS:
            reader.take(2)
        else:
            raise ValueError(f"property identifier 0x{identifier:02x} cannot be in a PUBLISH")
    return MessageProperties(**found, user_properties=tuple(users))  # type: ignore[arg-type]


class _Reader:
    """A cursor over a property block; every read checks the block has the bytes."""

    __slots__ = ("block", "pos")

    def __init__(self, block: bytes) -> None:
        self.block = block
        self.pos = 0

    def take(self, count: int) -> bytes:
        end = self.pos + count
        if end > len(self.block):
            raise ValueError(f"the property block ends inside a property (byte {self.pos} of {len(self.block)})")
        value = self.block[self.pos:end]
        self.pos = end
        return value

    def binary(self) -> bytes:
        return self.take(int.from_bytes(self.take(2), "big"))

    def text(self) -> str:
        return self.binary().decode()  # UnicodeDecodeError is a ValueError

    def varint(self) -> int:
        value = 0
        for shift in range(0, 28, 7):
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
        raise ValueError("a variable byte integer longer than 4 bytes")
