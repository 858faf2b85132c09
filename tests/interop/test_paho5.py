"""The Eclipse Paho MQTT 5 interoperability cases (client_test5.py) with paho-mqtt 2.x.

Retain handling is left to the retained-message work; shared subscriptions are in
tests/interop/test_node.py.
"""

import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.packets import MQTT_5, Connect, Disconnect, Puback, Publish
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connected, check_nothing_before_sentinel, properties, publish5 as publish, raw_client,
    recv_until_closed, run_id, subscribe5 as subscribe,
)

V5 = {"protocol": mqtt.MQTTv5}


def persistent(port: int, client_id: str) -> Client:
    """A connected MQTT 5 client whose session outlives its connection by an hour (resumed if it exists)."""
    client = Client(port, client_id, clean=False, **V5)
    client.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=3600))
    return client


def away(port: int, client_id: str, filter: str) -> None:
    """A persistent session subscribed to ``filter`` whose client has gone: messages are stored for it."""
    client = persistent(port, client_id)
    subscribe(client, filter)
    client.disconnect()


def test_client_topic_alias(interop_node):
    run = run_id()
    with connected(interop_node.port, **V5) as sub, connected(interop_node.port, **V5) as pub:
        subscribe(sub, f"alias{run}/#")
        publish(pub, f"alias{run}/t", b"named", TopicAlias=1)
        publish(pub, "", b"by alias", TopicAlias=1)  # the topic comes from the alias
        got = sub.receive(2)
        assert [(m.topic, m.payload) for m in got] == [(f"alias{run}/t", b"named"), (f"alias{run}/t", b"by alias")]


def test_server_topic_alias(interop_node):
    run = run_id()
    sub = Client(interop_node.port, **V5)
    sub.connect(properties=properties(PacketTypes.CONNECT, TopicAliasMaximum=2))
    try:
        subscribe(sub, f"salias{run}/#")
        with connected(interop_node.port, **V5) as pub:
            for i in range(3):
                publish(pub, f"salias{run}/t", str(i).encode())
        got = sub.receive(3)
        # The first carries the topic and sets alias 1; the next ones carry only the alias (paho does not
        # resolve inbound aliases, so the test reads them as sent).
        assert [(m.topic, m.payload, m.properties.TopicAlias) for m in got] == [
            (f"salias{run}/t", b"0", 1), ("", b"1", 1), ("", b"2", 1)]
    finally:
        sub.disconnect()


def test_no_topic_alias_beyond_the_clients_maximum(interop_node):
    run = run_id()
    with connected(interop_node.port, **V5) as sub, connected(interop_node.port, **V5) as pub:  # maximum 0
        subscribe(sub, f"noalias{run}/#")
        publish(pub, f"noalias{run}/t", b"x")
        (msg,) = sub.receive(1)
        assert not hasattr(msg.properties, "TopicAlias")


@pytest.mark.slow
def test_message_expiry(interop_node):
    run = run_id()
    away(interop_node.port, f"expiry-{run}", f"expiry{run}/#")
    with connected(interop_node.port, **V5) as pub:
        publish(pub, f"expiry{run}/short", b"expires", MessageExpiryInterval=1)
        publish(pub, f"expiry{run}/long", b"lives", MessageExpiryInterval=60)
    time.sleep(2.1)  # the message must outlive its expiry while queued: the behaviour under test, not a sync
    again = persistent(interop_node.port, f"expiry-{run}")
    (msg,) = again.receive(1)
    assert msg.payload == b"lives"
    assert 1 <= msg.properties.MessageExpiryInterval <= 58  # the time it waited is taken off
    check_nothing_before_sentinel(again, again, f"expiry{run}/x")
    again.disconnect()


def test_message_expiry_interval_zero_reaches_who_is_connected_and_no_one_later(interop_node):
    """MQTT 5.0 section 3.3.2.3.3: the interval is the message's lifetime, "if absent, the Application Message does
    not expire"; 0 is a lifetime of none. Delivery to a connected subscriber starts as the message is stored, so it
    gets it, with the interval 0 minus its wait [MQTT-3.3.2-6]; a session that was away and a later subscriber to the
    retained message come after its lifetime: deleted for them [MQTT-3.3.2-5]. It was dropped for every subscriber
    (Mosquitto delivers it)."""
    run = run_id()
    away(interop_node.port, f"zero-{run}", f"zero{run}/#")
    with connected(interop_node.port, **V5) as online, connected(interop_node.port, **V5) as pub:
        subscribe(online, f"zero{run}/#")
        publish(pub, f"zero{run}/now", b"now or never", MessageExpiryInterval=0)
        publish(pub, f"zero{run}/kept", b"retained", retain=True, MessageExpiryInterval=0)
        got = online.receive(2)
        assert [(m.payload, m.properties.MessageExpiryInterval) for m in got] == [(b"now or never", 0), (b"retained", 0)]
        back = persistent(interop_node.port, f"zero-{run}")
        check_nothing_before_sentinel(back, pub, f"zero{run}/x")  # both were stored while it was away
        back.disconnect()
        with connected(interop_node.port, **V5) as late:
            subscribe(late, f"zero{run}/kept")
            check_nothing_before_sentinel(late, pub, f"zero{run}/kept")  # retained messages come before new traffic


def test_publish_properties_pass_through(interop_node):
    """User properties, content type, payload format, response topic and correlation data (request/response)."""
    run = run_id()
    with connected(interop_node.port, **V5) as responder, connected(interop_node.port, **V5) as requester:
        subscribe(responder, f"req{run}")
        subscribe(requester, f"resp{run}")
        publish(requester, f"req{run}", "ask ✓".encode(), UserProperty=[("a", "1"), ("a", "2"), ("b", "3")],
                ContentType="text/plain", PayloadFormatIndicator=1, ResponseTopic=f"resp{run}",
                CorrelationData=b"\x00id-42")
        (request,) = responder.receive(1)
        props = request.properties
        assert props.UserProperty == [("a", "1"), ("a", "2"), ("b", "3")]  # order and repeats kept
        assert (props.ContentType, props.PayloadFormatIndicator) == ("text/plain", 1)
        assert (props.ResponseTopic, props.CorrelationData) == (f"resp{run}", b"\x00id-42")
        publish(responder, props.ResponseTopic, b"answer", CorrelationData=props.CorrelationData)
        (response,) = requester.receive(1)
        assert (response.payload, response.properties.CorrelationData) == (b"answer", b"\x00id-42")


def test_subscription_options_no_local_and_retain_as_published(interop_node):
    run = run_id()
    with connected(interop_node.port, **V5) as client, connected(interop_node.port, **V5) as other:
        subscribe(client, f"opts{run}/local", noLocal=True)
        subscribe(other, f"opts{run}/kept", retainAsPublished=True)
        subscribe(other, f"opts{run}/cleared")
        publish(client, f"opts{run}/local", b"own")  # not sent back to its publisher
        publish(client, f"opts{run}/kept", b"r", retain=True)
        publish(client, f"opts{run}/cleared", b"r", retain=True)
        got = {m.topic: m.retain for m in other.receive(2)}
        assert got == {f"opts{run}/kept": True, f"opts{run}/cleared": False}
        check_nothing_before_sentinel(client, other, f"opts{run}/local")


def test_subscription_identifiers(interop_node):
    run = run_id()
    with connected(interop_node.port, **V5) as sub, connected(interop_node.port, **V5) as pub:
        subscribe(sub, f"sid{run}/+", sub_id=2)
        subscribe(sub, f"sid{run}/#", sub_id=3)
        subscribe(sub, f"sid{run}/x/#")  # no identifier
        publish(pub, f"sid{run}/x", b"m")
        got = sub.receive(3)
        ids = sorted(getattr(m.properties, "SubscriptionIdentifier", [0]) for m in got)
        assert ids == [[0], [2], [3]]  # each delivery names its own subscription


def test_maximum_packet_size_of_the_client(interop_node):
    run = run_id()
    sub = Client(interop_node.port, **V5)
    sub.connect(properties=properties(PacketTypes.CONNECT, MaximumPacketSize=256))
    try:
        subscribe(sub, f"mps{run}/#")
        with connected(interop_node.port, **V5) as pub:
            publish(pub, f"mps{run}/big", b"x" * 1000)  # too big for that client: never sent to it
            publish(pub, f"mps{run}/small", b"ok")
        (msg,) = sub.receive(1)
        assert msg.topic == f"mps{run}/small"
        check_nothing_before_sentinel(sub, sub, f"mps{run}/x")
    finally:
        sub.disconnect()


def test_maximum_packet_size_of_the_server(interop_node):
    with raw_client(interop_node.port, MQTT_5) as client:
        connack = client.connect(f"big-{run_id()}")
        limit = connack.properties.maximum_packet_size
        assert limit is not None
        length = limit + 1
        header = bytearray([0x30])
        while True:  # the remaining length as a variable byte integer
            byte, length = length % 128, length // 128
            header.append(byte | (0x80 if length else 0))
            if not length:
                break
        client.sock.sendall(bytes(header) + b"\x00\x01t")  # the header alone announces too much
        disconnect = client.receive()
        assert disconnect.reason_code is ReasonCode.PACKET_TOO_LARGE
        assert "exceeds the maximum" in disconnect.properties.reason_string
        assert recv_until_closed(client.sock) == b""


@pytest.mark.parametrize("max_packet", [None, 16], ids=["explained", "too-small-for-a-reason-string"])
def test_session_expiry_set_at_disconnect_after_zero_is_a_protocol_error_with_a_reason_string(interop_node,
                                                                                            max_packet):
    with raw_client(interop_node.port, MQTT_5) as client:
        client.connect(f"sexp-{run_id()}", properties=Properties(maximum_packet_size=max_packet))  # expiry 0
        client.send(Disconnect(properties=Properties(session_expiry_interval=60)))
        disconnect = client.receive()
        assert disconnect.reason_code is ReasonCode.PROTOCOL_ERROR
        if max_packet is None:
            assert "MQTT-3.14.2-2" in disconnect.properties.reason_string
        else:
            assert disconnect.properties.reason_string is None  # it would exceed the client's maximum
        assert recv_until_closed(client.sock) == b""


def test_session_expiry_lowered_at_disconnect_keeps_the_session(interop_node):
    run = run_id()
    client = Client(interop_node.port, f"lower-{run}", clean=False, **V5)
    client.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=3600))
    subscribe(client, f"lower{run}/#")
    client.paho.disconnect(properties=properties(PacketTypes.DISCONNECT, SessionExpiryInterval=30))
    client.disconnects.get(timeout=WAIT_S)
    client.paho.loop_stop()
    with connected(interop_node.port, **V5) as pub:
        publish(pub, f"lower{run}/x", b"kept")
    again = Client(interop_node.port, f"lower-{run}", clean=False, **V5)
    assert again.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=30)).session_present
    (msg,) = again.receive(1)
    assert msg.payload == b"kept"
    again.disconnect()


@pytest.mark.slow
def test_will_delay(interop_node):
    run = run_id()
    with connected(interop_node.port, **V5) as watcher:
        subscribe(watcher, f"wd{run}/#")
        for name, resume in (("resumed", True), ("delayed", False)):
            with raw_client(interop_node.port, MQTT_5) as dying:
                dying.connect(f"wd-{name}-{run}", clean=True, will_topic=f"wd{run}/{name}", will_payload=b"late",
                              will_qos=1, will_properties=Properties(will_delay_interval=2),
                              properties=Properties(session_expiry_interval=60))
            if resume:  # back within the delay: the will is not published
                with raw_client(interop_node.port, MQTT_5) as back:
                    back.send(Connect(MQTT_5, f"wd-{name}-{run}", False,
                                      properties=Properties(session_expiry_interval=60)))
                    assert back.receive().session_present
                    back.send(Disconnect())
        started = time.monotonic()
        (will,) = watcher.receive(1)
        assert will.topic == f"wd{run}/delayed"
        assert time.monotonic() - started >= 1.0  # held back for (most of) its 2 s delay
        check_nothing_before_sentinel(watcher, watcher, f"wd{run}/x")  # the same queue as the wills


def test_receive_maximum_of_the_client_limits_what_is_in_flight(interop_node):
    run = run_id()
    with raw_client(interop_node.port, MQTT_5) as client:
        client.connect(f"rm-{run}", properties=Properties(receive_maximum=2))
        client.subscribe(f"rm{run}/#", 1)
        with connected(interop_node.port, **V5) as pub:
            for i in range(4):
                publish(pub, f"rm{run}/x", str(i).encode())
        first = [client.receive(), client.receive()]
        assert [p.payload for p in first] == [b"0", b"1"]
        # No barrier: what Receive Maximum holds back stays inside the node, and no later packet may overtake it
        # on this connection (a PINGRESP does not wait for deliveries). A fixed wait.
        client.sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            client.receive()  # the window is full until a PUBACK
        client.sock.settimeout(WAIT_S)
        client.send(Puback(first[0].packet_id))
        third = client.receive()
        assert isinstance(third, Publish) and third.payload == b"2"


@pytest.mark.slow
def test_server_keep_alive_caps_what_mqtt5_clients_ask_for(tmp_path):
    from tests.helpers.mqtt_fixtures import raw_client, running_node

    with running_node(tmp_path / "data", "--mqtt-max-keepalive", "60") as node:
        for asked, told in ((120, 60), (0, 60), (30, None)):
            with raw_client(node.port, MQTT_5) as raw:
                connack = raw.connect(f"ka-{asked}-{run_id()}", keep_alive=asked)
                assert connack.properties.server_keep_alive == told, asked
