"""The CONNECT path against hostile bytes: every CONNECT, valid or mutated, gets an answer the client can read or a
close, and nothing a client sends raises.

Sans-IO first (hundreds of examples a second): the server decoder and the channel, and the encoding of everything
the channel asks to send, at the level the server's connection would encode it. The end-to-end check (a real node,
raw sockets, its log) is in tests/gateway/node/test_hostile.py.
"""

from hypothesis import given, settings

from gateway.mqtt.actions import Close, OpenSession, Send, SessionOpened
from gateway.mqtt.channel import Channel, ChannelConfig
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, RemoteProtocolError, Role, encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connack, Connect
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.strategies import connects, mutated


def serve(data: bytes) -> tuple[list, Channel, int | None]:
    """What the server does with ``data`` on a new connection (gateway/node/connection.py's read loop): every action, with
    every packet the channel sends encoded at the level the connection encodes it (which must not raise)."""
    decoder = MqttDecoder(role=Role.SERVER, max_packet_size=ChannelConfig().max_packet_size)
    channel = Channel(ChannelConfig(reason_strings=True))
    decoder.feed(data)
    actions: list = []
    while True:
        try:
            packet = decoder.next_packet()
        except RemoteProtocolError as err:
            actions += channel.handle_protocol_error(err, decoder.protocol_level)
            break
        if packet is NEED_DATA:
            break
        actions += channel.handle_in(packet)
        if any(type(a) is OpenSession for a in actions) and not any(type(a) is Close for a in actions):
            actions += channel.handle_event(SessionOpened(False))
    for action in actions:
        if type(action) is Send:
            for packet in action.packets:
                encode(packet, channel.protocol_level)
    return actions, channel, decoder.protocol_level


def _answer(actions: list) -> list:
    return [p for a in actions if type(a) is Send for p in a.packets if type(p) is Connack]


@settings(max_examples=400)
@given(mutated())
def test_a_mutated_connect_is_answered_or_closed_never_raises(data):
    actions, channel, level = serve(data)
    closed = any(type(a) is Close for a in actions)
    answers = _answer(actions)
    if not closed:  # the whole CONNECT has not arrived yet, or it was accepted
        assert not answers or answers[0].reason_code is ReasonCode.SUCCESS
        return
    if answers:  # an error CONNACK is at the CONNECT's level, so the client can read it
        assert channel.protocol_level == (level or MQTT_311)
        client = MqttDecoder(role=Role.CLIENT, protocol_level=channel.protocol_level)
        client.feed(encode(answers[0], channel.protocol_level))
        assert isinstance(client.next_packet(), Connack)


@settings(max_examples=200)
@given(connects())
def test_a_valid_connect_is_accepted_with_a_connack_it_can_read(data):
    actions, channel, level = serve(data)
    answers = _answer(actions)
    closed = any(type(a) is Close for a in actions)
    if closed:  # refused (a will QoS or topic the server takes no, a tiny Maximum Packet Size): said why
        close = next(a for a in actions if type(a) is Close)
        assert close.reason.is_failure, close
        return
    assert answers and answers[0].reason_code is ReasonCode.SUCCESS


def test_a_malformed_mqtt5_connect_gets_connack_0x81_at_level_5():
    """[MQTT-3.1.4-1]: a malformed CONNECT is answered, at 5.0 with CONNACK 0x81 (section 3.2.2.2), and the
    CONNACK is encoded as 5.0 (a 3.1.1 encoding of a 5.0 reason raised an internal error: no CONNACK)."""
    data = bytearray(encode(Connect(MQTT_5, "m5"), MQTT_5))
    data[9] |= 0x01  # the reserved CONNECT flag [MQTT-3.1.2-3]
    actions, channel, _ = serve(bytes(data))
    (connack,) = _answer(actions)
    assert connack.reason_code is ReasonCode.MALFORMED_PACKET
    assert encode(connack, channel.protocol_level)[:4] == b"\x20" + bytes([len(encode(connack, MQTT_5)) - 2]) \
        + b"\x00\x81"


def test_a_protocol_error_in_an_mqtt5_connect_gets_connack_0x82():
    """Section 3.1.2.11: a property given twice is a Protocol Error, answered with CONNACK 0x82."""
    body = b"\x00\x04MQTT\x05\x02\x00\x3c" + b"\x06\x21\x00\x0a\x21\x00\x0a" + b"\x00\x02ab"
    actions, _, _ = serve(b"\x10" + bytes([len(body)]) + body)
    (connack,) = _answer(actions)
    assert connack.reason_code is ReasonCode.PROTOCOL_ERROR


def test_an_mqtt5_connect_with_a_wrong_protocol_name_gets_connack_0x84_at_level_5():
    """[MQTT-3.1.2-1]: the server may answer a bad protocol name (here at the client's level 5: 0x84)."""
    body = b"\x00\x04MQTX\x05\x02\x00\x3c\x00\x00\x02ab"
    actions, channel, _ = serve(b"\x10" + bytes([len(body)]) + body)
    (connack,) = _answer(actions)
    assert connack.reason_code is ReasonCode.UNSUPPORTED_PROTOCOL_VERSION
    assert channel.protocol_level == MQTT_5


def test_an_unknown_protocol_level_gets_the_311_return_code_1():
    """[MQTT-3.1.2-2]: level 3 (MQTT 3.1) or 6: a 3.1.1-form CONNACK with return code 1, which any client reads."""
    body = b"\x00\x06MQIsdp\x03\x02\x00\x3c\x00\x02ab"
    actions, channel, _ = serve(b"\x10" + bytes([len(body)]) + body)
    (connack,) = _answer(actions)
    assert encode(connack, channel.protocol_level) == b"\x20\x02\x00\x01"
