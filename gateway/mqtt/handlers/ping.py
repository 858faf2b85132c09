"""PINGREQ and DISCONNECT: the client saying it is alive, or that it leaves (with or without its will)."""

from __future__ import annotations

from gateway.mqtt.actions import Action, Send
from gateway.mqtt.handlers.view import ChannelView
from gateway.mqtt.packets import Disconnect, Pingreq, Pingresp
from gateway.mqtt.reasons import ReasonCode, RemoteProtocolError


def process_pingreq(channel: ChannelView, packet: Pingreq) -> list[Action]:
    """A PINGREQ is answered with a PINGRESP [MQTT-3.12.4-1] (receiving it already reset the keep alive)."""
    return [Send((Pingresp(),))]


def process_disconnect(channel: ChannelView, packet: Disconnect) -> list[Action]:
    """The client leaves: the session expiry it may set now, then the close (the will only with 0x04)."""
    expiry = packet.properties.session_expiry_interval
    if expiry is not None:
        _check_session_expiry(channel, expiry)
        channel.conn.expiry = min(expiry, channel.config.max_session_expiry_s)
        channel.conn.session.expiry_s = channel.conn.expiry  # type: ignore[union-attr]
    with_will = packet.reason_code is ReasonCode.DISCONNECT_WITH_WILL_MESSAGE
    return channel.close(packet.reason_code, f"client disconnected ({packet.reason_code.name})", will=with_will)


def _check_session_expiry(channel: ChannelView, expiry: int) -> None:
    """A session the CONNECT said ends with the connection (expiry 0) cannot be given an expiry at DISCONNECT.

    Raises:
        RemoteProtocolError: PROTOCOL_ERROR [MQTT-3.14.2-2].
    """
    if channel.conn.requested_expiry == 0 and expiry > 0:
        raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR,
                                  "session expiry set at DISCONNECT after 0 at CONNECT [MQTT-3.14.2-2]")
