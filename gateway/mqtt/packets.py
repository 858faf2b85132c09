"""The MQTT control packets as plain data: one frozen, slotted dataclass per packet type.

Don't subclass these: the codec picks its reader and writer by exact type.
The same classes serve MQTT 3.1.1 and 5.0. Reason codes are always 5.0 codes;
for 3.1.1 the codec maps them to the nearest 3.1.1 form (CONNACK return codes,
SUBACK 0x80, a plain ack for a success-class reason) and refuses what 3.1.1
cannot express at all (properties, a failure reason on an ack) rather than
dropping it silently.

Every field has a default where the spec has a natural one, so a packet is
easy to build: ``Publish("a/b", b"on", qos=1, packet_id=7)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType, Properties
from gateway.mqtt.reasons import ReasonCode

MQTT_311 = 4
"""Protocol Level byte of MQTT 3.1.1 (section 3.1.2.2)."""

MQTT_5 = 5
"""Protocol Level byte of MQTT 5.0 (section 3.1.2.2)."""

PROTOCOL_LEVELS = frozenset({MQTT_311, MQTT_5})
"""The levels LightGate speaks. Level 3 (MQTT 3.1, "MQIsdp") is refused with UNSUPPORTED_PROTOCOL_VERSION."""


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT (section 3.1). A will is present when ``will_topic`` is not None.

    ``client_id`` may be empty; whether to accept or assign one is the connection
    layer's decision (it answers with a CONNACK reason, which the codec cannot).
    """

    packet_type: ClassVar[PacketType] = PacketType.CONNECT
    protocol_level: int = MQTT_5
    client_id: str = ""
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will_topic: str | None = None
    will_payload: bytes = b""
    will_qos: int = 0
    will_retain: bool = False
    will_properties: Properties = EMPTY_PROPERTIES
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connack:
    """CONNACK (section 3.2). ``reason_code`` uses 5.0 codes in both versions; see ``connack_code_311``."""

    packet_type: ClassVar[PacketType] = PacketType.CONNACK
    session_present: bool = False
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Publish:
    """PUBLISH (section 3.3). ``packet_id`` is None exactly when ``qos`` is 0."""

    packet_type: ClassVar[PacketType] = PacketType.PUBLISH
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Puback:
    """PUBACK (section 3.4): QoS 1 acknowledgement."""

    packet_type: ClassVar[PacketType] = PacketType.PUBACK
    packet_id: int
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Pubrec:
    """PUBREC (section 3.5): QoS 2 delivery, part 1."""

    packet_type: ClassVar[PacketType] = PacketType.PUBREC
    packet_id: int
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Pubrel:
    """PUBREL (section 3.6): QoS 2 delivery, part 2."""

    packet_type: ClassVar[PacketType] = PacketType.PUBREL
    packet_id: int
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Pubcomp:
    """PUBCOMP (section 3.7): QoS 2 delivery, part 3."""

    packet_type: ClassVar[PacketType] = PacketType.PUBCOMP
    packet_id: int
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    """The options byte of one SUBSCRIBE entry (section 3.8.3.1). 3.1.1 has only ``qos``.

    ``retain_handling``: 0 send retained messages on subscribe, 1 only if the
    subscription is new, 2 never.
    """

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE (section 3.8): one or more (topic filter, options) pairs."""

    packet_type: ClassVar[PacketType] = PacketType.SUBSCRIBE
    packet_id: int
    subscriptions: tuple[tuple[str, SubscriptionOptions], ...]
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Suback:
    """SUBACK (section 3.9): one reason code per filter of the SUBSCRIBE, in order.

    In 3.1.1 every failure code is sent as 0x80, and 0x80 decodes as UNSPECIFIED_ERROR.
    """

    packet_type: ClassVar[PacketType] = PacketType.SUBACK
    packet_id: int
    reason_codes: tuple[ReasonCode, ...]
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (section 3.10): one or more topic filters."""

    packet_type: ClassVar[PacketType] = PacketType.UNSUBSCRIBE
    packet_id: int
    topic_filters: tuple[str, ...]
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsuback:
    """UNSUBACK (section 3.11). 5.0 has one reason code per filter; 3.1.1 has none (empty tuple)."""

    packet_type: ClassVar[PacketType] = PacketType.UNSUBACK
    packet_id: int
    reason_codes: tuple[ReasonCode, ...] = ()
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Pingreq:
    """PINGREQ (section 3.12)."""

    packet_type: ClassVar[PacketType] = PacketType.PINGREQ


@dataclass(frozen=True, slots=True)
class Pingresp:
    """PINGRESP (section 3.13)."""

    packet_type: ClassVar[PacketType] = PacketType.PINGRESP


@dataclass(frozen=True, slots=True)
class Disconnect:
    """DISCONNECT (section 3.14). 3.1.1 has no body (and only clients send it there)."""

    packet_type: ClassVar[PacketType] = PacketType.DISCONNECT
    reason_code: ReasonCode = ReasonCode.NORMAL_DISCONNECTION
    properties: Properties = EMPTY_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:
    """AUTH (section 3.15), MQTT 5.0 only. The spec requires an Authentication Method property."""

    packet_type: ClassVar[PacketType] = PacketType.AUTH
    reason_code: ReasonCode = ReasonCode.SUCCESS
    properties: Properties = EMPTY_PROPERTIES


Packet: TypeAlias = (
    Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe | Suback
    | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect | Auth
)
