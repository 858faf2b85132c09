"""The cases of the Eclipse Paho MQTT interoperability suites (client_test.py, client_test5.py), run as issue 21
says they will be: against `lightgate serve --mqtt-max-keepalive 60` with an ACL that refuses exactly
`test/nosubscribe`.

The suites themselves are not installable here (paho.mqtt.testing is on neither PyPI nor Debian), so this
module is their equivalent: each test is one of their cases with the specification clause it checks, with
paho-mqtt as the client and raw packets where a case needs to see exact packets. Where the specification
lets the server choose (overlapping subscriptions: one message per subscription or one in all; QoS 0 queued
for an offline session or not) the test accepts each allowed answer LightGate could give and says which.
"""

import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    Pubrec,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connected, check_nothing_before_sentinel, properties, publish5, quiet, raw_client, recv_until_closed,
    run_id, running_node, subscribe5, wait_until,
)

V311, V5 = mqtt.MQTTv311, mqtt.MQTTv5
BOTH = pytest.mark.parametrize("protocol", [V311, V5], ids=["3.1.1", "5.0"])

NOSUBSCRIBE = "test/nosubscribe"
SUITE_ACL = f"default allow\npattern\ndeny subscribe {NOSUBSCRIBE}\n"
"""The suites' broker set-up: everything allowed, but subscribing to their `nosubscribe_topics`."""

MAX_KEEPALIVE = 60
"""The suites' broker caps the keep alive at 60 s (`test_server_keep_alive` expects Server Keep Alive 60)."""


@pytest.fixture(scope="module")
def suite_node(tmp_path_factory):
    """The node as the interoperability suites run it; it must stop cleanly and log no error."""
    base = tmp_path_factory.mktemp("suite")
    acl = base / "suite.acl"
    acl.write_text(SUITE_ACL)
    with running_node(base / "data", "--mqtt-max-keepalive", str(MAX_KEEPALIVE), "--auth-acl-file", str(acl),
                      "--mqtt-connect-timeout-s", "2") as node:
        yield node
    assert node.proc.returncode == 0
    assert not node.errors(), node.errors()


def level_of(protocol: int) -> int:
    return MQTT_5 if protocol == V5 else MQTT_311


def session(port: int, client_id: str, protocol: int, clean: bool = False, expiry: int = 3600) -> Client:
    """A connected paho client; with clean=False its session outlives the connection (5.0: for `expiry` s)."""
    client = Client(port, client_id, protocol=protocol, clean=clean)
    props = properties(PacketTypes.CONNECT, SessionExpiryInterval=expiry) if protocol == V5 and not clean else None
    client.connect(**({"properties": props} if props else {}))
    return client


def granted(rcs) -> list[int]:
    return [int(getattr(rc, "value", rc)) for rc in rcs]


def barrier(client: Client, topic: str) -> None:
    """Publish a sentinel to `topic` (one subscription of the client matches it) and wait for it: what that
    subscription had to send before it (its retained messages, earlier messages) has been sent."""
    client.publish(topic, b"sentinel", 1)
    (msg,) = client.receive(1)
    assert msg.payload == b"sentinel", (msg.topic, msg.payload)


# ---------------------------------------------------------------------------------------------- client_test.py


@BOTH
def test_basic_qos_0_1_2_round_trip(suite_node, protocol):
    """Each QoS is delivered at the QoS of the publication [MQTT-3.8.4-8] (granted 2, so the publisher's)."""
    topic = f"conf{run_id()}/basic"
    with connected(suite_node.port, protocol=protocol) as client:
        assert granted(client.subscribe(topic, 2)) == [2]
        for qos in (0, 1, 2):
            client.publish(topic, f"qos {qos}".encode(), qos)
        assert sorted((m.payload, m.qos) for m in client.receive(3)) == [(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)]


@BOTH
def test_retained_messages_are_sent_to_new_subscribers_and_cleared_by_an_empty_one(suite_node, protocol):
    """[MQTT-3.3.1-5] stored, [MQTT-3.3.1-6] sent on SUBSCRIBE with RETAIN 1 [MQTT-3.3.1-8], a zero-byte
    retained PUBLISH removes it [MQTT-3.3.1-10] and is itself not stored [MQTT-3.3.1-11]."""
    run = run_id()
    names = [f"ret{run}/{leaf}" for leaf in ("q0", "q1", "q2")]
    with connected(suite_node.port, protocol=protocol) as pub:
        for qos, name in enumerate(names):
            pub.publish(name, b"retained", qos, retain=True)
    with connected(suite_node.port, protocol=protocol) as sub:
        sub.subscribe(f"ret{run}/+", 2)
        got = sub.receive(3)
        assert sorted((m.topic, m.qos, m.retain) for m in got) == [(n, q, True) for q, n in enumerate(names)]
    with connected(suite_node.port, protocol=protocol) as pub:
        for qos, name in enumerate(names):
            pub.publish(name, b"", qos, retain=True)
    with connected(suite_node.port, protocol=protocol) as sub:
        sub.subscribe(f"ret{run}/+", 2)
        barrier(sub, f"ret{run}/sentinel")  # no retained message came before it


@BOTH
def test_will_message_is_published_when_the_connection_drops(suite_node, protocol):
    """[MQTT-3.1.2-8]: the will is published when the network connection closes without DISCONNECT."""
    run = run_id()
    with connected(suite_node.port, protocol=protocol) as watcher:
        watcher.subscribe(f"will{run}/#", 2)
        with raw_client(suite_node.port, level_of(protocol)) as dying:
            dying.connect(f"will-{run}", will_topic=f"will{run}/gone", will_payload=b"client not disconnected",
                          will_qos=2)
        (will,) = watcher.receive(1)
        assert (will.topic, will.payload, will.qos) == (f"will{run}/gone", b"client not disconnected", 2)


def test_zero_length_client_id_311(suite_node):
    """[MQTT-3.1.3-6] a zero-byte id with Clean Session 1 is given a unique id; with Clean Session 0 it is
    refused with return code 2 [MQTT-3.1.3-8] and the connection closed."""
    with raw_client(suite_node.port) as ok:
        assert ok.connect("").reason_code is ReasonCode.SUCCESS
    with raw_client(suite_node.port) as refused:
        refused.send(Connect(MQTT_311, "", clean_start=False))
        assert refused.receive().reason_code is ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
        assert recv_until_closed(refused.sock) == b""


@pytest.mark.parametrize("clean", [True, False], ids=["clean-start", "no-clean-start"])
def test_zero_length_client_id_5_gets_an_assigned_client_identifier(suite_node, clean):
    """[MQTT-3.1.3-6] / [MQTT-3.2.2-16]: an MQTT 5 client without an id gets one in Assigned Client Identifier
    (Clean Start 0 allowed in 5.0), distinct for each connection."""
    ids = []
    for _ in range(2):
        with raw_client(suite_node.port, MQTT_5) as client:
            connack = client.connect("", clean=clean)
            assert connack.reason_code is ReasonCode.SUCCESS and not connack.session_present
            ids.append(connack.properties.assigned_client_identifier)
    assert all(ids) and ids[0] != ids[1]


@BOTH
def test_offline_message_queueing(suite_node, protocol):
    """[MQTT-3.1.2-5] (5.0: [MQTT-3.1.2-23]): a session that outlives its connection keeps QoS 1 and 2 messages
    that match its subscriptions; LightGate keeps QoS 0 too (the specification allows it)."""
    run = run_id()
    sub = session(suite_node.port, f"offline-{run}", protocol)
    sub.subscribe(f"off{run}/+", 2)
    sub.disconnect()
    with connected(suite_node.port, protocol=protocol) as pub:
        for qos in (0, 1, 2):
            pub.publish(f"off{run}/q{qos}", f"qos {qos}".encode(), qos)
    again = session(suite_node.port, f"offline-{run}", protocol)
    try:
        assert sorted(m.payload for m in again.receive(3)) == [b"qos 0", b"qos 1", b"qos 2"]
    finally:
        again.disconnect()


@BOTH
def test_overlapping_subscriptions(suite_node, protocol):
    """[MQTT-3.3.5-1]: with overlapping subscriptions the message is delivered at the largest granted QoS at
    least once; LightGate sends one copy per subscription (allowed), each at its own granted QoS."""
    run = run_id()
    with connected(suite_node.port, protocol=protocol) as client:
        client.subscribe(f"over{run}/#", 2)
        client.subscribe(f"over{run}/+", 1)
        client.publish(f"over{run}/x", b"overlapping topic filters", 2)
        assert sorted(m.qos for m in client.receive(2)) == [1, 2]
        check_nothing_before_sentinel(client, client, f"over{run}/x", copies=2)


@pytest.mark.slow
@BOTH
def test_keepalive_expiry_closes_and_publishes_the_will(suite_node, protocol):
    """[MQTT-3.1.2-24] (5.0 [MQTT-3.1.2-22]): nothing within 1.5 x the keep alive -> the server closes the
    connection (5.0: DISCONNECT 0x8D first) and publishes the will."""
    run = run_id()
    with connected(suite_node.port, protocol=protocol) as watcher:
        watcher.subscribe(f"ka{run}/#", 2)
        with raw_client(suite_node.port, level_of(protocol)) as silent:
            silent.connect(f"ka-{run}", keep_alive=2, will_topic=f"ka{run}/will", will_payload=b"keepalive expiry")
            (will,) = watcher.receive(1)
            assert will.payload == b"keepalive expiry"
            assert recv_until_closed(silent.sock) in (b"", b"\xe0\x01\x8d")


@pytest.mark.parametrize("asked, told", [(120, 60), (0, 60), (30, None)])
def test_server_keep_alive_with_a_60_s_maximum(suite_node, asked, told):
    """3.2.2.3.14: a server with a maximum answers Server Keep Alive when the client asks for more (or 0, no
    limit), and the client must then use it [MQTT-3.2.2-21]; a 3.1.1 client keeps what it asked for."""
    with raw_client(suite_node.port, MQTT_5) as raw:
        assert raw.connect(f"ska-{asked}-{run_id()}", keep_alive=asked).properties.server_keep_alive == told
    with raw_client(suite_node.port, MQTT_311) as raw:
        assert raw.connect(f"ka311-{asked}-{run_id()}", keep_alive=asked).reason_code is ReasonCode.SUCCESS


@BOTH
def test_redelivery_on_reconnect_keeps_packet_ids_and_sets_dup(suite_node, protocol):
    """[MQTT-4.4.0-1]: unacknowledged QoS 1 and 2 PUBLISHes are sent again on reconnect with their original
    packet identifiers and DUP set [MQTT-3.3.1-1]."""
    run = run_id()
    level = level_of(protocol)
    expiry = Properties(session_expiry_interval=3600) if level == MQTT_5 else Properties()
    with raw_client(suite_node.port, level) as paused:
        paused.connect(f"redeliver-{run}", clean=False, properties=expiry)
        paused.subscribe(f"redo{run}/#", 2)
        with connected(suite_node.port, protocol=protocol) as pub:
            pub.publish(f"redo{run}/1", b"qos 1", 1)
            pub.publish(f"redo{run}/2", b"qos 2", 2)
        first = sorted((paused.receive() for _ in range(2)), key=lambda p: p.qos)
    with raw_client(suite_node.port, level) as back:
        back.send(Connect(level, f"redeliver-{run}", False, properties=expiry))
        assert back.receive().session_present
        again = sorted((back.receive() for _ in range(2)), key=lambda p: p.qos)
        assert [(p.packet_id, p.payload, p.dup) for p in again] == [(p.packet_id, p.payload, True) for p in first]
        assert [p.dup for p in first] == [False, False]
        back.send(Puback(again[0].packet_id), Pubrec(again[1].packet_id))


@pytest.mark.parametrize("level, refusal", [(MQTT_311, 0x80), (MQTT_5, 0x87)], ids=["3.1.1", "5.0"])
def test_subscribe_failure_on_the_refused_topic(suite_node, level, refusal):
    """The ACL refuses `test/nosubscribe`: SUBACK 0x80 (3.1.1 [MQTT-3.9.3-2]) / 0x87 Not authorized (5.0),
    the other filters of the same SUBSCRIBE granted, the connection carries on; overlapping wildcards are
    granted and never deliver the refused topic (docs/security.md)."""
    run = run_id()
    with raw_client(suite_node.port, level) as client:
        client.connect(f"nosub-{run}")
        client.send(Subscribe(3, ((NOSUBSCRIBE, SubscriptionOptions(2)), (f"ok{run}/#", SubscriptionOptions(1)),
                                  ("test/+", SubscriptionOptions(0)))))
        assert client.receive() == Suback(3, (ReasonCode(refusal), ReasonCode.GRANTED_QOS_1,
                                              ReasonCode.GRANTED_QOS_0))
        with connected(suite_node.port) as pub:
            pub.publish(NOSUBSCRIBE, b"hidden", 0)
            pub.publish(f"test/sentinel{run}", b"sentinel", 0)  # through `test/+` as well, after it
        msg = client.receive()
        assert isinstance(msg, Publish) and msg.payload == b"sentinel", msg  # the denied topic never came
        client.send(Pingreq())
        assert client.receive() == Pingresp()


@BOTH
def test_dollar_topics_are_not_matched_by_leading_wildcards(suite_node, protocol):
    """[MQTT-4.7.2-1]: `#` and `+/...` do not match topics starting with `$`; a filter naming the level does."""
    run = run_id()
    with connected(suite_node.port, protocol=protocol) as client:
        client.subscribe(f"$conf{run}/#", 2)
        client.subscribe("#", 2)
        client.subscribe("+/+", 2)
        client.publish(f"$conf{run}/x", b"dollar", 1)
        (msg,) = client.receive(1)
        assert msg.topic == f"$conf{run}/x"
        client.publish(f"sentinel{run}", b"sentinel", 1)  # through `#` only (one level)
        while (msg := client.messages.get(timeout=WAIT_S)).topic != f"sentinel{run}":
            assert not msg.topic.startswith("$"), msg.topic  # other tests' retained messages may come first
        check_nothing_before_sentinel(client, client, f"sentinel{run}/x", copies=2)  # `#` and `+/+`: no `$` one in them


@BOTH
def test_unsubscribe_stops_only_the_named_subscriptions(suite_node, protocol):
    """[MQTT-3.10.4-1]/[MQTT-3.10.4-2]: UNSUBSCRIBE deletes the named subscriptions, the others stay; UNSUBACK
    answers [MQTT-3.10.4-4]."""
    run = run_id()
    names = [f"uns{run}/{i}" for i in range(3)]
    with connected(suite_node.port, protocol=protocol) as client:
        for name in names:
            client.subscribe(name, 2)
        for name in names[:2]:
            _, mid = client.paho.unsubscribe(name)
            assert client.unsubacks.get(timeout=WAIT_S) == mid
        with connected(suite_node.port, protocol=protocol) as pub:
            for name in names:
                pub.publish(name, b"x", 1)
        assert [m.topic for m in client.receive(1)] == [names[2]]
        # No barrier: an unsubscribed filter has no queue left that a sentinel could follow. A fixed wait.
        quiet(client.messages)


# ---------------------------------------------------------------------------------------------- client_test5.py


@pytest.mark.slow
def test_session_expiry(suite_node):
    """[MQTT-3.1.2-23]: the session is kept for its Session Expiry Interval after the connection closes (Session
    Present 1) and discarded after it (Session Present 0); the DISCONNECT may change the interval (3.14.2.2.2)."""
    run = run_id()
    expiry = Properties(session_expiry_interval=60)
    with raw_client(suite_node.port, MQTT_5) as client:
        assert not client.connect(f"sexp-{run}", clean=False, properties=expiry).session_present
        client.subscribe(f"sexp{run}", 1)
    with raw_client(suite_node.port, MQTT_5) as client:
        assert client.connect(f"sexp-{run}", clean=False, properties=expiry).session_present
        client.send(Disconnect(properties=Properties(session_expiry_interval=1)))
        assert recv_until_closed(client.sock) == b""
    time.sleep(2.5)  # the session must outlive its 1 s expiry: the behaviour under test, not a synchronisation
    with raw_client(suite_node.port, MQTT_5) as client:
        assert not client.connect(f"sexp-{run}", clean=False, properties=expiry).session_present


def test_user_properties_pass_through_in_order(suite_node):
    """[MQTT-3.3.2-17] the server forwards User Properties unaltered, [MQTT-3.3.2-18] keeping their order."""
    run = run_id()
    pairs = [("a", "2"), ("c", "3"), ("a", "1")]
    with connected(suite_node.port, protocol=V5) as client:
        subscribe5(client, f"up{run}")
        publish5(client, f"up{run}", b"props", UserProperty=pairs)
        (msg,) = client.receive(1)
        assert msg.properties.UserProperty == pairs


def test_payload_format_indicator_and_content_type_pass_through(suite_node):
    """[MQTT-3.3.2-4]: the Payload Format Indicator is forwarded unaltered; so is the Content Type (3.3.2.3.9)."""
    run = run_id()
    with connected(suite_node.port, protocol=V5) as client:
        subscribe5(client, f"pfi{run}")
        publish5(client, f"pfi{run}", "text ✓".encode(), PayloadFormatIndicator=1, ContentType="text/plain")
        (msg,) = client.receive(1)
        assert (msg.properties.PayloadFormatIndicator, msg.properties.ContentType) == (1, "text/plain")


@pytest.mark.slow
def test_message_expiry(suite_node):
    """[MQTT-3.3.2-5]: an expired message is not delivered to a subscriber; [MQTT-3.3.2-6] one that is gets the
    interval minus the time it waited."""
    run = run_id()
    sub = session(suite_node.port, f"mexp-{run}", V5)
    subscribe5(sub, f"mexp{run}/#")
    sub.disconnect()
    with connected(suite_node.port, protocol=V5) as pub:
        publish5(pub, f"mexp{run}/short", b"expires", MessageExpiryInterval=1)
        publish5(pub, f"mexp{run}/long", b"lives", MessageExpiryInterval=60)
    time.sleep(2.1)  # the short one must expire while queued: the behaviour under test, not a synchronisation
    again = session(suite_node.port, f"mexp-{run}", V5)
    try:
        (msg,) = again.receive(1)
        assert msg.payload == b"lives" and 1 <= msg.properties.MessageExpiryInterval <= 58
        check_nothing_before_sentinel(again, again, f"mexp{run}/x")
    finally:
        again.disconnect()


def test_subscribe_options_no_local_and_retain_as_published(suite_node):
    """[MQTT-3.8.3-3] No Local: not sent back to its own publisher; Retain As Published (3.8.3.1) keeps the
    RETAIN flag on forwarded messages, which is otherwise 0 [MQTT-3.3.1-12/13]."""
    run = run_id()
    with connected(suite_node.port, protocol=V5) as client:
        subscribe5(client, f"nl{run}/local", noLocal=True)
        subscribe5(client, f"nl{run}/rap", retainAsPublished=True)
        subscribe5(client, f"nl{run}/plain")
        publish5(client, f"nl{run}/local", b"own")
        publish5(client, f"nl{run}/rap", b"r", retain=True)
        publish5(client, f"nl{run}/plain", b"r", retain=True)
        got = {m.topic: m.retain for m in client.receive(2)}
        assert got == {f"nl{run}/rap": True, f"nl{run}/plain": False}
        with connected(suite_node.port, protocol=V5) as other:  # No Local would hold back a sentinel of its own
            check_nothing_before_sentinel(client, other, f"nl{run}/local")
        for leaf in ("rap", "plain"):
            publish5(client, f"nl{run}/{leaf}", b"", retain=True)


def test_subscribe_option_retain_handling(suite_node):
    """3.8.3.1 Retain Handling: 0 sends retained messages at every SUBSCRIBE [MQTT-3.3.1-9], 1 only when the
    subscription is new [MQTT-3.3.1-10], 2 never [MQTT-3.3.1-11]."""
    run = run_id()
    with connected(suite_node.port, protocol=V5) as client:
        publish5(client, f"rh{run}/t", b"retained", retain=True)
        counts = {}
        for handling in (0, 1, 2):
            counts[handling] = 0
            for _ in range(2):  # subscribe twice: a new subscription, then the same one again
                subscribe5(client, f"rh{run}/+", retainHandling=handling)
                publish5(client, f"rh{run}/sentinel", b"s")  # live, after what the SUBSCRIBE sent
                while client.messages.get(timeout=WAIT_S).topic != f"rh{run}/sentinel":
                    counts[handling] += 1
            client.paho.unsubscribe(f"rh{run}/+")
            client.unsubacks.get(timeout=WAIT_S)
        publish5(client, f"rh{run}/t", b"", retain=True)
        assert counts == {0: 2, 1: 1, 2: 0}


def test_flow_control_the_client_receive_maximum_limits_the_server(suite_node):
    """[MQTT-3.3.4-9]: the server sends at most the client's Receive Maximum QoS 1/2 PUBLISHes unacknowledged,
    and [MQTT-3.3.4-10] does not hold back other packets meanwhile."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as client:
        client.connect(f"fc-{run}", properties=Properties(receive_maximum=2))
        client.subscribe(f"fc{run}/#", 2)
        with connected(suite_node.port, protocol=V5) as pub:
            for i in range(5):
                publish5(pub, f"fc{run}/x", str(i).encode(), qos=1 + i % 2)
        window = [client.receive(), client.receive()]
        client.send(Pingreq())
        assert client.receive() == Pingresp()  # the full window holds back PUBLISHes only
        client.send(Puback(window[0].packet_id))
        third = client.receive()
        assert isinstance(third, Publish) and [p.payload for p in window + [third]] == [b"0", b"1", b"2"]


def test_flow_control_the_server_receive_maximum_is_enforced(suite_node):
    """3.2.2.3.3 / 4.9: a client that sends more unacknowledged QoS 2 PUBLISHes than the server's Receive
    Maximum (a QoS 2 one counts until its PUBCOMP) gets DISCONNECT 0x93 (Receive Maximum exceeded)."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as client:
        limit = client.connect(f"fcs-{run}").properties.receive_maximum
        assert limit is not None
        client.send(*(Publish(f"fcs{run}", b"x", qos=2, packet_id=i + 1) for i in range(limit + 1)))
        answers = []
        while not isinstance(answers[-1:] and answers[-1], Disconnect):
            answers.append(client.receive())
        assert answers[-1].reason_code is ReasonCode.RECEIVE_MAXIMUM_EXCEEDED
        assert all(isinstance(p, Pubrec) for p in answers[:-1]) and len(answers) <= limit + 1
        assert recv_until_closed(client.sock) == b""


@pytest.mark.slow
def test_will_delay(suite_node):
    """3.1.3.2.2: a will with a delay is published after it [MQTT-3.1.3-9], not at all when the session resumes
    within it."""
    run = run_id()
    with connected(suite_node.port, protocol=V5) as watcher:
        subscribe5(watcher, f"wdl{run}/#")
        for name, resume in (("resumed", True), ("published", False)):
            with raw_client(suite_node.port, MQTT_5) as dying:
                dying.connect(f"wdl-{name}-{run}", will_topic=f"wdl{run}/{name}", will_payload=b"late",
                              will_properties=Properties(will_delay_interval=2),
                              properties=Properties(session_expiry_interval=30))
            if resume:
                with raw_client(suite_node.port, MQTT_5) as back:
                    assert back.connect(f"wdl-{name}-{run}", clean=False,
                                        properties=Properties(session_expiry_interval=30)).session_present
                    back.send(Disconnect())
        closed = time.monotonic()
        (will,) = watcher.receive(1)
        assert will.topic == f"wdl{run}/published" and time.monotonic() - closed >= 1.0
        check_nothing_before_sentinel(watcher, watcher, f"wdl{run}/x")  # the same queue as the wills


def test_shared_subscriptions_deliver_each_message_to_one_member(suite_node):
    """4.8.2: a message to a shared subscription goes to one session of the group; two groups each get it."""
    run = run_id()
    members = [Client(suite_node.port, protocol=V5) for _ in range(2)]
    other = Client(suite_node.port, protocol=V5)
    for client in (*members, other):
        client.connect()
    try:
        for client in members:
            subscribe5(client, f"$share/g{run}/sh{run}/+", qos=1)
        subscribe5(other, f"$share/h{run}/sh{run}/+", qos=1)
        with connected(suite_node.port, protocol=V5) as pub:
            for i in range(20):
                publish5(pub, f"sh{run}/x", str(i).encode())
        assert sorted(int(m.payload) for m in other.receive(20)) == list(range(20))
        wait_until(lambda: sum(c.messages.qsize() for c in members) >= 20, what="20 group deliveries")
        got = [m for c in members for m in c.receive(c.messages.qsize())]
        assert sorted(int(m.payload) for m in got) == list(range(20))  # each once, to one member
    finally:
        for client in (*members, other):
            client.disconnect()


def test_client_topic_alias_maps_and_reuses(suite_node):
    """3.3.2.3.4: a Topic Alias the client sets with a topic name stands for it in later PUBLISHes
    [MQTT-3.3.2-12]; an alias above the server's Topic Alias Maximum is a protocol error (DISCONNECT 0x94)."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as client:
        maximum = client.connect(f"ca-{run}").properties.topic_alias_maximum
        assert maximum
        client.subscribe(f"ca{run}", 0)
        client.send(Publish(f"ca{run}", b"named", properties=Properties(topic_alias=1)),
                    Publish("", b"by alias", properties=Properties(topic_alias=1)))
        assert [(p.topic, p.payload) for p in (client.receive(), client.receive())] == \
            [(f"ca{run}", b"named"), (f"ca{run}", b"by alias")]
        client.send(Publish(f"ca{run}", b"x", properties=Properties(topic_alias=maximum + 1)))
        assert client.receive().reason_code is ReasonCode.TOPIC_ALIAS_INVALID
        assert recv_until_closed(client.sock) == b""


def test_server_topic_alias_only_within_the_clients_maximum(suite_node):
    """[MQTT-3.3.2-11]: the server uses aliases up to the client's Topic Alias Maximum (none when it sent none)."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as aliased, raw_client(suite_node.port, MQTT_5) as plain:
        aliased.connect(f"sa-{run}", properties=Properties(topic_alias_maximum=1))
        plain.connect(f"sp-{run}")
        for client in (aliased, plain):
            client.subscribe(f"sa{run}/#", 0)
        with connected(suite_node.port, protocol=V5) as pub:
            for i in range(3):
                publish5(pub, f"sa{run}/t", str(i).encode(), qos=0)
        got = [aliased.receive() for _ in range(3)]
        assert got[0].topic == f"sa{run}/t" and all(p.properties.topic_alias == 1 for p in got)
        assert all(p.topic == "" for p in got[1:])
        assert all(p.properties.topic_alias is None and p.topic == f"sa{run}/t" for p in
                   (plain.receive() for _ in range(3)))


def test_maximum_packet_size_of_the_client_is_respected(suite_node):
    """[MQTT-3.1.2-24]: the server never sends a packet bigger than the client's Maximum Packet Size; such a
    message is discarded for that client [MQTT-3.1.2-25] and the next ones still come."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as client:
        client.connect(f"mps-{run}", properties=Properties(maximum_packet_size=128))
        client.subscribe(f"mps{run}/#", 1)
        with connected(suite_node.port, protocol=V5) as pub:
            publish5(pub, f"mps{run}/big", b"x" * 200)
            publish5(pub, f"mps{run}/small", b"fits")
        msg = client.receive()
        assert (msg.topic, msg.payload) == (f"mps{run}/small", b"fits")


def test_request_response(suite_node):
    """3.3.2.3.5/6: Response Topic and Correlation Data reach the responder unaltered [MQTT-3.3.2-15/16]; a
    Request Response Information 1 may be answered with Response Information (the server's choice)."""
    run = run_id()
    with raw_client(suite_node.port, MQTT_5) as requester, raw_client(suite_node.port, MQTT_5) as responder:
        connack = requester.connect(f"req-{run}", properties=Properties(request_response_information=True))
        assert connack.reason_code is ReasonCode.SUCCESS
        responder.connect(f"resp-{run}")
        responder.subscribe(f"rr{run}/request", 1)
        requester.subscribe(f"rr{run}/response", 1)
        requester.send(Publish(f"rr{run}/request", b"ask", qos=1, packet_id=1, properties=Properties(
            response_topic=f"rr{run}/response", correlation_data=b"\x00\x01id")))
        assert isinstance(requester.receive(), Puback)
        request = responder.receive()
        props = request.properties
        assert (props.response_topic, props.correlation_data) == (f"rr{run}/response", b"\x00\x01id")
        responder.send(Puback(request.packet_id), Publish(props.response_topic, b"answer", qos=1, packet_id=1,
                                                            properties=Properties(correlation_data=b"\x00\x01id")))
        assert isinstance(responder.receive(), Puback)
        response = requester.receive()
        assert (response.payload, response.properties.correlation_data) == (b"answer", b"\x00\x01id")
