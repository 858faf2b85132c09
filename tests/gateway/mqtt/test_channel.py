"""The MQTT channel without sockets: packets and node results in, actions and packets out.

Outbound PUBLISHes come back as bytes (``Deliver``); the tests decode them with
the real codec in CLIENT role, and encode ``Send`` packets at the channel's
level, so what is asserted is what a client would receive.
"""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from gateway.mqtt.actions import (
    Activate,
    AdminDisconnect,
    Activated,
    Append,
    Appended,
    ArmTimer,
    CancelTimer,
    Close,
    CommitOffsets,
    ConnectionLost,
    Deliver,
    Denied,
    CloseSession,
    Message,
    OpenSession,
    PatchSession,
    PublishWill,
    Pull,
    InboundReleased,
    Pulled,
    QueueAdvanced,
    Release,
    ReleaseInbound,
    SavedSubscription,
    SaveSession,
    Send,
    ServerShutdown,
    SessionOpened,
    SessionSaved,
    SocketWritten,
    Subscription,
    TakenOver,
)
from gateway.mqtt.channel import Channel, ChannelConfig, error_packet
from gateway.mqtt.codec import RemoteProtocolError, encode
from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
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
from gateway.mqtt.properties import PacketType, decode_properties
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode
from gateway.mqtt.session import SessionState
from gateway.mqtt.state import TRANSITIONS, State
from store.api import Position
from tests.helpers.channel import T0, Clock, connect, delivered, msg, of, saved, sent, subscribe

R = ReasonCode


def decoded(block: bytes) -> Properties:
    """A stored message's MQTT 5 property block, decoded."""
    return decode_properties(block, 0, len(block), PacketType.PUBLISH)


def persistent(**extra) -> dict:
    return {"clean": False, "properties": Properties(session_expiry_interval=3600, **extra)}


# --- CONNECT ----------------------------------------------------------------------------------


def test_connect_v5_opens_session_then_connack_advertises_limits():
    clock = Clock()
    channel = Channel(ChannelConfig(receive_maximum=10, max_qos=1, retain_available=False), clock)
    actions = channel.handle_in(Connect(client_id="dev1", clean_start=True, keep_alive=30,
                                        properties=Properties(session_expiry_interval=10**9)))
    assert actions == [OpenSession("dev1", True, 7 * 24 * 3600)]
    assert channel.state is State.CONNECTING
    actions = channel.handle_event(SessionOpened(False))
    (connack,) = sent(actions)
    assert connack.session_present is False and connack.reason_code is R.SUCCESS
    props = connack.properties
    assert props.receive_maximum == 10 and props.maximum_qos == 1 and props.retain_available is False
    assert props.session_expiry_interval == 7 * 24 * 3600  # capped: the client is told
    assert ArmTimer("keepalive", 45.0) in actions
    encode(connack, MQTT_5)


def test_connect_311_empty_client_id_with_clean_session_0_is_identifier_rejected():
    channel = Channel(ChannelConfig(), Clock())
    actions = channel.handle_in(Connect(protocol_level=MQTT_311, client_id="", clean_start=False))
    (connack,) = sent(actions)
    assert encode(connack, MQTT_311) == b"\x20\x02\x00\x02"  # return code 2: identifier rejected
    assert of(actions, Close)[0].reason is R.CLIENT_IDENTIFIER_NOT_VALID
    assert not of(actions, OpenSession) and channel.state is State.CLOSED


def test_empty_client_id_is_assigned_and_told_only_in_v5():
    channel, _, actions = connect(MQTT_5, client_id="")
    assert channel.client_id.startswith("lightgate-")
    assert sent(actions)[0].properties.assigned_client_identifier == channel.client_id
    channel, _, actions = connect(MQTT_311, client_id="")
    assert channel.client_id.startswith("lightgate-")
    assert sent(actions)[0].properties == Properties()


def test_first_packet_not_connect_closes_without_answer():
    channel = Channel(ChannelConfig(), Clock())
    actions = channel.handle_in(Pingreq())
    assert sent(actions) == [] and of(actions, Close)[0].reason is R.PROTOCOL_ERROR
    assert channel.state is State.CLOSED
    assert channel.handle_in(Pingreq()) == []  # input after the close is dropped


def test_second_connect_is_a_protocol_error_that_publishes_the_will():
    channel, _, _ = connect(will_topic="dev/status", will_payload=b"gone")
    actions = channel.handle_in(Connect(client_id="dev1"))
    assert sent(actions) == [Disconnect(R.PROTOCOL_ERROR)]
    assert of(actions, PublishWill)[0].message.payload == b"gone"
    assert of(actions, CloseSession) == [CloseSession("dev1", 0, None)]


def test_decoder_errors_map_to_reason_codes_per_version():
    channel, _, _ = connect(MQTT_5)
    actions = channel.handle_protocol_error(RemoteProtocolError(R.MALFORMED_PACKET, "bad"))
    assert sent(actions) == [Disconnect(R.MALFORMED_PACKET)]
    channel, _, _ = connect(MQTT_311)
    actions = channel.handle_protocol_error(RemoteProtocolError(R.MALFORMED_PACKET, "bad"))
    assert sent(actions) == [] and of(actions, Close)
    # A CONNECT with an unknown protocol level: answered with return code 1 in the 3.1.1 form.
    channel = Channel(ChannelConfig(), Clock())
    actions = channel.handle_protocol_error(RemoteProtocolError(R.UNSUPPORTED_PROTOCOL_VERSION, "MQIsdp"))
    assert encode(sent(actions)[0], channel.protocol_level) == b"\x20\x02\x00\x01"
    assert error_packet(MQTT_5, True, R.KEEP_ALIVE_TIMEOUT) == Connack(reason_code=R.UNSPECIFIED_ERROR)


def test_enhanced_auth_is_refused_and_auth_packet_is_a_protocol_error():
    channel = Channel(ChannelConfig(), Clock())
    actions = channel.handle_in(Connect(properties=Properties(authentication_method="SCRAM")))
    assert sent(actions) == [Connack(reason_code=R.BAD_AUTHENTICATION_METHOD)]
    channel, _, _ = connect()
    actions = channel.handle_in(Auth(properties=Properties(authentication_method="SCRAM")))
    assert sent(actions) == [Disconnect(R.PROTOCOL_ERROR)]


def test_node_refusal_becomes_connack_reason():
    channel = Channel(ChannelConfig(), Clock())
    channel.handle_in(Connect(protocol_level=MQTT_311, client_id="x"))
    actions = channel.handle_event(SessionOpened(False, reason=R.BAD_USER_NAME_OR_PASSWORD))
    assert encode(sent(actions)[0], MQTT_311) == b"\x20\x02\x00\x04"
    assert channel.state is State.CLOSED


def test_a_refusal_for_the_nodes_own_state_is_a_connack_in_both_versions():
    # A full data disk (QUOTA_EXCEEDED): MQTT 5 says so [MQTT-3.2.2-7]; 3.1.1 has no such code, so it gets the
    # nearest, 3 Server unavailable, rather than a silent close [MQTT-3.2.2-5].
    for level, packet in ((MQTT_5, Connack(reason_code=R.QUOTA_EXCEEDED)),
                          (MQTT_311, Connack(reason_code=R.SERVER_UNAVAILABLE))):
        channel = Channel(ChannelConfig(reason_strings=False), Clock())
        channel.handle_in(Connect(protocol_level=level, client_id="x", clean_start=True))
        actions = channel.handle_event(SessionOpened(False, reason=R.QUOTA_EXCEEDED))
        assert sent(actions) == [packet]
        assert channel.state is State.CLOSED


def test_packets_before_connack_are_processed_after_it():
    channel = Channel(ChannelConfig(), Clock())
    channel.handle_in(Connect(client_id="dev1"))
    assert channel.handle_in(Pingreq()) == []
    actions = channel.handle_event(SessionOpened(False))
    assert [type(p) for p in sent(actions)] == [Connack, Pingresp]


def test_session_present_only_when_resumed_without_clean_start():
    state = SessionState("dev1", 3600)
    _, _, actions = connect(state=state, **persistent())
    assert sent(actions)[0].session_present is True
    channel = Channel(ChannelConfig(), Clock())
    channel.handle_in(Connect(client_id="dev1", clean_start=True))
    actions = channel.handle_event(SessionOpened(True, state))
    assert sent(actions)[0].session_present is False


# --- keep alive -------------------------------------------------------------------------------


def test_keepalive_fires_at_one_and_a_half_times_and_publishes_will():
    channel, clock, actions = connect(keep_alive=10, will_topic="dev/lwt", will_payload=b"x")
    assert ArmTimer("keepalive", 15.0) in actions
    clock.t += 9
    channel.handle_in(Pingreq())
    clock.t += 6  # 15 s since CONNECT, 6 s since the PINGREQ: re-armed for the rest
    assert channel.handle_timeout("keepalive") == [ArmTimer("keepalive", pytest.approx(9.0))]
    clock.t += 9
    actions = channel.handle_timeout("keepalive")
    assert sent(actions) == [Disconnect(R.KEEP_ALIVE_TIMEOUT)]
    assert of(actions, PublishWill) and of(actions, Close)[0].reason is R.KEEP_ALIVE_TIMEOUT


def test_keepalive_counts_bytes_waiting_unread_as_received():
    channel, clock, _ = connect(keep_alive=10)
    clock.t += 15  # nothing read for 1.5 x keep alive, but the client's bytes wait in the kernel (a busy node)
    assert channel.handle_timeout("keepalive", input_waiting=True) == [ArmTimer("keepalive", 15.0)]
    clock.t += 15  # the bytes were never read nor anything new sent: the keep alive is not extended again
    actions = channel.handle_timeout("keepalive")
    assert of(actions, Close)[0].reason is R.KEEP_ALIVE_TIMEOUT


def test_keepalive_zero_disables_and_max_keepalive_caps_mqtt5_clients():
    _, _, actions = connect(keep_alive=0)
    assert not of(actions, ArmTimer)
    for asked, told in ((0, 20), (120, 20), (20, None), (10, None)):
        channel, _, actions = connect(config=ChannelConfig(max_keepalive=20), keep_alive=asked)
        assert sent(actions)[0].properties.server_keep_alive == told, asked
        assert channel.keep_alive == (told or asked)
        assert ArmTimer("keepalive", channel.keep_alive * 1.5) in actions


# --- inbound PUBLISH --------------------------------------------------------------------------


def test_qos1_is_acked_only_after_the_store_appended_it():
    channel, _, _ = connect()
    actions = channel.handle_in(Publish("t/1", b"v", qos=1, packet_id=7, properties=Properties(content_type="x")))
    (append,) = of(actions, Append)
    assert sent(actions) == []
    stored = append.messages[0]
    assert (stored.topic, stored.payload, stored.qos, stored.client_id) == ("t/1", b"v", 1, "dev1")
    assert decoded(stored.properties).content_type == "x" and stored.born_ms == int(T0 * 1000)
    assert sent(channel.handle_event(Appended(append.ref))) == [Puback(7)]


def test_qos0_append_needs_no_answer():
    channel, _, _ = connect()
    actions = channel.handle_in(Publish("t/1", b"v"))
    assert of(actions, Append)[0].ref is None and sent(actions) == []


def test_store_failure_is_a_reason_in_v5_and_a_close_in_311():
    channel, _, _ = connect(MQTT_5)
    ref = of(channel.handle_in(Publish("t", qos=1, packet_id=1)), Append)[0].ref
    assert sent(channel.handle_event(Appended(ref, False, R.QUOTA_EXCEEDED))) == [Puback(1, R.QUOTA_EXCEEDED)]
    channel, _, _ = connect(MQTT_311)
    ref = of(channel.handle_in(Publish("t", qos=1, packet_id=1)), Append)[0].ref
    actions = channel.handle_event(Appended(ref, False, R.QUOTA_EXCEEDED))
    assert sent(actions) == [] and of(actions, Close)


class Denying:
    """An ``Authorizer`` that refuses the topics and filters under ``no/``."""

    def may_publish(self, topic: str) -> bool:
        return not topic.startswith("no/")

    def may_subscribe(self, filter: str) -> bool:
        return not filter.startswith("no/")

    def may_read(self, topic: str) -> bool:
        return not topic.startswith("no/")


def test_unauthorised_publish_is_dropped_0x87_in_v5_and_acknowledged_in_311():
    """The channel asks its injected ``Authorizer``: a refused message never reaches the node (no ``Append``),
    only its ``Denied`` for the count and the log line."""
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    actions = channel.handle_in(Publish("no/t", qos=1, packet_id=1))
    assert not of(actions, Append) and of(actions, Denied) == [Denied("publish", "no/t", "QoS 1 message dropped")]
    assert sent(actions) == [Puback(1, R.NOT_AUTHORIZED)]
    assert of(channel.handle_in(Publish("no/t", qos=0)), Denied) and not of(channel.handle_in(Publish("ok")), Denied)
    channel, _, _ = connect(MQTT_311, authorizer=Denying())
    actions = channel.handle_in(Publish("no/t", qos=1, packet_id=1))
    assert sent(actions) == [Puback(1)] and not of(actions, Close)  # 3.1.1 has no negative ack
    assert sent(channel.handle_in(Publish("no/t", qos=2, packet_id=2))) == [Pubrec(2)]
    assert sent(channel.handle_in(Pubrel(2))) == [Pubcomp(2)]


def test_a_refused_publish_is_answered_after_the_messages_read_before_it():
    """[MQTT-4.6.0-2]: PUBACKs in the order the PUBLISHes came, though a refusal needs no store write."""
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    (first,) = of(channel.handle_in(Publish("ok/1", qos=1, packet_id=1)), Append)
    actions = channel.handle_in(Publish("no/2", qos=1, packet_id=2))
    assert sent(actions) == [] and of(actions, Denied)  # its answer waits for the first one's
    (third,) = of(channel.handle_in(Publish("ok/3", qos=1, packet_id=3)), Append)
    assert sent(channel.handle_event(Appended(first.ref))) == [Puback(1), Puback(2, R.NOT_AUTHORIZED)]
    assert sent(channel.handle_event(Appended(third.ref))) == [Puback(3)]


def _round(level: int, **fields) -> tuple[Channel, list[Appended]]:
    """A channel that read five QoS 1 PUBLISHes in one round (the second refused by the ACL), and the answers of
    their store appends: the fourth not stored (a full disk)."""
    channel, _, _ = connect(level, authorizer=Denying(), **fields)
    refs = [a.ref for pid, topic in enumerate(("ok/1", "no/2", "ok/3", "ok/4", "ok/5"), 1)
            for a in of(channel.handle_in(Publish(topic, qos=1, packet_id=pid)), Append)]
    return channel, [Appended(ref, ref != refs[2], R.SUCCESS if ref != refs[2] else R.QUOTA_EXCEEDED)
                     for ref in refs]


@pytest.mark.parametrize("fields", [{}, {"properties": Properties(maximum_packet_size=64)}], ids=["", "max-packet"])
def test_a_rounds_acknowledgements_as_one_list_answer_as_they_would_one_by_one(fields):
    """``handle_events`` (a read round's ``Appended`` for one connection): PUBACKs in the order the PUBLISHes came
    [MQTT-4.6.0-2], each with its reason [MQTT-3.4.2-1]; in 3.1.1, which cannot refuse, the failure closes and what
    follows it sends nothing; the same actions as ``handle_event`` one by one."""
    channel, events = _round(MQTT_5, **fields)
    actions = channel.handle_events(events)
    assert sent(actions) == [Puback(1), Puback(2, R.NOT_AUTHORIZED), Puback(3), Puback(4, R.QUOTA_EXCEEDED),
                             Puback(5)]
    other, events = _round(MQTT_5, **fields)
    assert [a for e in events for a in other.handle_event(e)] == actions
    channel, events = _round(MQTT_311, **fields)
    actions = channel.handle_events(events)
    assert sent(actions) == [Puback(1), Puback(2), Puback(3)] and of(actions, Close)
    assert channel.state is not State.CONNECTED
    other, events = _round(MQTT_311, **fields)
    assert [type(a) for e in events for a in other.handle_event(e)] == [type(a) for a in actions]


def test_a_refused_filter_is_0x87_in_the_suback_and_never_activated():
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    actions = channel.handle_in(Subscribe(1, (("ok/+", SubscriptionOptions(qos=1)), ("no/+", SubscriptionOptions()))))
    (activate,) = of(actions, Activate)
    assert [sub.filter for sub in activate.subscriptions] == ["ok/+"]
    assert of(actions, Denied) == [Denied("subscribe", "no/+", "filter refused")]
    suback = sent(channel.handle_event(Activated(activate.ref, {"ok/+": 0})))[0]
    assert suback.reason_codes == (R.GRANTED_QOS_1, R.NOT_AUTHORIZED)


def test_qos2_exactly_once_flow_and_duplicates():
    """[MQTT-4.3.3-2]: PUBREC once stored; the packet id is held until PUBREL; PUBCOMP once the release is durable."""
    channel, _, _ = connect(**persistent())
    (append,) = of(channel.handle_in(Publish("t", b"1", qos=2, packet_id=3)), Append)
    assert append.messages[0].packet_id == 3  # the record keeps it: the store knows the flow awaits PUBREL
    assert channel.handle_in(Publish("t", b"1", qos=2, packet_id=3, dup=True)) == []  # still being stored
    actions = channel.handle_event(Appended(append.ref, position=Position(0, 700)))
    assert of(actions, SaveSession) == []  # the record is the state: no session write per message
    assert sent(actions) == [Pubrec(3)]
    actions = channel.handle_in(Publish("t", b"1", qos=2, packet_id=3, dup=True))
    assert of(actions, Append) == [] and sent(actions) == [Pubrec(3)]
    actions = channel.handle_in(Pubrel(3))
    (release,) = of(actions, ReleaseInbound)
    assert (release.client_id, release.packet_id, release.position) == ("dev1", 3, Position(0, 700))
    assert sent(actions) == []
    assert channel.handle_in(Pubrel(3)) == []  # the release is being written: one PUBCOMP follows
    assert sent(channel.handle_event(InboundReleased(release.ref))) == [Pubcomp(3)]
    assert sent(channel.handle_in(Pubrel(3))) == [Pubcomp(3, R.PACKET_IDENTIFIER_NOT_FOUND)]


def test_pubrel_for_unknown_id_in_311_still_completes():
    channel, _, _ = connect(MQTT_311)
    assert sent(channel.handle_in(Pubrel(9))) == [Pubcomp(9)]


def test_qos2_state_survives_reconnect_so_a_resend_is_not_stored_twice():
    # 6: a flow of an earlier version's blob, unknown to the store
    state = SessionState("dev1", 3600, awaiting={5: Position(0, 700)}, awaiting_rel=frozenset({6}))
    channel, _, _ = connect(state=state, **persistent())
    actions = channel.handle_in(Publish("t", qos=2, packet_id=5, dup=True))
    assert of(actions, Append) == [] and sent(actions) == [Pubrec(5)]
    assert of(channel.handle_in(Pubrel(5)), ReleaseInbound)[0].position == Position(0, 700)
    assert sent(channel.handle_in(Pubrel(6))) == [Pubcomp(6)]  # the store never knew it: nothing to write


def test_a_connection_closing_waits_for_its_releases_before_saving():
    channel, _, _ = connect(**persistent())
    (append,) = of(channel.handle_in(Publish("t", qos=2, packet_id=5)), Append)
    channel.handle_event(Appended(append.ref, position=Position(0, 90)))
    (release,) = of(channel.handle_in(Pubrel(5)), ReleaseInbound)
    assert of(channel.handle_event(ConnectionLost("reset")), SaveSession) == []  # the release is not written yet
    (save,) = of(channel.handle_event(InboundReleased(release.ref)), SaveSession)
    assert save.state.awaiting == {} and save.state.detached


def test_a_release_the_store_could_not_record_sends_no_pubcomp_and_the_flow_still_awaits_its_pubrel():
    """[MQTT-4.3.3-2]: no PUBCOMP for a release not recorded; the closing session settles without waiting and
    keeps the flow, so the client's PUBREL after reconnecting is answered."""
    channel, _, _ = connect(**persistent())
    (append,) = of(channel.handle_in(Publish("t", qos=2, packet_id=5)), Append)
    channel.handle_event(Appended(append.ref, position=Position(0, 90)))
    (release,) = of(channel.handle_in(Pubrel(5)), ReleaseInbound)
    assert channel.handle_event(InboundReleased(release.ref, ok=False)) == []
    (save,) = of(channel.handle_event(ConnectionLost("the store is not reachable")), SaveSession)
    assert save.state.awaiting == {5: Position(0, 90)} and save.state.detached


def test_a_publish_keeps_a_connected_channel_connected():
    """handle_in's fast path for PUBLISH skips the transition table on the strength of this entry."""
    assert TRANSITIONS[State.CONNECTED][Publish] is State.CONNECTED


def test_inbound_checks_qos_retain_and_topic():
    channel, _, _ = connect(config=ChannelConfig(max_qos=1))
    assert sent(channel.handle_in(Publish("t", qos=2, packet_id=1))) == [Disconnect(R.QOS_NOT_SUPPORTED)]
    channel, _, _ = connect(config=ChannelConfig(retain_available=False))
    assert sent(channel.handle_in(Publish("t", retain=True))) == [Disconnect(R.RETAIN_NOT_SUPPORTED)]
    # A wildcard in a topic name breaks [MQTT-3.3.2-2]: a protocol error (0x90 is for names "correctly formed, but
    # not accepted", as the topic limits answer).
    channel, _, _ = connect()
    assert sent(channel.handle_in(Publish("a/+"))) == [Disconnect(R.PROTOCOL_ERROR)]
    channel, _, _ = connect()  # a topic that passed is not checked again; any other one is
    assert [of(channel.handle_in(Publish("a/b")), Append) != [] for _ in range(2)] == [True, True]
    assert sent(channel.handle_in(Publish("a/#"))) == [Disconnect(R.PROTOCOL_ERROR)]


def test_receive_maximum_exceeded_disconnects():
    channel, _, _ = connect(config=ChannelConfig(receive_maximum=2))
    channel.handle_in(Publish("t", qos=1, packet_id=1))
    channel.handle_in(Publish("t", qos=2, packet_id=2))
    actions = channel.handle_in(Publish("t", qos=1, packet_id=3))
    assert sent(actions) == [Disconnect(R.RECEIVE_MAXIMUM_EXCEEDED)]


def test_inbound_topic_aliases():
    channel, _, _ = connect(config=ChannelConfig(topic_alias_maximum=2))
    first = of(channel.handle_in(Publish("a/b", b"1", properties=Properties(topic_alias=2))), Append)[0]
    assert decoded(first.messages[0].properties).topic_alias is None  # per connection: never stored
    second = of(channel.handle_in(Publish("", b"2", properties=Properties(topic_alias=2))), Append)[0]
    assert second.messages[0].topic == "a/b"
    assert sent(channel.handle_in(Publish("", properties=Properties(topic_alias=1)))) == [Disconnect(R.PROTOCOL_ERROR)]
    channel, _, _ = connect(config=ChannelConfig(topic_alias_maximum=2))
    actions = channel.handle_in(Publish("x", properties=Properties(topic_alias=3)))
    assert sent(actions) == [Disconnect(R.TOPIC_ALIAS_INVALID)]


def test_close_waits_for_pending_qos2_append_before_saving_the_session():
    channel, _, _ = connect(**persistent())
    (append,) = of(channel.handle_in(Publish("t", qos=2, packet_id=4)), Append)
    actions = channel.handle_event(ConnectionLost("reset"))
    assert of(actions, Close) and not of(actions, SaveSession)
    assert channel.state is State.DISCONNECTING
    actions = channel.handle_event(Appended(append.ref))
    assert sent(actions) == [] and of(actions, SaveSession)[0].state.awaiting_rel == {4}
    assert channel.state is State.CLOSED


# --- SUBSCRIBE / UNSUBSCRIBE ------------------------------------------------------------------


def test_subscribe_mixed_granted_and_refused_filters_v5():
    config = ChannelConfig(wildcard_available=False, max_qos=1)
    channel, _, _ = connect(config=config)
    activate, actions = subscribe(channel, ("a/b", SubscriptionOptions(qos=2)), ("a/+", SubscriptionOptions()))
    assert [s.filter for s in activate.subscriptions] == ["a/b"]
    (suback,) = [p for p in sent(actions) if type(p) is Suback]
    assert suback.reason_codes == (R.GRANTED_QOS_1, R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED)


def test_subscribe_failures_are_0x80_in_311_and_all_refused_needs_no_activation():
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(wildcard_available=False))
    actions = channel.handle_in(Subscribe(2, (("a/#", SubscriptionOptions()), ("+", SubscriptionOptions()))))
    assert not of(actions, Activate)
    (suback,) = sent(actions)
    assert encode(suback, MQTT_311) == b"\x90\x04\x00\x02\x80\x80"


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
@pytest.mark.parametrize("malformed", ["a/#/b", "a+/b", "", "$share//x", "$share/g+/x", "$share/g"])
@pytest.mark.parametrize("packet", ["subscribe", "unsubscribe"])
def test_a_malformed_topic_filter_is_a_protocol_error(level, malformed, packet):
    """A filter that breaks the wildcard rules [MQTT-4.7.1-2/3], is empty [MQTT-4.7.3-1] or is a malformed shared
    subscription [MQTT-4.8.2-1/2] is a protocol violation, not a refused subscription: 0x8F (and 3.1.1's 0x80) is
    for filters "correctly formed" but not allowed. The server closes (3.1.1 [MQTT-4.8.0-1]; 5.0 section 4.13.1,
    DISCONNECT 0x82), whatever valid filters the packet also carries."""
    channel, _, _ = connect(level)
    entries = (("a/b", SubscriptionOptions()), (malformed, SubscriptionOptions()))
    actions = channel.handle_in(Subscribe(1, entries) if packet == "subscribe" else
                                Unsubscribe(1, tuple(f for f, _ in entries)))
    assert sent(actions) == ([Disconnect(R.PROTOCOL_ERROR)] if level == MQTT_5 else [])
    assert of(actions, Close)[0].reason is R.PROTOCOL_ERROR and not of(actions, Activate)


def test_node_can_refuse_individual_filters():
    channel, _, _ = connect()
    actions = channel.handle_in(Subscribe(1, (("a", SubscriptionOptions()), ("b", SubscriptionOptions()))))
    ref = of(actions, Activate)[0].ref
    actions = channel.handle_event(Activated(ref, {"a": 0}, reasons={"b": R.NOT_AUTHORIZED}))
    assert sent(actions)[0].reason_codes == (R.GRANTED_QOS_0, R.NOT_AUTHORIZED)
    assert list(channel.session.subscriptions) == ["a"]


def test_subscription_ids_unsupported_is_a_protocol_error():
    channel, _, _ = connect(config=ChannelConfig(subscription_ids_available=False))
    actions = channel.handle_in(Subscribe(1, (("a", SubscriptionOptions()),), Properties(subscription_identifiers=(4,))))
    assert sent(actions) == [Disconnect(R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED)]


def test_shared_subscription_parsed_into_group_and_queue_without_retained():
    channel, _, _ = connect()
    activate, actions = subscribe(channel, ("$share/g1/a/+", SubscriptionOptions(qos=1)))
    (sub,) = activate.subscriptions
    assert (sub.filter, sub.queue, sub.group) == ("$share/g1/a/+", "a/+", "g1")
    assert activate.retained == ()
    (pull,) = of(actions, Pull)
    assert (pull.filter, pull.queue, pull.group) == ("$share/g1/a/+", "a/+", "g1")


def test_no_local_on_shared_subscription_is_a_protocol_error_in_v5():
    channel, _, _ = connect(will_topic="w")
    actions = channel.handle_in(Subscribe(1, (("$share/g/a", SubscriptionOptions(no_local=True)),)))
    assert sent(actions) == [Disconnect(R.PROTOCOL_ERROR)] and of(actions, PublishWill)


def test_unsubscribe_releases_and_reports_per_filter():
    channel, _, _ = connect(**persistent())
    subscribe(channel, ("a/+", SubscriptionOptions()))
    actions = channel.handle_in(Unsubscribe(3, ("a/+", "x")))
    assert of(actions, Release) == [Release("dev1", ("a/+",))]
    (patch,) = of(actions, PatchSession)
    assert patch.parts == {"a/+": None}  # the unsubscribed filter alone
    assert sent(actions) == [Unsuback(3, (R.SUCCESS, R.NO_SUBSCRIPTION_EXISTED))]
    channel, _, _ = connect(MQTT_311)
    assert encode(sent(channel.handle_in(Unsubscribe(3, ("x",))))[0], MQTT_311) == b"\xb0\x02\x00\x03"


# --- delivery ---------------------------------------------------------------------------------


def test_outbound_qos_is_the_minimum_of_subscription_and_message():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)), ("c", SubscriptionOptions(qos=2)))
    out = delivered(channel.handle_event(Pulled("a/b", (msg(0, qos=2),), 1)))
    assert [(p.qos, p.packet_id) for p in out] == [(1, 1)]
    out = delivered(channel.handle_event(Pulled("c", (msg(0, "c", qos=0, queue="c"),), 1)))
    assert [(p.qos, p.packet_id) for p in out] == [(0, None)]


def test_in_flight_window_is_the_clients_receive_maximum():
    channel, _, _ = connect(properties=Properties(receive_maximum=2))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    out = delivered(channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(5)), 5)))
    assert [p.payload for p in out] == [b"m0", b"m1"]
    out = delivered(channel.handle_in(Puback(out[1].packet_id)))
    assert [p.payload for p in out] == [b"m2"]


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
def test_pubcomp_for_a_qos1_delivery_closes_the_connection(level):
    """A wrong-kind acknowledgement of a packet id in flight is a protocol violation (test_session.py):
    5.0 says DISCONNECT 0x82 [4.13], 3.1.1 closes without a packet [MQTT-4.8.0-1]; the session keeps the message."""
    channel, _, _ = connect(level)
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    (out,) = delivered(channel.handle_event(Pulled("a/b", (msg(0),), 1)), level)
    actions = channel.handle_in(Pubcomp(out.packet_id))
    assert sent(actions) == ([Disconnect(R.PROTOCOL_ERROR)] if level == MQTT_5 else [])
    assert of(actions, Close)[0].reason is R.PROTOCOL_ERROR and not of(actions, CommitOffsets)


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
def test_a_puback_on_an_open_connection_counts_for_keep_alive_and_one_for_a_qos2_flow_closes_it(level):
    """A subscriber's PUBACK skips the state step while the connection is open (its state stays CONNECTED), and
    keeps what the step did not do: it is traffic for keep alive [MQTT-3.1.2-22], and a PUBACK for the packet id
    of a QoS 2 delivery is a protocol violation (5.0: DISCONNECT 0x82; 3.1.1: closed [MQTT-4.8.0-1])."""
    channel, clock, _ = connect(level, keep_alive=10)
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)), ("a/c", SubscriptionOptions(qos=2)))
    (first,) = delivered(channel.handle_event(Pulled("a/b", (msg(0),), 1)), level)
    clock.t += 12
    assert not of(channel.handle_in(Puback(first.packet_id)), Close)
    clock.t += 12  # 24 s after the CONNECT, 12 s after the PUBACK: within 1.5 x keep alive of the PUBACK
    assert not of(channel.handle_timeout("keepalive"), Close)
    (exactly_once,) = delivered(channel.handle_event(Pulled("a/c", (msg(0, "a/c", qos=2, queue="a/c"),), 1)), level)
    actions = channel.handle_in(Puback(exactly_once.packet_id))
    assert sent(actions) == ([Disconnect(R.PROTOCOL_ERROR)] if level == MQTT_5 else [])
    assert of(actions, Close)[0].reason is R.PROTOCOL_ERROR


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
def test_a_run_of_pubacks_acknowledges_each_in_order_and_closes_at_one_for_a_qos2_flow(level):
    """A read's PUBACKs as one run (``handle_pubacks``): each id is acknowledged as a PUBACK of its own would be
    (unknown and repeated ids ignored, keep alive counted [MQTT-3.1.2-22]), the offsets moved by the run commit
    once, and a PUBACK for a QoS 2 delivery's id closes the connection there (5.0: DISCONNECT 0x82; 3.1.1
    [MQTT-4.8.0-1]): the ids before it are acknowledged, the ones after it are not."""
    channel, clock, _ = connect(level, keep_alive=10, config=ChannelConfig(commit_every=2))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)), ("a/c", SubscriptionOptions(qos=2)))
    out = delivered(channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(6)), 6)), level)
    (exactly_once,) = delivered(channel.handle_event(Pulled("a/c", (msg(0, "a/c", qos=2, queue="a/c"),), 1)), level)
    clock.t += 12
    ids = [p.packet_id for p in out]
    actions = channel.handle_pubacks(Puback(ids[1]), [ids[0], 999, ids[2], ids[1], ids[3]])
    assert not of(actions, Close)
    assert [c.offsets for c in of(actions, CommitOffsets)] == [{"a/b": 4}]  # four acknowledgements, one commit
    clock.t += 12  # 24 s after the CONNECT, 12 s after the run: within 1.5 x keep alive of it
    assert not of(channel.handle_timeout("keepalive"), Close)
    actions = channel.handle_pubacks(Puback(ids[4]), [exactly_once.packet_id, ids[5]])
    assert sent(actions) == ([Disconnect(R.PROTOCOL_ERROR)] if level == MQTT_5 else [])
    assert of(actions, Close)[0].reason is R.PROTOCOL_ERROR
    assert sorted(e.packet_id for e in channel.conn.session.inflight) == sorted([ids[5], exactly_once.packet_id])


def test_a_run_of_pubacks_before_the_connection_is_open_is_each_puback_in_turn():
    """Before the CONNACK a PUBACK waits with the other packets (``max_queued_packets``); a run does too, one
    packet each, so it meets the same bound."""
    channel = Channel(ChannelConfig(max_queued_packets=2), Clock())
    assert of(channel.handle_in(Connect(protocol_level=MQTT_5, client_id="c")), OpenSession)
    actions = channel.handle_pubacks(Puback(1), [2, 3])
    assert sent(actions) == [Connack(False, R.QUOTA_EXCEEDED)] and of(actions, Close)  # before the CONNACK: refused


def test_311_window_is_the_configured_default():
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(default_receive_maximum=3))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    out = delivered(channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(5)), 5)), MQTT_311)
    assert len(out) == 3


def _all_delivered(channel: Channel, actions: list, level: int) -> list[Publish]:
    """What ``actions`` deliver, and what each write of them lets out after (a pump hands out a turn at a time)."""
    out = []
    while deliveries := of(actions, Deliver):
        out += delivered(deliveries, level)
        actions = [a for d in deliveries for a in channel.handle_event(SocketWritten(d.seq))]
    return out


def test_a_311_clients_default_window_fills_in_order_and_each_puback_lets_the_next_one_out():
    """The 3.1.1 window (``mqtt.inflight_311``) holds a fan-in read round (issue 31): at most that many QoS 1
    messages unacknowledged, in the order stored [MQTT-4.6.0-6], then one more per PUBACK."""
    window = ChannelConfig().default_receive_maximum
    channel, _, _ = connect(MQTT_311)
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    count = window + 3
    out = _all_delivered(channel, channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(count)), count)),
                         MQTT_311)
    assert [p.payload for p in out] == [b"m%d" % i for i in range(window)]
    assert len({p.packet_id for p in out}) == window and not any(p.dup for p in out)
    more = _all_delivered(channel, channel.handle_in(Puback(out[0].packet_id)) + channel.input_done(), MQTT_311)
    assert [p.payload for p in more] == [b"m%d" % window]


def test_an_mqtt5_receive_maximum_above_the_311_window_is_honoured_up_to_max_inflight():
    """[MQTT-3.3.4-9]: never more unacknowledged than the client's Receive Maximum; the server's own cap
    (``max_inflight``) is no smaller than the 3.1.1 window, so a client that asks for that much gets it."""
    config = ChannelConfig()
    assert config.max_inflight >= config.default_receive_maximum
    for asked, window in ((2000, 2000), (65535, config.max_inflight)):
        channel, _, _ = connect(properties=Properties(receive_maximum=asked))
        subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
        count = window + 5
        out = _all_delivered(channel, channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(count)),
                                                                  count)), MQTT_5)
        assert [p.payload for p in out] == [b"m%d" % i for i in range(window)], asked


def test_offsets_commit_only_contiguously_and_in_batches():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)), starts={"a/b": 5})
    out = delivered(channel.handle_event(Pulled("a/b", (msg(5), msg(6), msg(7)), 8)))
    pids = [p.packet_id for p in out]
    actions = channel.handle_in(Puback(pids[1]))
    assert ArmTimer("commit", 1.0) in actions and not of(actions, CommitOffsets)
    assert channel.handle_timeout("commit") == []  # 6 acked but 5 is not: nothing moves
    channel.handle_in(Puback(pids[0]))
    assert channel.handle_timeout("commit") == [CommitOffsets("dev1", {"a/b": 7})]
    channel.handle_in(Puback(pids[2]))
    assert channel.handle_timeout("commit") == [CommitOffsets("dev1", {"a/b": 8})]


def test_commit_every_n_acks_without_timer():
    channel, _, _ = connect(config=ChannelConfig(commit_every=2))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    out = delivered(channel.handle_event(Pulled("a/b", (msg(0), msg(1)), 2)))
    channel.handle_in(Puback(out[0].packet_id))
    actions = channel.handle_in(Puback(out[1].packet_id))
    assert of(actions, CommitOffsets) == [CommitOffsets("dev1", {"a/b": 2})]


def test_qos0_offsets_advance_on_socket_write():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=0)))
    actions = channel.handle_event(Pulled("a/b", (msg(0, qos=0), msg(1, qos=0)), 2))
    (deliver,) = of(actions, Deliver)
    assert channel.session.committed_offsets() == {"a/b": 0}
    channel.handle_event(SocketWritten(deliver.seq))
    assert channel.session.committed_offsets() == {"a/b": 2}


def test_qos1_and_qos2_outbound_flows_and_unique_packet_ids():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=2)))
    out = delivered(channel.handle_event(Pulled("a/b", (msg(0, qos=2), msg(1, qos=1)), 2)))
    assert len({p.packet_id for p in out}) == 2
    assert sent(channel.handle_in(Pubrec(out[0].packet_id))) == [Pubrel(out[0].packet_id)]
    channel.handle_in(Pubcomp(out[0].packet_id))
    channel.handle_in(Puback(out[1].packet_id))
    assert channel.session.inflight == () and channel.session.committed_offsets() == {"a/b": 2}


def test_lagging_session_keeps_pulling_until_the_head():
    channel, _, _ = connect(config=ChannelConfig(pull_batch=2))
    _, actions = subscribe(channel, ("a/b", SubscriptionOptions(qos=0)), starts={"a/b": 0})
    assert of(actions, Pull) == [Pull("a/b", "a/b", 0, 2)]
    actions = channel.handle_event(Pulled("a/b", (msg(0, qos=0), msg(1, qos=0)), 2))
    assert of(actions, Pull) == [Pull("a/b", "a/b", 2, 2)]  # no event needed to go on
    actions = channel.handle_event(Pulled("a/b", (), 2))
    assert of(actions, Pull) == []  # reached the head: wait for news
    actions = channel.handle_event(QueueAdvanced("a/b", 3))
    assert of(actions, Pull) == [Pull("a/b", "a/b", 2, 2)]


def test_retain_handling_and_retain_as_published():
    channel, _, _ = connect()
    retained_msg = Message("a/b", b"r", 1, retain=True)
    activate, actions = subscribe(channel, ("a/b", SubscriptionOptions(qos=1, retain_handling=1)),
                                  ("x/#", SubscriptionOptions(retain_handling=2)),
                                  retained=(("a/b", retained_msg),))
    assert activate.retained == ("a/b",)
    out = delivered(actions)
    assert [(p.payload, p.retain, p.qos) for p in out] == [(b"r", True, 1)]
    activate, _ = subscribe(channel, ("a/b", SubscriptionOptions(retain_handling=1)), packet_id=2)
    assert activate.retained == ()  # handling 1: only for a new subscription
    activate, _ = subscribe(channel, ("a/b", SubscriptionOptions(retain_handling=0)), packet_id=3)
    assert activate.retained == ("a/b",)
    # Live traffic: RETAIN only with Retain As Published.
    subscribe(channel, ("p", SubscriptionOptions(retain_as_published=True)), ("q", SubscriptionOptions()),
              packet_id=4)
    out = delivered(channel.handle_event(Pulled("p", (msg(0, "p", 0, "p", retain=True),), 1)))
    assert out[0].retain is True
    out = delivered(channel.handle_event(Pulled("q", (msg(0, "q", 0, "q", retain=True),), 1)))
    assert out[0].retain is False


def test_no_local_skips_own_messages_and_still_advances():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1, no_local=True)))
    actions = channel.handle_event(Pulled("a/b", (msg(0, client_id="dev1"), msg(1, client_id="other")), 2))
    assert [p.payload for p in delivered(actions)] == [b"m1"]
    assert channel.session.committed_offsets() == {"a/b": 1}


def test_overlapping_subscriptions_each_deliver_with_their_own_id_and_qos():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=0)), subscription_identifiers=(7,))
    subscribe(channel, ("a/+", SubscriptionOptions(qos=1)), packet_id=2, subscription_identifiers=(9,))
    out = delivered(channel.handle_event(Pulled("a/b", (msg(0, qos=1),), 1)))
    out += delivered(channel.handle_event(Pulled("a/+", (msg(0, qos=1, queue="a/+"),), 1)))
    assert [(p.qos, p.properties.subscription_identifiers) for p in out] == [(0, (7,)), (1, (9,))]


def test_user_properties_and_friends_pass_through():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    props = Properties(payload_format_indicator=1, content_type="json", response_topic="r", correlation_data=b"c",
                       user_properties=(("k", "v"),))
    (out,) = delivered(channel.handle_event(Pulled("a/b", (msg(0, properties=props),), 1)))
    assert out.properties == props


def test_message_too_big_for_the_client_is_skipped_and_its_offset_advances():
    channel, _, _ = connect(properties=Properties(maximum_packet_size=40))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    big = replace(msg(0), payload=b"x" * 100)
    out = delivered(channel.handle_event(Pulled("a/b", (big, msg(1)), 2)))
    assert [p.payload for p in out] == [b"m1"]
    channel.handle_in(Puback(out[0].packet_id))
    assert channel.session.committed_offsets() == {"a/b": 2}


def test_message_expiry_skips_expired_and_sends_remaining_interval():
    channel, clock, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=0)))
    clock.t += 30.5
    fresh = msg(0, qos=0, properties=Properties(message_expiry_interval=60))
    stale = msg(1, qos=0, properties=Properties(message_expiry_interval=30))
    (out,) = delivered(channel.handle_event(Pulled("a/b", (fresh, stale), 2)))
    assert out.properties.message_expiry_interval == 30


def test_message_expiry_interval_zero_goes_to_the_connections_up_when_it_was_stored_and_to_no_one_later():
    """MQTT 5.0 section 3.3.2.3.3: the interval is the message's lifetime in seconds, "if absent, the Application
    Message does not expire"; 0 is present, a lifetime of none. The server deletes a message whose interval passed
    before it started onward delivery to a subscriber [MQTT-3.3.2-5]: delivery to a connected subscriber starts
    as it is stored, so it goes there, carrying 0 (the interval minus its wait [MQTT-3.3.2-6]); a session that
    connects later, and a retained-message delivery at subscribe time, are after its lifetime. It was dropped for
    every subscriber (Mosquitto delivers it)."""
    zero = Properties(message_expiry_interval=0)
    channel, clock, _ = connect(**persistent())
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    clock.t += 5.5  # the subscriber is slow to read it: it was stored while the connection was up
    (out,) = delivered(channel.handle_event(Pulled("a/b", (msg(0, properties=zero),), 1)))
    assert out.payload == b"m0" and out.properties.message_expiry_interval == 0
    earlier = replace(msg(1, properties=zero), store_ms=int(T0 * 1000) - 1)  # stored before this CONNECT
    assert delivered(channel.handle_event(Pulled("a/b", (earlier,), 2))) == []
    later = replace(msg(2, "r/zero", properties=zero, retain=True), store_ms=int(clock.t * 1000))
    lives = replace(later, topic="r/lives", payload=b"lives", properties=Properties(message_expiry_interval=60))
    _, actions = subscribe(channel, ("r/zero", SubscriptionOptions(qos=1)), ("r/lives", SubscriptionOptions(qos=1)),
                           packet_id=2, retained=(("r/zero", later), ("r/lives", lives)))
    assert [p.payload for p in delivered(actions)] == [b"lives"]  # the retained one of interval 0 has expired


def test_outbound_topic_aliases_replace_repeated_topics():
    channel, _, _ = connect(properties=Properties(topic_alias_maximum=1))
    subscribe(channel, ("a/+", SubscriptionOptions()))
    ms = tuple(msg(i, t, 0, "a/+") for i, t in enumerate(["a/b", "a/b", "a/c"]))
    out = delivered(channel.handle_event(Pulled("a/+", ms, 3)))
    assert [(p.topic, p.properties.topic_alias) for p in out] == [("a/b", 1), ("", 1), ("a/c", None)]


def test_311_subscriber_is_not_sent_an_expired_message():
    """[MQTT-3.3.2-5] binds the server for every subscriber: a 3.1.1 one cannot be told the interval, but an
    expired message is not sent to it either (it was, with its properties stripped)."""
    channel, clock, _ = connect(MQTT_311)
    subscribe(channel, ("a/b", SubscriptionOptions(qos=0)))
    clock.t += 30.5
    fresh = msg(0, qos=0, properties=Properties(message_expiry_interval=60))
    stale = msg(1, qos=0, properties=Properties(message_expiry_interval=30))
    out = delivered(channel.handle_event(Pulled("a/b", (fresh, stale), 2)), MQTT_311)
    assert [p.payload for p in out] == [b"m0"]


def test_311_delivery_carries_no_properties():
    channel, _, _ = connect(MQTT_311)
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    props = Properties(message_expiry_interval=60, user_properties=(("k", "v"),))
    (out,) = delivered(channel.handle_event(Pulled("a/b", (msg(0, properties=props),), 1)), MQTT_311)
    assert out.properties == Properties() and out.payload == b"m0"


def test_resend_after_reconnect_sets_dup_and_skips_what_was_acknowledged():
    channel, _, _ = connect(**persistent())
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)), starts={"a/b": 10})
    out = delivered(channel.handle_event(Pulled("a/b", (msg(10), msg(11), msg(12)), 13)))
    channel.handle_in(Puback(out[1].packet_id))  # 11 acknowledged out of order
    actions = channel.handle_event(ConnectionLost("reset"))
    (save,) = of(actions, SaveSession)
    state = save.state
    assert state.offsets == {"a/b": 10} and state.cursors == {"a/b": 13}
    assert [(e.offset, e.packet_id) for e in state.inflight] == [(10, out[0].packet_id), (12, out[2].packet_id)]

    channel, _, actions = connect(state=state, **persistent())
    assert of(actions, Pull) == [Pull("a/b", "a/b", 10, ChannelConfig().pull_batch)]
    resent = delivered(channel.handle_event(Pulled("a/b", (msg(10), msg(11), msg(12), msg(13)), 14)))
    assert [(p.payload, p.dup, p.packet_id) for p in resent] == [
        (b"m10", True, out[0].packet_id), (b"m12", True, out[2].packet_id), (b"m13", False, resent[2].packet_id)]
    assert resent[2].packet_id not in {out[0].packet_id, out[2].packet_id}


def test_pubrel_is_resent_after_reconnect_for_released_messages():
    channel, _, _ = connect(**persistent())
    subscribe(channel, ("a/b", SubscriptionOptions(qos=2)))
    (out,) = delivered(channel.handle_event(Pulled("a/b", (msg(0, qos=2),), 1)))
    channel.handle_in(Pubrec(out.packet_id))
    state = of(channel.handle_event(ConnectionLost("x")), SaveSession)[0].state
    _, _, actions = connect(state=state, **persistent())
    assert sent(actions)[1:] == [Pubrel(out.packet_id)]


# --- will, takeover, session end --------------------------------------------------------------


def test_normal_disconnect_discards_the_will_but_0x04_publishes_it():
    channel, _, _ = connect(will_topic="w", will_payload=b"bye")
    actions = channel.handle_in(Disconnect())
    assert not of(actions, PublishWill) and of(actions, Close)[0].reason is R.NORMAL_DISCONNECTION
    assert of(actions, CloseSession) == [CloseSession("dev1", 0, None)]  # the store drops the will it holds
    channel, _, _ = connect(will_topic="w", will_payload=b"bye", will_qos=1, will_retain=True)
    (will,) = of(channel.handle_in(Disconnect(R.DISCONNECT_WITH_WILL_MESSAGE)), PublishWill)
    assert (will.message.topic, will.message.qos, will.message.retain) == ("w", 1, True)


def test_will_on_connection_loss_with_delay_bounded_by_session_expiry():
    channel = Channel(ChannelConfig(), Clock())
    (opened,) = of(channel.handle_in(Connect(
        client_id="dev1", clean_start=False, will_topic="w",
        will_properties=Properties(will_delay_interval=600, content_type="t"),
        properties=Properties(session_expiry_interval=120))), OpenSession)
    will = opened.will  # the store holds it while the client is connected
    assert decode_properties(will.properties, 0, len(will.properties), PacketType.PUBLISH) == \
        Properties(content_type="t")  # the delay is not a PUBLISH property
    channel.handle_event(SessionOpened(False))
    actions = channel.handle_event(ConnectionLost("reset"))
    assert not of(actions, PublishWill)  # due later: the store publishes it after its delay
    assert of(actions, CloseSession)[0].will_delay_s == 120


def test_takeover_sends_0x8e_publishes_will_and_hands_the_session_over():
    channel, _, _ = connect(will_topic="w", **persistent())
    subscribe(channel, ("a/b", SubscriptionOptions()))
    actions = channel.handle_event(TakenOver())
    assert sent(actions) == [Disconnect(R.SESSION_TAKEN_OVER)] and of(actions, PublishWill)
    (save,) = of(actions, SaveSession)
    assert [s.filter for s in save.state.subscriptions] == ["a/b"]
    assert not of(actions, Release) and of(actions, CloseSession) == [CloseSession("dev1", 3600, None)]
    assert CancelTimer("keepalive") in actions


def test_takeover_ends_a_session_that_ends_with_its_connection():
    """[MQTT-3.1.2-6]: a session of Session Expiry 0 (3.1.1: Clean Session 1) is not reused by the next one."""
    channel, _, _ = connect(will_topic="w")
    subscribe(channel, ("a/b", SubscriptionOptions()))
    actions = channel.handle_event(TakenOver())
    assert sent(actions) == [Disconnect(R.SESSION_TAKEN_OVER)] and of(actions, PublishWill)
    assert not of(actions, SaveSession)
    assert of(actions, CloseSession) == [CloseSession("dev1", 0, None)]  # the store ends it: its filters go


def test_takeover_of_311_connection_closes_without_packet():
    channel, _, _ = connect(MQTT_311)
    actions = channel.handle_event(TakenOver())
    assert sent(actions) == [] and of(actions, Close)[0].reason is R.SESSION_TAKEN_OVER


def test_session_expiry_at_disconnect():
    channel, _, _ = connect(will_topic="w")  # CONNECT said expiry 0
    actions = channel.handle_in(Disconnect(properties=Properties(session_expiry_interval=60)))
    assert sent(actions) == [Disconnect(R.PROTOCOL_ERROR)] and of(actions, PublishWill)
    channel, _, _ = connect(**persistent())
    subscribe(channel, ("a/b", SubscriptionOptions()))
    actions = channel.handle_in(Disconnect(properties=Properties(session_expiry_interval=0)))
    assert of(actions, CloseSession) == [CloseSession("dev1", 0, None)]
    channel, _, _ = connect(**persistent())
    actions = channel.handle_in(Disconnect(properties=Properties(session_expiry_interval=30)))
    assert of(actions, SaveSession)[0].state.expiry_s == 30


def test_311_clean_session_0_is_persistent():
    channel, _, _ = connect(MQTT_311, clean=False)
    actions = channel.handle_in(Disconnect())
    assert of(actions, SaveSession)[0].state.expiry_s == ChannelConfig().session_expiry_311_s


def test_connection_lost_while_connecting_returns_the_opened_session():
    channel = Channel(ChannelConfig(), Clock())
    channel.handle_in(Connect(client_id="dev1", clean_start=False, properties=Properties(session_expiry_interval=60)))
    actions = channel.handle_event(ConnectionLost("reset"))
    assert of(actions, Close) and channel.state is State.DISCONNECTING
    actions = channel.handle_event(SessionOpened(True, SessionState("dev1", 60)))
    assert sent(actions) == [] and of(actions, SaveSession) and channel.state is State.CLOSED


def test_unexpected_node_events_are_local_errors():
    channel, _, _ = connect()
    with pytest.raises(LocalProtocolError):
        channel.handle_event(Appended(99))
    with pytest.raises(LocalProtocolError):
        channel.handle_event(SessionOpened(False))


def test_late_node_results_after_close_are_ignored():
    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions()))
    channel.handle_in(Disconnect())
    assert channel.handle_event(Pulled("a/b", (msg(0),), 1)) == []
    assert channel.handle_event(QueueAdvanced("a/b", 5)) == []
    assert channel.handle_timeout("keepalive") == []


# --- the client's Maximum Packet Size on every packet sent ([MQTT-3.1.2-24]) ---------------------------------


def _sizes(actions: list, level: int = MQTT_5) -> list[int]:
    return [len(encode(p, level)) for p in sent(actions)]


def test_a_connack_over_the_clients_maximum_packet_size_is_never_sent():
    """[MQTT-3.1.2-24]: the CONNACK takes 16 bytes (receive maximum, maximum packet size, topic alias maximum); a
    client declaring 5..15 gets the 5-byte CONNACK 0x95 (packet too large) instead, one declaring 2..4 nothing,
    and neither opens (or takes over) a session."""
    for limit, answer in ((15, [R.PACKET_TOO_LARGE]), (5, [R.PACKET_TOO_LARGE]), (4, []), (2, [])):
        channel = Channel(ChannelConfig(reason_strings=True), Clock())
        actions = channel.handle_in(Connect(client_id="tiny", properties=Properties(maximum_packet_size=limit)))
        assert [p.reason_code for p in sent(actions)] == answer, limit
        assert all(size <= limit for size in _sizes(actions)), limit
        assert not of(actions, OpenSession) and of(actions, Close)[0].reason is R.PACKET_TOO_LARGE
    channel, _, actions = connect(properties=Properties(maximum_packet_size=16))
    assert _sizes(actions) == [16] and sent(actions)[0].reason_code is R.SUCCESS


def test_a_reason_string_is_left_out_when_the_packet_would_not_fit():
    """[MQTT-3.14.2-3]: the DISCONNECT's Reason String goes only where it fits; the bare reason code is sent."""
    channel, _, _ = connect(config=ChannelConfig(reason_strings=True), properties=Properties(maximum_packet_size=16))
    actions = channel.handle_in(Publish("a/+", b"x"))  # a wildcard in a topic name: 0x82
    (disconnect,) = sent(actions)
    assert disconnect.reason_code is R.PROTOCOL_ERROR and disconnect.properties.reason_string is None
    channel, _, _ = connect(config=ChannelConfig(reason_strings=True), properties=Properties(maximum_packet_size=200))
    (disconnect,) = sent(channel.handle_in(Publish("a/+", b"x")))
    assert disconnect.properties.reason_string  # room for it: sent


def test_a_suback_over_the_clients_maximum_packet_size_closes_the_connection_instead():
    """[MQTT-3.1.2-24]: a SUBACK with a reason code per filter can outgrow a small Maximum Packet Size: it is not
    sent, nor what follows it, and the connection closes (the client would wait for it forever)."""
    channel, _, _ = connect(properties=Properties(maximum_packet_size=20))
    entries = tuple((f"t/{i}", SubscriptionOptions(qos=1)) for i in range(30))
    (activate,) = of(channel.handle_in(Subscribe(1, entries)), Activate)
    actions = channel.handle_event(Activated(activate.ref, {sub.filter: 0 for sub in activate.subscriptions}))
    assert not sent(actions) and not of(actions, Deliver)
    assert of(actions, Close)[0].reason is R.PACKET_TOO_LARGE and channel.state is not State.CONNECTED
    assert of(actions, CloseSession)  # the session settles
    channel, _, _ = connect(properties=Properties(maximum_packet_size=40))
    (activate,) = of(channel.handle_in(Subscribe(1, entries[:20])), Activate)
    actions = channel.handle_event(Activated(activate.ref, {sub.filter: 0 for sub in activate.subscriptions}))
    assert _sizes(actions) == [25] and not of(actions, Close)


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
def test_server_shutdown_says_0x8b_to_mqtt5_clients_and_leaves_the_will_to_the_store(level):
    """SIGTERM: MQTT 5 clients get DISCONNECT 0x8B (Server shutting down) before the close; 3.1.1 has no server
    DISCONNECT. The will is not published here (a cluster store publishes the wills it holds for a gone node)."""
    expiry = Properties(session_expiry_interval=60) if level == MQTT_5 else Properties()
    channel, _, _ = connect(level, will_topic="dead/dev1", will_payload=b"bye", clean=False, properties=expiry)
    actions = channel.handle_event(ServerShutdown())
    expected = [Disconnect(R.SERVER_SHUTTING_DOWN)] if level == MQTT_5 else []
    assert sent(actions) == expected and of(actions, Close)[0].reason is R.SERVER_SHUTTING_DOWN
    assert not of(actions, PublishWill) and of(actions, SaveSession)


@pytest.mark.parametrize("level, answer", [(MQTT_5, R.SERVER_UNAVAILABLE), (MQTT_311, R.SERVER_UNAVAILABLE)])
def test_server_shutdown_before_the_connack_refuses_the_connect(level, answer):
    """A CONNECT still being accepted when the node stops gets a refusing CONNACK (0x88; 3.1.1 return code 3),
    not a DISCONNECT before any CONNACK; the session the node then opens is settled, not used."""
    channel = Channel(ChannelConfig(), Clock())
    assert of(channel.handle_in(Connect(protocol_level=level, client_id="late")), OpenSession)
    actions = channel.handle_event(ServerShutdown())
    (connack,) = sent(actions)
    assert isinstance(connack, Connack) and connack.reason_code is answer
    assert encode(connack, level)[3] == (0x88 if level == MQTT_5 else 3)
    assert of(channel.handle_event(SessionOpened(False)), CloseSession) and channel.state is State.CLOSED


@pytest.mark.parametrize("level", [MQTT_5, MQTT_311])
@pytest.mark.parametrize("event", [TakenOver(), AdminDisconnect()], ids=["taken-over", "admin"])
def test_takeover_or_admin_disconnect_before_the_connack_closes_without_sending_a_packet(level, event):
    """[MQTT-3.2.0-1]: the CONNACK is the first packet the server sends. A connection taken over, or disconnected by
    an operator, while its CONNECT is still being accepted is closed without a DISCONNECT (and 0x8E is no CONNACK
    reason); the session the node then opens is settled, not used."""
    channel = Channel(ChannelConfig(), Clock())
    assert of(channel.handle_in(Connect(protocol_level=level, client_id="late", will_topic="w")), OpenSession)
    actions = channel.handle_event(event)
    assert sent(actions) == [] and of(actions, Close) and not of(actions, PublishWill)
    late = channel.handle_event(SessionOpened(False))
    assert sent(late) == [] and of(late, CloseSession) and channel.state is State.CLOSED


def test_a_settled_channel_is_in_no_reference_cycle_so_its_session_goes_with_it():
    """The Link refers back to the channel (its clock and limit report): kept after the close, the channel, its
    session and the messages buffered for delivery waited for the cyclic collector (issue 21)."""
    import gc

    from gateway.mqtt.session import Link, Session

    channel, _, _ = connect()
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    channel.handle_event(ConnectionLost("reset"))
    assert channel.state is State.CLOSED
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        del channel
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if type(o) in (Channel, Link, Session)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []


def _holding(count: int, config: ChannelConfig = ChannelConfig()) -> Channel:
    """A connected clean session holding ``count`` exact filters, every stream idle at its queue's head."""
    channel, _, _ = connect(config=config)
    filters = tuple((f"held/{n}", SubscriptionOptions(qos=1)) for n in range(count))
    _, actions = subscribe(channel, *filters)
    for pull in of(actions, Pull):
        channel.handle_event(Pulled(pull.filter, (), 0))
    return channel


def _subscribe_once(channel: Channel, packet_id: int) -> None:
    """One more SUBSCRIBE, its activation and its stream's first (empty) pull: a client subscribing."""
    actions = channel.handle_in(Subscribe(packet_id, ((f"new/{packet_id}", SubscriptionOptions(qos=1)),)))
    (activate,) = of(actions, Activate)
    actions = channel.handle_event(Activated(activate.ref, {f"new/{packet_id}": 0}, ()))
    assert [p.reason_codes for p in sent(actions) if isinstance(p, Suback)] == [(R.GRANTED_QOS_1,)]
    (pull,) = of(actions, Pull)
    channel.handle_event(Pulled(pull.filter, (), 0))


def test_a_subscribe_costs_the_same_work_whatever_the_session_holds():
    """SUBSCRIBE grew quadratically with the filters held (0.17 ms each at 5k held, 4.4 ms at 40k): every pump
    walked every stream, and the quota copied every filter. Counted in Python lines run, 8x the filters held
    must cost about the same per SUBSCRIBE (issue 21)."""
    from tests.helpers.work import python_lines

    config = ChannelConfig(max_subscriptions=10_000)
    few, many = _holding(500, config), _holding(4000, config)
    per_few = min(python_lines(lambda: _subscribe_once(few, n))[0] for n in range(10, 13))
    per_many = min(python_lines(lambda: _subscribe_once(many, n))[0] for n in range(10, 13))
    assert per_many < 1.2 * per_few, (per_few, per_many)


def test_a_subscribe_costs_the_same_work_whatever_number_of_subscribes_are_in_flight():
    """A client that pipelines SUBSCRIBEs (64 in flight) made each one sum the filters of every activation in flight
    for the quota check (issue 31): they are counted as they come and go. Unanswered, they still count towards the
    quota; answered, they count as held."""
    from tests.helpers.work import python_lines

    config = ChannelConfig(max_subscriptions=130)
    channels = []
    for in_flight in (1, 64):
        channel, _, _ = connect(config=config)
        refs = [of(channel.handle_in(Subscribe(n, ((f"held/{n}", SubscriptionOptions(qos=1)),))), Activate)[0].ref
                for n in range(1, in_flight + 1)]
        channels.append((channel, refs))
    work = [min(python_lines(lambda c=c, n=n: c.handle_in(Subscribe(n, ((f"new/{n}", SubscriptionOptions()),))))[0]
                for n in range(100, 103)) for c, _ in channels]
    assert work[1] < 1.2 * work[0], work
    channel, refs = channels[1]  # 64 in flight + 3 more: 63 more fit, the 64th does not
    (activate,) = of(channel.handle_in(Subscribe(200, tuple((f"more/{n}", SubscriptionOptions())
                                                            for n in range(64)))), Activate)
    assert len(activate.subscriptions) == 63
    for n, ref in enumerate(refs, 1):
        assert sent(channel.handle_event(Activated(ref, {f"held/{n}": 0}, ()))) == [Suback(n, (R.GRANTED_QOS_1,))]
    # 130 held or in flight: refused, its SUBACK after the one of the SUBSCRIBE before it, still being activated
    assert sent(channel.handle_in(Subscribe(201, (("one/more", SubscriptionOptions()),)))) == []
    assert sent(channel.handle_event(Activated(activate.ref, {s.filter: 0 for s in activate.subscriptions}, ())))[
        -2:] == [Suback(200, (R.GRANTED_QOS_0,) * 63 + (R.QUOTA_EXCEEDED,)), Suback(201, (R.QUOTA_EXCEEDED,))]


def test_news_on_one_queue_costs_the_same_work_whatever_else_the_session_holds():
    from tests.helpers.work import python_lines

    few, many = _holding(500), _holding(4000)
    for channel in (few, many):
        subscribe(channel, ("hot", SubscriptionOptions(qos=1)))
    work = [python_lines(lambda c=c: c.handle_event(QueueAdvanced("hot", 1)))[0] for c in (few, many)]
    assert work[1] < 1.2 * work[0], work


# --- $delayed/<seconds>/<topic> (gateway/mqtt/delayed.py) ---------------------------------------------------


def test_a_delayed_publish_asks_the_acl_about_the_real_topic_at_publish_time():
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    actions = channel.handle_in(Publish("$delayed/5/no/t", qos=1, packet_id=1))
    assert not of(actions, Append) and of(actions, Denied) == [Denied("publish", "no/t", "QoS 1 message dropped")]
    assert sent(actions) == [Puback(1, R.NOT_AUTHORIZED)]  # [MQTT-3.4.2-1] reason 0x87
    (append,) = of(channel.handle_in(Publish("$delayed/5/ok/t", b"p", qos=1, packet_id=2)), Append)
    (message,) = append.messages
    assert message.topic == "ok/t" and message.deliver_at_ms == message.born_ms + 5000


def test_a_delayed_qos0_message_waits_for_the_stores_answer():
    channel, _, _ = connect(MQTT_5)
    (append,) = of(channel.handle_in(Publish("$delayed/1/a", qos=0)), Append)
    assert append.ref is not None  # a refusal (the client's cap) closes the connection instead of going unseen
    (plain,) = of(channel.handle_in(Publish("a", qos=0)), Append)
    assert plain.ref is None


def test_a_persistent_sessions_suback_waits_for_its_subscriptions_to_be_stored_alone():
    # Issue 31: a SUBSCRIBE stores its own filters (PatchSession), not the whole session, and its SUBACK (then the
    # retained messages) goes once they are written, so a crash after the SUBACK keeps them [MQTT-3.8.4-3];
    # SUBSCRIBEs answered while a patch is written go together in the next one, their SUBACKs in order.
    channel, _, _ = connect(**persistent())
    channel.handle_in(Subscribe(1, (("a/+", SubscriptionOptions(qos=1)),)))
    channel.handle_in(Subscribe(2, (("b/c", SubscriptionOptions(qos=0)),)))
    first, second = (a for a in channel.conn.activations)
    retained = (("a/+", msg(0, topic="a/x", queue="a/+", retain=True)),)
    actions = channel.handle_event(Activated(first, {"a/+": 5}, retained))
    # A connection's first write is whole: until then the stored blob says detached (a new session's is saved so
    # at its CONNECT), and a restore after a crash reads that to resend from the committed offsets with DUP
    # [MQTT-4.4.0-1] (tests/gateway/bench/test_scenarios.py's durability run counts resends without DUP).
    (whole,) = of(actions, SaveSession)
    assert not of(actions, PatchSession) and not sent(actions) and not of(actions, Deliver)
    assert not whole.state.detached and [sub.filter for sub in whole.state.subscriptions] == ["a/+"]
    assert channel.handle_event(Activated(second, {"b/c": 7})) == []  # waits for the save being written
    actions = channel.handle_event(SessionSaved(whole.ref))
    (patch,) = of(actions, PatchSession)
    assert set(patch.parts) == {"b/c"} and sent(actions) == [Suback(1, (R.GRANTED_QOS_1,))]
    assert patch.parts["b/c"].sub == Subscription("b/c", "b/c", SubscriptionOptions(qos=0))
    assert len(delivered(actions)) == 1  # the retained message, after its SUBACK
    assert sent(channel.handle_event(SessionSaved(patch.ref))) == [Suback(2, (R.GRANTED_QOS_0,))]


# --- SUBSCRIBEs read together -----------------------------------------------------------------


def _one_filter(packet_id: int, filter: str, qos: int = 1) -> Subscribe:
    return Subscribe(packet_id, ((filter, SubscriptionOptions(qos=qos)),))


def test_subscribes_read_together_are_one_activate_and_their_subacks_go_in_order_in_one_send():
    """Issue 31: a client pipelining one filter per SUBSCRIBE paid an activation, a session patch and a SUBACK write
    per packet. A run read together is checked packet by packet (a refusal in its own SUBACK [MQTT-3.8.4-6]) and
    activated as one; every SUBACK keeps its packet id [MQTT-3.8.4-2] and its place, and goes once the run's
    subscriptions are stored [MQTT-3.8.4-3]."""
    channel, _, _ = connect(config=ChannelConfig(max_topic_levels=3), **persistent())
    actions = channel.handle_subscribes([_one_filter(1, "a/+"), _one_filter(2, "b", 0), _one_filter(3, "x/y/z/w"),
                                         _one_filter(4, "c")])
    (activate,) = of(actions, Activate)
    assert [sub.filter for sub in activate.subscriptions] == ["a/+", "b", "c"] and not sent(actions)
    actions = saved(channel, channel.handle_event(Activated(activate.ref, {"a/+": 0, "b": 0, "c": 0})))
    (whole,) = of(actions, SaveSession)  # the connection's first write is whole (as one SUBSCRIBE's)
    assert [sub.filter for sub in whole.state.subscriptions] == ["a/+", "b", "c"]
    (send,) = of(actions, Send)
    assert send.packets == (Suback(1, (R.GRANTED_QOS_1,)), Suback(2, (R.GRANTED_QOS_0,)),
                            Suback(3, (R.TOPIC_FILTER_INVALID,)), Suback(4, (R.GRANTED_QOS_1,)))


def test_a_filter_asked_twice_in_a_run_starts_the_next_activate():
    """An ``Activated`` answers by filter: the second SUBSCRIBE of ``a`` in a run goes in the next ``Activate``, and
    replaces the first's subscription [MQTT-3.8.4-3]; the SUBACKs still come in order."""
    channel, _, _ = connect()
    actions = channel.handle_subscribes([_one_filter(1, "a", 0), _one_filter(2, "b"), _one_filter(3, "a", 1)])
    first, second = of(actions, Activate)
    assert [s.filter for s in first.subscriptions] == ["a", "b"] and [s.filter for s in second.subscriptions] == ["a"]
    assert sent(channel.handle_event(Activated(first.ref, {"a": 0, "b": 0}))) == [
        Suback(1, (R.GRANTED_QOS_0,)), Suback(2, (R.GRANTED_QOS_1,))]
    assert sent(channel.handle_event(Activated(second.ref, {"a": 0}))) == [Suback(3, (R.GRANTED_QOS_1,))]
    assert channel.session.subscriptions["a"].options.qos == 1


def test_a_subscribe_refused_whole_is_answered_after_the_subscribes_before_it():
    """A SUBSCRIBE whose filters are all refused needs no activation, but its SUBACK waits behind those of the
    SUBSCRIBEs before it that wait for theirs [MQTT-3.8.4-1] (it went first)."""
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(wildcard_available=False))
    (activate,) = of(channel.handle_in(_one_filter(1, "a")), Activate)
    assert channel.handle_in(_one_filter(2, "b/+")) == []
    assert sent(channel.handle_event(Activated(activate.ref, {"a": 0}))) == [
        Suback(1, (R.GRANTED_QOS_1,)), Suback(2, (R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,))]
    assert sent(channel.handle_in(_one_filter(3, "c/+"))) == [Suback(3, (R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,))]  # none waits


def test_a_malformed_subscribe_in_a_run_closes_after_the_ones_before_it():
    """A malformed filter closes the connection (3.1.1 [MQTT-4.8.0-1]; 5.0 section 4.13.1) as if each SUBSCRIBE of
    the run had come alone: the ones before it are activated, none after it."""
    channel, _, _ = connect()
    actions = channel.handle_subscribes([_one_filter(1, "a"), _one_filter(2, "a/#/b"), _one_filter(3, "c")])
    (activate,) = of(actions, Activate)
    assert [s.filter for s in activate.subscriptions] == ["a"]
    assert actions.index(activate) < actions.index(of(actions, Close)[0])
    assert of(actions, Close)[0].reason is R.PROTOCOL_ERROR and sent(actions) == [Disconnect(R.PROTOCOL_ERROR)]


def test_a_run_of_subscribes_costs_less_work_each_than_as_many_alone():
    """What a SUBSCRIBE costs the channel for its activation and its answer is paid once per run (issue 31):
    counted in Python lines run, a run of 32 costs at most 3/4 of 32 alone."""
    from tests.helpers.work import python_lines

    def answered(channel: Channel, actions: list) -> list:
        return channel.handle_events([Activated(a.ref, {s.filter: 0 for s in a.subscriptions})
                                      for a in of(actions, Activate)])

    alone, _, _ = connect(MQTT_311)
    together, _, _ = connect(MQTT_311)
    packets = [_one_filter(n, f"f/{n}/+" if n % 2 else f"f/{n}") for n in range(1, 33)]
    one_by_one, out = python_lines(lambda: answered(alone, [a for p in packets for a in alone.handle_in(p)]))
    as_run, run_out = python_lines(lambda: answered(together, together.handle_subscribes(packets)))
    assert sent(run_out) == sent(out) == [Suback(n, (R.GRANTED_QOS_1,)) for n in range(1, 33)]
    assert as_run < 0.75 * one_by_one, (as_run, one_by_one)


def test_a_filter_of_a_run_of_one_filter_subscribes_costs_the_channel_a_bounded_work():
    """Issue 31's attack: 50 persistent sessions pipeline 1,000 one-filter SUBSCRIBEs each (half wildcards). The
    channel checks each as if alone (its filter once in full, its topic limits only when it is long enough to be
    over one, its Subscription Identifier only when it has properties) and adds it to the run: counted in Python
    lines, at most 80 a filter (96 before)."""
    from tests.helpers.work import python_lines

    channel, _, _ = connect(MQTT_311, clean=False)
    packets = [_one_filter(n, f"cost/{n}/+" if n % 2 else f"cost/{n}") for n in range(1, 33)]
    lines, actions = python_lines(lambda: channel.handle_subscribes(packets))
    (activate,) = of(actions, Activate)
    assert [s.filter for s in activate.subscriptions] == [p.subscriptions[0][0] for p in packets]
    assert lines <= 80 * len(packets), lines / len(packets)
