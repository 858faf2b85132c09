"""The session's delivery engine on its own: packet ids, windows, buffers, contiguous offsets, resume."""

from __future__ import annotations

from gateway.actions import CommitOffsets, Deliver, InFlight, Message, Phase, Pull, Send, Subscription
from gateway.codec import NEED_DATA, MqttDecoder, Role, encode_publish_template
from gateway.packets import MQTT_5, Publish, Pubrel, SubscriptionOptions
from gateway.reasons import ReasonCode
from gateway.session import ALIAS_BYTES, Link, Session, SessionState

SUB = Subscription("a/+", "a/+", SubscriptionOptions(qos=1))


def link(**overrides) -> Link:
    fields = dict(protocol_level=MQTT_5, receive_maximum=8, max_packet_size=None, topic_alias_maximum=0,
                  pull_batch=4, max_unwritten=4, commit_every=1000, encoder=encode_publish_template,
                  now_ms=lambda: 0)
    fields.update(overrides)
    return Link(**fields)


def msg(offset: int, qos: int = 1) -> Message:
    return Message("a/b", b"%d" % offset, qos, queue="a/+", offset=offset)


def publishes(actions: list) -> list[Publish]:
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=MQTT_5)
    for action in actions:
        if isinstance(action, Deliver):
            decoder.feed(action.data)
    out = []
    while (packet := decoder.next_packet()) is not NEED_DATA:
        out.append(packet)
    return out


def pulls(actions: list) -> list[Pull]:
    return [a for a in actions if isinstance(a, Pull)]


def attached(start: int = 0, **overrides) -> Session:
    session = Session("c", 0)
    session.subscribe(SUB, start)
    session.attach(link(**overrides))
    return session


def test_new_subscription_pulls_once_and_buffers_at_most_one_batch():
    session = Session("c", 0)
    assert session.subscribe(SUB, 3) is True
    actions = session.attach(link(receive_maximum=1))
    assert pulls(actions) == [Pull("a/+", "a/+", 3, 4)]
    assert pulls(session.pump()) == []  # a pull is outstanding: no second one
    actions = session.pulled("a/+", tuple(msg(i) for i in range(3, 7)), 7)
    assert len(publishes(actions)) == 1 and pulls(actions) == []  # window full, buffer not empty: no pull


def test_resubscribe_replaces_options_and_keeps_position():
    session = attached(start=5)
    assert session.subscribe(Subscription("a/+", "a/+", SubscriptionOptions(qos=0)), 0) is False
    assert session.committed_offsets() == {"a/+": 5}
    assert session.subscriptions["a/+"].options.qos == 0


def test_packet_ids_are_unique_among_in_flight_and_wrap():
    state = SessionState("c", 60, (SUB,), {"a/+": 0}, {"a/+": 0}, next_packet_id=65534,
                         inflight=(InFlight(1, "a/+", 0, 1, Phase.RELEASED),))
    session = Session("c", 60, state)
    session.attach(link())
    out = publishes(session.pulled("a/+", tuple(msg(i) for i in range(1, 4)), 4))
    assert [p.packet_id for p in out] == [65534, 65535, 2]  # 1 is still in flight (PUBREL phase)


def test_committed_offset_is_the_lowest_unacknowledged():
    session = attached()
    out = publishes(session.pulled("a/+", (msg(0), msg(1), msg(2)), 3))
    session.puback(out[2].packet_id)
    assert session.committed_offsets() == {"a/+": 0}
    session.puback(out[0].packet_id)
    assert session.commit() == [CommitOffsets("c", {"a/+": 1})]
    assert session.commit() == []  # nothing moved since
    session.puback(out[1].packet_id)
    assert session.commit() == [CommitOffsets("c", {"a/+": 3})]


def test_unknown_acks_are_ignored_and_unknown_pubrec_gets_not_found():
    session = attached()
    assert session.puback(77) == []
    assert session.pubcomp(77) == []
    assert session.pubrec(77, ReasonCode.SUCCESS) == [Send((Pubrel(77, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),))]


def test_pubrec_with_failure_ends_the_flow_without_pubrel():
    session = attached()
    session.subscribe(Subscription("a/+", "a/+", SubscriptionOptions(qos=2)), 0)
    (out,) = publishes(session.pulled("a/+", (msg(0, qos=2),), 1))
    assert [a for a in session.pubrec(out.packet_id, ReasonCode.QUOTA_EXCEEDED) if isinstance(a, Send)] == []
    assert session.inflight == () and session.committed_offsets() == {"a/+": 1}


def test_qos0_backpressure_until_written():
    session = attached(max_unwritten=2)
    session.subscribe(Subscription("a/+", "a/+", SubscriptionOptions(qos=0)), 0)
    actions = session.pulled("a/+", tuple(msg(i, qos=0) for i in range(4)), 4)
    (deliver,) = [a for a in actions if isinstance(a, Deliver)]
    assert len(publishes(actions)) == 2
    assert len(publishes(session.written(deliver.seq))) == 2


def test_detach_counts_unwritten_qos0_as_delivered():
    session = attached()
    session.subscribe(Subscription("a/+", "a/+", SubscriptionOptions(qos=0)), 0)
    session.pulled("a/+", (msg(0, qos=0),), 1)
    session.detach()
    assert session.committed_offsets() == {"a/+": 1}
    assert session.pump() == []  # detached: no delivery


def test_resume_drops_in_flight_entries_the_store_no_longer_has():
    state = SessionState("c", 60, (SUB,), {"a/+": 2}, {"a/+": 6},
                         inflight=(InFlight(3, "a/+", 2, 1), InFlight(4, "a/+", 4, 1)))
    session = Session("c", 60, state)
    assert pulls(session.attach(link())) == [Pull("a/+", "a/+", 2, 4)]
    # Retention removed offsets 2-3: the queue restarts at 4.
    out = publishes(session.pulled("a/+", (msg(4), msg(5), msg(6)), 7))
    assert [(p.payload, p.dup) for p in out] == [(b"4", True), (b"6", False)]
    assert [e.packet_id for e in session.inflight] == [4, 1]


def test_resume_ignores_in_flight_below_a_later_commit():
    # A crash lost the clean save: the store's committed offset (5) is newer than the in-flight entry (3).
    state = SessionState("c", 60, (SUB,), {"a/+": 5}, inflight=(InFlight(9, "a/+", 3, 1),))
    session = Session("c", 60, state)
    assert pulls(session.attach(link())) == [Pull("a/+", "a/+", 5, 4)]
    assert session.inflight == ()


def test_state_round_trip_keeps_subscriptions_qos2_state_and_will():
    session = attached()
    session.awaiting_rel[12] = None
    will = Message("w", b"bye")
    state = session.state(will, 30)
    assert state.subscriptions == (SUB,) and state.awaiting_rel == {12} and state.will == will
    assert set(Session("c", 60, state).awaiting_rel) == {12}


def test_persistence_follows_expiry():
    session = Session("c", 0)
    assert session.save() == [] and not session.persistent
    session.expiry_s = 10
    assert session.persistent and len(session.save()) == 1


def test_acks_while_most_of_the_window_is_in_flight_pump_once_the_read_is_done():
    session = attached(receive_maximum=8)  # pumps wait while more than 8 - 8 // 4 = 6 are in flight
    sent = publishes(session.pulled("a/+", tuple(msg(i) for i in range(20)), 20))
    assert len(sent) == 8
    assert session.puback(sent[0].packet_id) == []  # 7 in flight: one write for the burst, later
    assert len(publishes(session.puback(sent[1].packet_id))) == 2  # 6 in flight: the room is used now
    assert session.puback(sent[2].packet_id) == []
    assert [p.payload for p in publishes(session.pump_due())] == [b"10"]
    assert session.pump_due() == []  # nothing deferred any more


def test_outbound_topic_aliases_hold_a_bounded_number_of_topic_bytes():
    """A client may accept 65,535 aliases; the server keeps each aliased topic, so long topics could pin
    65,535 x 65 KB per connection. Beyond ALIAS_BYTES of topics a topic goes out by name (issue 21)."""
    session = Session("c", 0)
    session.subscribe(Subscription("#", "#", SubscriptionOptions(qos=0)), 0)
    session.attach(link(topic_alias_maximum=65535, receive_maximum=1000, max_unwritten=1000, pull_batch=1000))
    topics = [f"{n:04d}/" + "x" * 4000 for n in range(100)]
    messages = tuple(Message(t, b"p", 0, queue="#", offset=n) for n, t in enumerate(topics))
    sent = publishes(session.pulled("#", messages, 100))
    aliased = [p for p in sent if p.properties.topic_alias is not None]
    assert 0 < len(aliased) < len(sent)
    assert sum(len(p.topic) for p in aliased) <= ALIAS_BYTES
    assert all(p.topic for p in sent)  # first sightings carry their names; none relies on an alias it lacks
