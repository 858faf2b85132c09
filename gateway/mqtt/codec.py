"""Sans-IO MQTT 3.1.1 / 5.0 codec: bytes in, packets out; packets in, bytes out.

There is no socket here (the h11 pattern). ``MqttDecoder.feed()`` buffers
bytes as they arrive, in fragments of any size; ``next_packet()`` returns one
packet or ``NEED_DATA``. ``encode()`` turns a packet into bytes, and
PUBLISH is written through ``gateway/mqtt/template.py``'s ``PublishTemplate``, which
encodes a message once so that delivering it to many subscribers only patches
the flags, the packet id and their own properties (design.md section 6).

Errors: the peer's mistakes raise ``RemoteProtocolError`` carrying the MQTT 5
reason code to answer with (the connection layer sends it in a CONNACK or
DISCONNECT for 5.0 and simply closes for 3.1.1); nothing else escapes the
decoder. Our own mistakes (encoding a packet the spec forbids) raise
``LocalProtocolError``.

What the codec checks is what can be checked from the bytes of one packet and
the protocol level: encodings, lengths, reserved bits, flag combinations,
packet ids, property rules, reason codes allowed per packet, and which side
may send which packet. Topic syntax (wildcards in names, ``#`` placement) is
``lightqueue/topics.py``'s job; topic aliases, packet-id bookkeeping and
receive maximum are connection state.

Spec references: "section" numbers are MQTT 5.0's unless marked 3.1.1;
``[MQTT-x.y.z-n]`` are the spec's normative statement ids.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Final, Literal, final

from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    PROTOCOL_LEVELS,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from gateway.mqtt.properties import (
    EMPTY_PROPERTIES,
    MAX_UINT16,
    MAX_VARINT,
    NO_REPEAT_LIMIT,
    PacketType,
    Properties,
    RepeatLimit,
    decode_utf8,
    decode_varint as decode_varint,
    encode_binary,
    encode_properties,
    encode_string,
    encode_varint as encode_varint,
    read_binary,
    read_properties,
    read_string,
    with_length,
)
from gateway.mqtt.reasons import (
    AUTH_REASONS,
    CONNACK_REASONS,
    DISCONNECT_REASONS,
    PUBACK_REASONS,
    PUBCOMP_REASONS,
    PUBREC_REASONS,
    PUBREL_REASONS,
    SUBACK_FAILURE_311,
    SUBACK_REASONS,
    UNSUBACK_REASONS,
    ConnackCode311,
    LocalProtocolError as LocalProtocolError,
    ReasonCode,
    RemoteProtocolError as RemoteProtocolError,
    connack_code_311,
    connack_reason_from_311,
)
from gateway.mqtt.template import PublishTemplate

MAX_PACKET_SIZE = MAX_VARINT + 5
"""The largest packet MQTT can express: a type byte, four Remaining Length bytes and the largest Remaining Length."""


class Role(Enum):
    """Which end of the connection a decoder sits at: a SERVER decodes what clients send."""

    CLIENT = "client"
    SERVER = "server"


_LITTLE_ENDIAN: Final = sys.byteorder == "little"  # array("H") holds native words; MQTT sends them big-endian

_PUBACK_SLICE: Final = 64
"""The PUBACKs ``MqttDecoder.pubacks`` looks at first: a subscriber's read holds tens."""


class _NeedData(Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = _NeedData.NEED_DATA
"""Returned by ``next_packet()`` when the buffer does not hold a whole packet yet."""

_SENT_BY = {
    Role.CLIENT: frozenset({
        PacketType.CONNECT, PacketType.PUBLISH, PacketType.PUBACK, PacketType.PUBREC, PacketType.PUBREL,
        PacketType.PUBCOMP, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE, PacketType.PINGREQ,
        PacketType.DISCONNECT, PacketType.AUTH,
    }),
    Role.SERVER: frozenset({
        PacketType.CONNACK, PacketType.PUBLISH, PacketType.PUBACK, PacketType.PUBREC, PacketType.PUBREL,
        PacketType.PUBCOMP, PacketType.SUBACK, PacketType.UNSUBACK, PacketType.PINGRESP,
        PacketType.DISCONNECT, PacketType.AUTH,
    }),
}
"""Which side may send each packet type (the "Direction of flow" column of section 2.1.2)."""

_PEER = {Role.CLIENT: Role.SERVER, Role.SERVER: Role.CLIENT}

_FIXED_FLAGS = {packet_type: 0 for packet_type in PacketType} | {
    PacketType.PUBREL: 0b0010,
    PacketType.SUBSCRIBE: 0b0010,
    PacketType.UNSUBSCRIBE: 0b0010,
}
"""The only legal low nibble of the first byte per packet type (PUBLISH's carries DUP/QoS/RETAIN instead)."""


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ReasonCode.MALFORMED_PACKET, message)


def _protocol_error(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, message)


def _judge_first_byte(role: Role, level: int | None, byte: int) -> tuple[ReasonCode, str] | None:
    """Why a packet starting with ``byte`` is unacceptable at this point, or None if it is fine."""
    if byte >> 4 == 0:
        return ReasonCode.MALFORMED_PACKET, "packet type 0 is reserved"
    packet_type = PacketType(byte >> 4)
    flags = byte & 0x0F
    sender = _PEER[role]
    if packet_type is PacketType.AUTH and level == MQTT_311:
        return ReasonCode.PROTOCOL_ERROR, "AUTH does not exist in MQTT 3.1.1 (packet type 15 is reserved)"
    if packet_type not in _SENT_BY[sender]:
        return ReasonCode.PROTOCOL_ERROR, f"a {sender.value} may not send {packet_type.name}"
    if role is Role.SERVER and level is None and packet_type is not PacketType.CONNECT:
        return ReasonCode.PROTOCOL_ERROR, f"first packet is {packet_type.name}, must be CONNECT [MQTT-3.1.0-1]"
    if role is Role.SERVER and level is not None and packet_type is PacketType.CONNECT:
        return ReasonCode.PROTOCOL_ERROR, "a second CONNECT on one connection [MQTT-3.1.0-2]"
    if role is Role.CLIENT and level == MQTT_311 and packet_type is PacketType.DISCONNECT:
        return ReasonCode.PROTOCOL_ERROR, "an MQTT 3.1.1 server never sends DISCONNECT"
    if packet_type is PacketType.PUBLISH:
        # A Malformed Packet in 5.0 (section 3.3.1.2); 3.1.1 closes the connection. DUP on QoS 0
        # breaks [MQTT-3.3.1-2]; the spec names no reason, and like Mosquitto we treat an invalid
        # fixed-header flag combination as malformed (section 2.1.3).
        if flags & 0b0110 == 0b0110:
            return ReasonCode.MALFORMED_PACKET, "PUBLISH with QoS 3 [MQTT-3.3.1-4]"
        if flags & 0b1000 and not flags & 0b0110:
            return ReasonCode.MALFORMED_PACKET, "DUP set on a QoS 0 PUBLISH [MQTT-3.3.1-2]"
    elif flags != _FIXED_FLAGS[packet_type]:
        # 5.0 section 2.1.3: invalid reserved flags are a Malformed Packet; 3.1.1 [MQTT-2.2.2-2]: close.
        return ReasonCode.MALFORMED_PACKET, f"{packet_type.name} with reserved flags 0b{flags:04b}"
    return None


@functools.cache
def _first_byte_verdicts(role: Role, level: int | None) -> tuple[tuple[ReasonCode, str] | None, ...]:
    """``_judge_first_byte`` for all 256 values, so checking a packet's first byte is one lookup."""
    return tuple(_judge_first_byte(role, level, byte) for byte in range(256))


def _reason_lookup(reasons: frozenset[ReasonCode]) -> dict[int, ReasonCode]:
    return {int(reason): reason for reason in reasons}


_CONNACK_CODES = _reason_lookup(CONNACK_REASONS)
_SUBACK_CODES = _reason_lookup(SUBACK_REASONS)
_UNSUBACK_CODES = _reason_lookup(UNSUBACK_REASONS)
_DISCONNECT_CODES = _reason_lookup(DISCONNECT_REASONS)
_AUTH_CODES = _reason_lookup(AUTH_REASONS)
_SUBACK_CODES_311 = {
    0x00: ReasonCode.GRANTED_QOS_0,
    0x01: ReasonCode.GRANTED_QOS_1,
    0x02: ReasonCode.GRANTED_QOS_2,
    SUBACK_FAILURE_311: ReasonCode.UNSPECIFIED_ERROR,
}

# Every legal options byte of a SUBSCRIBE entry, decoded once. 3.1.1 (section 3.8.3.1 of 3.1.1)
# has only QoS; 5.0 adds No Local, Retain As Published and Retain Handling.
_OPTIONS_311 = {qos: SubscriptionOptions(qos) for qos in range(3)}
_OPTIONS_5 = {
    qos | no_local << 2 | rap << 3 | handling << 4: SubscriptionOptions(qos, bool(no_local), bool(rap), handling)
    for qos in range(3) for no_local in (0, 1) for rap in (0, 1) for handling in range(3)
}


def _auth_problem(props: Properties) -> str | None:
    # Sections 3.1.2.11.10 and 3.2.2.3.18: Authentication Data without a method is a Protocol Error.
    if props.authentication_data is not None and props.authentication_method is None:
        return "authentication data without an authentication method"
    return None


@final
class MqttDecoder:
    """Turns the bytes of one connection, arriving in any fragmentation, into packets.

    Args:
        role: SERVER decodes client->server packets (and learns the protocol level from
            the CONNECT, which must come first); CLIENT decodes server->client packets.
        max_packet_size: the largest packet accepted, counted as MQTT 5 counts Maximum
            Packet Size (the whole packet, fixed header included). Also the most this
            decoder buffers for one packet.
        protocol_level: required in CLIENT role (4 or 5), not allowed in SERVER role.
        max_connect_size: SERVER role: the largest CONNECT accepted (at most ``max_packet_size``), so what
            an unauthenticated client can make the decoder buffer is bounded apart from later packets.
        repeat_limit: the bounds of repeated properties (User Properties) per property block.

    The SERVER role enforces CONNECT-first; the CLIENT role does not track the
    CONNECT/CONNACK exchange (the caller knows when it sent its CONNECT).

    Error handling: once ``next_packet()`` has raised ``RemoteProtocolError`` the
    stream cannot be resynchronised, and every later call raises the same error.

    Resource handling: owns nothing but its buffer; the caller owns the socket.
    """

    __slots__ = ("max_packet_size", "_role", "_level", "_verdicts", "_buf", "_pos", "_incoming", "_need", "_error",
                 "_limit", "_repeat")

    def __init__(self, *, role: Role, max_packet_size: int = MAX_PACKET_SIZE, protocol_level: int | None = None,
                 max_connect_size: int | None = None, repeat_limit: RepeatLimit = NO_REPEAT_LIMIT) -> None:
        if not 2 <= max_packet_size <= MAX_PACKET_SIZE:
            raise LocalProtocolError(f"max_packet_size {max_packet_size} is outside 2..{MAX_PACKET_SIZE}")
        if role is Role.CLIENT and protocol_level not in PROTOCOL_LEVELS:
            raise LocalProtocolError(f"a CLIENT decoder needs protocol_level 4 or 5, got {protocol_level!r}")
        if role is Role.SERVER and protocol_level is not None:
            raise LocalProtocolError("a SERVER decoder learns the protocol level from the CONNECT")
        self.max_packet_size = max_packet_size
        # The packet size limit now: the CONNECT's until it has been read (SERVER role), then max_packet_size.
        self._limit = min(max_connect_size or max_packet_size, max_packet_size)
        self._repeat = repeat_limit
        self._role = role
        self._level = protocol_level
        self._verdicts = _first_byte_verdicts(role, protocol_level)
        # Complete data is parsed from ``_buf`` (immutable, so payloads are plain slices) starting at
        # ``_pos``; fed bytes wait in ``_incoming`` until they can complete what ``_need`` says the
        # next step requires, so a packet trickling in is copied a bounded number of times.
        self._buf = b""
        self._pos = 0
        self._incoming: bytes | bytearray = b""  # a bytearray from the first feed to the next join
        self._need = 2
        self._error: RemoteProtocolError | None = None

    @property
    def protocol_level(self) -> int | None:
        """4 or 5; None in SERVER role until a CONNECT's protocol level byte has been read.

        It is set even if the rest of that CONNECT turns out malformed, so the
        connection layer can answer in the client's version.
        """
        return self._level

    @property
    def role(self) -> Role:
        """Which end of the connection this decoder sits at."""
        return self._role

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes to the buffer (copying them: the caller may reuse ``data``)."""
        if self._incoming:
            self._incoming += data
        else:  # an idle connection's decoder keeps no empty bytearray (56 B) between its packets
            self._incoming = bytearray(data)

    def next_packet(self) -> Packet | Literal[_NeedData.NEED_DATA]:
        """Decode the next complete packet, or return ``NEED_DATA``.

        Raises:
            RemoteProtocolError: the peer broke the protocol; ``.reason`` says how.
                PACKET_TOO_LARGE is raised as soon as the fixed header announces a
                packet over ``max_packet_size``, without waiting for its body.
        """
        if self._error is not None:
            raise self._error
        if len(self._buf) - self._pos + len(self._incoming) < self._need:
            if self._pos == len(self._buf) and self._pos:  # all decoded: an idle connection keeps no old bytes
                self._buf = b""
                self._pos = 0
            return NEED_DATA
        if self._incoming:
            self._join()
        try:
            return self._decode_next()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def next_is_subscribe(self) -> bool:
        """Whether the next buffered byte starts a SUBSCRIBE (0x82), complete or not: the connection gathers the
        SUBSCRIBEs read one after another into one run (``Channel.handle_subscribes``). It decodes nothing;
        :meth:`next_packet` judges the packet as ever."""
        if self._pos < len(self._buf):
            return self._buf[self._pos] == 0x82
        return bool(self._incoming) and self._incoming[0] == 0x82

    def repeats(self, topic: str) -> list[bytes]:
        """The payloads of the complete PUBLISHes next in the buffer that repeat one just decoded but for their
        payloads: QoS 0, no DUP or RETAIN, on ``topic``, without properties (MQTT 5: a property length of 0), each
        within the size limit; they are consumed. A device's flood read at once is mostly such packets: their
        topic bytes are compared, not decoded again, and no ``Publish`` is made for them.

        The first packet that is not one (another topic or kind, a remaining length of more than two bytes or
        not in its minimal form, an incomplete one) stops the run and stays for :meth:`next_packet`, which
        judges it as ever. Call it only after ``next_packet`` returned a valid QoS 0 PUBLISH to ``topic`` without
        RETAIN or properties: what it is compared with was checked there (UTF-8, [MQTT-3.3.2-1, 2]; the topic's
        encoding is the bytes it was decoded from).
        """
        buf = self._buf
        pos = self._pos
        size = len(buf)
        name = topic.encode()
        prefix = len(name).to_bytes(2, "big") + name + (b"\x00" if self._level == MQTT_5 else b"")
        skip = len(prefix)
        limit = self._limit
        payloads: list[bytes] = []
        while pos + 2 <= size and buf[pos] == 0x30:
            length = buf[pos + 1]
            header = 2
            if length >= 0x80:
                if pos + 2 >= size or not 0 < buf[pos + 2] < 0x80:
                    break
                length = (length & 0x7F) | (buf[pos + 2] << 7)
                header = 3
            end = pos + header + length
            if end - pos > limit or end > size or not buf.startswith(prefix, pos + header, end):
                break
            payloads.append(buf[pos + header + skip:end])
            pos = end
        self._pos = pos
        return payloads

    def pubacks(self) -> list[int]:
        """The packet ids of the complete PUBACKs next in the buffer in their shortest form (0x40 0x02 and a
        packet id: no reason code, no properties); they are consumed. A subscriber's read is mostly such packets,
        one per QoS 1 message it got: their ids are read without a ``Puback`` made for each.

        The first packet that is not one (another kind, a longer PUBACK: a reason code or properties, packet id 0,
        an incomplete one, or any under a packet size limit below 4 bytes) stops the run and stays for
        :meth:`next_packet`, which judges it as ever. Call it only after ``next_packet`` returned a packet (SERVER
        role: the CONNECT was read, so a PUBACK is a packet the client may send).
        """
        if self._limit < 4:
            return []  # a 4-byte packet is over the limit: next_packet refuses it
        buf = self._buf
        pos = self._pos
        size = len(buf)
        ids: list[int] = []
        # Read as slices, not byte by byte (a third of the time for a read's tens): were the next ``most`` packets
        # PUBACKs, every fourth byte from ``pos`` would be 0x40 and every fourth from ``pos + 1`` 0x02; the run is
        # as long as both hold from the start, and its ids are every second big-endian 16-bit word. A slice is at
        # most twice what it finds (``most`` grows only while it is all PUBACKs), so a read that mixes PUBACKs with
        # other packets costs in proportion to its bytes, not to its bytes times its packets.
        most = _PUBACK_SLICE
        while True:
            most = min(most, (size - pos) >> 2)
            count = most - len(buf[pos:pos + 4 * most:4].lstrip(b"\x40"))
            if count:
                count -= len(buf[pos + 1:pos + 4 * count:4].lstrip(b"\x02"))
            if not count:
                break
            words = array("H", buf[pos:pos + 4 * count])
            if _LITTLE_ENDIAN:
                words.byteswap()
            found = words[1::2].tolist()
            if 0 in found:  # [MQTT-2.2.1-3]: the run stops before it, and next_packet closes for it
                del found[found.index(0):]
                count = 0
            ids += found
            pos += 4 * len(found)
            if count < most:
                break
            most *= 2
        self._pos = pos
        return ids

    def _join(self) -> None:
        if self._pos == len(self._buf):
            self._buf = bytes(self._incoming)
        else:
            self._buf = b"".join((memoryview(self._buf)[self._pos:], self._incoming))
        self._pos = 0
        self._incoming = b""

    def _decode_next(self) -> Packet | Literal[_NeedData.NEED_DATA]:
        buf = self._buf
        pos = self._pos
        size = len(buf)
        first = buf[pos]
        verdict = self._verdicts[first]
        if verdict is not None:
            raise RemoteProtocolError(*verdict)
        byte = buf[pos + 1]
        if byte < 0x80:
            length = byte
            header = 2
        else:
            length = byte & 0x7F
            index = pos + 2
            shift = 7
            while True:
                if index >= size:
                    self._need = index - pos + 1
                    return NEED_DATA
                byte = buf[index]
                length |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                if index - pos == 4:
                    raise _malformed("remaining length is longer than four bytes")
                index += 1
                shift += 7
            header = index - pos + 1
            # 5.0 [MQTT-1.5.5-1]: the minimum number of bytes. 3.1.1 (section 2.2.3) only gives the
            # algorithm and no such requirement, so a longer 3.1.1 encoding is accepted. A last
            # byte of 0 is exactly the non-minimal case. (Before CONNECT the level is unknown:
            # the CONNECT reader repeats this check.)
            if byte == 0 and self._level == MQTT_5:
                raise _malformed("remaining length is not in its minimal form [MQTT-1.5.5-1]")
        total = header + length
        if total > self._limit:
            if first == 0x10 and self._level is None:
                self._peek_level(buf, pos + header)
            raise RemoteProtocolError(
                ReasonCode.PACKET_TOO_LARGE, f"{total}-byte packet exceeds the maximum of {self._limit}"
            )
        if size - pos < total:
            self._need = total
            return NEED_DATA
        self._pos = pos + total
        self._need = 2
        return _READERS[first >> 4](self, first, buf, pos + header, pos + total)

    def _peek_level(self, buf: bytes, start: int) -> None:
        """Learn the protocol level of a CONNECT refused before its body arrived, if its first bytes did, so the
        refusal is answered in the client's version (MQTT 5: CONNACK 0x95)."""
        if buf[start:start + 6] == b"\x00\x04MQTT" and start + 6 < len(buf) and buf[start + 6] in PROTOCOL_LEVELS:
            self._level = buf[start + 6]

    def buffered(self) -> bytes:
        """The bytes fed and not decoded yet: a reader that takes the stream over (the bench's raw subscribers,
        after their CONNACK and SUBACK) starts from them, so nothing that arrived behind a decoded packet is lost."""
        return bytes(memoryview(self._buf)[self._pos:]) + bytes(self._incoming)

    def discard(self) -> None:
        """Drop the buffered bytes (the connection ended): a partial packet must not outlive its connection."""
        self._buf = b""
        self._pos = 0
        self._incoming = b""

    # --- one reader per packet type: (first byte, buffer, body start, body end) -> packet ------

    def _read_connect(self, first: int, buf: bytes, start: int, end: int) -> Connect:
        name, pos = read_binary(buf, start, end)
        if pos >= end:
            raise _malformed("CONNECT ends before its protocol level")
        level = buf[pos]
        if level in PROTOCOL_LEVELS:
            self._level = level  # before any check below: the error is answered at the client's level
        if name != b"MQTT" or level not in PROTOCOL_LEVELS:
            # [MQTT-3.1.2-1] / [MQTT-3.1.2-2]: answered with CONNACK 0x84 (5.0) or return code 1 (3.1.1; also for
            # an unknown level, which every version's client reads).
            raise RemoteProtocolError(
                ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, f"protocol {name!r} level {level} is not MQTT 3.1.1 or 5.0"
            )
        self._verdicts = _first_byte_verdicts(self._role, level)
        self._limit = self.max_packet_size
        # The Remaining Length's last byte is 0 only when its encoding is not minimal (or the body
        # is empty, which a CONNECT's never is); see _decode_next.
        if level == MQTT_5 and buf[start - 1] == 0:
            raise _malformed("remaining length is not in its minimal form [MQTT-1.5.5-1]")
        if pos + 4 > end:
            raise _malformed("CONNECT ends inside its variable header")
        flags = buf[pos + 1]
        keep_alive = (buf[pos + 2] << 8) | buf[pos + 3]
        pos += 4
        if flags & 0x01:
            raise _malformed("CONNECT reserved flag is set [MQTT-3.1.2-3]")
        has_will = bool(flags & 0x04)
        will_qos = (flags >> 3) & 0x03
        will_retain = bool(flags & 0x20)
        if will_qos == 3:
            raise _malformed("will QoS 3 (section 3.1.2.6)")
        if not has_will and (will_qos or will_retain):
            raise _malformed("will QoS or will retain set without the will flag (sections 3.1.2.6, 3.1.2.7)")
        has_username = bool(flags & 0x80)
        has_password = bool(flags & 0x40)
        if level == MQTT_311 and has_password and not has_username:
            raise _malformed("MQTT 3.1.1 password flag without user name flag [MQTT-3.1.2-22]")
        properties = EMPTY_PROPERTIES
        if level == MQTT_5:
            properties, pos = read_properties(buf, pos, end, PacketType.CONNECT, limit=self._repeat)
            problem = _auth_problem(properties)
            if problem:
                raise _protocol_error(problem)
        client_id, pos = read_string(buf, pos, end)
        will_properties = EMPTY_PROPERTIES
        will_topic = None
        will_payload = b""
        if has_will:
            if level == MQTT_5:
                will_properties, pos = read_properties(buf, pos, end, PacketType.CONNECT, will=True,
                                                       limit=self._repeat)
            will_topic, pos = read_string(buf, pos, end)
            will_payload, pos = read_binary(buf, pos, end)
        username = None
        if has_username:
            username, pos = read_string(buf, pos, end)
        password = None
        if has_password:
            password, pos = read_binary(buf, pos, end)
        if pos != end:
            raise _malformed("bytes after the end of the CONNECT payload")
        return Connect(
            level, client_id, bool(flags & 0x02), keep_alive, username, password,
            will_topic, will_payload, will_qos, will_retain, will_properties, properties,
        )

    def _read_connack(self, first: int, buf: bytes, start: int, end: int) -> Connack:
        if end - start < 2:
            raise _malformed("CONNACK shorter than two bytes")
        ack_flags = buf[start]
        code = buf[start + 1]
        if ack_flags & 0xFE:
            raise _malformed("CONNACK acknowledge flags bits 7-1 are reserved")
        properties = EMPTY_PROPERTIES
        if self._level == MQTT_311:
            if end - start != 2:
                raise _malformed("MQTT 3.1.1 CONNACK must have a remaining length of 2")
            if code > ConnackCode311.NOT_AUTHORIZED:
                raise _malformed(f"CONNACK return code {code} is reserved")
            reason = connack_reason_from_311(ConnackCode311(code))
        else:
            found = _CONNACK_CODES.get(code)
            if found is None:
                raise _malformed(f"0x{code:02X} is not a CONNACK reason code")
            reason = found
            properties, pos = read_properties(buf, start + 2, end, PacketType.CONNACK)
            if pos != end:
                raise _malformed("bytes after the end of the CONNACK properties")
            problem = _auth_problem(properties)
            if problem:
                raise _protocol_error(problem)
        if ack_flags and reason.is_failure:
            raise _protocol_error("session present set on a refused connection (section 3.2.2.1.1)")
        return Connack(bool(ack_flags), reason, properties)

    def _read_publish(self, first: int, buf: bytes, start: int, end: int) -> Publish:
        # The hot path: a handful of index operations and slices, no per-byte loop over the payload.
        if start + 2 > end:
            raise _malformed("PUBLISH ends before its topic name")
        pos = start + 2 + ((buf[start] << 8) | buf[start + 1])
        if pos > end:
            raise _malformed("PUBLISH topic name runs past the end of the packet")
        topic = decode_utf8(buf[start + 2:pos])
        qos = (first >> 1) & 0x03
        packet_id = None
        if qos:
            if pos + 2 > end:
                raise _malformed("PUBLISH ends before its packet identifier")
            packet_id = (buf[pos] << 8) | buf[pos + 1]
            if not packet_id:
                raise _protocol_error("PUBLISH with packet identifier 0 [MQTT-2.2.1-3]")
            pos += 2
        properties = EMPTY_PROPERTIES
        if self._level == MQTT_5:
            if pos >= end:
                raise _malformed("PUBLISH ends before its property length")
            if buf[pos]:
                properties, pos = read_properties(buf, pos, end, PacketType.PUBLISH, limit=self._repeat)
                if properties.subscription_identifiers and self._role is Role.SERVER:
                    raise _protocol_error("a client PUBLISH carries a subscription identifier [MQTT-3.3.4-6]")
            else:
                pos += 1
        if not topic and properties.topic_alias is None:
            # 5.0 section 3.3.2.1: an empty topic name needs a Topic Alias; 3.1.1 [MQTT-4.7.3-1]: never.
            raise _protocol_error("PUBLISH with an empty topic name and no topic alias")
        return Publish(topic, buf[pos:end], qos, bool(first & 0x01), bool(first & 0x08), packet_id, properties)

    def _read_reason_and_properties(
        self, buf: bytes, pos: int, end: int, codes: dict[int, ReasonCode], packet_type: PacketType
    ) -> tuple[ReasonCode, Properties]:
        """The 5.0 tail of acks, DISCONNECT and AUTH: a reason code and properties, both omissible.

        A body that ends before the reason code means success; one that ends before
        the property length means no properties (sections 3.4.2.1, 3.14.2.1, 3.15.2.1).
        """
        if pos >= end:
            return ReasonCode.SUCCESS, EMPTY_PROPERTIES
        reason = codes.get(buf[pos])
        if reason is None:
            raise _malformed(f"0x{buf[pos]:02X} is not a {packet_type.name} reason code")
        if pos + 1 == end:
            return reason, EMPTY_PROPERTIES
        properties, pos = read_properties(buf, pos + 1, end, packet_type, limit=self._repeat)
        if pos != end:
            raise _malformed(f"bytes after the end of the {packet_type.name} properties")
        return reason, properties

    def _read_packet_id(self, buf: bytes, start: int, end: int, packet_type: PacketType) -> int:
        if start + 2 > end:
            raise _malformed(f"{packet_type.name} ends before its packet identifier")
        packet_id = (buf[start] << 8) | buf[start + 1]
        if not packet_id:
            raise _protocol_error(f"{packet_type.name} with packet identifier 0 [MQTT-2.2.1-3]")
        return packet_id

    def _read_subscribe(self, first: int, buf: bytes, start: int, end: int) -> Subscribe:
        # Read in place, without the generic readers (a client may subscribe one filter a packet, 50,000 of them in
        # issue 31's attack): the packet id, a 5.0 property length of 0, each filter's length, UTF-8 and options byte.
        packet_id = self._read_packet_id(buf, start, end, PacketType.SUBSCRIBE)
        pos = start + 2
        properties = EMPTY_PROPERTIES
        options_of = _OPTIONS_311
        if self._level == MQTT_5:
            options_of = _OPTIONS_5
            if pos < end and not buf[pos]:
                pos += 1
            else:
                properties, pos = read_properties(buf, pos, end, PacketType.SUBSCRIBE, limit=self._repeat)
        subscriptions = []
        while pos < end:
            if pos + 2 > end:
                raise _malformed("length field runs past the end of the packet")
            stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
            if stop > end:
                raise _malformed("string or binary data runs past the end of its field")
            topic_filter = decode_utf8(buf[pos + 2:stop])
            if stop == end:
                raise _malformed("SUBSCRIBE topic filter without subscription options")
            options = options_of.get(buf[stop])
            if options is None:
                raise self._options_error(buf[stop])
            subscriptions.append((topic_filter, options))
            pos = stop + 1
        if not subscriptions:
            raise _protocol_error("SUBSCRIBE without topic filters [MQTT-3.8.3-2]")
        return Subscribe(packet_id, tuple(subscriptions), properties)

    def _options_error(self, byte: int) -> RemoteProtocolError:
        """Why ``byte`` is no SUBSCRIBE options byte of the connection's version."""
        if self._level == MQTT_311:
            # 3.1.1 [MQTT-3.8.3-4]: reserved bits or QoS 3 make the SUBSCRIBE malformed.
            return _malformed(f"SUBSCRIBE options byte 0x{byte:02X} has reserved bits set or QoS 3")
        if byte & 0xC0:
            return _malformed(f"SUBSCRIBE options byte 0x{byte:02X} has reserved bits set [MQTT-3.8.3-5]")
        what = "QoS 3" if byte & 0x03 == 0x03 else "retain handling 3"
        return _protocol_error(f"SUBSCRIBE options with {what} (section 3.8.3.1)")

    def _read_suback(self, first: int, buf: bytes, start: int, end: int) -> Suback:
        packet_id = self._read_packet_id(buf, start, end, PacketType.SUBACK)
        pos = start + 2
        properties = EMPTY_PROPERTIES
        codes = _SUBACK_CODES_311
        if self._level == MQTT_5:
            properties, pos = read_properties(buf, pos, end, PacketType.SUBACK)
            codes = _SUBACK_CODES
        reasons = []
        for value in buf[pos:end]:
            reason = codes.get(value)
            if reason is None:
                raise _malformed(f"0x{value:02X} is not a SUBACK return code")
            reasons.append(reason)
        if not reasons:
            raise _protocol_error("SUBACK without return codes")
        return Suback(packet_id, tuple(reasons), properties)

    def _read_unsubscribe(self, first: int, buf: bytes, start: int, end: int) -> Unsubscribe:
        packet_id = self._read_packet_id(buf, start, end, PacketType.UNSUBSCRIBE)
        pos = start + 2
        properties = EMPTY_PROPERTIES
        if self._level == MQTT_5:
            properties, pos = read_properties(buf, pos, end, PacketType.UNSUBSCRIBE, limit=self._repeat)
        topic_filters = []
        while pos < end:
            topic_filter, pos = read_string(buf, pos, end)
            topic_filters.append(topic_filter)
        if not topic_filters:
            raise _protocol_error("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]")
        return Unsubscribe(packet_id, tuple(topic_filters), properties)

    def _read_unsuback(self, first: int, buf: bytes, start: int, end: int) -> Unsuback:
        packet_id = self._read_packet_id(buf, start, end, PacketType.UNSUBACK)
        if self._level == MQTT_311:
            if end - start != 2:
                raise _malformed("MQTT 3.1.1 UNSUBACK must have a remaining length of 2")
            return Unsuback(packet_id)
        properties, pos = read_properties(buf, start + 2, end, PacketType.UNSUBACK)
        reasons = []
        for value in buf[pos:end]:
            reason = _UNSUBACK_CODES.get(value)
            if reason is None:
                raise _malformed(f"0x{value:02X} is not an UNSUBACK reason code")
            reasons.append(reason)
        if not reasons:
            raise _protocol_error("UNSUBACK without reason codes")
        return Unsuback(packet_id, tuple(reasons), properties)

    def _read_ping(self, first: int, buf: bytes, start: int, end: int) -> Pingreq | Pingresp:
        if end != start:
            raise _malformed("PINGREQ and PINGRESP have no body")
        return _PING[first >> 4]

    def _read_disconnect(self, first: int, buf: bytes, start: int, end: int) -> Disconnect:
        if self._level == MQTT_311:
            if end != start:
                raise _malformed("MQTT 3.1.1 DISCONNECT has no body")
            return _DISCONNECT
        reason, properties = self._read_reason_and_properties(buf, start, end, _DISCONNECT_CODES, PacketType.DISCONNECT)
        if properties.session_expiry_interval is not None and self._role is Role.CLIENT:
            raise _protocol_error("a server DISCONNECT carries a session expiry interval [MQTT-3.14.2-2]")
        return Disconnect(reason, properties)

    def _read_auth(self, first: int, buf: bytes, start: int, end: int) -> Auth:
        reason, properties = self._read_reason_and_properties(buf, start, end, _AUTH_CODES, PacketType.AUTH)
        if properties.authentication_method is None:
            raise _protocol_error("AUTH without an authentication method (section 3.15.2.2.2)")
        return Auth(reason, properties)


def _ack_reader(
    cls: type[Puback | Pubrec | Pubrel | Pubcomp], reasons: frozenset[ReasonCode]
) -> Callable[[MqttDecoder, int, bytes, int, int], Puback | Pubrec | Pubrel | Pubcomp]:
    """The reader for PUBACK, PUBREC, PUBREL or PUBCOMP: a packet id, then (5.0) an omissible tail."""
    codes = _reason_lookup(reasons)
    packet_type = cls.packet_type

    def read(decoder: MqttDecoder, first: int, buf: bytes, start: int, end: int) -> Puback | Pubrec | Pubrel | Pubcomp:
        packet_id = decoder._read_packet_id(buf, start, end, packet_type)
        if decoder._level == MQTT_311:
            if end - start != 2:
                raise _malformed(f"MQTT 3.1.1 {packet_type.name} must have a remaining length of 2")
            return cls(packet_id)
        reason, properties = decoder._read_reason_and_properties(buf, start + 2, end, codes, packet_type)
        return cls(packet_id, reason, properties)

    return read


_PING: dict[int, Pingreq | Pingresp] = {PacketType.PINGREQ: Pingreq(), PacketType.PINGRESP: Pingresp()}
_DISCONNECT = Disconnect()

# Keyed by packet type (the first byte's high nibble); type 0 never gets this far.
_READERS: dict[int, Callable[..., Packet]] = {
    PacketType.CONNECT: MqttDecoder._read_connect,
    PacketType.CONNACK: MqttDecoder._read_connack,
    PacketType.PUBLISH: MqttDecoder._read_publish,
    PacketType.PUBACK: _ack_reader(Puback, PUBACK_REASONS),
    PacketType.PUBREC: _ack_reader(Pubrec, PUBREC_REASONS),
    PacketType.PUBREL: _ack_reader(Pubrel, PUBREL_REASONS),
    PacketType.PUBCOMP: _ack_reader(Pubcomp, PUBCOMP_REASONS),
    PacketType.SUBSCRIBE: MqttDecoder._read_subscribe,
    PacketType.SUBACK: MqttDecoder._read_suback,
    PacketType.UNSUBSCRIBE: MqttDecoder._read_unsubscribe,
    PacketType.UNSUBACK: MqttDecoder._read_unsuback,
    PacketType.PINGREQ: MqttDecoder._read_ping,
    PacketType.PINGRESP: MqttDecoder._read_ping,
    PacketType.DISCONNECT: MqttDecoder._read_disconnect,
    PacketType.AUTH: MqttDecoder._read_auth,
}


# --- encoding ----------------------------------------------------------------------------------


def encode(packet: Packet, protocol_level: int) -> bytes:
    """Encode a packet for a connection speaking ``protocol_level`` (4 = 3.1.1, 5 = 5.0).

    3.1.1 has no properties and fewer reason codes: a CONNACK reason is sent as
    the nearest 3.1.1 return code (``connack_code_311``), SUBACK failures as 0x80,
    and success-class reasons of acks as the plain ack; anything else 3.1.1
    cannot express is refused rather than silently dropped.

    Raises:
        LocalProtocolError: the packet breaks the spec for that protocol level.
    """
    if protocol_level not in PROTOCOL_LEVELS:
        raise LocalProtocolError(f"protocol level {protocol_level!r} is not 4 (3.1.1) or 5 (5.0)")
    writer = _WRITERS.get(type(packet))
    if writer is None:
        raise LocalProtocolError(f"{packet!r} is not an MQTT packet")
    return writer(packet, protocol_level)


SMALL_PACKET_BYTES = 5
"""The most a PINGRESP, or a PUBACK, PUBREC, PUBREL, PUBCOMP or DISCONNECT without properties, can take (fixed
header 2, packet id 2, reason code 1): ``fit`` passes them without encoding to any limit at least this large."""

_SMALL_TYPES = frozenset({Pingresp, Puback, Pubrec, Pubrel, Pubcomp, Disconnect})


def fit(packet: Packet, protocol_level: int, limit: int) -> Packet | None:
    """``packet`` as it may be sent to a peer whose Maximum Packet Size is ``limit``, or None if it cannot be.

    [MQTT-3.1.2-24] / [MQTT-3.2.2-15]: nothing sent may exceed the receiver's
    Maximum Packet Size. What a packet may lose to fit is what the spec says
    must then be left out ([MQTT-3.1.2-25] and, per packet, [MQTT-3.2.2-19/20],
    [MQTT-3.4.2-2/3] ... [MQTT-3.15.2-2/3]): its Reason String and User
    Properties. Without them it is the smallest form of that packet; if even
    that does not fit, None: the caller must not send it.

    Raises:
        LocalProtocolError: as ``encode``.
    """
    properties = getattr(packet, "properties", None)
    if limit >= SMALL_PACKET_BYTES and type(packet) in _SMALL_TYPES and not properties:
        return packet
    if len(encode(packet, protocol_level)) <= limit:
        return packet
    if properties is None or (properties.reason_string is None and not properties.user_properties):
        return None
    slim = replace(packet, properties=replace(properties, reason_string=None, user_properties=()))  # type: ignore
    return slim if len(encode(slim, protocol_level)) <= limit else None


def _frame(first: int, body: bytes) -> bytes:
    if len(body) > MAX_VARINT:
        raise LocalProtocolError(f"packet body of {len(body)} bytes exceeds the maximum remaining length")
    return bytes((first,)) + encode_varint(len(body)) + body


def _packet_id(packet_id: int | None, packet_type: PacketType) -> bytes:
    if not isinstance(packet_id, int) or not 0 < packet_id <= MAX_UINT16:
        raise LocalProtocolError(f"{packet_type.name} packet identifier {packet_id!r} is outside 1..65535")
    return packet_id.to_bytes(2, "big")


def _property_block(
    properties: Properties, packet_type: PacketType, protocol_level: int, *, will: bool = False
) -> bytes:
    if protocol_level == MQTT_5:
        return with_length(encode_properties(properties, packet_type, will=will))
    if properties:
        raise LocalProtocolError(f"MQTT 3.1.1 {packet_type.name} cannot carry properties")
    return b""


def _check_reason(reason: ReasonCode, allowed: frozenset[ReasonCode], packet_type: PacketType) -> None:
    if reason not in allowed:
        raise LocalProtocolError(f"{reason!r} is not a {packet_type.name} reason code")


def _check_qos(qos: int, what: str) -> None:
    if qos not in (0, 1, 2):
        raise LocalProtocolError(f"{what} QoS {qos!r} is not 0, 1 or 2")


def _write_connect(packet: Connect, level: int) -> bytes:
    if packet.protocol_level != level:
        raise LocalProtocolError(f"CONNECT says protocol level {packet.protocol_level}, encoding for {level}")
    if not 0 <= packet.keep_alive <= MAX_UINT16:
        raise LocalProtocolError(f"keep alive {packet.keep_alive} is outside 0..65535")
    flags = 0x02 if packet.clean_start else 0
    will = b""
    if packet.will_topic is None:
        if packet.will_qos or packet.will_retain or packet.will_payload or packet.will_properties:
            raise LocalProtocolError("will QoS, retain, payload or properties set without a will topic")
    else:
        _check_qos(packet.will_qos, "will")
        flags |= 0x04 | packet.will_qos << 3 | (0x20 if packet.will_retain else 0)
        will = (
            _property_block(packet.will_properties, PacketType.CONNECT, level, will=True)
            + encode_string(packet.will_topic)
            + encode_binary(packet.will_payload)
        )
    credentials = b""
    if packet.username is not None:
        flags |= 0x80
        credentials = encode_string(packet.username)
    if packet.password is not None:
        if level == MQTT_311 and packet.username is None:
            raise LocalProtocolError("MQTT 3.1.1 CONNECT cannot have a password without a user name")
        flags |= 0x40
        credentials += encode_binary(packet.password)
    problem = _auth_problem(packet.properties)
    if problem:
        raise LocalProtocolError(problem)
    body = (
        b"\x00\x04MQTT"
        + bytes((level, flags))
        + packet.keep_alive.to_bytes(2, "big")
        + _property_block(packet.properties, PacketType.CONNECT, level)
        + encode_string(packet.client_id)
        + will
        + credentials
    )
    return _frame(0x10, body)


def _write_connack(packet: Connack, level: int) -> bytes:
    _check_reason(packet.reason_code, CONNACK_REASONS, PacketType.CONNACK)
    if packet.session_present and packet.reason_code.is_failure:
        raise LocalProtocolError("session present must be 0 on a refused connection")
    problem = _auth_problem(packet.properties)
    if problem:
        raise LocalProtocolError(problem)
    code = packet.reason_code if level == MQTT_5 else connack_code_311(packet.reason_code)
    body = bytes((packet.session_present, code)) + _property_block(packet.properties, PacketType.CONNACK, level)
    return _frame(0x20, body)


def _write_publish(packet: Publish, level: int) -> bytes:
    props = packet.properties
    if not packet.topic and (level == MQTT_311 or props.topic_alias is None):
        raise LocalProtocolError("PUBLISH with an empty topic name needs a topic alias (and MQTT 5.0)")
    if level == MQTT_311 and props:
        raise LocalProtocolError("MQTT 3.1.1 PUBLISH cannot carry properties")
    template = PublishTemplate(packet.topic, packet.payload, props)
    block = template.patched(props.message_expiry_interval, props.subscription_identifiers, props.topic_alias) \
        if level == MQTT_5 else None
    return template.render(level, packet.qos, packet.retain, packet.dup, packet.packet_id, block)


def _ack_writer(
    reasons: frozenset[ReasonCode], packet_type: PacketType
) -> Callable[[Puback | Pubrec | Pubrel | Pubcomp, int], bytes]:
    """The writer for PUBACK, PUBREC, PUBREL or PUBCOMP, in the shortest form the spec allows."""
    first = packet_type << 4 | _FIXED_FLAGS[packet_type]
    plain = bytes((first, 2))  # the fixed header of a success without properties, in either version

    def write(packet: Puback | Pubrec | Pubrel | Pubcomp, level: int) -> bytes:
        packet_id = packet.packet_id
        if packet.reason_code is ReasonCode.SUCCESS and packet.properties is EMPTY_PROPERTIES \
                and type(packet_id) is int and 0 < packet_id <= MAX_UINT16:
            return plain + packet_id.to_bytes(2, "big")  # one per QoS 1/2 message: its shortest form, at once
        _check_reason(packet.reason_code, reasons, packet_type)
        body = _packet_id(packet.packet_id, packet_type)
        if level == MQTT_311:
            if packet.reason_code.is_failure:
                raise LocalProtocolError(f"MQTT 3.1.1 {packet_type.name} cannot carry {packet.reason_code!r}")
            body += _property_block(packet.properties, packet_type, level)  # b"", or refuses properties
        elif packet.properties:
            body += bytes((packet.reason_code,)) + _property_block(packet.properties, packet_type, level)
        elif packet.reason_code:
            body += bytes((packet.reason_code,))
        return _frame(first, body)

    return write


def _write_subscribe(packet: Subscribe, level: int) -> bytes:
    if not packet.subscriptions:
        raise LocalProtocolError("SUBSCRIBE needs at least one topic filter")
    parts = [_packet_id(packet.packet_id, PacketType.SUBSCRIBE), _property_block(packet.properties, PacketType.SUBSCRIBE, level)]
    for topic_filter, options in packet.subscriptions:
        _check_qos(options.qos, "subscription")
        if options.retain_handling not in (0, 1, 2):
            raise LocalProtocolError(f"retain handling {options.retain_handling!r} is not 0, 1 or 2")
        if level == MQTT_311 and options != _OPTIONS_311[options.qos]:
            raise LocalProtocolError("MQTT 3.1.1 subscription options carry only a QoS")
        byte = options.qos | options.no_local << 2 | options.retain_as_published << 3 | options.retain_handling << 4
        parts += (encode_string(topic_filter), bytes((byte,)))
    return _frame(0x82, b"".join(parts))


_ONE_CODE_SUBACKS: dict[tuple[int, ReasonCode], tuple[bytes, bytes]] = {
    **{(MQTT_311, reason): (b"\x90\x03", bytes((SUBACK_FAILURE_311 if reason.is_failure else reason,)))
       for reason in SUBACK_REASONS},
    **{(MQTT_5, reason): (b"\x90\x04", bytes((0, reason))) for reason in SUBACK_REASONS},
}
"""The bytes around the packet id of a SUBACK of one reason code without properties, per level and reason: what a
client subscribing one filter per packet is answered (issue 31: encoding it was a tenth of such a SUBSCRIBE's cost)."""


def _write_suback(packet: Suback, level: int) -> bytes:
    reasons = packet.reason_codes
    if len(reasons) == 1 and packet.properties is EMPTY_PROPERTIES and type(packet.packet_id) is int \
            and 0 < packet.packet_id <= MAX_UINT16 and (around := _ONE_CODE_SUBACKS.get((level, reasons[0]))):
        return around[0] + packet.packet_id.to_bytes(2, "big") + around[1]
    if not packet.reason_codes:
        raise LocalProtocolError("SUBACK needs at least one reason code")
    for reason in packet.reason_codes:
        _check_reason(reason, SUBACK_REASONS, PacketType.SUBACK)
    codes: tuple[int, ...] = packet.reason_codes
    if level == MQTT_311:
        codes = tuple(SUBACK_FAILURE_311 if reason.is_failure else reason for reason in packet.reason_codes)
    body = (
        _packet_id(packet.packet_id, PacketType.SUBACK)
        + _property_block(packet.properties, PacketType.SUBACK, level)
        + bytes(codes)
    )
    return _frame(0x90, body)


def _write_unsubscribe(packet: Unsubscribe, level: int) -> bytes:
    if not packet.topic_filters:
        raise LocalProtocolError("UNSUBSCRIBE needs at least one topic filter")
    body = (
        _packet_id(packet.packet_id, PacketType.UNSUBSCRIBE)
        + _property_block(packet.properties, PacketType.UNSUBSCRIBE, level)
        + b"".join(encode_string(topic_filter) for topic_filter in packet.topic_filters)
    )
    return _frame(0xA2, body)


def _write_unsuback(packet: Unsuback, level: int) -> bytes:
    for reason in packet.reason_codes:
        _check_reason(reason, UNSUBACK_REASONS, PacketType.UNSUBACK)
    body = _packet_id(packet.packet_id, PacketType.UNSUBACK) + _property_block(
        packet.properties, PacketType.UNSUBACK, level
    )
    if level == MQTT_311:
        if any(reason.is_failure for reason in packet.reason_codes):
            raise LocalProtocolError("MQTT 3.1.1 UNSUBACK cannot carry a failure reason")
    elif not packet.reason_codes:
        raise LocalProtocolError("MQTT 5.0 UNSUBACK needs one reason code per topic filter")
    else:
        body += bytes(packet.reason_codes)
    return _frame(0xB0, body)


def _write_ping(packet: Pingreq | Pingresp, level: int) -> bytes:
    return bytes((packet.packet_type << 4, 0))


def _reason_tail(reason: ReasonCode, properties: Properties, packet_type: PacketType) -> bytes:
    """The shortest 5.0 DISCONNECT or AUTH body: nothing, the reason alone, or reason and properties."""
    if properties:
        return bytes((reason,)) + with_length(encode_properties(properties, packet_type))
    return bytes((reason,)) if reason else b""


def _write_disconnect(packet: Disconnect, level: int) -> bytes:
    _check_reason(packet.reason_code, DISCONNECT_REASONS, PacketType.DISCONNECT)
    if level == MQTT_311:
        if packet.reason_code or packet.properties:
            raise LocalProtocolError("MQTT 3.1.1 DISCONNECT has no reason code or properties")
        return b"\xe0\x00"
    return _frame(0xE0, _reason_tail(packet.reason_code, packet.properties, PacketType.DISCONNECT))


def _write_auth(packet: Auth, level: int) -> bytes:
    if level == MQTT_311:
        raise LocalProtocolError("AUTH does not exist in MQTT 3.1.1")
    _check_reason(packet.reason_code, AUTH_REASONS, PacketType.AUTH)
    if packet.properties.authentication_method is None:
        raise LocalProtocolError("AUTH needs an authentication method (section 3.15.2.2.2)")
    return _frame(0xF0, _reason_tail(packet.reason_code, packet.properties, PacketType.AUTH))


_WRITERS: dict[type, Callable[..., bytes]] = {
    Connect: _write_connect,
    Connack: _write_connack,
    Publish: _write_publish,
    Puback: _ack_writer(PUBACK_REASONS, PacketType.PUBACK),
    Pubrec: _ack_writer(PUBREC_REASONS, PacketType.PUBREC),
    Pubrel: _ack_writer(PUBREL_REASONS, PacketType.PUBREL),
    Pubcomp: _ack_writer(PUBCOMP_REASONS, PacketType.PUBCOMP),
    Subscribe: _write_subscribe,
    Suback: _write_suback,
    Unsubscribe: _write_unsubscribe,
    Unsuback: _write_unsuback,
    Pingreq: _write_ping,
    Pingresp: _write_ping,
    Disconnect: _write_disconnect,
    Auth: _write_auth,
}
