"""The PUBLISH packets a session writes, byte for byte, against a reference encoder of the spec's layout.

Delivery writes every message from one ``PublishTemplate`` shared by the sessions that deliver it, patching in
each subscriber's flags, packet id and MQTT 5 properties. What a client reads must be exactly what encoding a
whole PUBLISH for it gives: ``reference`` (tests/helpers/publish.py) is that encoder, independent of the template.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from msgspec.structs import replace as with_fields

from gateway.mqtt.actions import Deliver, InFlight, Message, Subscription
from gateway.mqtt.packets import MQTT_5, MQTT_311, SubscriptionOptions
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from gateway.mqtt.session import LANE_PIDS, Link, Session, SessionState
from tests.helpers.links import Owner
from tests.helpers.publish import reference_publish as reference, split_packets

STORED_MS = 1_700_000_000_000

PROPERTIES = Properties(payload_format_indicator=1, content_type="text/plain", response_topic="reply/to",
                        correlation_data=b"\x00\x01", user_properties=(("k", "v"), ("k", "w")))


def packets(actions: list) -> list[bytes]:
    return split_packets(b"".join(a.data for a in actions if isinstance(a, Deliver)))


def link(level: int, now_ms: int = STORED_MS, **overrides) -> Link:
    fields = dict(protocol_level=level, receive_maximum=100, max_packet_size=None, topic_alias_maximum=0,
                  pull_batch=100, max_unwritten=100, commit_every=1000, owner=Owner(now_ms))
    fields.update(overrides)
    return Link(**fields)


def message(offset: int, qos: int, retain: bool = False, properties: Properties = EMPTY_PROPERTIES,
            topic: str = "tele/dev1", payload: bytes = b"") -> Message:
    return Message(topic, payload or b"payload %d" % offset, qos, retain, properties, "pub", STORED_MS, STORED_MS,
                   "tele/#", offset)


def deliver(session: Session, messages: tuple[Message, ...]) -> list[bytes]:
    return packets(session.pulled("tele/#", messages, messages[-1].offset + 1))  # type: ignore[operator]


CASES = [(level, qos, retain, rap) for level in (MQTT_311, MQTT_5) for qos in (0, 1, 2) for retain in (False, True)
         for rap in (False, True)]


@pytest.mark.parametrize(("level", "qos", "retain", "rap"), CASES)
def test_each_subscriber_reads_the_packet_a_whole_encoding_gives(level, qos, retain, rap):
    # [MQTT-3.3.1-12]/[MQTT-3.3.1-13]: RETAIN as published only with Retain As Published; [MQTT-3.8.4-8] the
    # delivered QoS is the lower of the message's and the subscription's.
    props = PROPERTIES if level == MQTT_5 else EMPTY_PROPERTIES
    messages = tuple(message(i, q, retain, props) for i, q in enumerate((0, 1, 2)))
    sessions = [Session(f"s{k}", 0) for k in range(2)]
    outs = []
    for session in sessions:
        session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(qos=qos, retain_as_published=rap)), 0)
        session.attach(link(level))
        outs.append(deliver(session, messages))
    for out in outs:
        expected = []
        pid = 1
        for m in messages:
            delivered = min(qos, m.qos)
            expected.append(reference(level, m.topic, m.payload, delivered, rap and retain, False,
                                      pid if delivered else None, props))
            pid += 1 if delivered else 0
        assert out == expected
    assert all(m.template is not None for m in messages)  # made once, by the first session: shared


def test_mqtt5_subscribers_get_their_own_identifiers_aliases_and_expiry_around_the_shared_properties():
    # [MQTT-3.3.4-3] the Subscription Identifier of the matching subscription; [MQTT-3.3.2-6] the Message Expiry
    # Interval minus the time the message waited (12.5 s: 60 -> 48); topic aliases: a new one with the name, a
    # known one with an empty name [MQTT-3.3.2-12 for the client's maximum, section 3.3.2.3.4].
    props = replace(PROPERTIES, message_expiry_interval=60)
    messages = (message(0, 1, properties=props), message(1, 1, properties=props, topic="tele/dev2"),
                message(2, 0, properties=props), message(3, 1, properties=props, topic="tele/dev3"))
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(qos=1), subscription_id=7), 0)
    session.attach(link(MQTT_5, now_ms=STORED_MS + 12_500, topic_alias_maximum=2))
    out = deliver(session, messages)
    own = replace(PROPERTIES, message_expiry_interval=48, subscription_identifiers=(7,))
    assert out == [
        reference(MQTT_5, "tele/dev1", b"payload 0", 1, False, False, 1, replace(own, topic_alias=1)),
        reference(MQTT_5, "tele/dev2", b"payload 1", 1, False, False, 2, replace(own, topic_alias=2)),
        reference(MQTT_5, "", b"payload 2", 0, False, False, None, replace(own, topic_alias=1)),
        reference(MQTT_5, "tele/dev3", b"payload 3", 1, False, False, 3, own),  # past the client's maximum
    ]
    # Another subscriber of the same messages: no identifier, no alias, waited longer (the expiry floor is 1).
    other = Session("t", 0)
    other.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(qos=1)), 0)
    other.attach(link(MQTT_5, now_ms=STORED_MS + 59_999))
    assert deliver(other, messages[:1]) == [
        reference(MQTT_5, "tele/dev1", b"payload 0", 1, False, False, 1, replace(PROPERTIES, message_expiry_interval=1))]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
def test_a_resend_after_a_crash_sets_dup_and_keeps_its_packet_id(level):
    # [MQTT-3.3.1-1] DUP on a redelivery; [MQTT-4.4.0-1] with the packet id it was first sent with.
    sub = Subscription("tele/#", "tele/#", SubscriptionOptions(qos=2))
    state = SessionState("s", 60, (sub,), {"tele/#": 3}, lanes={"tele/#": 1},
                         inflight=(InFlight(LANE_PIDS + 3, "tele/#", 3, 2),))
    session = Session("s", 60, state)
    session.attach(link(level))
    props = PROPERTIES if level == MQTT_5 else EMPTY_PROPERTIES
    out = deliver(session, (message(3, 2, properties=props), message(4, 2, properties=props)))
    assert out[0] == reference(level, "tele/dev1", b"payload 3", 2, False, True, LANE_PIDS + 3, props)
    assert out[1] == reference(level, "tele/dev1", b"payload 4", 2, False, True, LANE_PIDS + 4, props)


def test_a_packet_over_the_clients_maximum_is_skipped_and_a_long_one_is_framed_right():
    # [MQTT-3.1.2-25] a packet over the client's Maximum Packet Size is not sent; a Remaining Length of 128 bytes
    # or more takes a longer Variable Byte Integer (section 1.5.5).
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(qos=1)), 0)
    session.attach(link(MQTT_311, max_packet_size=200))
    big, fits = message(0, 1, payload=b"x" * 300), message(1, 1, payload=b"y" * 150)
    # The skipped message's packet id is not reused at once (ids go round the pool).
    assert deliver(session, (big, fits)) == [reference(MQTT_311, "tele/dev1", b"y" * 150, 1, False, False, 2,
                                                       EMPTY_PROPERTIES)]


# Guard tests of the delivery that writes the shared packet in one call (``PublishTemplate.write_plain``, taken
# when a message has no expiry and the subscriber patches nothing in; QoS 0 mostly, QoS 1 beside it): they pass on the code before it
# too, and hold what a client reads of each rule that path hoists or skips.


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
def test_guard_qos0_no_local_skips_own_messages_in_a_run_and_keeps_the_others_order(level):
    # [MQTT-3.8.3-3] No Local: the subscriber's own messages are not delivered to it; [MQTT-4.6.0-6] the others
    # keep their order, QoS 0 and QoS 1 interleaved; the skipped offsets advance.
    messages = tuple(with_fields(message(i, i % 2), client_id="s" if i % 3 == 0 else "pub") for i in range(9))
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(qos=1, no_local=True)), 0)
    session.attach(link(level))
    out = deliver(session, messages)
    # A skipped QoS 1 message's packet id is not reused at once (ids go round the pool): ids by QoS 1 message.
    pids = {m.offset: pid for pid, m in enumerate((m for m in messages if m.qos), 1)}
    assert out == [reference(level, m.topic, m.payload, m.qos, False, False, pids.get(m.offset), EMPTY_PROPERTIES)
                   for m in messages if m.client_id != "s"]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
@pytest.mark.parametrize("rap", [False, True])
def test_guard_qos0_retain_is_as_published_only_with_the_option(level, rap):
    # [MQTT-3.3.1-12] RETAIN 0 on a queue delivery unless Retain As Published [MQTT-3.3.1-13]; the same message
    # to two subscribers sharing its template, one with the option and one without.
    messages = (message(0, 0, retain=True), message(1, 0), message(2, 0, retain=True))
    outs = []
    for name, option in (("a", rap), ("b", not rap)):
        session = Session(name, 0)
        session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(retain_as_published=option)), 0)
        session.attach(link(level))
        outs.append((option, deliver(session, messages)))
    for option, out in outs:
        assert out == [reference(level, m.topic, m.payload, 0, option and m.retain, False, None, EMPTY_PROPERTIES)
                       for m in messages]


def test_guard_qos0_mqtt5_identifier_alias_and_expiry_are_patched_in():
    # A QoS 0 message to an MQTT 5 subscriber with a Subscription Identifier [MQTT-3.3.4-3], topic aliases
    # (section 3.3.2.3.4) or an expiring message [MQTT-3.3.2-6] goes with them; an expired one not at all
    # [MQTT-3.3.2-5]; a plain one beside them with the shared block.
    expiring = replace(PROPERTIES, message_expiry_interval=10)
    messages = (message(0, 0, properties=PROPERTIES), message(1, 0, properties=expiring),
                with_fields(message(2, 0, properties=expiring), store_ms=STORED_MS - 20_000))
    plain = Session("p", 0)
    plain.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions()), 0)
    plain.attach(link(MQTT_5, now_ms=STORED_MS + 3_000))
    assert deliver(plain, messages) == [
        reference(MQTT_5, "tele/dev1", b"payload 0", 0, False, False, None, PROPERTIES),
        reference(MQTT_5, "tele/dev1", b"payload 1", 0, False, False, None, replace(expiring,
                                                                                  message_expiry_interval=7))]
    own = Session("o", 0)
    own.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions(), subscription_id=5), 0)
    own.attach(link(MQTT_5, now_ms=STORED_MS + 3_000, topic_alias_maximum=1))
    assert deliver(own, messages[:1] + (message(3, 0, properties=PROPERTIES),)) == [
        reference(MQTT_5, "tele/dev1", b"payload 0", 0, False, False, None,
                  replace(PROPERTIES, subscription_identifiers=(5,), topic_alias=1)),
        reference(MQTT_5, "", b"payload 3", 0, False, False, None,
                  replace(PROPERTIES, subscription_identifiers=(5,), topic_alias=1))]


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
def test_guard_qos0_expiry_binds_every_level_and_long_packets_are_framed(level):
    # [MQTT-3.3.2-5] an expired message is not sent, to a 3.1.1 subscriber either (without the property); a
    # Remaining Length of 128 or more takes two bytes (section 1.5.5), a QoS 0 packet too.
    expired = with_fields(message(0, 0, properties=Properties(message_expiry_interval=5)), store_ms=STORED_MS - 6_000)
    long = message(1, 0, payload=b"z" * 200)
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions()), 0)
    session.attach(link(level))
    assert deliver(session, (expired, long)) == [reference(level, "tele/dev1", b"z" * 200, 0, False, False, None,
                                                           EMPTY_PROPERTIES)]


def test_guard_qos0_acl_and_maximum_packet_size_still_withhold():
    # The ACL's delivery check (a wildcard over a denied topic) and [MQTT-3.1.2-25] the client's Maximum Packet
    # Size withhold QoS 0 messages as they do QoS 1 ones; the rest go in order.
    messages = (message(0, 0, topic="tele/secret"), message(1, 0, payload=b"x" * 300), message(2, 0))
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions()), 0)
    session.attach(link(MQTT_311, max_packet_size=200, may_read=lambda topic: topic != "tele/secret"))
    assert deliver(session, messages) == [reference(MQTT_311, "tele/dev1", b"payload 2", 0, False, False, None,
                                                    EMPTY_PROPERTIES)]


def test_guard_a_pull_answer_overlapping_what_was_delivered_sends_only_the_new_messages_in_order():
    # [MQTT-4.6.0-6] in order, and each once: a pull answered from behind the cursor (a concurrent read that
    # extended the queue cache) repeats delivered messages, which are dropped; an answer that starts at or after
    # the cursor is taken whole.
    session = Session("s", 0)
    session.subscribe(Subscription("tele/#", "tele/#", SubscriptionOptions()), 0)
    session.attach(link(MQTT_311))
    first = deliver(session, tuple(message(i, 0) for i in range(3)))
    again = deliver(session, tuple(message(i, 0) for i in range(1, 6)))
    assert first + again == [reference(MQTT_311, "tele/dev1", b"payload %d" % i, 0, False, False, None,
                                       EMPTY_PROPERTIES) for i in range(6)]
