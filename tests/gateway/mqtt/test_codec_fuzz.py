"""Fuzzing the decoder: random and mutated bytes never raise anything but RemoteProtocolError.

A second property rides along: whatever the decoder accepts, the encoder can
re-encode, and decoding that gives the same packet. So the decoder never lets
through a packet the encoder would call invalid.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, RemoteProtocolError, Role, encode, encode_varint
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
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from gateway.mqtt.reasons import ReasonCode

# Decoder states worth fuzzing: (role, level); a SERVER with level None still awaits its CONNECT.
STATES = [
    (Role.SERVER, None),
    (Role.SERVER, 4),
    (Role.SERVER, 5),
    (Role.CLIENT, 4),
    (Role.CLIENT, 5),
]


def make_decoder(role, level):
    """A decoder in the given state; a SERVER with a level has already decoded a CONNECT."""
    if role is Role.CLIENT:
        return MqttDecoder(role=role, protocol_level=level)
    decoder = MqttDecoder(role=role)
    if level is not None:
        decoder.feed(encode(Connect(protocol_level=level, client_id="fuzz"), level))
        assert isinstance(decoder.next_packet(), Connect)
    return decoder


def corpus(role, level):
    """Valid streams sent to a decoder in this state, with every packet type and most fields set."""
    five = level == 5

    def p(**fields):
        return Properties(**fields) if five else EMPTY_PROPERTIES

    acks = [
        cls(9, ReasonCode.SUCCESS, p(reason_string="ok", user_properties=(("k", "v"),))) for cls in (Puback, Pubrec, Pubrel, Pubcomp)
    ]
    publish = [
        Publish("a/b", b"payload", 0, True),
        Publish("dev/\u00e9", b"\x00\xff" * 20, 2, False, True, 77, p(
            payload_format_indicator=1, message_expiry_interval=3600, content_type="json", response_topic="r/t",
            correlation_data=b"\x01\x02", topic_alias=3, user_properties=(("a", "b"), ("a", "c")),
        )),
    ]
    if role is Role.SERVER:
        options = SubscriptionOptions(1, five, five, 2 if five else 0)
        packets = [
            *publish,
            *acks,
            Subscribe(5, (("a/+/c", options), ("#", SubscriptionOptions(2))), p(subscription_identifiers=(42,))),
            Unsubscribe(6, ("a/+/c", "#"), p(user_properties=(("u", "1"),))),
            Pingreq(),
        ]
        if five:
            packets += [
                Auth(ReasonCode.CONTINUE_AUTHENTICATION, p(authentication_method="SCRAM", authentication_data=b"xyz")),
                Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE, p(session_expiry_interval=10, reason_string="bye")),
            ]
        else:
            packets.append(Disconnect())
        if level is None:
            return [
                encode(Connect(5, "dev-1", False, 30, "user", b"pw", "will/t", b"gone", 1, True,
                               Properties(will_delay_interval=5, content_type="text"),
                               Properties(session_expiry_interval=60, receive_maximum=10, maximum_packet_size=4096,
                                          topic_alias_maximum=5, request_problem_information=True,
                                          authentication_method="M")), 5),
                encode(Connect(4, "dev-2", True, 0, "user", b"pw", "will/t", b"gone", 2, False), 4),
            ]
        return [b"".join(encode(packet, level) for packet in packets)]
    packets = [
        Connack(True, ReasonCode.SUCCESS, p(
            session_expiry_interval=0, assigned_client_identifier="auto-1", server_keep_alive=30, receive_maximum=100,
            maximum_qos=1, retain_available=False, maximum_packet_size=1 << 20, topic_alias_maximum=10,
            wildcard_subscription_available=True, subscription_identifier_available=True,
            shared_subscription_available=False, response_information="resp", server_reference="other",
        )),
        *publish,
        *acks,
        Suback(5, (ReasonCode.GRANTED_QOS_1, ReasonCode.UNSPECIFIED_ERROR), p(reason_string="partly")),
        Unsuback(6, (ReasonCode.SUCCESS, ReasonCode.NO_SUBSCRIPTION_EXISTED) if five else (), p(reason_string="done")),
        Pingresp(),
    ]
    if five:
        packets += [
            Publish("s", b"", 1, False, False, 1, p(subscription_identifiers=(1, 268_435_455))),
            Disconnect(ReasonCode.SERVER_MOVED, p(server_reference="elsewhere")),
        ]
    return [b"".join(encode(packet, level) for packet in packets)]


SAMPLES = [(role, level, wire) for role, level in STATES for wire in corpus(role, level)]


def decode_all(decoder, chunks):
    """Feed chunks and decode until NEED_DATA or the peer's error; any other exception escapes."""
    packets = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            while (packet := decoder.next_packet()) is not NEED_DATA:
                packets.append(packet)
    except RemoteProtocolError as exc:
        assert isinstance(exc.reason, ReasonCode)
    return packets


def assert_reencodes(decoder, role, packets):
    level = decoder.protocol_level
    for packet in packets:
        again = make_decoder(role, None if isinstance(packet, Connect) else level)
        again.feed(encode(packet, level))
        assert again.next_packet() == packet


def split(wire, cuts):
    cuts = sorted(cut % (len(wire) + 1) for cut in cuts)
    return [wire[start:stop] for start, stop in zip([0, *cuts], [*cuts, len(wire)])]


@st.composite
def mutated(draw):
    role, level, wire = draw(st.sampled_from(SAMPLES))
    data = bytearray(wire)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "length"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if not data:
            break
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        else:  # a plausible but wrong length: a small integer written over a length byte
            data[at] = draw(st.integers(0, 8)) if draw(st.booleans()) else data[at] ^ 0x80
    return role, level, bytes(data), draw(st.lists(st.integers(0, 1 << 16), max_size=4))


@pytest.mark.slow
@settings(max_examples=2000)
@given(mutated())
def test_mutated_packets_raise_only_remote_protocol_errors(case):
    role, level, wire, cuts = case
    decoder = make_decoder(role, level)
    packets = decode_all(decoder, split(wire, cuts))
    assert_reencodes(decoder, role, packets)


def framed(body):
    """Random first byte and body with a correct Remaining Length, so every reader sees garbage."""
    return st.tuples(st.integers(0, 255), body).map(lambda t: bytes((t[0],)) + encode_varint(len(t[1])) + t[1])


@pytest.mark.parametrize(("role", "level"), STATES, ids=lambda v: getattr(v, "value", str(v)))
@settings(max_examples=400)
@given(st.lists(st.binary(max_size=40) | framed(st.binary(max_size=40)), min_size=1, max_size=4))
def test_random_bytes_raise_only_remote_protocol_errors(role, level, chunks):
    decoder = make_decoder(role, level)
    packets = decode_all(decoder, chunks)
    assert_reencodes(decoder, role, packets)


def test_corpus_is_valid():
    # The mutations start from valid streams; make sure they are, or the fuzzing proves little.
    for role, level, wire in SAMPLES:
        decoder = make_decoder(role, level)
        decoder.feed(wire)
        packets = []
        while (packet := decoder.next_packet()) is not NEED_DATA:
            packets.append(packet)
        assert len(packets) >= 1
        assert b"".join(encode(packet, decoder.protocol_level) for packet in packets) == wire
