"""Clients that pipeline QoS 1 PUBLISHes, against a `lightgate serve` process over raw sockets (issue 21, item 9).

MQTT 3.1.1 has no Receive Maximum: a client may send any number of QoS 1
PUBLISHes without waiting for their PUBACKs, and the server applies
back-pressure by reading no further, never by closing. MQTT 5 clients are
told the Receive Maximum; exceeding it is their protocol error [MQTT-3.3.4-7].
"""

import threading

import pytest

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connack, Connect, Disconnect, Puback, Publish
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import raw_client, run_id

PIPELINED = 5000
RECEIVE_MAXIMUM = 128  # the node's default mqtt.receive_maximum


def _send_in_background(sock, data: bytes) -> threading.Thread:
    """Send ``data`` from a thread: a server that stops reading must not block the test's own reads."""
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    return sender


@pytest.mark.slow
def test_a_311_client_pipelining_5000_qos1_publishes_gets_every_puback_and_loses_none(interop_node):
    run = run_id()
    topic = f"pipe{run}/x"
    with raw_client(interop_node.port) as sub, raw_client(interop_node.port) as pub:
        sub.connect(f"sub-{run}")
        sub.subscribe(topic, qos=0)
        pub.connect(f"pub-{run}")
        burst = b"".join(encode(Publish(topic, str(i).encode(), 1, packet_id=i), MQTT_311)
                         for i in range(1, PIPELINED + 1))
        sender = _send_in_background(pub.sock, burst)
        acked = []
        for _ in range(PIPELINED):
            packet = pub.receive()  # fails the test if the server closes the connection
            assert isinstance(packet, Puback), packet
            acked.append(packet.packet_id)
        sender.join()
        assert acked == list(range(1, PIPELINED + 1))  # in order, each once
        got = [sub.receive() for _ in range(PIPELINED)]
        assert [p.payload for p in got] == [str(i).encode() for i in range(1, PIPELINED + 1)]


@pytest.mark.slow
def test_an_mqtt5_client_exceeding_the_receive_maximum_is_disconnected_with_0x93(interop_node):
    """[MQTT-3.3.4-7]: the client may not send more unacknowledged QoS 1 PUBLISHes than the server's Receive
    Maximum. The burst is one write of 24 KB, which the node reads at once (one loopback segment): more than
    128 of its PUBLISHes are read before any PUBACK is sent."""
    run = run_id()
    with raw_client(interop_node.port, MQTT_5) as pub:
        connack = pub.connect(f"pub5-{run}")
        assert connack.properties.receive_maximum == RECEIVE_MAXIMUM
        burst = b"".join(encode(Publish(f"pipe5{run}", b"x", 1, packet_id=i), MQTT_5) for i in range(1, 2001))
        _send_in_background(pub.sock, burst)
        while True:
            packet = pub.receive()
            if not isinstance(packet, Puback):
                break
        assert isinstance(packet, Disconnect) and packet.reason_code is ReasonCode.RECEIVE_MAXIMUM_EXCEEDED


@pytest.mark.slow
def test_a_311_client_pipelining_its_publishes_behind_its_connect_gets_every_puback(interop_node):
    """The PUBLISHes sent before the CONNACK wait in the socket, not in a bounded queue that closes the
    connection when full: decoding stops until the session is open."""
    run = run_id()
    with raw_client(interop_node.port) as pub:
        burst = encode(Connect(MQTT_311, f"pub-{run}", True), MQTT_311) + b"".join(
            encode(Publish(f"early{run}/x", b"x", 1, packet_id=i), MQTT_311) for i in range(1, PIPELINED + 1))
        sender = _send_in_background(pub.sock, burst)
        connack = pub.receive()
        assert isinstance(connack, Connack) and not connack.reason_code.is_failure
        acked = []
        for _ in range(PIPELINED):
            packet = pub.receive()
            assert isinstance(packet, Puback), packet
            acked.append(packet.packet_id)
        sender.join()
        assert acked == list(range(1, PIPELINED + 1))


UNACKED = 400  # more than the 3.1.1 window before issue 31 (256), less than a persistent subscription's lane (512)


@pytest.mark.slow
def test_a_311_subscriber_gets_its_window_unacknowledged_in_order_and_a_resumed_session_resends_it_with_dup(
        interop_node):
    """The 3.1.1 outbound window (``mqtt.inflight_311``) lets a subscriber hold this many QoS 1 messages
    unacknowledged, in the order published [MQTT-4.6.0-6]; the persistent session resumed resends each of them
    with DUP set and the same packet id, in order [MQTT-4.4.0-1], and PUBACKs for them end the flows."""
    run = run_id()
    topic = f"win{run}/x"
    with raw_client(interop_node.port) as pub:
        pub.connect(f"pub-{run}")
        with raw_client(interop_node.port) as sub:
            sub.connect(f"sub-{run}", clean=False)
            sub.subscribe(topic, qos=1)
            pub.sock.sendall(b"".join(encode(Publish(topic, str(i).encode(), 1, packet_id=i), MQTT_311)
                                      for i in range(1, UNACKED + 1)))
            assert [pub.receive().packet_id for _ in range(UNACKED)] == list(range(1, UNACKED + 1))
            first = [sub.receive() for _ in range(UNACKED)]  # none acknowledged
        assert [p.payload for p in first] == [str(i).encode() for i in range(1, UNACKED + 1)]
        assert not any(p.dup for p in first) and len({p.packet_id for p in first}) == UNACKED
        with raw_client(interop_node.port) as sub:
            assert sub.connect(f"sub-{run}", clean=False).session_present
            again = [sub.receive() for _ in range(UNACKED)]
            assert [(p.payload, p.packet_id) for p in again] == [(p.payload, p.packet_id) for p in first]
            assert all(p.dup for p in again)
            sub.send(*(Puback(p.packet_id) for p in again))
            pub.send(Publish(topic, b"after", 1, packet_id=1))
            assert isinstance(pub.receive(), Puback)
            last = sub.receive()
            assert (last.payload, last.dup) == (b"after", False)  # nothing of the acknowledged ones again
