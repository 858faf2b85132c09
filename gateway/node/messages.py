"""MQTT messages to and from store records: what a PUBLISH keeps in the CommitLog, and how it comes back.

The record carries the MQTT 5 properties as their encoded property block, so
a device receives exactly the properties its publisher sent (one encoding at
append, one decoding per queue read, shared by every local session).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.mqtt.actions import Message
from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType, decode_properties, encode_properties
from store.local import NewMessage
from store.log.record import FLAG_RETAIN, QOS_MASK, Record

__all__ = ["from_record", "record_fields", "to_new_message"]


def to_new_message(message: Message) -> NewMessage:
    """The message as the store appends it."""
    return message.topic, message.payload, record_fields(message)


def record_fields(message: Message) -> Mapping[str, Any]:
    """The optional record fields of ``message`` (:func:`store.log.record.encode_record`).

    Most device messages have no properties: that case skips the encoder (this runs once per message).
    """
    props = message.properties
    fields = {
        "client_id": message.client_id,
        "qos": message.qos,
        "retain": message.retain,
        "properties": b"" if props is EMPTY_PROPERTIES else encode_properties(props, PacketType.PUBLISH),
        "born_ms": message.born_ms or None,
    }
    if message.packet_id:
        fields["packet_id"] = message.packet_id
    return fields


def from_record(record: Record, queue: str | None, offset: int | None) -> Message:
    """The message a record holds, as read from ``queue`` at ``offset`` (None, None: a retained copy)."""
    props = record.properties
    flags = record.flags  # not the qos/retain properties: this runs once per message and queue
    return Message(
        record.topic, record.payload, flags & QOS_MASK, bool(flags & FLAG_RETAIN),
        decode_properties(props, 0, len(props), PacketType.PUBLISH) if props else EMPTY_PROPERTIES,
        record.client_id, record.born_ms, record.store_ms, queue, offset,
    )
