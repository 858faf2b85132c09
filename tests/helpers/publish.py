"""A PUBLISH encoded whole from the spec's layout, and the packets of a byte stream: what delivery must produce.

The reference for the outbound template (gateway/mqtt/template.py), written independently of it: fixed header,
topic name, packet id, the property block in the spec's table order (``encode_properties``), payload (section 3.3).
"""

from __future__ import annotations

from gateway.mqtt.packets import MQTT_5
from gateway.mqtt.properties import PacketType, Properties, encode_properties, encode_string, encode_varint, with_length


def reference_publish(level: int, topic: str, payload: bytes, qos: int, retain: bool, dup: bool,
                      packet_id: int | None, properties: Properties) -> bytes:
    """A PUBLISH as section 3.3 lays it out, encoded whole."""
    body = encode_string(topic) + (packet_id.to_bytes(2, "big") if qos else b"") \
        + (with_length(encode_properties(properties, PacketType.PUBLISH)) if level == MQTT_5 else b"") + payload
    return bytes((0x30 | dup << 3 | qos << 1 | retain,)) + encode_varint(len(body)) + body


def split_packets(data: bytes) -> list[bytes]:
    """The packets of ``data``, split by their fixed headers' Remaining Length (not decoded)."""
    out = []
    pos = 0
    while pos < len(data):
        length, shift, index = 0, 0, pos + 1
        while True:
            byte = data[index]
            length |= (byte & 0x7F) << shift
            index += 1
            shift += 7
            if byte < 0x80:
                break
        out.append(data[pos:index + length])
        pos = index + length
    return out
