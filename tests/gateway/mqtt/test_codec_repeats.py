"""``MqttDecoder.repeats``: the QoS 0 PUBLISHes that repeat one just decoded but for their payloads, taken as
payloads only; ``MqttDecoder.pubacks``: the shortest-form PUBACKs next in the buffer, taken as packet ids only
(issue 31). Whatever they take must be what ``next_packet`` would have decoded, and whatever they leave (another
packet, one ``next_packet`` refuses) must be judged by ``next_packet`` as ever.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connect, Packet, Pingreq, Pingresp, Puback, Publish
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode, RemoteProtocolError


def _decoder(level: int, max_packet_size: int = 1 << 20) -> MqttDecoder:
    """A server decoder past the client's CONNECT."""
    decoder = MqttDecoder(role=Role.SERVER, max_packet_size=max_packet_size)
    decoder.feed(encode(Connect(protocol_level=level, client_id="c"), level))
    assert isinstance(decoder.next_packet(), Connect)
    return decoder


def _first(decoder: MqttDecoder, data: bytes) -> Publish:
    decoder.feed(data)
    packet = decoder.next_packet()
    assert isinstance(packet, Publish), packet
    return packet


def _decoded(decoder: MqttDecoder, repeats: bool) -> list[Packet | str]:
    """Decode what is buffered; ``repeats``: as the connection does, ``repeats`` after each plain QoS 0 PUBLISH,
    its payloads as the packets they stand for, and ``pubacks`` after each PUBACK, its ids as the PUBACKs they
    stand for. An error ends the list as its reason's name."""
    out: list[Packet | str] = []
    while True:
        try:
            packet = decoder.next_packet()
        except RemoteProtocolError as err:
            return [*out, err.reason.name]
        if packet is NEED_DATA:
            return out
        out.append(packet)
        if repeats and type(packet) is Publish and not packet.qos and not packet.retain and packet.topic \
                and packet.properties == Properties():
            out += [Publish(packet.topic, payload) for payload in decoder.repeats(packet.topic)]
        if repeats and type(packet) is Puback:
            out += [Puback(packet_id) for packet_id in decoder.pubacks()]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_the_repeats_of_a_qos0_publish_are_its_payloads_up_to_the_first_other_packet(level: int):
    decoder = _decoder(level)
    payloads = [b"", b"x", b"y" * 127, b"z" * 200, b"w" * 16000]  # one- and two-byte remaining lengths
    stream = b"".join(encode(Publish("a/b", p), level) for p in [b"first", *payloads])
    first = _first(decoder, stream + encode(Publish("a/bc", b"other"), level) + encode(Pingreq(), level))
    assert decoder.repeats(first.topic) == payloads
    assert decoder.next_packet() == Publish("a/bc", b"other")  # a longer topic with the same prefix stops it
    assert decoder.repeats("a/bc") == []
    assert decoder.next_packet() == Pingreq()


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
@pytest.mark.parametrize("other", [
    Publish("t", b"retained", retain=True),
    Publish("t", b"qos1", qos=1, packet_id=1),
    Publish("u", b"another topic"),
    Publish("t", b"p" * 20000),  # a three-byte remaining length
], ids=["retain", "qos1", "topic", "length"])
def test_a_packet_unlike_the_first_stops_the_run_and_is_decoded_whole(level: int, other: Publish):
    decoder = _decoder(level)
    first = _first(decoder, b"".join(encode(p, level) for p in
                                     [Publish("t", b"1"), Publish("t", b"2"), other, Publish("t", b"3")]))
    assert decoder.repeats(first.topic) == [b"2"]
    assert decoder.next_packet() == other


def test_an_mqtt5_publish_with_properties_is_not_a_repeat():
    """[MQTT-3.3.2-7..12]: a Topic Alias (or any property) is read by ``next_packet`` and checked by the channel."""
    decoder = _decoder(MQTT_5)
    aliased = Publish("t", b"a", properties=Properties(topic_alias=3))
    first = _first(decoder, encode(Publish("t", b"1"), MQTT_5) + encode(aliased, MQTT_5))
    assert decoder.repeats(first.topic) == []
    assert decoder.next_packet() == aliased


def test_a_repeat_over_the_maximum_packet_size_is_refused_by_next_packet():
    """[MQTT-3.2.2-15]: the server's Maximum Packet Size holds for every packet of a run."""
    decoder = _decoder(MQTT_5, max_packet_size=100)
    first = _first(decoder, b"".join(encode(Publish("t", p), MQTT_5) for p in [b"1", b"2", b"x" * 100]))
    assert decoder.repeats(first.topic) == [b"2"]
    with pytest.raises(RemoteProtocolError) as err:
        decoder.next_packet()
    assert err.value.reason is ReasonCode.PACKET_TOO_LARGE


def test_a_non_minimal_remaining_length_in_mqtt5_is_left_to_next_packet():
    """[MQTT-1.5.5-1]: a remaining length not in its fewest bytes is malformed in 5.0 (3.1.1 accepts it)."""
    body = b"\x00\x01t" + b"\x00" + b"p"
    padded = bytes((0x30, 0x80 | len(body), 0x00)) + body
    decoder = _decoder(MQTT_5)
    first = _first(decoder, encode(Publish("t", b"1"), MQTT_5) + padded)
    assert decoder.repeats(first.topic) == []
    with pytest.raises(RemoteProtocolError) as err:
        decoder.next_packet()
    assert err.value.reason is ReasonCode.MALFORMED_PACKET
    decoder = _decoder(MQTT_311)
    first = _first(decoder, encode(Publish("t", b"1"), MQTT_311) + bytes((0x30, 0x80 | 4, 0x00)) + b"\x00\x01tp")
    assert decoder.repeats(first.topic) == []
    assert decoder.next_packet() == Publish("t", b"p")


def test_an_incomplete_repeat_waits_for_its_bytes():
    decoder = _decoder(MQTT_311)
    second = encode(Publish("t", b"second"), MQTT_311)
    first = _first(decoder, encode(Publish("t", b"1"), MQTT_311) + second[:5])
    assert decoder.repeats(first.topic) == []
    assert decoder.next_packet() is NEED_DATA
    decoder.feed(second[5:])
    assert decoder.next_packet() == Publish("t", b"second")


_TOPICS = st.sampled_from(["t", "t/", "t/a", "u", "é/ü"])
_PACKETS = st.one_of(
    st.builds(Publish, _TOPICS, st.binary(max_size=300)),
    st.builds(Publish, _TOPICS, st.binary(max_size=20), retain=st.booleans()),
    st.builds(lambda t, p, i: Publish(t, p, qos=1, packet_id=i), _TOPICS, st.binary(max_size=20),
              st.integers(1, 65535)),
    st.just(Pingreq()),
    st.builds(Puback, st.integers(1, 65535)),
    st.builds(Puback, st.integers(1, 65535), st.just(ReasonCode.NO_MATCHING_SUBSCRIBERS)),
)


@settings(max_examples=300, deadline=None)
@given(level=st.sampled_from([MQTT_311, MQTT_5]), packets=st.lists(_PACKETS, max_size=12),
       cut=st.integers(0, 4000), mutate=st.integers(0, 4000), byte=st.integers(0, 255))
def test_decoding_with_repeats_gives_the_packets_and_errors_of_next_packet_alone(level, packets, cut, mutate, byte):
    """Every stream, valid or with one byte changed, split in two reads: the same packets, then the same error."""
    stream = bytearray(b"".join(encode(p, level) for p in packets))
    if stream and mutate < len(stream):
        stream[mutate] = byte
    cut = min(cut, len(stream))
    a, b = _decoder(level, 200), _decoder(level, 200)
    got, want = [], []
    for part in (bytes(stream[:cut]), bytes(stream[cut:])):
        a.feed(part)
        b.feed(part)
        got += _decoded(a, repeats=True)
        want += _decoded(b, repeats=False)
        if want and isinstance(want[-1], str):
            break
    assert got == want


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_the_pubacks_after_a_puback_are_their_packet_ids_up_to_the_first_other_packet(level: int):
    decoder = _decoder(level)
    ids = [2, 255, 256, 65535, 1]
    decoder.feed(b"".join(encode(Puback(i), level) for i in [7, *ids]) + encode(Pingreq(), level)
                 + encode(Puback(9), level))
    assert decoder.next_packet() == Puback(7)
    assert decoder.pubacks() == ids
    assert decoder.pubacks() == []
    assert decoder.next_packet() == Pingreq()
    assert decoder.next_packet() == Puback(9)
    assert decoder.pubacks() == []
    assert decoder.next_packet() is NEED_DATA


def test_an_mqtt5_puback_with_a_reason_code_or_properties_stops_the_run():
    """[MQTT-3.4.2-1]: its reason code (and properties) are read by ``next_packet``, as the channel must see them."""
    decoder = _decoder(MQTT_5)
    refused = Puback(3, ReasonCode.NOT_AUTHORIZED)
    explained = Puback(4, ReasonCode.SUCCESS, Properties(reason_string="ok"))
    decoder.feed(b"".join(encode(p, MQTT_5) for p in [Puback(1), Puback(2), refused, explained, Puback(5)]))
    assert decoder.next_packet() == Puback(1)
    assert decoder.pubacks() == [2]
    assert decoder.next_packet() == refused
    assert decoder.pubacks() == []
    assert decoder.next_packet() == explained
    assert decoder.pubacks() == [5]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_puback_with_packet_id_0_stops_the_run_and_is_refused_by_next_packet(level: int):
    """[MQTT-2.2.1-3]: a PUBACK needs a non-zero packet identifier; the run leaves it to ``next_packet``."""
    decoder = _decoder(level)
    decoder.feed(encode(Puback(1), level) + encode(Puback(2), level) + b"\x40\x02\x00\x00" + encode(Puback(3), level))
    assert decoder.next_packet() == Puback(1)
    assert decoder.pubacks() == [2]
    with pytest.raises(RemoteProtocolError) as err:
        decoder.next_packet()
    assert err.value.reason is ReasonCode.PROTOCOL_ERROR


def test_an_incomplete_puback_waits_for_its_bytes():
    decoder = _decoder(MQTT_311)
    decoder.feed(encode(Puback(1), MQTT_311) + encode(Puback(2), MQTT_311) + b"\x40\x02\x00")
    assert decoder.next_packet() == Puback(1)
    assert decoder.pubacks() == [2]
    assert decoder.next_packet() is NEED_DATA
    decoder.feed(b"\x03")
    assert decoder.next_packet() == Puback(3)


def test_no_puback_run_under_a_maximum_packet_size_below_four_bytes():
    """[MQTT-3.2.2-15]: a decoder that takes packets of at most 3 bytes (a client's, which reads no CONNECT first)
    refuses a 4-byte PUBACK, in a run too."""
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=MQTT_311, max_packet_size=3)
    decoder.feed(encode(Pingresp(), MQTT_311) + encode(Puback(2), MQTT_311))
    assert decoder.next_packet() == Pingresp()
    assert decoder.pubacks() == []
    with pytest.raises(RemoteProtocolError) as err:
        decoder.next_packet()
    assert err.value.reason is ReasonCode.PACKET_TOO_LARGE


@settings(max_examples=200, deadline=None)
@given(level=st.sampled_from([MQTT_311, MQTT_5]),
       runs=st.lists(st.lists(st.integers(1, 65535), max_size=300), max_size=4),
       others=st.lists(_PACKETS, min_size=4, max_size=4), mutate=st.integers(0, 3000), byte=st.integers(0, 255))
def test_long_runs_of_pubacks_give_the_packets_and_errors_of_next_packet_alone(level, runs, others, mutate, byte):
    """Runs longer than the first slice ``pubacks`` looks at (64), each followed by another packet, one byte
    changed (an id of 0, another packet type, a longer PUBACK inside a run)."""
    stream = bytearray(b"".join(b"".join(encode(Puback(i), level) for i in ids) + encode(other, level)
                                for ids, other in zip(runs, others)))
    if stream and mutate < len(stream):
        stream[mutate] = byte
    a, b = _decoder(level, 200), _decoder(level, 200)
    a.feed(bytes(stream))
    b.feed(bytes(stream))
    assert _decoded(a, repeats=True) == _decoded(b, repeats=False)
