"""MQTT 5 properties and data types: the table against paho's, round trips, and every validation rule."""

from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from gateway.mqtt.properties import (
    EMPTY_PROPERTIES,
    MAX_VARINT,
    PROPERTY_TABLE,
    PacketType,
    Properties,
    PropertyType,
    decode_properties,
    decode_utf8,
    decode_varint,
    encode_properties,
    encode_string,
    encode_varint,
    read_properties,
    read_string,
    with_length,
)
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode, RemoteProtocolError
from tests.helpers.strategies import mqtt_text, properties_for

# Every place a property block can appear: each packet type that has properties, plus will properties.
SCOPES = [(packet_type, False) for packet_type in PacketType if packet_type not in (PacketType.PINGREQ, PacketType.PINGRESP)]
SCOPES.append((PacketType.CONNECT, True))


def decode_all(data: bytes, packet_type: PacketType, will: bool = False) -> Properties:
    return decode_properties(data, 0, len(data), packet_type, will=will)


def check_remote_error(reason: ReasonCode, data: bytes, packet_type: PacketType, will: bool = False) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_all(data, packet_type, will)
    assert info.value.reason is reason, info.value


# --- the table ---------------------------------------------------------------------------------


def test_properties_fields_follow_the_table():
    assert [f.name for f in fields(Properties)] == [prop.name for prop in PROPERTY_TABLE]
    assert len(PROPERTY_TABLE) == 27
    assert not hasattr(EMPTY_PROPERTIES, "__dict__")  # slotted


def test_table_matches_paho_types_and_packets():
    paho = PahoProperties(PacketTypes.CONNECT)
    paho_types = {
        "Byte": {PropertyType.BYTE, PropertyType.BOOL},
        "Two Byte Integer": {PropertyType.UINT16},
        "Four Byte Integer": {PropertyType.UINT32},
        "Variable Byte Integer": {PropertyType.VARINT},
        "Binary Data": {PropertyType.BINARY},
        "UTF-8 Encoded String": {PropertyType.STRING},
        "UTF-8 String Pair": {PropertyType.STRING_PAIR},
    }
    assert {prop.identifier for prop in PROPERTY_TABLE} == set(paho.properties)
    for prop in PROPERTY_TABLE:
        type_index, packets = paho.properties[prop.identifier]
        assert prop.type in paho_types[paho.types[type_index]], prop.name
        ours = {PacketTypes.__dict__[p.name] for p in prop.packets} | ({PacketTypes.WILLMESSAGE} if prop.in_will else set())
        assert ours == set(packets), prop.name
        assert prop.multiple == paho.allowsMultiple(paho.getNameFromIdent(prop.identifier).replace(" ", ""))


# --- data types --------------------------------------------------------------------------------

VARINT_EXAMPLES = [  # section 1.5.5's table of boundaries
    (0, b"\x00"),
    (127, b"\x7f"),
    (128, b"\x80\x01"),
    (16_383, b"\xff\x7f"),
    (16_384, b"\x80\x80\x01"),
    (2_097_151, b"\xff\xff\x7f"),
    (2_097_152, b"\x80\x80\x80\x01"),
    (268_435_455, b"\xff\xff\xff\x7f"),
]


@pytest.mark.parametrize(("value", "wire"), VARINT_EXAMPLES)
def test_varint_spec_examples(value, wire):
    assert encode_varint(value) == wire
    assert decode_varint(wire + b"tail", 0, len(wire) + 4) == (value, len(wire))


@given(st.integers(0, MAX_VARINT), st.binary(max_size=3))
def test_varint_round_trip(value, prefix):
    wire = prefix + encode_varint(value)
    assert decode_varint(wire, len(prefix), len(wire)) == (value, len(wire))


@pytest.mark.parametrize(
    "wire",
    [
        b"\x80\x00",  # 0 in two bytes: not minimal [MQTT-1.5.5-1]
        b"\xff\x80\x00",
        b"\x80\x80\x80\x80\x01",  # five bytes
        b"\xff\xff",  # runs past the end
        b"",
    ],
)
def test_varint_rejects_malformed(wire):
    with pytest.raises(RemoteProtocolError) as info:
        decode_varint(wire, 0, len(wire))
    assert info.value.reason is ReasonCode.MALFORMED_PACKET


@pytest.mark.parametrize("value", [-1, MAX_VARINT + 1])
def test_varint_encode_refuses_out_of_range(value):
    with pytest.raises(LocalProtocolError):
        encode_varint(value)


@given(mqtt_text)
def test_string_round_trip(text):
    wire = encode_string(text)
    assert read_string(wire, 0, len(wire)) == (text, len(wire))


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",  # never valid in UTF-8
        b"\xc0\x80",  # overlong U+0000
        b"\xed\xa0\x80",  # encoded surrogate U+D800 [MQTT-1.5.4-1]
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"a\x00b",  # U+0000 [MQTT-1.5.4-2]
    ],
)
def test_utf8_rules(raw):
    with pytest.raises(RemoteProtocolError) as info:
        decode_utf8(raw)
    assert info.value.reason is ReasonCode.MALFORMED_PACKET


def test_utf8_keeps_a_leading_byte_order_mark():
    # [MQTT-1.5.4-3]: U+FEFF must not be skipped or stripped.
    assert decode_utf8(b"\xef\xbb\xbfa") == "\ufeffa"


def test_string_longer_than_its_field_is_malformed():
    with pytest.raises(RemoteProtocolError) as info:
        read_string(b"\x00\x05abc", 0, 5)
    assert info.value.reason is ReasonCode.MALFORMED_PACKET


@pytest.mark.parametrize("text", ["a\x00", "\ud800", "x" * 65_536])
def test_encode_string_refuses_what_mqtt_cannot_carry(text):
    with pytest.raises(LocalProtocolError):
        encode_string(text)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize(("packet_type", "will"), SCOPES, ids=lambda v: getattr(v, "name", str(v)))
@given(data=st.data())
def test_round_trip_every_property_in_every_place(packet_type, will, data):
    props = data.draw(properties_for(packet_type, will))
    wire = encode_properties(props, packet_type, will=will)
    assert decode_all(wire, packet_type, will) == props
    framed = b"junk" + with_length(wire) + b"next"
    assert read_properties(framed, 4, len(framed), packet_type, will=will) == (props, len(framed) - 4)


@given(properties_for(PacketType.PUBLISH))
def test_wire_bytes_match_paho(props):
    paho = PahoProperties(PacketTypes.PUBLISH)
    for prop in PROPERTY_TABLE:
        value = getattr(props, prop.name)
        for item in value if prop.multiple else ([] if value is None else [value]):
            setattr(paho, paho.getNameFromIdent(prop.identifier).replace(" ", ""), item)
    assert with_length(encode_properties(props, PacketType.PUBLISH)) == paho.pack()


def test_empty_properties_are_shared_and_cost_nothing():
    assert encode_properties(EMPTY_PROPERTIES, PacketType.PUBLISH) == b""
    assert encode_properties(Properties(), PacketType.PUBLISH) == b""
    assert with_length(b"") == b"\x00"
    assert decode_all(b"", PacketType.PUBLISH) is EMPTY_PROPERTIES
    assert not EMPTY_PROPERTIES and not Properties() and Properties(topic_alias=1)
    assert Properties(user_properties=(("a", "b"),))


def test_golden_connect_properties():
    props = Properties(session_expiry_interval=3600, receive_maximum=20, user_properties=(("a", "b"),))
    assert encode_properties(props, PacketType.CONNECT) == (
        b"\x11\x00\x00\x0e\x10" + b"\x21\x00\x14" + b"\x26\x00\x01a\x00\x01b"
    )


def test_repr_shows_only_present_properties():
    assert repr(Properties(topic_alias=3)) == "Properties(topic_alias=3)"


# --- decoding rules ----------------------------------------------------------------------------


def test_user_property_may_repeat_and_keeps_order():
    wire = b"\x26\x00\x01k\x00\x011" + b"\x26\x00\x01k\x00\x012"
    assert decode_all(wire, PacketType.PUBACK).user_properties == (("k", "1"), ("k", "2"))


def test_subscription_identifier_may_repeat_in_publish_only():
    wire = b"\x0b\x01\x0b\x02"
    assert decode_all(wire, PacketType.PUBLISH).subscription_identifiers == (1, 2)
    check_remote_error(ReasonCode.PROTOCOL_ERROR, wire, PacketType.SUBSCRIBE)


@pytest.mark.parametrize(
    ("wire", "packet_type"),
    [
        (b"\x23\x00\x01\x23\x00\x02", PacketType.PUBLISH),  # topic alias twice
        (b"\x11\x00\x00\x00\x01\x11\x00\x00\x00\x01", PacketType.CONNECT),  # session expiry twice
        (b"\x1f\x00\x00\x1f\x00\x00", PacketType.DISCONNECT),  # reason string twice
    ],
)
def test_duplicate_property_is_a_protocol_error(wire, packet_type):
    check_remote_error(ReasonCode.PROTOCOL_ERROR, wire, packet_type)


@pytest.mark.parametrize(
    ("wire", "packet_type"),
    [
        (b"\x21\x00\x00", PacketType.CONNECT),  # receive maximum 0
        (b"\x27\x00\x00\x00\x00", PacketType.CONNACK),  # maximum packet size 0
        (b"\x0b\x00", PacketType.SUBSCRIBE),  # subscription identifier 0
        (b"\x23\x00\x00", PacketType.PUBLISH),  # topic alias 0
        (b"\x01\x02", PacketType.PUBLISH),  # payload format indicator 2
        (b"\x24\x02", PacketType.CONNACK),  # maximum QoS 2
        (b"\x25\x02", PacketType.CONNACK),  # retain available 2
        (b"\x17\x02", PacketType.CONNECT),  # request problem information 2
        (b"\x19\xff", PacketType.CONNECT),  # request response information 255
        (b"\x2a\x02", PacketType.CONNACK),  # shared subscription available 2
    ],
)
def test_value_out_of_range_is_a_protocol_error(wire, packet_type):
    check_remote_error(ReasonCode.PROTOCOL_ERROR, wire, packet_type)


@pytest.mark.parametrize(
    ("wire", "packet_type", "will"),
    [
        (b"\x23\x00\x01", PacketType.CONNECT, False),  # topic alias in CONNECT
        (b"\x18\x00\x00\x00\x01", PacketType.CONNECT, False),  # will delay outside will properties
        (b"\x11\x00\x00\x00\x01", PacketType.CONNECT, True),  # session expiry in will properties
        (b"\x11\x00\x00\x00\x01", PacketType.PUBLISH, False),
        (b"\x1f\x00\x00", PacketType.SUBSCRIBE, False),  # reason string in SUBSCRIBE
        (b"\x0b\x01", PacketType.CONNACK, False),
    ],
)
def test_property_not_allowed_here_is_malformed(wire, packet_type, will):
    # Section 2.2.2.2: an identifier not valid for its packet type is a Malformed Packet.
    check_remote_error(ReasonCode.MALFORMED_PACKET, wire, packet_type, will)


@pytest.mark.parametrize(
    "wire",
    [
        b"\x00",  # no property 0
        b"\x04\x00",  # unassigned identifier
        b"\x81\x00",  # identifier 1 in a non-minimal two-byte form
        b"\x02\x00\x00",  # four-byte integer cut short
        b"\x03\x00\x05ab",  # string longer than the properties
        b"\x03\x00\x02\xff\xfe",  # ill-formed UTF-8
        b"\x26\x00\x01a",  # user property without its value
        b"\x0b\x80",  # varint cut short
        b"\x01",  # byte property without its byte
    ],
)
def test_unparseable_properties_are_malformed(wire):
    check_remote_error(ReasonCode.MALFORMED_PACKET, wire, PacketType.PUBLISH)


def test_decoding_stops_at_end_not_at_buffer_end():
    wire = b"\x23\x00\x05" + b"\x23\x00\x06"
    assert decode_properties(wire, 0, 3, PacketType.PUBLISH) == Properties(topic_alias=5)


def test_property_length_past_the_packet_is_malformed():
    with pytest.raises(RemoteProtocolError) as info:
        read_properties(b"\x05\x23\x00\x01", 0, 4, PacketType.PUBLISH)
    assert info.value.reason is ReasonCode.MALFORMED_PACKET


# --- encoding rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("props", "packet_type", "will"),
    [
        (Properties(topic_alias=1), PacketType.CONNECT, False),
        (Properties(will_delay_interval=5), PacketType.CONNECT, False),
        (Properties(session_expiry_interval=5), PacketType.CONNECT, True),
        (Properties(subscription_identifiers=(1, 2)), PacketType.SUBSCRIBE, False),
        (Properties(receive_maximum=0), PacketType.CONNECT, False),
        (Properties(topic_alias=70_000), PacketType.PUBLISH, False),
        (Properties(maximum_qos=2), PacketType.CONNACK, False),
        (Properties(subscription_identifiers=(MAX_VARINT + 1,)), PacketType.PUBLISH, False),
        (Properties(content_type="a\x00"), PacketType.PUBLISH, False),
        (Properties(correlation_data=b"x" * 65_536), PacketType.PUBLISH, False),
        (Properties(reason_string="x"), PacketType.PUBLISH, False),
    ],
)
def test_encode_refuses_invalid_properties(props, packet_type, will):
    with pytest.raises(LocalProtocolError):
        encode_properties(props, packet_type, will=will)
