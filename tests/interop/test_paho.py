"""The Eclipse Paho interoperability cases (client_test.py) with paho-mqtt 2.x, over MQTT 3.1.1 and 5.0.

Each case is the Paho suite's, with LightGate's answers where the suite allows
several (overlapping subscriptions: one message per matching subscription).
Retained-message cases live with the retained-message work.
"""

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.packets import MQTT_5, MQTT_311, Connect, Subscribe, SubscriptionOptions
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connected, check_nothing_before_sentinel, properties, quiet, raw_client, recv_until_closed, run_id,
    wait_until,
)

PROTOCOLS = pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["3.1.1", "5.0"])


def topics(run: str) -> tuple[list[str], list[str]]:
    """The suite's topic names and wildcard filters, under a per-test prefix."""
    names = [f"TopicA{run}", f"TopicA{run}/B", f"TopicA{run}/C", f"TopicA{run}/B/C", f"/TopicA{run}"]
    filters = [f"TopicA{run}/+", f"+{run}/C", "#", "/#", "/+", "+/+", f"TopicA{run}/C"]
    return names, filters


def persistent(port: int, client_id: str, protocol: int) -> Client:
    """A connected client whose session outlives the connection (clean session 0 / session expiry 1 h)."""
    client = Client(port, client_id, protocol=protocol, clean=False)
    kwargs = {"properties": properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)} \
        if protocol == mqtt.MQTTv5 else {}
    client.connect(**kwargs)
    return client


def codes(reason_codes) -> list[int]:
    return [int(getattr(rc, "value", rc)) for rc in reason_codes]


@PROTOCOLS
def test_basic(interop_node, protocol):
    names, _ = topics(run_id())
    with connected(interop_node.port, protocol=protocol) as client:
        assert codes(client.subscribe(names[0], 2)) == [2]
        for qos in (0, 1, 2):
            client.publish(names[0], f"qos {qos}".encode(), qos)
        got = client.receive(3)
        assert sorted((m.payload, m.qos) for m in got) == [(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)]


@PROTOCOLS
def test_offline_message_queueing(interop_node, protocol):
    run = run_id()
    names, _ = topics(run)
    sub = persistent(interop_node.port, f"offline-{run}", protocol)
    sub.subscribe(f"TopicA{run}/#", 2)
    sub.disconnect()
    with connected(interop_node.port, protocol=protocol) as pub:
        for qos, name in zip((0, 1, 2), names[1:4]):
            pub.publish(name, f"qos {qos}".encode(), qos)
    again = persistent(interop_node.port, f"offline-{run}", protocol)
    got = again.receive(2)
    # QoS 0 messages of an offline persistent session are kept too (the suite accepts 2 or 3): expect all 3.
    got += again.receive(1)
    assert sorted(m.payload for m in got) == [b"qos 0", b"qos 1", b"qos 2"]
    again.disconnect()


@PROTOCOLS
def test_will_message(interop_node, protocol):
    run = run_id()
    names, _ = topics(run)
    with connected(interop_node.port, protocol=protocol) as watcher:
        watcher.subscribe(names[2], 2)
        with raw_client(interop_node.port, MQTT_5 if protocol == mqtt.MQTTv5 else MQTT_311) as dying:
            dying.connect(f"will-{run}", keep_alive=2, will_topic=names[2], will_payload=b"client not disconnected",
                          will_qos=1)
        (will,) = watcher.receive(1)
        assert (will.topic, will.payload, will.qos) == (names[2], b"client not disconnected", 1)


@PROTOCOLS
def test_overlapping_subscriptions(interop_node, protocol):
    run = run_id()
    names, filters = topics(run)
    with connected(interop_node.port, protocol=protocol) as client:
        client.subscribe(filters[6], 2)
        client.subscribe(filters[0], 1)
        client.publish(names[2], b"overlapping topic filters", 2)
        got = client.receive(2)  # one per matching subscription, each at min(granted, published)
        assert sorted(m.qos for m in got) == [1, 2]
        assert {m.payload for m in got} == {b"overlapping topic filters"}
        check_nothing_before_sentinel(client, client, names[2], copies=2)


@pytest.mark.slow
@PROTOCOLS
def test_keepalive(interop_node, protocol):
    run = run_id()
    names, _ = topics(run)
    with connected(interop_node.port, protocol=protocol) as watcher:
        watcher.subscribe(names[4], 2)
        with raw_client(interop_node.port, MQTT_5 if protocol == mqtt.MQTTv5 else MQTT_311) as silent:
            silent.connect(f"keepalive-{run}", keep_alive=2, will_topic=names[4], will_payload=b"keepalive expiry",
                           will_qos=1)
            (will,) = watcher.receive(1)  # no PINGREQ within 1.5 x 2 s: the server closes and publishes the will
            assert will.payload == b"keepalive expiry"
            assert recv_until_closed(silent.sock) in (b"", b"\xe0\x01\x8d")  # 5.0: DISCONNECT Keep Alive timeout


@PROTOCOLS
def test_redelivery_on_reconnect(interop_node, protocol):
    run = run_id()
    names, filters = topics(run)
    level = MQTT_5 if protocol == mqtt.MQTTv5 else MQTT_311
    expiry = {"properties": properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)} \
        if protocol == mqtt.MQTTv5 else {}
    with raw_client(interop_node.port, level) as paused:  # receives, never acknowledges
        paused.connect(f"redeliver-{run}", clean=False,
                       properties=Properties(session_expiry_interval=3600) if level == MQTT_5 else Properties())
        paused.subscribe(filters[6], 2)
        with connected(interop_node.port, protocol=protocol) as pub:
            pub.publish(names[2], b"qos 1", 1)
            pub.publish(names[2], b"qos 2", 2)
        first = [paused.receive(), paused.receive()]
        assert sorted((p.payload, p.qos, p.dup) for p in first) == [(b"qos 1", 1, False), (b"qos 2", 2, False)]
    again = Client(interop_node.port, f"redeliver-{run}", protocol=protocol, clean=False)
    assert again.connect(**expiry).session_present
    got = again.receive(2)
    assert sorted((m.payload, m.qos, m.dup) for m in got) == [(b"qos 1", 1, True), (b"qos 2", 2, True)]
    check_nothing_before_sentinel(again, again, names[2])
    again.disconnect()


@PROTOCOLS
def test_zero_length_clientid(interop_node, protocol):
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="", protocol=protocol,
                         **({"clean_session": True} if protocol != mqtt.MQTTv5 else {}))
    connacks = []
    client.on_connect = lambda c, u, flags, rc, props: connacks.append((rc, props))
    client.connect("127.0.0.1", interop_node.port)
    client.loop_start()
    try:
        wait_until(lambda: connacks, what="CONNACK")
        rc, props = connacks[0]
        assert not rc.is_failure
        if protocol == mqtt.MQTTv5:
            assert props.AssignedClientIdentifier.startswith("lightgate-")
    finally:
        client.disconnect()
        client.loop_stop()


def test_zero_length_clientid_without_clean_session_is_refused_in_311(interop_node):
    with raw_client(interop_node.port) as raw:
        raw.send(Connect(MQTT_311, "", clean_start=False))
        connack = raw.receive()
        assert connack.reason_code is ReasonCode.CLIENT_IDENTIFIER_NOT_VALID  # return code 2 [MQTT-3.1.3-9]
        assert recv_until_closed(raw.sock) == b""


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_subscribe_with_a_malformed_filter_closes_the_connection(interop_node, level):
    """paho refuses to send a malformed filter, so a raw client does. '#' not last [MQTT-4.7.1-2] is a protocol
    violation, not a refused subscription: the server closes (3.1.1 [MQTT-4.8.0-1]; 5.0: DISCONNECT 0x82 [4.13.1]).
    The suite's own subscribe failure (an ACL-refused filter) is in tests/interop/test_conformance.py."""
    run = run_id()
    with raw_client(interop_node.port, level) as client:
        client.connect(f"subfail-{run}")
        client.send(Subscribe(7, ((f"fail{run}/#/x", SubscriptionOptions(1)), (f"fail{run}/ok", SubscriptionOptions(1)))))
        if level == MQTT_5:
            assert client.receive().reason_code is ReasonCode.PROTOCOL_ERROR
        assert recv_until_closed(client.sock) == b""


@PROTOCOLS
def test_dollar_topics(interop_node, protocol):
    run = run_id()
    with connected(interop_node.port, protocol=protocol) as client:
        client.subscribe("+/+", 2)
        client.subscribe("#", 2)
        client.subscribe(f"$dollar{run}/#", 2)
        client.publish(f"$dollar{run}/x", b"", 1)
        (msg,) = client.receive(1)  # only through the filter that names the $ level
        assert msg.topic == f"$dollar{run}/x"
        check_nothing_before_sentinel(client, client, f"sentinel{run}/x", copies=2)  # `+/+` and `#`: no `$` one in them


@PROTOCOLS
def test_unsubscribe(interop_node, protocol):
    names, _ = topics(run_id())
    with connected(interop_node.port, protocol=protocol) as client:
        for name in names[1:4]:
            client.subscribe(name, 2)
        for name in (names[1], names[2]):
            rc, mid = client.paho.unsubscribe(name)
            assert rc == mqtt.MQTT_ERR_SUCCESS
            assert client.unsubacks.get(timeout=WAIT_S) == mid  # unsubscribed only once UNSUBACK arrives
        with connected(interop_node.port, protocol=protocol) as pub:
            for name in names[1:4]:
                pub.publish(name, b"", 1)
        (msg,) = client.receive(1)
        assert msg.topic == names[3]
        # No barrier: an unsubscribed filter has no queue left that a sentinel could follow. A fixed wait.
        quiet(client.messages)

