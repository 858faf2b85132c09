"""PUBACK, PUBREC and PUBCOMP from the client: acknowledgements of outbound messages, which the session settles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.mqtt.actions import Action
from gateway.mqtt.packets import Puback, Pubcomp, Pubrec

if TYPE_CHECKING:  # the channel imports this module for its dispatch table: only the type checker imports it back
    from gateway.mqtt.channel import Channel


def process_puback(channel: Channel, packet: Puback) -> list[Action]:
    return channel.conn.session.puback(packet.packet_id)  # type: ignore[union-attr]


def process_pubrec(channel: Channel, packet: Pubrec) -> list[Action]:
    return channel.conn.session.pubrec(packet.packet_id, packet.reason_code)  # type: ignore[union-attr]


def process_pubcomp(channel: Channel, packet: Pubcomp) -> list[Action]:
    return channel.conn.session.pubcomp(packet.packet_id)  # type: ignore[union-attr]
