"""The outbound PUBLISH template: every rendering of it is the whole encoding of that packet, byte for byte."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import Publish
from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType
from gateway.mqtt.reasons import LocalProtocolError
from gateway.mqtt.template import PublishTemplate
from tests.helpers.publish import reference_publish
from tests.helpers.strategies import mqtt_text, properties_for


@pytest.mark.parametrize("level", [4, 5])
@given(
    topic=mqtt_text.filter(bool),
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    packet_id=st.integers(1, 0xFFFF),
    dup=st.booleans(),
    data=st.data(),
)
def test_a_rendering_is_the_whole_encoding_of_its_packet(level, topic, payload, qos, retain, packet_id, dup, data):
    # Section 3.3: one template, any subscriber's flags, packet id and (5.0) properties patched in.
    properties = data.draw(properties_for(PacketType.PUBLISH)) if level == 5 else EMPTY_PROPERTIES
    template = PublishTemplate(topic, payload, properties)
    pid = packet_id if qos else None
    dup = dup and qos > 0
    block = template.patched(properties.message_expiry_interval, properties.subscription_identifiers,
                             properties.topic_alias) if level == 5 else None
    rendered = template.render(level, qos, retain, dup, pid, block)
    assert rendered == reference_publish(level, topic, payload, qos, retain, dup, pid, properties)
    assert rendered == encode(Publish(topic, payload, qos, retain, dup, pid, properties), level)
    assert len(rendered) == template.size(template.head(level, qos, retain, dup, block), level, qos, block)


def test_a_rendering_patches_only_flags_and_packet_id():
    template = PublishTemplate("t", b"p")
    assert template.render(5, 1, packet_id=1) == b"\x32\x07\x00\x01t\x00\x01\x00p"
    assert template.render(5, 1, packet_id=0xABCD) == b"\x32\x07\x00\x01t\xab\xcd\x00p"
    assert template.render(5, 1, dup=True, packet_id=1) == b"\x3a\x07\x00\x01t\x00\x01\x00p"
    assert template.render(4, 2, retain=True, packet_id=1) == b"\x35\x06\x00\x01t\x00\x01p"
    assert template.render(4, 0) == b"\x30\x04\x00\x01tp"


def test_a_long_packet_takes_a_longer_remaining_length():
    # Section 1.5.5: 128 and more take two bytes, 16,384 and more three.
    for size in (125, 126, 16_379, 16_380):
        assert PublishTemplate("t", bytes(size)).render(4, 0) == reference_publish(4, "t", bytes(size), 0, False,
                                                                                   False, None, EMPTY_PROPERTIES)


@pytest.mark.parametrize(
    ("qos", "packet_id", "dup"), [(0, 1, False), (0, None, True), (1, None, False), (1, 0, False), (2, 65_536, False)]
)
def test_bad_packet_ids_are_refused(qos, packet_id, dup):
    # [MQTT-2.2.1-2] no packet id at QoS 0, [MQTT-2.2.1-3] a non-zero one at QoS 1/2; [MQTT-3.3.1-2] no DUP at QoS 0.
    with pytest.raises(LocalProtocolError):
        PublishTemplate("t", b"").render(4, qos, False, dup, packet_id)


@pytest.mark.parametrize(("topic", "level", "qos"), [("t", 5, 3), ("t", 6, 0), ("t\x00", 5, 0)])
def test_invalid_messages_are_refused(topic, level, qos):
    # QoS 3, an unknown protocol level, U+0000 in a topic name [MQTT-1.5.4-2].
    with pytest.raises(LocalProtocolError):
        PublishTemplate(topic, b"").render(level, qos)


@pytest.mark.parametrize("level", [4, 5])
@given(topic=mqtt_text.filter(bool), payload=st.binary(max_size=300), qos=st.integers(0, 2), retain=st.booleans(),
       packet_id=st.integers(1, 0xFFFF), data=st.data())
def test_a_plain_write_is_the_whole_encoding_with_nothing_patched(level, topic, payload, qos, retain, packet_id, data):
    # Section 3.3: the packet id on QoS 1/2 only, DUP 0 [MQTT-3.3.1-2]; at 5.0 the shared property block (no
    # expiry, Subscription Identifier or Topic Alias of a subscriber's patched in).
    properties = EMPTY_PROPERTIES
    if level == 5:
        properties = replace(data.draw(properties_for(PacketType.PUBLISH)), message_expiry_interval=None,
                             subscription_identifiers=(), topic_alias=None)
    template = PublishTemplate(topic, payload, properties)
    pid = packet_id if qos else None
    out: list[bytes] = []
    size = template.write_plain(out, level, qos, retain, pid)
    assert b"".join(out) == reference_publish(level, topic, payload, qos, retain, False, pid, properties)
    assert size == len(b"".join(out)) == len(template.render(level, qos, retain, packet_id=pid))
