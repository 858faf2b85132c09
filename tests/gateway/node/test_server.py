"""`lightgate serve` end to end: real paho-mqtt clients and raw sockets against a node in a subprocess."""

import queue
import socket
import struct
import uuid

import paho.mqtt.client as mqtt
import pytest

from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connect_packet, connected, check_nothing_before_sentinel, kill, recv_until_closed, running_node,
)
from tests.helpers.derived import control_sizes


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_reaches_wildcard_subscribers(interop_node, protocol, qos):
    run = uuid.uuid4().hex[:6]
    port = interop_node.port
    with connected(port, protocol=protocol) as plus, connected(port, protocol=protocol) as hash_, \
            connected(port, protocol=protocol) as pub:
        assert [int(getattr(rc, "value", rc)) for rc in plus.subscribe(f"tele{run}/+/temp", 2)] == [2]
        hash_.subscribe(f"tele{run}/#", qos)
        for i in range(5):
            pub.publish(f"tele{run}/dev{i}/temp", f"t{i}".encode(), qos)
        pub.publish(f"tele{run}/dev0/humidity", b"h", qos)
        got_plus = plus.receive(5)
        got_hash = hash_.receive(6)
        assert [(m.topic, m.payload) for m in got_plus] == [(f"tele{run}/dev{i}/temp", f"t{i}".encode())
                                                             for i in range(5)]
        expected = {f"tele{run}/dev{i}/temp" for i in range(5)} | {f"tele{run}/dev0/humidity"}
        assert {m.topic for m in got_hash} == expected
        assert all(m.qos == qos for m in got_plus)  # granted QoS 2: delivered at the publish QoS
        assert plus.messages.empty()


@pytest.mark.slow
def test_ping_and_keepalive_close(interop_node):
    with connected(interop_node.port, keepalive=1) as quiet:
        # paho sends PINGREQs while idle: the connection outlives several keep alive periods
        with pytest.raises(queue.Empty):
            quiet.disconnects.get(timeout=3.5)
        assert quiet.paho.is_connected()
    with socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S) as raw:
        # CONNECT 3.1.1, keep alive 1 s, then silence: the server must close within 1.5 s (+ slack)
        raw.sendall(connect_packet("silent-" + uuid.uuid4().hex[:6], keepalive=1))
        assert raw.recv(4) == b"\x20\x02\x00\x00"  # CONNACK accepted
        assert recv_until_closed(raw) == b""


def test_no_connect_within_the_timeout_is_closed(interop_node):
    with socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S) as raw:
        assert recv_until_closed(raw) == b""  # the fixture's node runs with --mqtt-connect-timeout-s 2
    interop_node.wait_log(lambda doc: "no CONNECT within" in doc.get("msg", ""))


def test_malformed_bytes_close_that_client_only(interop_node):
    run = uuid.uuid4().hex[:6]
    with connected(interop_node.port) as sub, connected(interop_node.port) as pub:
        sub.subscribe(f"m{run}/#")
        with socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S) as raw:
            raw.sendall(connect_packet("bad-" + run))
            assert raw.recv(4) == b"\x20\x02\x00\x00"
            raw.sendall(b"\x3f\xff\xff\xff\xff\x00garbage")  # PUBLISH with QoS 3 and a 5-byte length
            assert recv_until_closed(raw) == b""
        with socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S) as raw:
            raw.sendall(b"\x10\x03\x00\x01Z")  # a CONNECT that is cut short and nonsense
            raw.sendall(b"\xff" * 16)
            assert recv_until_closed(raw) == b""
        pub.publish(f"m{run}/ok", b"still here", 1)
        (msg,) = sub.receive(1)
        assert msg.payload == b"still here"
    interop_node.wait_log(lambda doc: f"bad-{run}" in doc.get("msg", "") and "protocol error" in doc.get("msg", ""))


def test_a_message_the_store_refuses_gets_a_failing_puback_not_a_false_ack(interop_node):
    run = uuid.uuid4().hex[:6]
    with connected(interop_node.port) as sub, connected(interop_node.port, protocol=mqtt.MQTTv5) as pub:
        sub.subscribe(f"big{run}/#")
        acks: queue.Queue = queue.Queue()
        pub.paho.on_publish = lambda c, u, mid, rc, props: acks.put((mid, rc))
        too_big = pub.paho.publish(f"big{run}/x", b"x" * (1024 * 1024), 1)  # a record over commitlog.max_record_bytes
        mid, rc = acks.get(timeout=WAIT_S)
        assert mid == too_big.mid and rc.is_failure
        pub.publish(f"big{run}/x", b"small", 1)  # the connection carries on
        (msg,) = sub.receive(1)
        assert msg.payload == b"small"


@pytest.mark.slow
def test_a_backlog_bigger_than_the_pull_batches_is_delivered_whole_without_further_traffic(interop_node):
    """Every pull the deliveries lead to is served, also the one a write at the end of a read queues."""
    run = uuid.uuid4().hex[:6]
    count = 3000  # a dozen pull batches of 256, each emptied by the subscriber's PUBACKs
    sub = Client(interop_node.port, f"b-{run}", clean=False)
    sub.connect()
    sub.subscribe(f"b{run}/#", 0)  # QoS 0: the node sends on as its writes complete, not on PUBACKs
    sub.disconnect()
    with connected(interop_node.port) as pub:
        for i in range(count):
            pub.paho.publish(f"b{run}/x", str(i).encode(), 1)
        pub.publish(f"b{run}/x", b"last", 1)  # waits for its PUBACK: the ones before were acknowledged first
    again = Client(interop_node.port, f"b-{run}", clean=False)
    assert again.connect().session_present
    try:
        got = again.receive(count + 1)  # nothing else happens on the node meanwhile
        assert [m.payload for m in got] == [str(i).encode() for i in range(count)] + [b"last"]
    finally:
        again.disconnect()


def test_persistent_session_gets_what_was_published_while_offline(interop_node):
    run = uuid.uuid4().hex[:6]
    sub = Client(interop_node.port, f"p-{run}", clean=False)
    assert not sub.connect().session_present
    sub.subscribe(f"p{run}/+/v", 1)
    with connected(interop_node.port) as pub:
        pub.publish(f"p{run}/a/v", b"online", 1)
        (first,) = sub.receive(1)
        assert first.payload == b"online"
        sub.disconnect()
        for i in range(3):
            pub.publish(f"p{run}/a/v", f"offline{i}".encode(), 1)
    again = Client(interop_node.port, f"p-{run}", clean=False)
    flags = again.connect()
    assert flags.session_present
    got = again.receive(3)
    assert [m.payload for m in got] == [b"offline0", b"offline1", b"offline2"]
    check_nothing_before_sentinel(again, again, f"p{run}/a/v")  # nothing acknowledged before the disconnect comes again
    again.disconnect()


@pytest.mark.slow
def test_persistent_session_survives_a_node_restart(tmp_path):
    run = uuid.uuid4().hex[:6]
    with running_node(tmp_path / "data") as first:
        sub = Client(first.port, f"r-{run}", protocol=mqtt.MQTTv5, clean=False)
        sub.paho.connect("127.0.0.1", first.port, clean_start=False,
                         properties=_expiry(3600))
        sub.paho.loop_start()
        sub.connacks.get(timeout=WAIT_S)
        sub.subscribe(f"r{run}/#", 1)
        sub.disconnect()
        with connected(first.port) as pub:
            pub.publish(f"r{run}/x", b"kept", 1)
    with running_node(tmp_path / "data") as second:
        again = Client(second.port, f"r-{run}", protocol=mqtt.MQTTv5, clean=False)
        again.paho.connect("127.0.0.1", second.port, clean_start=False, properties=_expiry(3600))
        again.paho.loop_start()
        flags, rc = again.connacks.get(timeout=WAIT_S)
        assert flags.session_present and not rc.is_failure
        (msg,) = again.receive(1)
        assert msg.payload == b"kept"
        again.disconnect()


@pytest.mark.slow
def test_a_session_that_pipelined_its_subscribes_has_every_filter_matching_and_after_a_restart(tmp_path):
    # Issue 31: the saves of a session pipelining SUBSCRIBEs are merged (one blob for many); none may be left out.
    # [MQTT-3.1.2-4/5]: a session resumed with clean session 0 keeps its subscriptions, across a node restart too.
    run = uuid.uuid4().hex[:6]
    filters = [f"p{run}/{n}" if n % 2 else f"p{run}/+/{n}" for n in range(300)]
    topics = [f"p{run}/{n}" if n % 2 else f"p{run}/x/{n}" for n in range(300)]

    def every_filter_matches(port: int, sub: Client) -> None:
        with connected(port) as pub:
            for n, topic in enumerate(topics):
                pub.publish(topic, b"%d" % n, 1)
        assert sorted(int(m.payload) for m in sub.receive(len(topics))) == list(range(len(topics)))

    with running_node(tmp_path / "data") as first:
        sub = Client(first.port, f"p-{run}", clean=False)
        sub.connect()
        for topic_filter in filters:  # one SUBSCRIBE each, none waiting for the SUBACK of the one before
            sub.paho.subscribe(topic_filter, 1)
        assert [sub.subacks.get(timeout=WAIT_S) for _ in filters] and sub.subacks.empty()
        every_filter_matches(first.port, sub)
        sub.disconnect()
    with running_node(tmp_path / "data") as second:
        again = Client(second.port, f"p-{run}", clean=False)
        assert again.connect().session_present
        every_filter_matches(second.port, again)
        again.disconnect()


@pytest.mark.slow
def test_a_session_killed_after_its_acks_resumes_every_subscription_it_was_sent_a_suback_for(tmp_path):
    # Issue 31: a SUBSCRIBE stores its own filters (a session_patched record), not the whole session again, so the
    # session records grow with the filters, not with their square; and a SUBACK goes once what it
    # acknowledges is stored (an UNSUBSCRIBE's, stored in order, before the SUBACK after it), so a node killed
    # (SIGKILL) right after it resumes exactly that: [MQTT-3.8.4-3] the subscriptions exist once SUBACKed, a
    # re-SUBSCRIBE's options replace the old ones [MQTT-3.8.4-3], an UNSUBSCRIBEd filter is gone [MQTT-3.10.4-1],
    # and the session is present [MQTT-3.1.2-4/5].
    run = uuid.uuid4().hex[:6]
    count = 200
    filters = [f"k{run}/{n}" if n % 2 else f"k{run}/+/{n}" for n in range(count)]
    topics = [f"k{run}/{n}" if n % 2 else f"k{run}/x/{n}" for n in range(count)]
    with running_node(tmp_path / "data") as first:
        sub = Client(first.port, f"k-{run}", clean=False)
        sub.connect()
        for topic_filter in filters:  # one SUBSCRIBE each, after the SUBACK of the one before
            sub.subscribe(topic_filter, 1)
        sub.paho.unsubscribe(filters[1])
        sub.unsubacks.get(timeout=WAIT_S)
        sub.subscribe(filters[0], 0)  # options replaced: QoS 0 from now on; stored after the UNSUBSCRIBE
        kill(first)
    sizes = control_sizes(tmp_path / "data")
    session_bytes = sum(size for kind, size in sizes if kind in ("session_saved", "session_patched"))
    assert session_bytes < count * 256, sizes  # one subscription's bytes each, not every one held
    with running_node(tmp_path / "data") as second:
        again = Client(second.port, f"k-{run}", clean=False)
        assert again.connect().session_present
        with connected(second.port) as pub:
            for n, topic in enumerate(topics):
                pub.publish(topic, b"%d" % n, 1)
            got = {int(m.payload): m.qos for m in again.receive(count - 1)}
            assert sorted(got) == [0, *range(2, count)] and got[0] == 0 and got[2] == 1
            check_nothing_before_sentinel(again, pub, topics[3])
        again.disconnect()


@pytest.mark.slow
def test_will_on_abnormal_close_only(interop_node):
    run = uuid.uuid4().hex[:6]
    with connected(interop_node.port) as watcher:
        watcher.subscribe(f"w{run}/#", 1)
        polite = Client(interop_node.port, will=(f"w{run}/polite", b"gone", 1))
        polite.connect()
        polite.disconnect()
        rude = socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S)
        rude.sendall(connect_packet("rude-" + run, will=(f"w{run}/rude", b"died")))
        assert rude.recv(4) == b"\x20\x02\x00\x00"
        rude.close()  # no DISCONNECT: the will goes
        (msg,) = watcher.receive(1)
        assert (msg.topic, msg.payload) == (f"w{run}/rude", b"died")
        reset = socket.create_connection(("127.0.0.1", interop_node.port), timeout=WAIT_S)
        reset.sendall(connect_packet("reset-" + run, will=(f"w{run}/reset", b"cut")))
        assert reset.recv(4) == b"\x20\x02\x00\x00"
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()  # an RST: the node's read fails (ECONNRESET), and the will goes
        (msg,) = watcher.receive(1)
        assert (msg.topic, msg.payload) == (f"w{run}/reset", b"cut")
        check_nothing_before_sentinel(watcher, watcher, f"w{run}/x")  # each will went once


def test_takeover_closes_the_old_connection(interop_node):
    run = uuid.uuid4().hex[:6]
    old = Client(interop_node.port, f"t-{run}")
    old.connect()
    with connected(interop_node.port, client_id=f"t-{run}") as new:
        old.disconnects.get(timeout=WAIT_S)  # raises queue.Empty if the old connection stays open
        assert not old.paho.is_connected() and new.paho.is_connected()
    old.paho.loop_stop()


# --- raw packet helpers -----------------------------------------------------------------


def _expiry(seconds: int):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = seconds
    return props


