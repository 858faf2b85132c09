"""Why an MQTT exchange failed: the reason codes of both protocol versions and the errors that carry them.

MQTT 5.0 answers most failures with a one-byte reason code (spec table 2-6);
MQTT 3.1.1 only has CONNACK return codes and the SUBACK failure code 0x80, and
otherwise closes the connection. ``ReasonCode`` holds the 5.0 codes for both
versions: the codec maps them to the 3.1.1 wire values where 3.1.1 has a field
for them (``connack_code_311``, SUBACK failures), so the layers above speak one
vocabulary.

The errors live here rather than in the codec because the property decoder
below the codec raises them too.
"""

from __future__ import annotations

from enum import IntEnum


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (section 2.4). Values the spec reuses get each name as an alias."""

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2

    @property
    def is_failure(self) -> bool:
        """Values of 0x80 and above are failures in every packet that carries a reason code (section 2.4)."""
        return self >= 0x80


_R = ReasonCode

# Which reason codes each 5.0 packet may carry (the reason code tables of sections 3.2.2.2 to
# 3.15.2.1). A value outside its packet's set cannot be parsed according to the spec, so the
# decoder treats it as a Malformed Packet and the encoder refuses it.
CONNACK_REASONS = frozenset({
    _R.SUCCESS, _R.UNSPECIFIED_ERROR, _R.MALFORMED_PACKET, _R.PROTOCOL_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.UNSUPPORTED_PROTOCOL_VERSION, _R.CLIENT_IDENTIFIER_NOT_VALID,
    _R.BAD_USER_NAME_OR_PASSWORD, _R.NOT_AUTHORIZED, _R.SERVER_UNAVAILABLE, _R.SERVER_BUSY, _R.BANNED,
    _R.BAD_AUTHENTICATION_METHOD, _R.TOPIC_NAME_INVALID, _R.PACKET_TOO_LARGE, _R.QUOTA_EXCEEDED,
    _R.PAYLOAD_FORMAT_INVALID, _R.RETAIN_NOT_SUPPORTED, _R.QOS_NOT_SUPPORTED, _R.USE_ANOTHER_SERVER,
    _R.SERVER_MOVED, _R.CONNECTION_RATE_EXCEEDED,
})
PUBACK_REASONS = frozenset({
    _R.SUCCESS, _R.NO_MATCHING_SUBSCRIBERS, _R.UNSPECIFIED_ERROR, _R.IMPLEMENTATION_SPECIFIC_ERROR,
    _R.NOT_AUTHORIZED, _R.TOPIC_NAME_INVALID, _R.PACKET_IDENTIFIER_IN_USE, _R.QUOTA_EXCEEDED,
    _R.PAYLOAD_FORMAT_INVALID,
})
PUBREC_REASONS = PUBACK_REASONS
PUBREL_REASONS = frozenset({_R.SUCCESS, _R.PACKET_IDENTIFIER_NOT_FOUND})
PUBCOMP_REASONS = PUBREL_REASONS
SUBACK_REASONS = frozenset({
    _R.GRANTED_QOS_0, _R.GRANTED_QOS_1, _R.GRANTED_QOS_2, _R.UNSPECIFIED_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.NOT_AUTHORIZED, _R.TOPIC_FILTER_INVALID,
    _R.PACKET_IDENTIFIER_IN_USE, _R.QUOTA_EXCEEDED, _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
    _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
})
UNSUBACK_REASONS = frozenset({
    _R.SUCCESS, _R.NO_SUBSCRIPTION_EXISTED, _R.UNSPECIFIED_ERROR, _R.IMPLEMENTATION_SPECIFIC_ERROR,
    _R.NOT_AUTHORIZED, _R.TOPIC_FILTER_INVALID, _R.PACKET_IDENTIFIER_IN_USE,
})
DISCONNECT_REASONS = frozenset({
    _R.NORMAL_DISCONNECTION, _R.DISCONNECT_WITH_WILL_MESSAGE, _R.UNSPECIFIED_ERROR,
    _R.MALFORMED_PACKET, _R.PROTOCOL_ERROR, _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.NOT_AUTHORIZED,
    _R.SERVER_BUSY, _R.SERVER_SHUTTING_DOWN, _R.BAD_AUTHENTICATION_METHOD, _R.KEEP_ALIVE_TIMEOUT,
    _R.SESSION_TAKEN_OVER, _R.TOPIC_FILTER_INVALID, _R.TOPIC_NAME_INVALID,
    _R.RECEIVE_MAXIMUM_EXCEEDED, _R.TOPIC_ALIAS_INVALID, _R.PACKET_TOO_LARGE,
    _R.MESSAGE_RATE_TOO_HIGH, _R.QUOTA_EXCEEDED, _R.ADMINISTRATIVE_ACTION, _R.PAYLOAD_FORMAT_INVALID,
    _R.RETAIN_NOT_SUPPORTED, _R.QOS_NOT_SUPPORTED, _R.USE_ANOTHER_SERVER, _R.SERVER_MOVED,
    _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED, _R.CONNECTION_RATE_EXCEEDED, _R.MAXIMUM_CONNECT_TIME,
    _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
})
AUTH_REASONS = frozenset({_R.SUCCESS, _R.CONTINUE_AUTHENTICATION, _R.RE_AUTHENTICATE})


class ConnackCode311(IntEnum):
    """MQTT 3.1.1 CONNACK return codes (section 3.2.2.3); 6-255 are reserved."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


SUBACK_FAILURE_311 = 0x80
"""The only failure return code a 3.1.1 SUBACK has (section 3.9.3); every 5.0 SUBACK failure maps to it."""

_C = ConnackCode311

# The nearest 3.1.1 return code for each 5.0 CONNACK reason. 3.1.1 has six codes, so refusals
# about credentials or permission keep their meaning and everything the client could not fix by
# changing what it sends (load, moves, limits, the CONNECT's content) becomes "server unavailable".
_CONNACK_311 = {
    _R.SUCCESS: _C.ACCEPTED,
    _R.UNSUPPORTED_PROTOCOL_VERSION: _C.UNACCEPTABLE_PROTOCOL_VERSION,
    _R.CLIENT_IDENTIFIER_NOT_VALID: _C.IDENTIFIER_REJECTED,
    _R.BAD_USER_NAME_OR_PASSWORD: _C.BAD_USER_NAME_OR_PASSWORD,
    _R.BAD_AUTHENTICATION_METHOD: _C.BAD_USER_NAME_OR_PASSWORD,
    _R.NOT_AUTHORIZED: _C.NOT_AUTHORIZED,
    _R.BANNED: _C.NOT_AUTHORIZED,
    **{reason: _C.SERVER_UNAVAILABLE for reason in (
        _R.UNSPECIFIED_ERROR, _R.MALFORMED_PACKET, _R.PROTOCOL_ERROR,
        _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.SERVER_UNAVAILABLE, _R.SERVER_BUSY,
        _R.TOPIC_NAME_INVALID, _R.PACKET_TOO_LARGE, _R.QUOTA_EXCEEDED, _R.PAYLOAD_FORMAT_INVALID,
        _R.RETAIN_NOT_SUPPORTED, _R.QOS_NOT_SUPPORTED, _R.USE_ANOTHER_SERVER, _R.SERVER_MOVED,
        _R.CONNECTION_RATE_EXCEEDED,
    )},
}
# The reverse direction is exact for the six codes 3.1.1 has.
_CONNACK_FROM_311 = {
    _C.ACCEPTED: _R.SUCCESS,
    _C.UNACCEPTABLE_PROTOCOL_VERSION: _R.UNSUPPORTED_PROTOCOL_VERSION,
    _C.IDENTIFIER_REJECTED: _R.CLIENT_IDENTIFIER_NOT_VALID,
    _C.SERVER_UNAVAILABLE: _R.SERVER_UNAVAILABLE,
    _C.BAD_USER_NAME_OR_PASSWORD: _R.BAD_USER_NAME_OR_PASSWORD,
    _C.NOT_AUTHORIZED: _R.NOT_AUTHORIZED,
}


def connack_code_311(reason: ReasonCode) -> ConnackCode311:
    """The 3.1.1 return code closest to a 5.0 CONNACK reason, for answering 3.1.1 clients.

    Raises:
        ValueError: ``reason`` is not a CONNACK reason code.
    """
    try:
        return _CONNACK_311[reason]
    except KeyError:
        raise ValueError(f"{reason!r} is not a CONNACK reason code") from None


def connack_reason_from_311(code: ConnackCode311) -> ReasonCode:
    """The 5.0 reason that means exactly what a 3.1.1 return code means."""
    return _CONNACK_FROM_311[code]


class RemoteProtocolError(Exception):
    """The peer sent bytes that break the MQTT spec.

    ``reason`` says how the connection layer answers: MQTT 5.0 sends it in a
    CONNACK (during CONNECT) or DISCONNECT and closes; 3.1.1 just closes.
    """

    def __init__(self, reason: ReasonCode, message: str) -> None:
        super().__init__(f"{reason.name}: {message}")
        self.reason = reason
        self.message = message


class LocalProtocolError(Exception):
    """We asked for something the spec forbids (for example encoding a packet with an invalid field)."""
