"""PUBACK, PUBREC and PUBCOMP from the client: acknowledgements of outbound messages, which the session settles."""

from __future__ import annotations

from gateway.mqtt.actions import Action
from gateway.mqtt.handlers.view import ChannelView
from gateway.mqtt.packets import Puback, Pubcomp, Pubrec


def process_puback(channel: ChannelView, packet: Puback) -> list[Action]:
    return channel.conn.session.puback(packet.packet_id)  # type: ignore[union-attr]


def process_pubrec(channel: ChannelView, packet: Pubrec) -> list[Action]:
    return channel.conn.session.pubrec(packet.packet_id, packet.reason_code)  # type: ignore[union-attr]


def process_pubcomp(channel: ChannelView, packet: Pubcomp) -> list[Action]:
    return channel.conn.session.pubcomp(packet.packet_id)  # type: ignore[union-attr]
