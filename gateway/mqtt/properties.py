"""MQTT 5.0 properties, and the MQTT data types (section 1.5) that properties and packets are made of.

``PROPERTY_TABLE`` is the spec's property table (section 2.2.2.2): identifier,
data type, and where each property may appear. Encoding, decoding and the
checks on both sides are driven by it, so a property is described once.

The store keeps a PUBLISH's properties as their wire bytes *without* the
Property Length prefix, which is exactly what ``encode_properties`` returns and
``decode_properties`` reads; ``with_length`` and ``read_properties`` handle
the length-prefixed form found inside packets.

Decoding raises only ``RemoteProtocolError`` (the peer's fault); encoding
raises ``LocalProtocolError`` (ours).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

from gateway.mqtt.reasons import LocalProtocolError, ReasonCode, RemoteProtocolError

MAX_VARINT = 268_435_455
"""The largest Variable Byte Integer: four 7-bit groups (section 1.5.5). Also the largest Remaining Length."""

MAX_UINT16 = 0xFFFF
"""Strings and binary data carry a two-byte length, so neither can be longer than this (sections 1.5.4, 1.5.6)."""


class PacketType(IntEnum):
    """MQTT control packet types: the high nibble of a packet's first byte (section 2.1.2)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ReasonCode.MALFORMED_PACKET, message)


# --- MQTT data types -------------------------------------------------------------------------

# One-byte encodings of the values 0-127, which are almost every varint on the wire.
_SMALL_VARINTS = tuple(bytes((value,)) for value in range(128))


def encode_varint(value: int) -> bytes:
    """Encode a Variable Byte Integer in the minimum number of bytes, as [MQTT-1.5.5-1] requires.

    Raises:
        LocalProtocolError: ``value`` is negative or above ``MAX_VARINT``.
    """
    if 0 <= value < 128:
        return _SMALL_VARINTS[value]
    if not 0 <= value <= MAX_VARINT:
        raise LocalProtocolError(f"variable byte integer {value} is outside 0..{MAX_VARINT}")
    out = bytearray()
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Decode a Variable Byte Integer that must lie within ``buf[pos:end]``.

    Returns:
        ``(value, position after it)``.

    Raises:
        RemoteProtocolError: MALFORMED_PACKET if it runs past ``end``, is longer than four
            bytes, or is not in its minimal form ([MQTT-1.5.5-1]).
    """
    value = 0
    shift = 0
    for index in range(pos, min(pos + 4, end)):
        byte = buf[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and index > pos:
                raise _malformed("variable byte integer is not in its minimal form")
            return value, index + 1
        shift += 7
    if end - pos >= 4:
        raise _malformed("variable byte integer is longer than four bytes")
    raise _malformed("variable byte integer runs past the end of its field")


def decode_utf8(raw: bytes) -> str:
    """Decode a UTF-8 Encoded String's bytes, enforcing section 1.5.4.

    Python's strict decoder rejects everything [MQTT-1.5.4-1] calls ill-formed
    (overlong forms, encoded surrogates U+D800..U+DFFF, code points past
    U+10FFFF); U+0000 is checked here ([MQTT-1.5.4-2]). A leading U+FEFF is kept,
    as [MQTT-1.5.4-3] requires.

    Raises:
        RemoteProtocolError: MALFORMED_PACKET.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed(f"ill-formed UTF-8 string ({exc.reason})") from None
    if "\x00" in text:
        raise _malformed("UTF-8 string contains U+0000")
    return text


def read_string(buf: bytes, pos: int, end: int) -> tuple[str, int]:
    """Read a UTF-8 Encoded String (two-byte length, then UTF-8) from ``buf[pos:end]``.

    Raises:
        RemoteProtocolError: MALFORMED_PACKET if it runs past ``end`` or is not valid MQTT UTF-8.
    """
    raw, pos = read_binary(buf, pos, end)
    return decode_utf8(raw), pos


def read_binary(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """Read Binary Data (two-byte length, then bytes) from ``buf[pos:end]``.

    Raises:
        RemoteProtocolError: MALFORMED_PACKET if it runs past ``end``.
    """
    if pos + 2 > end:
        raise _malformed("length field runs past the end of the packet")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise _malformed("string or binary data runs past the end of its field")
    return bytes(buf[pos + 2:stop]), stop


def encode_string(text: str) -> bytes:
    """Encode a UTF-8 Encoded String with its two-byte length.

    Raises:
        LocalProtocolError: ``text`` contains U+0000 or a lone surrogate, or is over 65535 bytes.
    """
    if "\x00" in text:
        raise LocalProtocolError(f"string {text!r} contains U+0000, which MQTT forbids")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"string {text!r} contains a lone surrogate, which is not UTF-8") from None
    return encode_binary(raw)


def encode_binary(data: bytes) -> bytes:
    """Encode Binary Data with its two-byte length.

    Raises:
        LocalProtocolError: ``data`` is over 65535 bytes.
    """
    if len(data) > MAX_UINT16:
        raise LocalProtocolError(f"{len(data)} bytes do not fit a two-byte length")
    return len(data).to_bytes(2, "big") + data


# --- the property table ----------------------------------------------------------------------


class PropertyType(Enum):
    """The data type of a property's value (section 2.2.2.2)."""

    BYTE = "Byte"
    BOOL = "Byte (0 or 1, decoded as bool)"
    UINT16 = "Two Byte Integer"
    UINT32 = "Four Byte Integer"
    VARINT = "Variable Byte Integer"
    STRING = "UTF-8 Encoded String"
    STRING_PAIR = "UTF-8 String Pair"
    BINARY = "Binary Data"


# The largest value each integer type can carry; a property may narrow it (``PropertyDef.highest``).
_TYPE_HIGHEST = {
    PropertyType.BYTE: 0xFF,
    PropertyType.BOOL: 1,
    PropertyType.UINT16: MAX_UINT16,
    PropertyType.UINT32: 0xFFFF_FFFF,
    PropertyType.VARINT: MAX_VARINT,
}


@dataclass(frozen=True, slots=True)
class PropertyDef:
    """One row of the spec's property table.

    ``name`` is the ``Properties`` field. ``packets`` are where the property may
    appear; ``in_will`` whether it may appear in a CONNECT's will properties.
    ``multiple`` properties are tuples that may repeat in the packets listed in
    ``repeatable_in`` (elsewhere at most once). Integer values must lie in
    ``lowest..highest``; outside it, or a second copy of a single property, is a
    Protocol Error.
    """

    identifier: int
    name: str
    type: PropertyType
    packets: frozenset[PacketType]
    in_will: bool = False
    lowest: int = 0
    highest: int | None = None
    multiple: bool = False
    repeatable_in: frozenset[PacketType] = frozenset()

    @property
    def value_range(self) -> tuple[int, int] | None:
        """Inclusive bounds for integer properties, None for strings and binary data."""
        if self.type not in _TYPE_HIGHEST:
            return None
        return self.lowest, self.highest if self.highest is not None else _TYPE_HIGHEST[self.type]


_P = PacketType
_ALL_PACKETS = frozenset(_P) - {_P.PINGREQ, _P.PINGRESP}
_ACKS = frozenset({_P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP, _P.SUBACK, _P.UNSUBACK})


def _row(identifier: int, name: str, type_: PropertyType, packets: set[PacketType], **extra: Any) -> PropertyDef:
    return PropertyDef(identifier, name, type_, frozenset(packets), **extra)


# Section 2.2.2.2's table, in identifier order (which is also the order properties are encoded in,
# as paho does). The byte-typed properties only allow 0 and 1; four integers forbid 0.
PROPERTY_TABLE: tuple[PropertyDef, ...] = (
    _row(0x01, "payload_format_indicator", PropertyType.BYTE, {_P.PUBLISH}, in_will=True, highest=1),
    _row(0x02, "message_expiry_interval", PropertyType.UINT32, {_P.PUBLISH}, in_will=True),
    _row(0x03, "content_type", PropertyType.STRING, {_P.PUBLISH}, in_will=True),
    _row(0x08, "response_topic", PropertyType.STRING, {_P.PUBLISH}, in_will=True),
    _row(0x09, "correlation_data", PropertyType.BINARY, {_P.PUBLISH}, in_will=True),
    _row(0x0B, "subscription_identifiers", PropertyType.VARINT, {_P.PUBLISH, _P.SUBSCRIBE},
         lowest=1, multiple=True, repeatable_in=frozenset({_P.PUBLISH})),
    _row(0x11, "session_expiry_interval", PropertyType.UINT32, {_P.CONNECT, _P.CONNACK, _P.DISCONNECT}),
    _row(0x12, "assigned_client_identifier", PropertyType.STRING, {_P.CONNACK}),
    _row(0x13, "server_keep_alive", PropertyType.UINT16, {_P.CONNACK}),
    _row(0x15, "authentication_method", PropertyType.STRING, {_P.CONNECT, _P.CONNACK, _P.AUTH}),
    _row(0x16, "authentication_data", PropertyType.BINARY, {_P.CONNECT, _P.CONNACK, _P.AUTH}),
    _row(0x17, "request_problem_information", PropertyType.BOOL, {_P.CONNECT}),
    _row(0x18, "will_delay_interval", PropertyType.UINT32, set(), in_will=True),
    _row(0x19, "request_response_information", PropertyType.BOOL, {_P.CONNECT}),
    _row(0x1A, "response_information", PropertyType.STRING, {_P.CONNACK}),
    _row(0x1C, "server_reference", PropertyType.STRING, {_P.CONNACK, _P.DISCONNECT}),
    _row(0x1F, "reason_string", PropertyType.STRING, {_P.CONNACK, _P.DISCONNECT, _P.AUTH} | _ACKS),
    _row(0x21, "receive_maximum", PropertyType.UINT16, {_P.CONNECT, _P.CONNACK}, lowest=1),
    _row(0x22, "topic_alias_maximum", PropertyType.UINT16, {_P.CONNECT, _P.CONNACK}),
    _row(0x23, "topic_alias", PropertyType.UINT16, {_P.PUBLISH}, lowest=1),
    _row(0x24, "maximum_qos", PropertyType.BYTE, {_P.CONNACK}, highest=1),
    _row(0x25, "retain_available", PropertyType.BOOL, {_P.CONNACK}),
    _row(0x26, "user_properties", PropertyType.STRING_PAIR, set(_ALL_PACKETS), in_will=True,
         multiple=True, repeatable_in=_ALL_PACKETS),
    _row(0x27, "maximum_packet_size", PropertyType.UINT32, {_P.CONNECT, _P.CONNACK}, lowest=1),
    _row(0x28, "wildcard_subscription_available", PropertyType.BOOL, {_P.CONNACK}),
    _row(0x29, "subscription_identifier_available", PropertyType.BOOL, {_P.CONNACK}),
    _row(0x2A, "shared_subscription_available", PropertyType.BOOL, {_P.CONNACK}),
)


@dataclass(frozen=True, slots=True, repr=False)
class Properties:
    """The MQTT 5.0 properties of one packet (or of a CONNECT's will); None means absent.

    Don't subclass this. 3.1.1 packets always carry ``EMPTY_PROPERTIES``.
    """

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: bool | None = None
    will_delay_interval: int | None = None
    request_response_information: bool | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: bool | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: bool | None = None
    subscription_identifier_available: bool | None = None
    shared_subscription_available: bool | None = None

    def __bool__(self) -> bool:
        """True when any property is present, so ``if packet.properties:`` reads as it should."""
        return self is not EMPTY_PROPERTIES and self != EMPTY_PROPERTIES

    def __repr__(self) -> str:
        present = ", ".join(
            f"{prop.name}={getattr(self, prop.name)!r}" for prop in PROPERTY_TABLE if _is_present(getattr(self, prop.name))
        )
        return f"Properties({present})"


EMPTY_PROPERTIES = Properties()
"""The properties of a packet that has none; decoding returns this very object, so ``is`` tests are cheap."""

def _is_present(value: object) -> bool:
    return value is not None and value != ()


# Lookups built once from the table: the row for each identifier byte (None: no such property),
# and the identifiers allowed in each place a property block can be.
_BY_IDENTIFIER: tuple[PropertyDef | None, ...] = tuple(
    next((prop for prop in PROPERTY_TABLE if prop.identifier == byte), None) for byte in range(256)
)
_ALLOWED: dict[tuple[PacketType, bool], frozenset[int]] = {
    (packet_type, False): frozenset(prop.identifier for prop in PROPERTY_TABLE if packet_type in prop.packets)
    for packet_type in PacketType
}
_ALLOWED[PacketType.CONNECT, True] = frozenset(prop.identifier for prop in PROPERTY_TABLE if prop.in_will)
_RANGES = {prop.identifier: prop.value_range for prop in PROPERTY_TABLE}
_INT_SIZES = {PropertyType.BYTE: 1, PropertyType.BOOL: 1, PropertyType.UINT16: 2, PropertyType.UINT32: 4}


def _where(packet_type: PacketType, will: bool) -> str:
    return "will properties" if will else packet_type.name


def _read_byte(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos >= end:
        raise _malformed("property value runs past the end of the properties")
    return buf[pos], pos + 1


def _read_fixed(size: int) -> Callable[[bytes, int, int], tuple[int, int]]:
    def read(buf: bytes, pos: int, end: int) -> tuple[int, int]:
        stop = pos + size
        if stop > end:
            raise _malformed("property value runs past the end of the properties")
        return int.from_bytes(buf[pos:stop], "big"), stop

    return read


def _read_pair(buf: bytes, pos: int, end: int) -> tuple[tuple[str, str], int]:
    name, pos = read_string(buf, pos, end)
    value, pos = read_string(buf, pos, end)
    return (name, value), pos


_READERS: dict[PropertyType, Callable[[bytes, int, int], tuple[Any, int]]] = {
    PropertyType.BYTE: _read_byte,
    PropertyType.BOOL: _read_byte,
    PropertyType.UINT16: _read_fixed(2),
    PropertyType.UINT32: _read_fixed(4),
    PropertyType.VARINT: decode_varint,
    PropertyType.STRING: read_string,
    PropertyType.STRING_PAIR: _read_pair,
    PropertyType.BINARY: read_binary,
}


@dataclass(frozen=True, slots=True)
class RepeatLimit:
    """How many repeated properties (User Properties, Subscription Identifiers) one property block may hold, and
    how many bytes they may take, identifiers and length prefixes included.

    Decoding stops with QUOTA_EXCEEDED at the first property over either bound, so the work a block costs is
    bounded by the limit, not by the packet's size (20,000 User Properties took about 90 ms to decode).
    """

    count: int = MAX_VARINT
    bytes: int = MAX_VARINT


NO_REPEAT_LIMIT = RepeatLimit()
"""What a decoder of our own peer's packets (a client's view of the server) accepts: anything the packet holds."""


class RepeatLimitExceeded(RemoteProtocolError):
    """A property block holds more repeated properties than its ``RepeatLimit`` allows (QUOTA_EXCEEDED)."""


def decode_properties(buf: bytes, pos: int, end: int, packet_type: PacketType, *, will: bool = False,
                      limit: RepeatLimit = NO_REPEAT_LIMIT) -> Properties:
    """Decode the property list in ``buf[pos:end]`` (no Property Length prefix).

    Args:
        packet_type: the packet the properties belong to; with ``will=True`` (only for
            CONNECT) they are the will properties, which allow a different set.
        limit: the bounds of the repeated properties of the block.

    Returns:
        ``EMPTY_PROPERTIES`` when the range is empty, else a new ``Properties``.

    Raises:
        RemoteProtocolError: MALFORMED_PACKET for an unknown identifier, a property not
            allowed here (section 2.2.2.2), or a value that runs past ``end`` or is not
            valid UTF-8; PROTOCOL_ERROR for a duplicate or an out-of-range value;
            QUOTA_EXCEEDED for repeated properties over ``limit``.
    """
    if pos >= end:
        return EMPTY_PROPERTIES
    allowed = _ALLOWED[packet_type, will]
    values: dict[str, Any] = {}
    repeated: dict[str, list[Any]] = {}
    count = 0
    size = 0
    while pos < end:
        identifier = buf[pos]
        prop = _BY_IDENTIFIER[identifier]
        if prop is None:
            # Identifiers are Variable Byte Integers, but all defined ones are below 0x80: a
            # continuation bit means an unknown identifier or a non-minimal encoding.
            raise _malformed(f"unknown property identifier 0x{identifier:02X}")
        if identifier not in allowed:
            raise _malformed(f"property {prop.name} is not allowed in {_where(packet_type, will)}")
        start = pos
        value, pos = _READERS[prop.type](buf, pos + 1, end)
        bounds = _RANGES[identifier]
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise RemoteProtocolError(
                ReasonCode.PROTOCOL_ERROR, f"property {prop.name} value {value} is outside {bounds[0]}..{bounds[1]}"
            )
        if prop.type is PropertyType.BOOL:
            value = value == 1
        if prop.multiple:
            count += 1
            size += pos - start
            if count > limit.count or size > limit.bytes:
                raise RepeatLimitExceeded(
                    ReasonCode.QUOTA_EXCEEDED, f"repeated properties ({prop.name}) over the limit of {limit.count}"
                    f" properties or {limit.bytes} bytes in {_where(packet_type, will)}")
            seen = repeated.setdefault(prop.name, [])
            if seen and packet_type not in prop.repeatable_in:
                raise RemoteProtocolError(
                    ReasonCode.PROTOCOL_ERROR, f"property {prop.name} appears twice in {_where(packet_type, will)}"
                )
            seen.append(value)
        elif prop.name in values:
            raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"property {prop.name} appears twice")
        else:
            values[prop.name] = value
    for name, items in repeated.items():
        values[name] = tuple(items)
    return Properties(**values)


def read_properties(
    buf: bytes, pos: int, end: int, packet_type: PacketType, *, will: bool = False,
    limit: RepeatLimit = NO_REPEAT_LIMIT,
) -> tuple[Properties, int]:
    """Read a Property Length and the properties it covers, as they appear inside a packet.

    Returns:
        ``(properties, position after them)``.

    Raises:
        RemoteProtocolError: as ``decode_properties``, and MALFORMED_PACKET if the
            length runs past ``end``.
    """
    length, pos = decode_varint(buf, pos, end)
    stop = pos + length
    if stop > end:
        raise _malformed("property length runs past the end of the packet")
    return decode_properties(buf, pos, stop, packet_type, will=will, limit=limit), stop


def _encode_int(prop: PropertyDef, value: int) -> bytes:
    low, high = _RANGES[prop.identifier]  # type: ignore[misc]  # only called for integer types
    if not isinstance(value, int) or not low <= value <= high:
        raise LocalProtocolError(f"property {prop.name} value {value!r} is outside {low}..{high}")
    if prop.type is PropertyType.VARINT:
        return encode_varint(value)
    return int(value).to_bytes(_INT_SIZES[prop.type], "big")


def _encode_value(prop: PropertyDef, value: Any) -> bytes:
    if prop.type is PropertyType.STRING:
        return encode_string(value)
    if prop.type is PropertyType.BINARY:
        return encode_binary(value)
    if prop.type is PropertyType.STRING_PAIR:
        name, text = value
        return encode_string(name) + encode_string(text)
    return _encode_int(prop, value)


def encode_properties(props: Properties, packet_type: PacketType, *, will: bool = False) -> bytes:
    """Encode properties in table order, without the Property Length prefix.

    This is the form the CommitLog stores for a PUBLISH; ``with_length`` makes
    the in-packet form.

    Raises:
        LocalProtocolError: a property is not allowed for ``packet_type`` (or in will
            properties), repeats where it may not, or has a value out of range.
    """
    if not props:
        return b""
    allowed = _ALLOWED[packet_type, will]
    parts: list[bytes] = []
    for prop in PROPERTY_TABLE:
        value = getattr(props, prop.name)
        if not _is_present(value):
            continue
        if prop.identifier not in allowed:
            raise LocalProtocolError(f"property {prop.name} is not allowed in {_where(packet_type, will)}")
        tag = _SMALL_VARINTS[prop.identifier]
        if not prop.multiple:
            parts += (tag, _encode_value(prop, value))
            continue
        if len(value) > 1 and packet_type not in prop.repeatable_in:
            raise LocalProtocolError(f"property {prop.name} may appear only once in {_where(packet_type, will)}")
        for item in value:
            parts += (tag, _encode_value(prop, item))
    return b"".join(parts)


def with_length(properties_bytes: bytes) -> bytes:
    """Prefix encoded properties with their Property Length, the form they take inside a packet."""
    return encode_varint(len(properties_bytes)) + properties_bytes
