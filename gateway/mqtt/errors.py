"""Why the server closes, as the packet that tells the client: the one place errors become a CONNACK or DISCONNECT.

The channel answers protocol errors, node refusals and shutdowns through
``error_packet``; the handlers (gateway/mqtt/handlers/) answer CONNECT refusals
and limit closes through it too, so every close speaks the same way.
"""

from __future__ import annotations

from gateway.mqtt.packets import MQTT_5, Connack, Disconnect, Packet
from gateway.mqtt.reasons import CONNACK_REASONS, DISCONNECT_REASONS, ReasonCode

__all__ = ["CONNACK_REFUSALS_311", "error_packet"]

CONNACK_REFUSALS_311 = frozenset({
    ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
    ReasonCode.BAD_USER_NAME_OR_PASSWORD, ReasonCode.BAD_AUTHENTICATION_METHOD, ReasonCode.NOT_AUTHORIZED,
    ReasonCode.BANNED, ReasonCode.SERVER_UNAVAILABLE, ReasonCode.SERVER_BUSY,
})
"""CONNECT refusals a 3.1.1 CONNACK return code expresses (section 3.2.2.3); any other error closes without a packet."""


def error_packet(protocol_level: int | None, before_connack: bool, reason: ReasonCode) -> Packet | None:
    """The packet that tells the client why the server closes, or None to close silently.

    MQTT 5 answers in the CONNACK before the connection is accepted and in a
    DISCONNECT after; a reason a packet cannot carry becomes UNSPECIFIED_ERROR.
    MQTT 3.1.1 (and an unknown level, answered in 3.1.1 form as Mosquitto does
    for unknown protocol versions) only has CONNACK return codes for refusals.
    """
    if before_connack:
        if protocol_level == MQTT_5:
            return Connack(reason_code=reason if reason in CONNACK_REASONS else ReasonCode.UNSPECIFIED_ERROR)
        return Connack(reason_code=reason) if reason in CONNACK_REFUSALS_311 else None
    if protocol_level == MQTT_5:
        return Disconnect(reason if reason in DISCONNECT_REASONS else ReasonCode.UNSPECIFIED_ERROR)
    return None
