"""A read holding a run of QoS 0 PUBLISHes takes the connection's QoS 0 fast path (gateway/node/connection.py
``_decode``: no full pause check, no walk of the action table per message); a bad or refused PUBLISH in the middle
of the run is answered as any other, against a `lightgate serve` process over raw sockets (issue 31).

Each publisher writes its whole burst at once, so the node reads it in one read: the good messages before the bad
one reach a subscriber in order [MQTT-4.6.0-5]; the bad one closes the connection with the reason its rule gives
(MQTT 5: a DISCONNECT; 3.1.1: a close without one, [MQTT-4.8.0-1]) and nothing after it is delivered; a message
the ACL refuses is dropped and the run goes on.
"""

import pytest

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Disconnect, Pingreq, Pingresp, Publish
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import RawClient, raw_client, recv_until_closed, run_id, running_node

GOOD = 30
"""Good messages before the bad one, and as many after it."""

MAX_PACKET = 4096
"""The node's mqtt.max_packet_size in these tests."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("runs")
    acl = base / "runs.acl"
    acl.write_text("default allow\npattern\ndeny publish +/denied\n")
    with running_node(base / "data", "--auth-acl-file", str(acl), "--mqtt-max-packet-size", str(MAX_PACKET)) as node:
        yield node


def _run(topic: str, bad: bytes, level: int) -> bytes:
    """``GOOD`` QoS 0 messages to ``topic``, the ``bad`` packet, ``GOOD`` more: one write's bytes."""
    before = b"".join(encode(Publish(topic, b"b%d" % i), level) for i in range(GOOD))
    after = b"".join(encode(Publish(topic, b"a%d" % i), level) for i in range(GOOD))
    return before + bad + after


def _connect(sub: RawClient, pub: RawClient, run: str, filter: str) -> None:
    """Connect the subscriber to ``filter`` at QoS 0, then the publisher."""
    sub.connect(f"sub-{run}")
    sub.subscribe(filter, qos=0)
    pub.connect(f"pub-{run}")


def _received(sub: RawClient, count: int) -> list[bytes]:
    """The payloads of the next ``count`` PUBLISHes, then a PINGRESP: nothing else came before it."""
    got = [sub.receive() for _ in range(count)]
    assert all(isinstance(p, Publish) for p in got), got
    sub.send(Pingreq())
    assert isinstance(sub.receive(), Pingresp)
    return [p.payload for p in got]


def _qos3(topic: str) -> bytes:
    """A PUBLISH with both QoS bits set: malformed [MQTT-3.3.1-4]."""
    body = len(topic).to_bytes(2, "big") + topic.encode() + b"\x00" + b"x"
    return bytes((0x36, len(body))) + body


BAD_5 = {
    # [MQTT-3.3.2-2]: a wildcard in a topic name; a protocol error (0x90 is for well-formed names refused)
    "wildcard": (lambda t: encode(Publish(t + "/+", b"bad"), MQTT_5), ReasonCode.PROTOCOL_ERROR),
    # [MQTT-3.3.2-12]: a Topic Alias above the server's Topic Alias Maximum (64)
    "alias": (lambda t: encode(Publish(t, b"bad", properties=Properties(topic_alias=65)), MQTT_5),
              ReasonCode.TOPIC_ALIAS_INVALID),
    # [MQTT-3.3.1-4]
    "qos3": (_qos3, ReasonCode.MALFORMED_PACKET),
    # [MQTT-3.2.2-15] (the server's Maximum Packet Size): 0x95
    "too large": (lambda t: encode(Publish(t, b"x" * MAX_PACKET), MQTT_5), ReasonCode.PACKET_TOO_LARGE),
}


@pytest.mark.parametrize("kind", BAD_5)
def test_a_bad_publish_in_a_qos0_run_is_answered_after_the_good_ones_before_it(node, kind: str):
    make_bad, reason = BAD_5[kind]
    run = run_id()
    topic = f"run{run}/t"
    with raw_client(node.port, MQTT_5) as sub, raw_client(node.port, MQTT_5) as pub:
        _connect(sub, pub, run, topic)
        pub.sock.sendall(_run(topic, make_bad(topic), MQTT_5))
        answer = pub.receive()
        assert isinstance(answer, Disconnect) and answer.reason_code == reason, answer
        assert recv_until_closed(pub.sock) == b""
        assert _received(sub, GOOD) == [b"b%d" % i for i in range(GOOD)]


def test_a_bad_publish_in_a_qos0_run_closes_a_311_connection_after_the_good_ones_before_it(node):
    run = run_id()
    topic = f"run{run}/t"
    with raw_client(node.port, MQTT_311) as sub, raw_client(node.port, MQTT_311) as pub:
        _connect(sub, pub, run, topic)
        # [MQTT-3.3.2-2] then [MQTT-4.8.0-1]: 3.1.1 has no DISCONNECT from the server, the connection is closed
        pub.sock.sendall(_run(topic, encode(Publish(topic + "/#", b"bad"), MQTT_311), MQTT_311))
        assert recv_until_closed(pub.sock) == b""
        assert _received(sub, GOOD) == [b"b%d" % i for i in range(GOOD)]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_denied_publish_in_a_qos0_run_is_dropped_and_the_run_goes_on(node, level: int):
    run = run_id()
    topic = f"run{run}/t"
    with raw_client(node.port, level) as sub, raw_client(node.port, level) as pub:
        _connect(sub, pub, run, f"run{run}/#")
        # a QoS 0 message the ACL refuses is dropped: no acknowledgement to refuse it in, no disconnect
        pub.sock.sendall(_run(topic, encode(Publish(f"run{run}/denied", b"bad"), level), level))
        assert _received(sub, 2 * GOOD) == [b"b%d" % i for i in range(GOOD)] + [b"a%d" % i for i in range(GOOD)]
        pub.send(Pingreq())
        assert isinstance(pub.receive(), Pingresp)  # still connected, nothing sent before the PINGRESP


@pytest.fixture(scope="module")
def small_records(tmp_path_factory: pytest.TempPathFactory):
    """A node whose CommitLog records are smaller than the packets it accepts."""
    with running_node(tmp_path_factory.mktemp("records") / "data", "--mqtt-max-packet-size", str(MAX_PACKET),
                      "--commitlog-max-record-bytes", "2048") as node:
        yield node


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_qos0_message_the_store_refuses_in_a_run_drops_alone(small_records, level: int):
    """A read's QoS 0 PUBLISHes to one topic are one append (a ``PayloadRun``): one the store cannot take (a record
    over ``commitlog.max_record_bytes``, within the packet size) must not take the others with it."""
    run = run_id()
    topic = f"run{run}/t"
    with raw_client(small_records.port, level) as sub, raw_client(small_records.port, level) as pub:
        _connect(sub, pub, run, topic)
        pub.sock.sendall(_run(topic, encode(Publish(topic, b"x" * 3000), level), level))
        assert _received(sub, 2 * GOOD) == [b"b%d" % i for i in range(GOOD)] + [b"a%d" % i for i in range(GOOD)]
        pub.send(Pingreq())
        assert isinstance(pub.receive(), Pingresp)
