"""The MQTT codec: round trips, fragmented streams, golden bytes, interop, and every validation rule."""

import asyncio
from dataclasses import replace

import paho.mqtt.client as paho_client
import pytest
from amqtt.adapters import BufferReader
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.suback import SubackPacket
from amqtt.mqtt.subscribe import SubscribePacket
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.mqtt.codec import (
    MAX_PACKET_SIZE,
    NEED_DATA,
    LocalProtocolError,
    MqttDecoder,
    RemoteProtocolError,
    Role,
    encode,
)
from gateway.mqtt.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from gateway.mqtt.properties import (
    EMPTY_PROPERTIES, PacketType, Properties, RepeatLimit, RepeatLimitExceeded,
)
from gateway.mqtt.reasons import (
    AUTH_REASONS,
    CONNACK_REASONS,
    DISCONNECT_REASONS,
    PUBACK_REASONS,
    PUBREL_REASONS,
    SUBACK_REASONS,
    UNSUBACK_REASONS,
    ConnackCode311,
    ReasonCode,
    connack_code_311,
    connack_reason_from_311,
)
from tests.helpers.strategies import mqtt_text, properties_for
from tests.helpers.work import python_lines

LEVELS = [4, 5]

# --- strategies: valid packets per protocol level and sender ------------------------------------


def props(packet_type, level, *, will=False, exclude=()):
    """Properties for 5.0 (without the ``exclude``d fields); always empty for 3.1.1."""
    if level == 4:
        return st.just(EMPTY_PROPERTIES)
    absent = {name: getattr(EMPTY_PROPERTIES, name) for name in exclude}
    return properties_for(packet_type, will).map(lambda p: replace(p, **absent))


def auth_consistent(p):
    return p.authentication_data is None or p.authentication_method is not None


packet_ids = st.integers(1, 0xFFFF)


def reasons(allowed):
    return st.sampled_from(sorted(allowed))


@st.composite
def connects(draw, level):
    username = draw(st.none() | mqtt_text)
    password = draw(st.none() | st.binary(max_size=8)) if level == 5 or username is not None else None
    will_topic = draw(st.none() | mqtt_text)
    will = {}
    if will_topic is not None:
        will = dict(
            will_topic=will_topic,
            will_payload=draw(st.binary(max_size=8)),
            will_qos=draw(st.integers(0, 2)),
            will_retain=draw(st.booleans()),
            will_properties=draw(props(PacketType.CONNECT, level, will=True)),
        )
    return Connect(
        protocol_level=level,
        client_id=draw(mqtt_text),
        clean_start=draw(st.booleans()),
        keep_alive=draw(st.integers(0, 0xFFFF)),
        username=username,
        password=password,
        properties=draw(props(PacketType.CONNECT, level).filter(auth_consistent)),
        **will,
    )


@st.composite
def connacks(draw, level):
    # 3.1.1 has six return codes; the other 5.0 reasons map onto them (tested separately).
    allowed = CONNACK_REASONS if level == 5 else {connack_reason_from_311(code) for code in ConnackCode311}
    reason = draw(reasons(allowed))
    return Connack(
        session_present=draw(st.booleans()) and not reason.is_failure,
        reason_code=reason,
        properties=draw(props(PacketType.CONNACK, level).filter(auth_consistent)),
    )


@st.composite
def publishes(draw, level, sender):
    qos = draw(st.integers(0, 2))
    # [MQTT-3.3.4-6]: only servers send subscription identifiers.
    exclude = ("subscription_identifiers",) if sender is Role.CLIENT else ()
    properties = draw(props(PacketType.PUBLISH, level, exclude=exclude))
    topic = draw(mqtt_text.filter(bool) if properties.topic_alias is None else mqtt_text)
    return Publish(
        topic=topic,
        payload=draw(st.binary(max_size=40)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=qos > 0 and draw(st.booleans()),
        packet_id=draw(packet_ids) if qos else None,
        properties=properties,
    )


def acks(cls, allowed, level):
    return st.builds(
        cls,
        packet_id=packet_ids,
        reason_code=reasons(allowed) if level == 5 else st.just(ReasonCode.SUCCESS),
        properties=props(cls.packet_type, level),
    )


def subscription_options(level):
    if level == 4:
        return st.builds(SubscriptionOptions, qos=st.integers(0, 2))
    return st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2))


def subscribes(level):
    return st.builds(
        Subscribe,
        packet_id=packet_ids,
        subscriptions=st.lists(st.tuples(mqtt_text, subscription_options(level)), min_size=1, max_size=4).map(tuple),
        properties=props(PacketType.SUBSCRIBE, level),
    )


def subacks(level):
    allowed = SUBACK_REASONS if level == 5 else {
        ReasonCode.GRANTED_QOS_0, ReasonCode.GRANTED_QOS_1, ReasonCode.GRANTED_QOS_2, ReasonCode.UNSPECIFIED_ERROR,
    }
    return st.builds(
        Suback,
        packet_id=packet_ids,
        reason_codes=st.lists(reasons(allowed), min_size=1, max_size=4).map(tuple),
        properties=props(PacketType.SUBACK, level),
    )


def unsubscribes(level):
    return st.builds(
        Unsubscribe,
        packet_id=packet_ids,
        topic_filters=st.lists(mqtt_text, min_size=1, max_size=4).map(tuple),
        properties=props(PacketType.UNSUBSCRIBE, level),
    )


def unsubacks(level):
    codes = st.lists(reasons(UNSUBACK_REASONS), min_size=1, max_size=4).map(tuple) if level == 5 else st.just(())
    return st.builds(Unsuback, packet_id=packet_ids, reason_codes=codes, properties=props(PacketType.UNSUBACK, level))


def disconnects(level, sender):
    if level == 4:
        return st.just(Disconnect())
    exclude = ("session_expiry_interval",) if sender is Role.SERVER else ()  # [MQTT-3.14.2-2]
    return st.builds(Disconnect, reasons(DISCONNECT_REASONS), props(PacketType.DISCONNECT, level, exclude=exclude))


def auths():
    return st.builds(
        Auth,
        reasons(AUTH_REASONS),
        props(PacketType.AUTH, 5).map(lambda p: replace(p, authentication_method=p.authentication_method or "SCRAM")),
    )


def packets_sent_by(sender, level):
    """Every packet type the sender may send after the CONNECT / CONNACK exchange, by name."""
    common = {
        "publish": publishes(level, sender),
        "puback": acks(Puback, PUBACK_REASONS, level),
        "pubrec": acks(Pubrec, PUBACK_REASONS, level),
        "pubrel": acks(Pubrel, PUBREL_REASONS, level),
        "pubcomp": acks(Pubcomp, PUBREL_REASONS, level),
    }
    if level == 5:
        common["auth"] = auths()
    if sender is Role.CLIENT:
        return common | {
            "subscribe": subscribes(level),
            "unsubscribe": unsubscribes(level),
            "pingreq": st.just(Pingreq()),
            "disconnect": disconnects(level, sender),
        }
    server = common | {
        "connack": connacks(level),
        "suback": subacks(level),
        "unsuback": unsubacks(level),
        "pingresp": st.just(Pingresp()),
    }
    if level == 5:
        server["disconnect"] = disconnects(level, sender)
    return server


def stream(sender, level):
    """A valid sequence of packets from one side; a client's starts with its CONNECT."""
    body = st.lists(st.one_of(*packets_sent_by(sender, level).values()), max_size=8)
    if sender is Role.CLIENT:
        return st.tuples(connects(level), body).map(lambda pair: [pair[0], *pair[1]])
    return body


# --- helpers -----------------------------------------------------------------------------------


def receiver_of(sender, level):
    """A decoder at the other end; a SERVER decoder still expects the CONNECT."""
    if sender is Role.CLIENT:
        return MqttDecoder(role=Role.SERVER)
    return MqttDecoder(role=Role.CLIENT, protocol_level=level)


def drain(decoder):
    out = []
    while (packet := decoder.next_packet()) is not NEED_DATA:
        out.append(packet)
    return out


def drain_server(wire):
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(wire)
    return drain(decoder)


def decode_stream(data, role=Role.SERVER, level=5, **options):
    """Decode ``data``; a SERVER decoder first gets a valid CONNECT of ``level``."""
    if role is Role.SERVER:
        decoder = MqttDecoder(role=role, **options)
        decoder.feed(encode(Connect(protocol_level=level, client_id="c"), level))
        assert isinstance(decoder.next_packet(), Connect)
    else:
        decoder = MqttDecoder(role=role, protocol_level=level, **options)
    decoder.feed(data)
    return drain(decoder)


def check_remote_error(reason, data, role=Role.SERVER, level=5, **options):
    with pytest.raises(RemoteProtocolError) as info:
        decode_stream(data, role, level, **options)
    assert info.value.reason is reason, info.value
    return info.value


def connect_bytes(level, flags=0x02, body_tail=b"\x00\x01c", name=b"MQTT", properties=b"\x00"):
    """A raw CONNECT, for rules the encoder refuses to produce."""
    variable = b"\x00" + bytes((len(name),)) + name + bytes((level, flags)) + b"\x00\x3c"
    if level == 5:
        variable += properties
    body = variable + body_tail
    return bytes((0x10, len(body))) + body


# --- round trips and fragmentation -------------------------------------------------------------

CASES = [
    (sender, level, name)
    for level in LEVELS
    for sender in (Role.CLIENT, Role.SERVER)
    for name in ["connect" if sender is Role.CLIENT else None, *packets_sent_by(sender, level)]
    if name
]


@pytest.mark.parametrize(("sender", "level", "name"), CASES, ids=lambda v: getattr(v, "value", str(v)))
@settings(max_examples=50)
@given(data=st.data())
def test_round_trip_every_packet_type(sender, level, name, data):
    if name == "connect":
        packet = data.draw(connects(level))
        decoder = MqttDecoder(role=Role.SERVER)
    else:
        packet = data.draw(packets_sent_by(sender, level)[name])
        decoder = receiver_of(sender, level)
        if sender is Role.CLIENT:
            decoder.feed(encode(Connect(protocol_level=level), level))
            decoder.next_packet()
    decoder.feed(encode(packet, level))
    assert drain(decoder) == [packet]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("sender", [Role.CLIENT, Role.SERVER], ids=lambda r: r.value)
@settings(max_examples=60)
@given(data=st.data())
def test_stream_in_random_fragments_decodes_the_same(sender, level, data):
    packets = data.draw(stream(sender, level))
    wire = b"".join(encode(packet, level) for packet in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    decoder = receiver_of(sender, level)
    out = []
    for start, stop in zip([0, *cuts], [*cuts, len(wire)]):
        decoder.feed(wire[start:stop])
        out += drain(decoder)
    assert out == packets
    assert decoder.next_packet() is NEED_DATA


@pytest.mark.parametrize("level", LEVELS)
def test_one_byte_at_a_time(level):
    packets = [
        Connect(protocol_level=level, client_id="dev", will_topic="w", will_payload=b"bye"),
        Publish("a/b", b"x" * 300, qos=1, packet_id=9),  # two-byte remaining length
        Subscribe(1, (("a/#", SubscriptionOptions(1)),)),
        Pingreq(),
        Disconnect(),
    ]
    wire = b"".join(encode(packet, level) for packet in packets)
    decoder = MqttDecoder(role=Role.SERVER)
    out = []
    for index in range(len(wire)):
        decoder.feed(wire[index:index + 1])
        out += drain(decoder)
    assert out == packets


def test_feed_copies_mutable_buffers():
    data = bytearray(encode(Connect(client_id="c"), 5))
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(data)
    data[:] = b"\x00" * len(data)
    assert decoder.next_packet() == Connect(client_id="c")


def test_large_packet_arriving_in_chunks():
    payload = bytes(range(256)) * 4096  # 1 MiB
    wire = encode(Publish("big", payload, qos=2, packet_id=3), 5)
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(encode(Connect(), 5))
    decoder.next_packet()
    for start in range(0, len(wire), 65_536):
        assert decoder.next_packet() is NEED_DATA
        decoder.feed(wire[start:start + 65_536])
    assert decoder.next_packet() == Publish("big", payload, qos=2, packet_id=3)


# --- golden bytes ------------------------------------------------------------------------------


def test_golden_311_connect():
    packet = Connect(
        protocol_level=4, client_id="dev-1", keep_alive=60, username="u", password=b"p",
        will_topic="w/t", will_payload=b"bye", will_qos=1, will_retain=True,
    )
    wire = (
        b"\x10\x21" + b"\x00\x04MQTT\x04" + b"\xee" + b"\x00\x3c"  # user, password, will retain, QoS 1, will, clean
        + b"\x00\x05dev-1" + b"\x00\x03w/t" + b"\x00\x03bye" + b"\x00\x01u" + b"\x00\x01p"
    )
    assert encode(packet, 4) == wire
    assert drain_server(wire) == [packet]


def test_golden_5_connect_with_properties():
    # The variable header is the spec's example (section 3.1.2.12): keep alive 10, session expiry 10.
    packet = Connect(
        protocol_level=5, client_id="c1", keep_alive=10, username="u", password=b"pw",
        will_topic="t", will_qos=1, will_payload=b"x", properties=Properties(session_expiry_interval=10),
    )
    variable = b"\x00\x04MQTT\x05\xce\x00\x0a\x05\x11\x00\x00\x00\x0a"
    payload = b"\x00\x02c1" + b"\x00" + b"\x00\x01t" + b"\x00\x01x" + b"\x00\x01u" + b"\x00\x02pw"
    wire = bytes((0x10, len(variable + payload))) + variable + payload
    assert encode(packet, 5) == wire
    assert drain_server(wire) == [packet]


@pytest.mark.parametrize(
    ("packet", "level", "wire"),
    [
        # 3.1.1 section 3.3.2.3's example variable header: topic "a/b", packet id 10.
        (Publish("a/b", b"hi", qos=1, packet_id=10), 4, b"\x32\x09\x00\x03a/b\x00\x0ahi"),
        (Publish("a/b", b"hi", qos=1, packet_id=10), 5, b"\x32\x0a\x00\x03a/b\x00\x0a\x00hi"),
        (Publish("a/b", retain=True), 4, b"\x31\x05\x00\x03a/b"),
        (Publish("a/b", qos=2, dup=True, packet_id=1), 4, b"\x3c\x07\x00\x03a/b\x00\x01"),
        # 3.1.1 section 3.8.3.4's example: "a/b" QoS 1 and "c/d" QoS 2, packet id 10.
        (
            Subscribe(10, (("a/b", SubscriptionOptions(1)), ("c/d", SubscriptionOptions(2)))), 4,
            b"\x82\x0e\x00\x0a\x00\x03a/b\x01\x00\x03c/d\x02",
        ),
        (Subscribe(1, (("a", SubscriptionOptions(2, True, True, 2)),)), 5, b"\x82\x07\x00\x01\x00\x00\x01a\x2e"),
        # 3.1.1 section 3.9.3.1's example: QoS 0, QoS 2, failure.
        (
            Suback(10, (ReasonCode.GRANTED_QOS_0, ReasonCode.GRANTED_QOS_2, ReasonCode.UNSPECIFIED_ERROR)), 4,
            b"\x90\x05\x00\x0a\x00\x02\x80",
        ),
        (Suback(10, (ReasonCode.GRANTED_QOS_1, ReasonCode.QUOTA_EXCEEDED)), 5, b"\x90\x05\x00\x0a\x00\x01\x97"),
        (Connack(), 4, b"\x20\x02\x00\x00"),
        (Connack(True), 5, b"\x20\x03\x01\x00\x00"),
        (Connack(reason_code=ReasonCode.NOT_AUTHORIZED), 4, b"\x20\x02\x00\x05"),
        (Puback(1), 5, b"\x40\x02\x00\x01"),  # section 3.4.2.1: success without properties is short
        (Pubrec(1, ReasonCode.NO_MATCHING_SUBSCRIBERS), 5, b"\x50\x03\x00\x01\x10"),
        (Pubrel(1), 4, b"\x62\x02\x00\x01"),
        (Pubcomp(2, properties=Properties(reason_string="r")), 5, b"\x70\x08\x00\x02\x00\x04\x1f\x00\x01r"),
        (Unsubscribe(3, ("a",)), 4, b"\xa2\x05\x00\x03\x00\x01a"),
        (Unsuback(3), 4, b"\xb0\x02\x00\x03"),
        (Unsuback(3, (ReasonCode.NO_SUBSCRIPTION_EXISTED,)), 5, b"\xb0\x04\x00\x03\x00\x11"),
        (Pingreq(), 4, b"\xc0\x00"),
        (Pingresp(), 5, b"\xd0\x00"),
        (Disconnect(), 4, b"\xe0\x00"),
        (Disconnect(), 5, b"\xe0\x00"),
        (Disconnect(ReasonCode.SERVER_SHUTTING_DOWN), 5, b"\xe0\x01\x8b"),
        (Auth(properties=Properties(authentication_method="M")), 5, b"\xf0\x06\x00\x04\x15\x00\x01M"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, (bytes, int)) else None,
)
def test_golden_bytes(packet, level, wire):
    assert encode(packet, level) == wire


@pytest.mark.parametrize(
    ("wire", "packet"),
    [
        (b"\x40\x02\x00\x07", Puback(7)),
        (b"\x40\x03\x00\x07\x10", Puback(7, ReasonCode.NO_MATCHING_SUBSCRIBERS)),
        (b"\x40\x04\x00\x07\x10\x00", Puback(7, ReasonCode.NO_MATCHING_SUBSCRIBERS)),
        (b"\x62\x03\x00\x07\x92", Pubrel(7, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)),
        (b"\xe0\x00", Disconnect()),
        (b"\xe0\x01\x04", Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE)),
        (b"\xe0\x02\x00\x00", Disconnect()),
    ],
)
def test_5_short_forms_decode(wire, packet):
    # Sections 3.4.2.1 and 3.14.2.1: reason code and property length may be omitted.
    assert decode_stream(wire) == [packet]


# --- 3.1.1 mappings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (ReasonCode.SUCCESS, ConnackCode311.ACCEPTED),
        (ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, ConnackCode311.UNACCEPTABLE_PROTOCOL_VERSION),
        (ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, ConnackCode311.IDENTIFIER_REJECTED),
        (ReasonCode.SERVER_UNAVAILABLE, ConnackCode311.SERVER_UNAVAILABLE),
        (ReasonCode.BAD_USER_NAME_OR_PASSWORD, ConnackCode311.BAD_USER_NAME_OR_PASSWORD),
        (ReasonCode.NOT_AUTHORIZED, ConnackCode311.NOT_AUTHORIZED),
        (ReasonCode.BANNED, ConnackCode311.NOT_AUTHORIZED),
        (ReasonCode.SERVER_BUSY, ConnackCode311.SERVER_UNAVAILABLE),
    ],
)
def test_connack_code_311(reason, code):
    assert connack_code_311(reason) is code


def test_reason_code_tables():
    # Table 2-6 has 43 distinct values, and each one belongs to at least one packet's table.
    everything = set(ReasonCode)
    assert len(everything) == 43
    assert ReasonCode.NORMAL_DISCONNECTION is ReasonCode.GRANTED_QOS_0 is ReasonCode.SUCCESS
    tables = [CONNACK_REASONS, PUBACK_REASONS, PUBREL_REASONS, SUBACK_REASONS, UNSUBACK_REASONS,
              DISCONNECT_REASONS, AUTH_REASONS]
    assert set().union(*tables) == everything
    assert [len(table) for table in tables] == [22, 9, 2, 12, 7, 30, 3]


def test_every_connack_reason_has_a_311_code_and_others_do_not():
    for reason in CONNACK_REASONS:
        encoded = encode(Connack(reason_code=reason), 4)
        assert encoded[3] == connack_code_311(reason)
    with pytest.raises(ValueError):
        connack_code_311(ReasonCode.GRANTED_QOS_1)


def test_311_lossy_mappings_decode_to_the_nearest_meaning():
    wire = b"".join(
        encode(packet, 4)
        for packet in [
            Connack(reason_code=ReasonCode.BANNED),
            Suback(1, (ReasonCode.QUOTA_EXCEEDED, ReasonCode.GRANTED_QOS_1)),
            Puback(2, ReasonCode.NO_MATCHING_SUBSCRIBERS),
            Unsuback(3, (ReasonCode.NO_SUBSCRIPTION_EXISTED,)),
        ]
    )
    assert decode_stream(wire, Role.CLIENT, 4) == [
        Connack(reason_code=ReasonCode.NOT_AUTHORIZED),
        Suback(1, (ReasonCode.UNSPECIFIED_ERROR, ReasonCode.GRANTED_QOS_1)),
        Puback(2),
        Unsuback(3),
    ]


# --- interop -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("paho_protocol", "level"), [(paho_client.MQTTv311, 4), (paho_client.MQTTv5, 5)])
def test_decodes_what_paho_sends(paho_protocol, level):
    # paho builds packets in private methods; with no socket they stay in its out-queue.
    client = paho_client.Client(paho_client.CallbackAPIVersion.VERSION2, client_id="dev-1", protocol=paho_protocol)
    client.username_pw_set("user", "secret")
    client.will_set("w/t", b"bye", qos=1, retain=True)
    client._send_connect(30)
    options = paho_client.SubscribeOptions(qos=2, noLocal=True) if level == 5 else 2
    client._send_subscribe(False, [("a/+", options)])
    client._send_unsubscribe(False, ["a/+"])
    client._send_pubrel(7)
    wire = b"".join(bytes(item["packet"]) for item in client._out_packet)
    out = drain_server(wire)
    assert out[0] == Connect(
        protocol_level=level, client_id="dev-1", keep_alive=30, username="user", password=b"secret",
        will_topic="w/t", will_payload=b"bye", will_qos=1, will_retain=True,
    )
    assert isinstance(out[1], Subscribe)
    assert out[1].subscriptions == (("a/+", SubscriptionOptions(2, level == 5)),)
    assert out[2] == Unsubscribe(2, ("a/+",))
    assert out[3] == Pubrel(7)


def test_amqtt_interop_both_ways():
    theirs = [
        PublishPacket.build("a/b", b"payload", 5, False, 1, True),
        SubscribePacket.build([("a/#", 1), ("c", 0)], 6),
    ]
    wire = b"".join(packet.to_bytes() for packet in theirs)
    assert decode_stream(wire, Role.SERVER, 4) == [
        Publish("a/b", b"payload", qos=1, retain=True, packet_id=5),
        Subscribe(6, (("a/#", SubscriptionOptions(1)), ("c", SubscriptionOptions(0)))),
    ]

    async def parse(cls, data):
        return await cls.from_stream(BufferReader(data))

    publish = asyncio.run(parse(PublishPacket, encode(Publish("x/y", b"z", qos=2, packet_id=9, dup=True), 4)))
    assert (publish.topic_name, publish.data, publish.qos, publish.packet_id, publish.dup_flag) == ("x/y", b"z", 2, 9, True)
    suback = asyncio.run(parse(SubackPacket, encode(Suback(4, (ReasonCode.GRANTED_QOS_2, ReasonCode.NOT_AUTHORIZED)), 4)))
    assert (suback.variable_header.packet_id, suback.payload.return_codes) == (4, [2, 0x80])


# --- decoding rules: the fixed header and connection state --------------------------------------


def test_first_packet_must_be_connect():
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(encode(Pingreq(), 4))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.PROTOCOL_ERROR


@pytest.mark.parametrize("level", LEVELS)
def test_second_connect_is_a_protocol_error(level):
    check_remote_error(ReasonCode.PROTOCOL_ERROR, encode(Connect(protocol_level=level), level), level=level)


@pytest.mark.parametrize(
    ("wire", "role", "level"),
    [
        (encode(Connack(), 5), Role.SERVER, 5),  # servers do not receive CONNACK
        (encode(Suback(1, (ReasonCode.GRANTED_QOS_0,)), 4), Role.SERVER, 4),
        (encode(Pingresp(), 5), Role.SERVER, 5),
        (encode(Subscribe(1, (("a", SubscriptionOptions()),)), 5), Role.CLIENT, 5),  # clients do not receive SUBSCRIBE
        (encode(Pingreq(), 4), Role.CLIENT, 4),
        (encode(Connect(), 5), Role.CLIENT, 5),
        (b"\xf0\x00", Role.SERVER, 4),  # AUTH does not exist in 3.1.1
        (b"\xf0\x00", Role.CLIENT, 4),
        (b"\xe0\x00", Role.CLIENT, 4),  # a 3.1.1 server never sends DISCONNECT
    ],
)
def test_packet_from_the_wrong_side_is_a_protocol_error(wire, role, level):
    check_remote_error(ReasonCode.PROTOCOL_ERROR, wire, role, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "wire",
    [
        b"\x00\x00",  # packet type 0 is reserved
        b"\x41\x02\x00\x01",  # PUBACK with flags 0001
        b"\x60\x02\x00\x01",  # PUBREL must have flags 0010
        b"\x80\x06\x00\x01\x00\x01a\x00",  # SUBSCRIBE must have flags 0010
        b"\xa0\x05\x00\x01\x00\x01a",  # UNSUBSCRIBE must have flags 0010
        b"\xc1\x00",  # PINGREQ with flags 0001
        b"\xe8\x00",  # DISCONNECT with flags 1000
        b"\x36\x05\x00\x01a\x00\x01",  # PUBLISH QoS 3 [MQTT-3.3.1-4]
        b"\x38\x03\x00\x01a",  # PUBLISH DUP on QoS 0 [MQTT-3.3.1-2]
        b"\x30\xff\xff\xff\xff\x01",  # remaining length of five bytes
    ],
)
def test_fixed_header_rules(wire, level):
    check_remote_error(ReasonCode.MALFORMED_PACKET, wire, level=level)


def test_non_minimal_remaining_length_is_malformed_in_5_only():
    # 5.0 [MQTT-1.5.5-1] requires the minimal form; 3.1.1 section 2.2.3 does not.
    long_form = b"\xc0\x80\x00"  # PINGREQ with remaining length 0 in two bytes
    check_remote_error(ReasonCode.MALFORMED_PACKET, long_form, level=5)
    assert decode_stream(long_form, level=4) == [Pingreq()]


@pytest.mark.parametrize("level", LEVELS)
def test_non_minimal_remaining_length_in_connect(level):
    body = encode(Connect(protocol_level=level), level)[2:]
    wire = bytes((0x10, 0x80 | len(body), 0x00)) + body
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(wire)
    if level == 5:
        with pytest.raises(RemoteProtocolError) as info:
            decoder.next_packet()
        assert info.value.reason is ReasonCode.MALFORMED_PACKET
    else:
        assert decoder.next_packet() == Connect(protocol_level=4)


def test_too_large_is_raised_from_the_header_alone():
    decoder = MqttDecoder(role=Role.SERVER, max_packet_size=1000)
    decoder.feed(encode(Connect(), 5))
    decoder.next_packet()
    decoder.feed(b"\x30\xe8\x07")  # announces 1003 bytes; no body yet
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.PACKET_TOO_LARGE


def test_max_packet_size_counts_the_whole_packet():
    packet = encode(Publish("t", b"x" * 94), 5)  # 100 bytes
    assert len(packet) == 100
    assert decode_stream(packet, max_packet_size=100) == [Publish("t", b"x" * 94)]
    check_remote_error(ReasonCode.PACKET_TOO_LARGE, packet, max_packet_size=99)


def test_errors_are_sticky():
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(b"\x00\x00")
    with pytest.raises(RemoteProtocolError):
        decoder.next_packet()
    decoder.feed(encode(Connect(), 5))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.MALFORMED_PACKET


@pytest.mark.parametrize(
    "options",
    [{"role": Role.CLIENT}, {"role": Role.CLIENT, "protocol_level": 3}, {"role": Role.SERVER, "protocol_level": 5},
     {"role": Role.SERVER, "max_packet_size": MAX_PACKET_SIZE + 1}],
)
def test_decoder_refuses_bad_configuration(options):
    with pytest.raises(LocalProtocolError):
        MqttDecoder(**options)


# --- decoding rules: CONNECT and CONNACK -------------------------------------------------------


@pytest.mark.parametrize(
    "wire, level",
    [
        (connect_bytes(3, name=b"MQIsdp"), None),  # MQTT 3.1: not supported
        (connect_bytes(3), None),
        (connect_bytes(6), None),
        (connect_bytes(4, name=b"MQTX"), 4),  # a level we speak: the refusal is answered at it
        (connect_bytes(5, name=b"MQTX"), 5),
    ],
)
def test_unsupported_protocol(wire, level):
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(wire)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.UNSUPPORTED_PROTOCOL_VERSION
    assert decoder.protocol_level == level


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    ("flags", "tail"),
    [
        (0x03, b"\x00\x01c"),  # reserved flag [MQTT-3.1.2-3]
        (0x1e, b"\x00\x01c"),  # will QoS 3
        (0x0a, b"\x00\x01c"),  # will QoS 1 without the will flag
        (0x22, b"\x00\x01c"),  # will retain without the will flag
        (0x02, b"\x00\x01cX"),  # a byte after the payload
        (0x02, b"\x00\x05c"),  # client id past the end
        (0x82, b"\x00\x01c"),  # user name flag, no user name
    ],
)
def test_connect_rules(flags, tail, level):
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(connect_bytes(level, flags, tail))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.MALFORMED_PACKET
    assert decoder.protocol_level == level  # so the connection layer answers in the right version


def test_password_without_user_name_is_311_only():
    tail = b"\x00\x01c\x00\x02pw"
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(connect_bytes(5, 0x42, tail))
    assert decoder.next_packet() == Connect(client_id="c", password=b"pw")
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(connect_bytes(4, 0x42, tail))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.MALFORMED_PACKET  # [MQTT-3.1.2-22]


def test_connect_authentication_data_needs_a_method():
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(connect_bytes(5, properties=b"\x04\x16\x00\x01x"))
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("wire", "level", "reason"),
    [
        (b"\x20\x02\x02\x00", 4, ReasonCode.MALFORMED_PACKET),  # reserved acknowledge flag
        (b"\x20\x02\x00\x06", 4, ReasonCode.MALFORMED_PACKET),  # reserved 3.1.1 return code
        (b"\x20\x03\x00\x00\x00", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 CONNACK is two bytes
        (b"\x20\x03\x00\x01\x00", 5, ReasonCode.MALFORMED_PACKET),  # 0x01 is no CONNACK reason
        (b"\x20\x02\x00\x00", 5, ReasonCode.MALFORMED_PACKET),  # 5.0 needs the property length
        (b"\x20\x02\x01\x05", 4, ReasonCode.PROTOCOL_ERROR),  # session present on a refusal
        (b"\x20\x03\x01\x87\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\x20\x07\x00\x00\x04\x16\x00\x01x", 5, ReasonCode.PROTOCOL_ERROR),  # auth data, no method
    ],
)
def test_connack_rules(wire, level, reason):
    check_remote_error(reason, wire, Role.CLIENT, level)


# --- decoding rules: PUBLISH and acks ----------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "level", "reason"),
    [
        (b"\x32\x05\x00\x01a\x00\x00", 4, ReasonCode.PROTOCOL_ERROR),  # packet id 0
        (b"\x32\x06\x00\x01a\x00\x00\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\x30\x03\x00\x01\xff", 4, ReasonCode.MALFORMED_PACKET),  # ill-formed UTF-8
        (b"\x30\x05\x00\x03\xed\xa0\x80", 4, ReasonCode.MALFORMED_PACKET),  # encoded surrogate
        (b"\x30\x04\x00\x01\x00\x00", 5, ReasonCode.MALFORMED_PACKET),  # U+0000 in the topic
        (b"\x30\x03\x00\x05a", 4, ReasonCode.MALFORMED_PACKET),  # topic past the end
        (b"\x32\x04\x00\x01a\x00", 4, ReasonCode.MALFORMED_PACKET),  # packet id cut short
        (b"\x30\x03\x00\x01a", 5, ReasonCode.MALFORMED_PACKET),  # no property length
        (b"\x30\x05\x00\x01a\x05\x00", 5, ReasonCode.MALFORMED_PACKET),  # properties past the end
        (b"\x30\x02\x00\x00", 4, ReasonCode.PROTOCOL_ERROR),  # empty topic name
        (b"\x30\x03\x00\x00\x00", 5, ReasonCode.PROTOCOL_ERROR),  # empty topic name, no alias
        (b"\x30\x06\x00\x01a\x02\x0b\x01", 5, ReasonCode.PROTOCOL_ERROR),  # client sends subscription id
        (b"\x30\x08\x00\x01a\x05\x11\x00\x00\x00\x01", 5, ReasonCode.MALFORMED_PACKET),  # CONNECT-only property
    ],
)
def test_publish_rules(wire, level, reason):
    check_remote_error(reason, wire, Role.SERVER, level)


def test_publish_edge_cases_that_are_valid():
    alias_only = b"\x30\x06\x00\x00\x03\x23\x00\x01"  # empty topic with a topic alias (section 3.3.2.3.4)
    assert decode_stream(alias_only) == [Publish("", properties=Properties(topic_alias=1))]
    with_sub_id = b"\x30\x06\x00\x01a\x02\x0b\x01"  # servers do send subscription identifiers
    assert decode_stream(with_sub_id, Role.CLIENT) == [Publish("a", properties=Properties(subscription_identifiers=(1,)))]
    bom = b"\x30\x06\x00\x04\xef\xbb\xbfa"  # U+FEFF is kept [MQTT-1.5.4-3]
    assert decode_stream(bom, level=4) == [Publish("\ufeffa")]


@pytest.mark.parametrize(
    ("wire", "level", "reason"),
    [
        (b"\x40\x02\x00\x00", 4, ReasonCode.PROTOCOL_ERROR),  # packet id 0
        (b"\x50\x02\x00\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\x40\x01\x00", 5, ReasonCode.MALFORMED_PACKET),  # packet id cut short
        (b"\x40\x03\x00\x01\x00", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 acks are two bytes
        (b"\x40\x03\x00\x01\x92", 5, ReasonCode.MALFORMED_PACKET),  # 0x92 is for PUBREL/PUBCOMP
        (b"\x62\x03\x00\x01\x10", 5, ReasonCode.MALFORMED_PACKET),  # 0x10 is for PUBACK/PUBREC
        (b"\x70\x05\x00\x01\x00\x05\x00", 5, ReasonCode.MALFORMED_PACKET),  # properties past the end
        (b"\x40\x06\x00\x01\x00\x01\x1f\x00", 5, ReasonCode.MALFORMED_PACKET),  # string cut short
        (b"\x40\x05\x00\x01\x00\x00\x00", 5, ReasonCode.MALFORMED_PACKET),  # byte after the properties
    ],
)
def test_ack_rules(wire, level, reason):
    check_remote_error(reason, wire, Role.SERVER, level)


# --- decoding rules: SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PING, DISCONNECT, AUTH ------------


@pytest.mark.parametrize(
    ("wire", "level", "reason"),
    [
        (b"\x82\x02\x00\x01", 4, ReasonCode.PROTOCOL_ERROR),  # no topic filters
        (b"\x82\x03\x00\x01\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\x82\x02\x00\x00", 4, ReasonCode.PROTOCOL_ERROR),  # packet id 0
        (b"\x82\x06\x00\x01\x00\x01a\x04", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 reserved option bits
        (b"\x82\x06\x00\x01\x00\x01a\x03", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 QoS 3
        (b"\x82\x07\x00\x01\x00\x00\x01a\x40", 5, ReasonCode.MALFORMED_PACKET),  # reserved bits 6-7
        (b"\x82\x07\x00\x01\x00\x00\x01a\x03", 5, ReasonCode.PROTOCOL_ERROR),  # QoS 3
        (b"\x82\x07\x00\x01\x00\x00\x01a\x30", 5, ReasonCode.PROTOCOL_ERROR),  # retain handling 3
        (b"\x82\x05\x00\x01\x00\x01a", 4, ReasonCode.MALFORMED_PACKET),  # filter without options
        (b"\x82\x0b\x00\x01\x04\x0b\x01\x0b\x02\x00\x01a\x00", 5, ReasonCode.PROTOCOL_ERROR),  # two subscription ids
        (b"\xa2\x02\x00\x01", 4, ReasonCode.PROTOCOL_ERROR),  # UNSUBSCRIBE without filters
        (b"\xa2\x03\x00\x01\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\xa2\x05\x00\x01\x00\x05a", 4, ReasonCode.MALFORMED_PACKET),  # filter past the end
        (b"\xc0\x01\x00", 4, ReasonCode.MALFORMED_PACKET),  # PINGREQ with a body
        (b"\xe0\x01\x00", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 DISCONNECT with a body
        (b"\xe0\x01\x05", 5, ReasonCode.MALFORMED_PACKET),  # 0x05 is no DISCONNECT reason
        (b"\xe0\x03\x00\x00\x00", 5, ReasonCode.MALFORMED_PACKET),  # byte after the properties
        (b"\xf0\x00", 5, ReasonCode.PROTOCOL_ERROR),  # AUTH without an authentication method
        (b"\xf0\x01\x18", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\xf0\x06\x00\x04\x15\x00\x01M", 5, None),  # valid, for contrast
        (b"\xf0\x06\x87\x04\x15\x00\x01M", 5, ReasonCode.MALFORMED_PACKET),  # 0x87 is no AUTH reason
    ],
)
def test_client_packet_rules(wire, level, reason):
    if reason is None:
        assert len(decode_stream(wire, Role.SERVER, level)) == 1
    else:
        check_remote_error(reason, wire, Role.SERVER, level)


@pytest.mark.parametrize(
    ("wire", "level", "reason"),
    [
        (b"\x90\x02\x00\x01", 4, ReasonCode.PROTOCOL_ERROR),  # SUBACK without codes
        (b"\x90\x03\x00\x01\x00", 5, ReasonCode.PROTOCOL_ERROR),
        (b"\x90\x03\x00\x01\x03", 4, ReasonCode.MALFORMED_PACKET),  # 0x03 is no SUBACK code
        (b"\x90\x03\x00\x01\x97", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 has only 0x80 for failure
        (b"\x90\x04\x00\x01\x00\x11", 5, ReasonCode.MALFORMED_PACKET),  # 0x11 is for UNSUBACK
        (b"\xb0\x03\x00\x01\x00", 4, ReasonCode.MALFORMED_PACKET),  # 3.1.1 UNSUBACK is two bytes
        (b"\xb0\x03\x00\x01\x00", 5, ReasonCode.PROTOCOL_ERROR),  # 5.0 UNSUBACK without codes
        (b"\xb0\x04\x00\x01\x00\x10", 5, ReasonCode.MALFORMED_PACKET),  # 0x10 is for PUBACK
        (b"\xd0\x01\x00", 5, ReasonCode.MALFORMED_PACKET),  # PINGRESP with a body
        (b"\xe0\x07\x00\x05\x11\x00\x00\x00\x01", 5, ReasonCode.PROTOCOL_ERROR),  # server sends session expiry
    ],
)
def test_server_packet_rules(wire, level, reason):
    check_remote_error(reason, wire, Role.CLIENT, level)


def test_client_disconnect_may_carry_session_expiry():
    wire = b"\xe0\x07\x00\x05\x11\x00\x00\x00\x01"
    assert decode_stream(wire) == [Disconnect(properties=Properties(session_expiry_interval=1))]


# --- encoding rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("packet", "level"),
    [
        (Publish("t", qos=0, packet_id=1), 5),
        (Publish("t", qos=1), 5),
        (Publish("t", qos=3, packet_id=1), 5),
        (Publish("t", dup=True), 4),
        (Publish("t", properties=Properties(topic_alias=1)), 4),
        (Publish(""), 4),
        (Publish(""), 5),
        (Publish("t\x00"), 5),
        (Publish("t", qos=1, packet_id=0), 4),
        (Publish("t", properties=Properties(session_expiry_interval=1)), 5),
        (Connect(protocol_level=5), 4),
        (Connect(protocol_level=4, will_qos=1), 4),
        (Connect(protocol_level=5, will_payload=b"x"), 5),
        (Connect(protocol_level=5, will_topic="w", will_qos=3), 5),
        (Connect(protocol_level=4, password=b"p"), 4),
        (Connect(protocol_level=4, keep_alive=70_000), 4),
        (Connect(protocol_level=5, properties=Properties(authentication_data=b"x")), 5),
        (Connect(protocol_level=3), 3),
        (Connack(True, ReasonCode.NOT_AUTHORIZED), 5),
        (Connack(reason_code=ReasonCode.GRANTED_QOS_1), 5),
        (Connack(properties=Properties(maximum_qos=1)), 4),
        (Puback(1, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND), 5),
        (Puback(1, ReasonCode.NOT_AUTHORIZED), 4),
        (Pubrel(0), 5),
        (Pubcomp(70_000), 5),
        (Pubrec(1, properties=Properties(reason_string="r")), 4),
        (Subscribe(1, ()), 5),
        (Subscribe(1, (("a", SubscriptionOptions(1, no_local=True)),)), 4),
        (Subscribe(1, (("a", SubscriptionOptions(retain_handling=3)),)), 5),
        (Subscribe(1, (("a", SubscriptionOptions(qos=3)),)), 5),
        (Suback(1, ()), 5),
        (Suback(1, (ReasonCode.NO_SUBSCRIPTION_EXISTED,)), 5),
        (Unsubscribe(1, ()), 4),
        (Unsuback(1), 5),
        (Unsuback(1, (ReasonCode.NOT_AUTHORIZED,)), 4),
        (Unsuback(1, (ReasonCode.GRANTED_QOS_1,)), 5),
        (Disconnect(ReasonCode.SERVER_SHUTTING_DOWN), 4),
        (Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE), 4),
        (Disconnect(ReasonCode.CONTINUE_AUTHENTICATION), 5),
        (Auth(properties=Properties(authentication_method="M")), 4),
        (Auth(), 5),
        (Auth(ReasonCode.UNSPECIFIED_ERROR, Properties(authentication_method="M")), 5),
    ],
    ids=repr,
)
def test_encode_refuses_invalid_packets(packet, level):
    with pytest.raises(LocalProtocolError):
        encode(packet, level)


def test_encode_refuses_non_packets():
    with pytest.raises(LocalProtocolError):
        encode("PINGREQ", 5)


# --- what a hostile client can make the decoder hold or do (issue 21) ----------------------------


def test_a_connect_over_max_connect_size_is_refused_from_its_header_in_the_clients_version():
    """A client not yet accepted may not make the node buffer a packet of an accepted client's size; the
    protocol level is read from the bytes already there, so an MQTT 5 client gets CONNACK 0x95."""
    connect = encode(Connect(protocol_level=5, client_id="c" * 2000), 5)
    decoder = MqttDecoder(role=Role.SERVER, max_packet_size=100_000, max_connect_size=1000)
    decoder.feed(connect[:20])  # the header announces more than 1000 bytes; the body has not arrived
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_packet()
    assert info.value.reason is ReasonCode.PACKET_TOO_LARGE
    assert decoder.protocol_level == 5


def test_max_connect_size_bounds_the_connect_only():
    decoder = MqttDecoder(role=Role.SERVER, max_packet_size=100_000, max_connect_size=1000)
    decoder.feed(encode(Connect(protocol_level=5, client_id="c"), 5))
    assert isinstance(decoder.next_packet(), Connect)
    big = Publish("t", b"x" * 50_000)
    decoder.feed(encode(big, 5))
    assert decoder.next_packet() == big


def _user_properties(count: int) -> Properties:
    return Properties(user_properties=tuple((f"k{i}", f"v{i}") for i in range(count)))


@pytest.mark.parametrize("limit", [RepeatLimit(count=32), RepeatLimit(bytes=8192)])
def test_user_properties_over_the_limit_are_refused_after_the_limit_not_after_the_packet(limit):
    """20,000 User Properties took ~90 ms of CPU per PUBLISH to decode; decoding now stops at the first one
    over the limit (QUOTA_EXCEEDED), so the work is bounded by the limit, not by the packet."""
    def decode(count: int) -> int:
        decoder = MqttDecoder(role=Role.SERVER, repeat_limit=limit)
        decoder.feed(encode(Connect(protocol_level=5, client_id="c"), 5))
        decoder.next_packet()
        decoder.feed(encode(Publish("t", b"x", properties=_user_properties(count)), 5))

        def refused() -> RemoteProtocolError:
            with pytest.raises(RepeatLimitExceeded) as info:
                decoder.next_packet()
            return info.value

        lines, error = python_lines(refused)
        assert error.reason is ReasonCode.QUOTA_EXCEEDED
        return lines

    assert decode(20_000) < 1.1 * decode(2_000)  # the same work whatever the packet holds beyond the limit


def test_user_properties_within_the_limit_are_decoded():
    within = Publish("t", b"x", properties=_user_properties(32))
    assert decode_stream(encode(within, 5), repeat_limit=RepeatLimit(count=32)) == [within]


@pytest.mark.parametrize("level", [4, 5])
def test_next_is_subscribe_looks_at_the_next_packets_first_byte_only(level):
    """The connection gathers the SUBSCRIBEs read one after another (``next_is_subscribe``): the answer is the next
    buffered byte's, whether the packet is complete, buffered or still to be joined; nothing is consumed."""
    subscribe = encode(Subscribe(1, (("a/+", SubscriptionOptions(qos=1)),)), level)
    decoder = MqttDecoder(role=Role.SERVER)
    decoder.feed(encode(Connect(protocol_level=level, client_id="c"), level))
    assert not decoder.next_is_subscribe()
    assert isinstance(decoder.next_packet(), Connect)
    assert not decoder.next_is_subscribe()  # nothing buffered
    decoder.feed(subscribe[:1])
    assert decoder.next_is_subscribe() and decoder.next_packet() is NEED_DATA  # incomplete: still to come
    decoder.feed(subscribe[1:] + encode(Pingreq(), level))
    assert decoder.next_is_subscribe()
    assert decoder.next_packet() == Subscribe(1, (("a/+", SubscriptionOptions(qos=1)),))
    assert not decoder.next_is_subscribe() and isinstance(decoder.next_packet(), Pingreq)


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("reason", sorted(SUBACK_REASONS))
def test_a_one_code_suback_is_the_bytes_section_3_9_gives(level, reason):
    """A SUBACK of one reason code without properties takes a shortcut (issue 31): its bytes are the ones section
    3.9 gives, a 3.1.1 failure as 0x80 (section 3.9.3); with properties it is encoded in full."""
    code = (0x80 if reason.is_failure else reason) if level == 4 else reason
    for packet_id in (1, 0x1234, 0xFFFF):
        header = b"\x90\x03" if level == 4 else b"\x90\x04"
        expected = header + packet_id.to_bytes(2, "big") + (b"\x00" if level == 5 else b"") + bytes((code,))
        assert encode(Suback(packet_id, (reason,)), level) == expected
    if level == 5:
        assert encode(Suback(9, (reason,), Properties(reason_string="r")), 5) == b"\x90\x08\x00\x09\x04\x1f\x00\x01r" \
            + bytes((reason,))
    with pytest.raises(LocalProtocolError):
        encode(Suback(0, (reason,)), level)


def test_a_suback_of_a_reason_it_cannot_carry_is_refused_as_ever():
    with pytest.raises(LocalProtocolError):
        encode(Suback(1, (ReasonCode.PACKET_TOO_LARGE,)), 5)


# A SUBSCRIBE is read in place (issue 31: one filter a packet, 50,000 of them): each malformed part is still found,
# in the order the generic readers found them, with their messages.
@pytest.mark.parametrize(
    ("wire", "level", "reason", "message"),
    [
        (b"\x82\x01\x00", 4, ReasonCode.MALFORMED_PACKET, "ends before its packet identifier"),
        (b"\x82\x03\x00\x01\x00", 4, ReasonCode.MALFORMED_PACKET, "length field runs past the end"),
        (b"\x82\x06\x00\x01\x00\x05ab", 4, ReasonCode.MALFORMED_PACKET, "runs past the end of its field"),
        (b"\x82\x07\x00\x01\x00\x01a\x01\x00", 4, ReasonCode.MALFORMED_PACKET, "length field runs past the end"),
        (b"\x82\x06\x00\x01\x00\x01\xff\x01", 4, ReasonCode.MALFORMED_PACKET, "ill-formed UTF-8"),  # [MQTT-1.5.4-1]
        (b"\x82\x06\x00\x01\x00\x01\x00\x01", 4, ReasonCode.MALFORMED_PACKET, "U+0000"),  # [MQTT-1.5.4-2]
        (b"\x82\x06\x00\x01\x00\x01\xff\x03", 4, ReasonCode.MALFORMED_PACKET, "ill-formed UTF-8"),  # before the QoS 3
        (b"\x82\x05\x00\x01\x00\x01\xff", 4, ReasonCode.MALFORMED_PACKET, "ill-formed UTF-8"),  # before the options
        (b"\x82\x09\x00\x01\x00\x01a\x01\x00\x01b", 4, ReasonCode.MALFORMED_PACKET, "without subscription options"),
        (b"\x82\x0a\x00\x01\x00\x01a\x01\x00\x01b\x07", 4, ReasonCode.MALFORMED_PACKET,
         "has reserved bits set or QoS 3"),  # the second filter's options [MQTT-3.8.3-4]
        (b"\x82\x02\x00\x01", 5, ReasonCode.MALFORMED_PACKET, "variable byte integer runs past"),  # no property length
        (b"\x82\x04\x00\x01\x05\x00", 5, ReasonCode.MALFORMED_PACKET, "property length runs past"),
        (b"\x82\x07\x00\x01\x00\x00\x01a\xc1", 5, ReasonCode.MALFORMED_PACKET, "[MQTT-3.8.3-5]"),
        (b"\x82\x07\x00\x01\x00\x00\x01a\x33", 5, ReasonCode.PROTOCOL_ERROR, "QoS 3"),
        (b"\x82\x07\x00\x01\x00\x00\x01a\x31", 5, ReasonCode.PROTOCOL_ERROR, "retain handling 3"),
        (b"\x82\x04\x00\x01\x00\x00", 5, ReasonCode.MALFORMED_PACKET, "length field runs past the end"),
    ],
)
def test_a_malformed_subscribe_is_refused_for_its_first_fault(wire, level, reason, message):
    """[MQTT-3.8.3-*]: a SUBSCRIBE's faults close the connection with their reason code, the first one found."""
    error = check_remote_error(reason, wire, Role.SERVER, level)
    assert message in str(error), error


@pytest.mark.parametrize("level", [4, 5])
def test_subscribes_read_in_place_decode_as_encoded(level):
    """Each filter with its options in order, the 5.0 properties when there are some (a Subscription Identifier),
    none when the property length is 0."""
    packets = [
        Subscribe(1, (("a/+", SubscriptionOptions(qos=1)),)),
        Subscribe(2, (("a/#", SubscriptionOptions(2)), ("é/b", SubscriptionOptions()), ("c", SubscriptionOptions(1)))),
    ]
    if level == 5:
        packets += [Subscribe(3, (("$share/g/x", SubscriptionOptions(1, False, True, 2)),), Properties(
                        subscription_identifiers=(7,), user_properties=(("k", "v"),))),
                    Subscribe(4, (("d", SubscriptionOptions(0, True, False, 1)),))]
    assert decode_stream(b"".join(encode(p, level) for p in packets), Role.SERVER, level) == packets


def test_a_5_subscribe_without_properties_decodes_at_the_cost_of_a_3_1_1_one():
    """A 5.0 SUBSCRIBE's property length of 0 is read as such, not through the property reader: what a client
    subscribing one filter per packet sends is decoded at the cost of the 3.1.1 one, counted in Python lines."""
    from tests.helpers.work import python_lines

    costs = {}
    for level in (4, 5):
        decoder = MqttDecoder(role=Role.SERVER)
        decoder.feed(encode(Connect(protocol_level=level, client_id="c"), level))
        decoder.next_packet()
        decoder.feed(encode(Subscribe(1, (("fleet/1/+/2", SubscriptionOptions(1)),)), level))
        costs[level], packet = python_lines(decoder.next_packet)
        assert packet == Subscribe(1, (("fleet/1/+/2", SubscriptionOptions(1)),))
    assert costs[5] <= costs[4] + 3, costs
