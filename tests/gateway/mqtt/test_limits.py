"""Per-client limits: the channel's answers per protocol version, the hits it reports, and the node's counters.

The channel tests run without sockets (tests/helpers/channel.py);
the end-to-end tests at the bottom drive a `lightgate serve` node with paho
clients and read the counters from the node's log lines.
"""

from __future__ import annotations

import queue
import uuid

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.app.config import OPTIONS
from gateway.app.serve import channel_config
from gateway.mqtt.actions import (
    Activate,
    Activated,
    Append,
    Appended,
    Close,
    Deliver,
    LimitHit,
    Message,
    OpenSession,
    Pulled,
    SocketWritten,
    Subscription,
)
from gateway.mqtt.channel import RATE_DEBT_S, Channel, ChannelConfig
from gateway.mqtt.codec import RemoteProtocolError, encode
from gateway.mqtt.limits import LOG_INTERVAL_S, HitLog, Limit, LimitCounters
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
    Unsubscribe,
)
from gateway.mqtt.properties import RepeatLimit
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.session import SessionState
from gateway.mqtt.state import State
from tests.helpers.channel import T0, Clock, connect, delivered, msg, of, sent, subscribe
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connected, check_nothing_before_sentinel, quiet, running_node

R = ReasonCode
BOTH = pytest.mark.parametrize("level", [MQTT_5, MQTT_311])


def hits(actions: list) -> list[tuple[Limit, int]]:
    return [(a.limit, a.count) for a in of(actions, LimitHit)]


def closed(actions: list) -> ReasonCode | None:
    closes = of(actions, Close)
    return closes[0].reason if closes else None


# --- counters and log lines -------------------------------------------------------------------


def test_counters_have_one_field_per_limit_and_add_up():
    counters = LimitCounters()
    assert counters.add(Limit.QOS0_QUEUE, 3) == 3
    assert counters.add(Limit.QOS0_QUEUE) == 4
    assert counters.qos0_queue == 4 and counters.publish_rate == 0
    for limit in Limit:
        assert getattr(counters, limit.value) >= 0


def test_hit_log_lets_the_first_hit_through_then_one_line_per_interval_with_the_count():
    log = HitLog(interval_s=10.0)
    assert log.due(Limit.PUBLISH_RATE, 1, 0.0) == 1
    assert log.due(Limit.PUBLISH_RATE, 1, 1.0) is None
    assert log.due(Limit.PUBLISH_RATE, 5, 9.0) is None
    assert log.due(Limit.TOPIC_LEVELS, 1, 9.0) == 1  # each limit has its own interval
    assert log.due(Limit.PUBLISH_RATE, 1, 10.0) == 7  # this one plus the six kept quiet
    assert log.due(Limit.PUBLISH_RATE, 1, 11.0) is None


def test_channel_rate_limits_its_log_lines_but_reports_every_hit():
    channel, clock, _ = connect(config=ChannelConfig(publish_rate=1, publish_burst=1))
    channel.handle_in(Publish("t"))
    first = of(channel.handle_in(Publish("t")), LimitHit)[0]
    second = of(channel.handle_in(Publish("t")), LimitHit)[0]
    assert first.log is not None and "dropped" in first.log
    assert second.log is None and second.count == 1  # counted, not logged
    clock.t += LOG_INTERVAL_S
    later = next(hit for _ in range(5) for hit in of(channel.handle_in(Publish("t")), LimitHit))
    assert later.log is not None and "(2 hits of this limit since the last line)" in later.log


# --- packet size ------------------------------------------------------------------------------


@BOTH
def test_packet_too_large_is_counted_when_it_closes(level):
    channel, _, _ = connect(level)
    actions = channel.handle_protocol_error(RemoteProtocolError(R.PACKET_TOO_LARGE, "2000000-byte packet"))
    assert hits(actions) == [(Limit.PACKET_SIZE, 1)]
    assert sent(actions) == ([Disconnect(R.PACKET_TOO_LARGE)] if level == MQTT_5 else [])
    assert closed(actions) is R.PACKET_TOO_LARGE


def test_other_protocol_errors_are_not_limit_hits():
    channel, _, _ = connect()
    assert hits(channel.handle_protocol_error(RemoteProtocolError(R.MALFORMED_PACKET, "bad"))) == []


# --- topic length and levels ------------------------------------------------------------------

LEVELS = ChannelConfig(max_topic_levels=3, max_topic_length=12)


@pytest.mark.parametrize(("qos", "ack"), [(1, Puback), (2, Pubrec)])
def test_v5_qos12_publish_over_a_topic_limit_is_refused_with_0x90_and_the_connection_stays(qos, ack):
    channel, _, _ = connect(config=LEVELS)
    actions = channel.handle_in(Publish("a/b/c/d", qos=qos, packet_id=7))
    assert sent(actions) == [ack(7, R.TOPIC_NAME_INVALID)]
    assert hits(actions) == [(Limit.TOPIC_LEVELS, 1)] and not of(actions, Append)
    assert of(channel.handle_in(Publish("a/b/c", qos=qos, packet_id=8)), Append)  # still connected


def test_topic_length_counts_utf8_bytes():
    channel, _, _ = connect(config=LEVELS)
    assert of(channel.handle_in(Publish("a" * 12, qos=1, packet_id=1)), Append)
    actions = channel.handle_in(Publish("é" * 7, qos=1, packet_id=2))  # 7 characters, 14 bytes
    assert sent(actions) == [Puback(2, R.TOPIC_NAME_INVALID)] and hits(actions) == [(Limit.TOPIC_LENGTH, 1)]


@BOTH
def test_qos0_publish_over_a_topic_limit_disconnects(level):
    channel, _, _ = connect(level, config=LEVELS)
    actions = channel.handle_in(Publish("a/b/c/d"))
    assert sent(actions) == ([Disconnect(R.TOPIC_NAME_INVALID)] if level == MQTT_5 else [])
    assert closed(actions) is R.TOPIC_NAME_INVALID and hits(actions) == [(Limit.TOPIC_LEVELS, 1)]
    assert not of(actions, Append)


def test_v311_qos1_publish_over_a_topic_limit_closes_without_an_ack():
    channel, _, _ = connect(MQTT_311, config=LEVELS)
    actions = channel.handle_in(Publish("x" * 13, qos=1, packet_id=1))
    assert sent(actions) == [] and closed(actions) is R.TOPIC_NAME_INVALID
    assert hits(actions) == [(Limit.TOPIC_LENGTH, 1)]


@settings(max_examples=300)
@given(st.text(st.sampled_from("a/é𝄞"), min_size=1, max_size=24), st.integers(1, 12), st.integers(1, 40))
def test_a_publish_is_refused_exactly_when_its_topic_is_over_a_limit(topic, levels, length):
    # The publish path skips the check for topics too short to be over; this pins that shortcut to the rule.
    channel, _, _ = connect(config=ChannelConfig(max_topic_levels=levels, max_topic_length=length))
    over = topic.count("/") + 1 > levels or len(topic.encode()) > length
    actions = channel.handle_in(Publish(topic, qos=1, packet_id=1))
    assert bool(of(actions, Append)) is not over
    assert bool(hits(actions)) is over


@settings(max_examples=200, deadline=None)
@given(st.text(st.sampled_from("a/é𝄞+"), min_size=1, max_size=24), st.integers(1, 12), st.integers(1, 40),
       st.booleans())
def test_a_filter_is_refused_exactly_when_it_is_over_a_topic_limit(filter, levels, length, shared):
    """SUBACK 0x8F (3.1.1: 0x80) for a filter over a topic limit, measured without its "$share/<group>/" prefix; the
    subscribe path skips the check for filters too short to be over one, as the publish path does: this pins that
    shortcut to the rule."""
    filter = "/".join("+" if "+" in level else level for level in filter.split("/"))  # '+' only as a whole level
    channel, _, _ = connect(config=ChannelConfig(max_topic_levels=levels, max_topic_length=length))
    over = filter.count("/") + 1 > levels or len(filter.encode()) > length
    asked = f"$share/g/{filter}" if shared else filter
    actions = channel.handle_in(Subscribe(1, ((asked, SubscriptionOptions(qos=1)),)))
    assert bool(of(actions, Activate)) is not over
    assert hits(actions) == ([(Limit.TOPIC_LEVELS if filter.count("/") + 1 > levels else Limit.TOPIC_LENGTH, 1)]
                             if over else [])
    if over:
        assert [p.reason_codes for p in sent(actions)] == [(R.TOPIC_FILTER_INVALID,)]


def test_the_default_level_limit_is_the_stores_and_counted():
    channel, _, _ = connect()
    actions = channel.handle_in(Publish("/".join("l" * 129), qos=1, packet_id=1))
    assert sent(actions) == [Puback(1, R.TOPIC_NAME_INVALID)] and hits(actions) == [(Limit.TOPIC_LEVELS, 1)]


@BOTH
def test_subscribe_filter_over_a_topic_limit_is_refused_for_that_filter_only(level):
    channel, _, _ = connect(level, config=LEVELS)
    entries = (("a/b/c/#", SubscriptionOptions(qos=1)), ("a/+", SubscriptionOptions(qos=1)),
               ("$share/g/a/b/c/d", SubscriptionOptions(qos=1)), ("$share/long-group-name/a/b", SubscriptionOptions()))
    actions = channel.handle_in(Subscribe(1, entries))
    assert hits(actions) == [(Limit.TOPIC_LEVELS, 1), (Limit.TOPIC_LEVELS, 1)]
    (activate,) = of(actions, Activate)
    # A shared subscription is measured by its filter, not the "$share/<group>/" prefix.
    assert [s.filter for s in activate.subscriptions] == ["a/+", "$share/long-group-name/a/b"]
    (suback,) = sent(channel.handle_event(Activated(activate.ref, {"a/+": 0, "$share/long-group-name/a/b": 0})))
    assert suback.reason_codes == (R.TOPIC_FILTER_INVALID, R.GRANTED_QOS_1, R.TOPIC_FILTER_INVALID, R.GRANTED_QOS_0)
    if level == MQTT_311:
        assert encode(suback, MQTT_311)[-4:] == bytes([0x80, 1, 0x80, 0])


@BOTH
def test_will_topic_over_a_topic_limit_refuses_the_connect(level):
    channel = Channel(LEVELS, Clock())
    actions = channel.handle_in(Connect(protocol_level=level, client_id="d", will_topic="a/b/c/d", will_payload=b"x"))
    assert not of(actions, OpenSession) and hits(actions) == [(Limit.TOPIC_LEVELS, 1)]
    assert [p.reason_code for p in sent(actions)] == ([R.TOPIC_NAME_INVALID] if level == MQTT_5 else [])


def test_unsubscribe_accepts_a_filter_over_a_lowered_limit():
    # Subscribed while the limit was higher; the session is resumed under the lower one.
    deep = Subscription("a/b/c/d/#", "a/b/c/d/#")
    state = SessionState("dev1", 60, (deep,), {deep.filter: 0}, {deep.filter: 0})
    channel, _, _ = connect(config=LEVELS, state=state, clean=False)
    actions = channel.handle_in(Unsubscribe(2, ("a/b/c/d/#",)))
    assert [p.reason_codes for p in sent(actions)] == [(R.SUCCESS,)]


# --- subscriptions per session ----------------------------------------------------------------


@BOTH
def test_filters_beyond_the_subscription_limit_get_quota_exceeded(level):
    channel, _, _ = connect(level, config=ChannelConfig(max_subscriptions=2))
    opts = SubscriptionOptions(qos=1)
    actions = channel.handle_in(Subscribe(1, (("a", opts), ("b", opts), ("a", opts), ("c", opts), ("d", opts))))
    assert hits(actions) == [(Limit.SUBSCRIPTIONS, 2)]
    (activate,) = of(actions, Activate)
    assert [s.filter for s in activate.subscriptions] == ["a", "b", "a"]  # the same filter twice counts once
    (suback,) = sent(channel.handle_event(Activated(activate.ref, {"a": 0, "b": 0})))
    assert suback.reason_codes == (R.GRANTED_QOS_1,) * 3 + (R.QUOTA_EXCEEDED,) * 2
    if level == MQTT_311:
        assert encode(suback, MQTT_311)[-5:] == bytes([1, 1, 1, 0x80, 0x80])
    # At the limit, re-subscribing a held filter (new options) still works; a new one does not.
    _, actions = subscribe(channel, ("b", SubscriptionOptions(qos=0)), packet_id=2)
    assert sent(actions)[0].reason_codes == (R.GRANTED_QOS_0,)
    actions = channel.handle_in(Subscribe(3, (("e", opts),)))
    assert sent(actions) == [Suback(3, (R.QUOTA_EXCEEDED,))] and not of(actions, Activate)


def test_subscriptions_being_activated_count_against_the_limit():
    channel, _, _ = connect(config=ChannelConfig(max_subscriptions=1))
    first = channel.handle_in(Subscribe(1, (("a", SubscriptionOptions()),)))
    second = channel.handle_in(Subscribe(2, (("b", SubscriptionOptions()),)))  # before the first is answered
    assert of(first, Activate) and sent(second) == []  # refused; its SUBACK after the first's
    (activate,) = of(first, Activate)
    assert sent(channel.handle_event(Activated(activate.ref, {"a": 0}))) == [
        Suback(1, (R.GRANTED_QOS_0,)), Suback(2, (R.QUOTA_EXCEEDED,))]


def test_subscriptions_held_before_the_limit_keep_working():
    # The resumed session holds three subscriptions; the limit is now one.
    subs = tuple(Subscription(f, f, SubscriptionOptions(qos=0)) for f in ("a", "b", "c"))
    state = SessionState("dev1", 60, subs, {f: 0 for f in "abc"}, {f: 0 for f in "abc"})
    channel, _, _ = connect(config=ChannelConfig(max_subscriptions=1), state=state, clean=False)
    out = delivered(channel.handle_event(Pulled("c", (msg(0, "c", qos=0, queue="c"),), 1)))
    assert [p.topic for p in out] == ["c"]
    assert sent(channel.handle_in(Subscribe(4, (("d", SubscriptionOptions()),)))) == [Suback(4, (R.QUOTA_EXCEEDED,))]


# --- in-flight --------------------------------------------------------------------------------


def test_v5_receive_maximum_exceeded_is_counted():
    channel, _, _ = connect(config=ChannelConfig(receive_maximum=1))
    channel.handle_in(Publish("t", qos=1, packet_id=1))
    actions = channel.handle_in(Publish("t", qos=1, packet_id=2))
    assert sent(actions) == [Disconnect(R.RECEIVE_MAXIMUM_EXCEEDED)]
    assert hits(actions) == [(Limit.INFLIGHT, 1)]


def test_v311_publishes_beyond_the_limit_wait_in_order_and_pause_input():
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(receive_maximum=2))
    refs = [of(channel.handle_in(Publish("t", b"%d" % i, qos=1, packet_id=i + 1)), Append)[0].ref for i in range(2)]
    actions = channel.handle_in(Publish("t", b"2", qos=2, packet_id=3))
    assert hits(actions) == [(Limit.INFLIGHT, 1)] and not of(actions, Append)
    assert channel.input_paused
    assert channel.handle_in(Pingreq()) == []  # behind the waiting PUBLISH, in order
    assert channel.handle_in(Publish("t", b"3")) == []
    actions = channel.handle_event(Appended(refs[0]))
    assert sent(actions)[0] == Puback(1)
    appended = of(actions, Append)
    assert [a.messages[0].payload for a in appended] == [b"2", b"3"]  # QoS 2 then QoS 0, as received
    assert sent(actions)[1:] == [Pingresp()] and not channel.input_paused
    assert sent(channel.handle_event(Appended(appended[0].ref))) == [Pubrec(3)]


def test_v311_too_many_waiting_packets_close():
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(receive_maximum=1, max_queued_packets=2))
    channel.handle_in(Publish("t", qos=1, packet_id=1))
    channel.handle_in(Publish("t", qos=1, packet_id=2))
    channel.handle_in(Pingreq())
    actions = channel.handle_in(Pingreq())
    assert closed(actions) is R.RECEIVE_MAXIMUM_EXCEEDED and sent(actions) == []
    assert hits(actions) == [(Limit.INFLIGHT, 1)] and not channel.input_paused


# --- publish rate -----------------------------------------------------------------------------


@pytest.mark.parametrize(("qos", "ack"), [(1, Puback), (2, Pubrec)])
def test_v5_qos12_over_the_rate_gets_quota_exceeded_and_is_not_stored(qos, ack):
    channel, clock, _ = connect(config=ChannelConfig(publish_rate=1, publish_burst=2))
    assert of(channel.handle_in(Publish("t", qos=qos, packet_id=1)), Append)
    assert of(channel.handle_in(Publish("t", qos=qos, packet_id=2)), Append)
    actions = channel.handle_in(Publish("t", qos=qos, packet_id=3))
    assert sent(actions) == [ack(3, R.QUOTA_EXCEEDED)] and not of(actions, Append)
    assert hits(actions) == [(Limit.PUBLISH_RATE, 1)]
    clock.t += 2.0  # the refused message was charged: 2 s refill pays it and one more
    assert of(channel.handle_in(Publish("t", qos=qos, packet_id=4)), Append)


@BOTH
def test_qos0_over_the_rate_is_dropped_and_counted(level):
    channel, _, _ = connect(level, config=ChannelConfig(publish_rate=1, publish_burst=1))
    assert of(channel.handle_in(Publish("t")), Append)
    actions = channel.handle_in(Publish("t"))
    assert actions == [of(actions, LimitHit)[0]] and hits(actions) == [(Limit.PUBLISH_RATE, 1)]
    assert channel.state is State.CONNECTED


def test_v311_qos1_over_the_rate_closes_without_acknowledging():
    channel, _, _ = connect(MQTT_311, config=ChannelConfig(publish_rate=1, publish_burst=1))
    channel.handle_in(Publish("t", qos=1, packet_id=1))
    actions = channel.handle_in(Publish("t", qos=1, packet_id=2))
    assert sent(actions) == [] and closed(actions) is R.MESSAGE_RATE_TOO_HIGH
    assert hits(actions) == [(Limit.PUBLISH_RATE, 1)]


@BOTH
def test_sustained_excess_disconnects(level):
    channel, clock, _ = connect(level, config=ChannelConfig(publish_rate=2, publish_burst=2))
    sends = 0
    while True:
        actions = channel.handle_in(Publish("t"))  # QoS 0: dropped while over, but charged
        sends += 1
        if of(actions, Close):
            break
        clock.t += 0.01
        assert sends < 100
    # After n sends at t = 0.01 (n - 1) s the balance is 2 - n + 2 t: the debt first exceeds RATE_DEBT_S (10 s of
    # 2 messages/s, 20 tokens) at n = 23.
    assert RATE_DEBT_S == 10.0 and sends == 23
    assert closed(actions) is R.MESSAGE_RATE_TOO_HIGH and hits(actions) == [(Limit.PUBLISH_RATE, 1)]
    assert sent(actions) == ([Disconnect(R.MESSAGE_RATE_TOO_HIGH)] if level == MQTT_5 else [])


def test_byte_rate_counts_payload_bytes_and_banks_one_second():
    channel, clock, _ = connect(config=ChannelConfig(publish_bytes_rate=100))
    assert of(channel.handle_in(Publish("t", b"x" * 60, qos=1, packet_id=1)), Append)
    actions = channel.handle_in(Publish("t", b"x" * 60, qos=1, packet_id=2))
    assert sent(actions) == [Puback(2, R.QUOTA_EXCEEDED)] and hits(actions) == [(Limit.PUBLISH_BYTES_RATE, 1)]
    clock.t += 1.0  # balance -20 + 100
    assert of(channel.handle_in(Publish("t", b"x" * 60, qos=1, packet_id=3)), Append)


def test_a_resent_stored_qos2_publish_is_not_charged():
    channel, _, _ = connect(config=ChannelConfig(publish_rate=1, publish_burst=1))
    (append,) = of(channel.handle_in(Publish("t", qos=2, packet_id=5)), Append)
    channel.handle_event(Appended(append.ref))
    actions = channel.handle_in(Publish("t", qos=2, packet_id=5, dup=True))
    assert sent(actions) == [Pubrec(5)] and hits(actions) == []


# --- QoS 0 queue bytes ------------------------------------------------------------------------


@BOTH
def test_qos0_deliveries_beyond_the_queue_bytes_are_dropped_and_their_offsets_advance(level):
    channel, _, _ = connect(level, config=ChannelConfig(qos0_queue_bytes=100))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=0)))
    batch = tuple(Message("a/b", b"m%d" % i + bytes(58), 0, queue="a/b", offset=i, store_ms=int(T0 * 1000))
                  for i in range(5))
    actions = channel.handle_event(Pulled("a/b", batch, 5))
    out = delivered(actions, level)
    assert [p.payload[:2] for p in out] == [b"m0", b"m1"]  # the second still fits: the queue was under 100 bytes
    assert hits(actions) == [(Limit.QOS0_QUEUE, 3)]
    assert channel.session.committed_offsets() == {"a/b": 0}  # the two in the writer are not written yet
    (deliver,) = of(actions, Deliver)
    channel.handle_event(SocketWritten(deliver.seq))
    assert channel.session.committed_offsets() == {"a/b": 5}  # dropped offsets advanced too
    out = delivered(channel.handle_event(Pulled("a/b", (msg(5, qos=0),), 6)), level)
    assert [p.payload for p in out] == [b"m5"]  # written: room again


def test_qos1_deliveries_are_not_dropped_by_the_qos0_limit():
    channel, _, _ = connect(config=ChannelConfig(qos0_queue_bytes=1))
    subscribe(channel, ("a/b", SubscriptionOptions(qos=1)))
    actions = channel.handle_event(Pulled("a/b", tuple(msg(i) for i in range(3)), 3))
    assert len(delivered(actions)) == 3 and hits(actions) == []


# --- configuration ----------------------------------------------------------------------------


def test_options_reach_thechannel_config():
    settings = {o.key: o.default for o in OPTIONS}
    assert channel_config(settings) == channel_config(settings)  # defaults: every limit off or at its maximum
    default = channel_config(settings)
    assert (default.max_topic_length, default.max_topic_levels, default.max_subscriptions, default.publish_rate,
            default.publish_bytes_rate, default.qos0_queue_bytes) == (4096, 128, 1024, 0, 0, 0)
    assert default.repeat_limit == RepeatLimit(32, 8192)
    settings.update({"limits.max_topic_length": 100, "limits.max_topic_levels": 8, "limits.max_subscriptions": 50,
                     "limits.publish_rate": 10.0, "limits.publish_burst": 20.0, "limits.publish_bytes_rate": 1e6,
                     "limits.qos0_queue_bytes": 65536})
    config = channel_config(settings)
    assert (config.max_topic_length, config.max_topic_levels, config.max_subscriptions, config.publish_rate,
            config.publish_burst, config.publish_bytes_rate, config.qos0_queue_bytes) == (
        100, 8, 50, 10.0, 20.0, 1e6, 65536)


@pytest.mark.parametrize("fields", [{"max_topic_levels": 129}, {"max_topic_levels": 0}, {"max_topic_length": 65536},
                                    {"max_subscriptions": -1}, {"publish_rate": -1.0}, {"qos0_queue_bytes": -5}])
def test_invalid_limits_are_refused_with_the_field_name(fields):
    (name,) = fields
    with pytest.raises(ValueError, match=name):
        ChannelConfig(**fields)


# --- end to end: paho clients against a node --------------------------------------------------

# The admin HTTP listener is off: these tests read the counters from the log lines, which carry the totals.
E2E_FLAGS = ("--limits-publish-rate", "2", "--limits-publish-burst", "2", "--limits-max-subscriptions", "2",
             "--limits-max-topic-levels", "4", "--admin-port", "0")


@pytest.fixture(scope="module")
def limited_node(tmp_path_factory):
    with running_node(tmp_path_factory.mktemp("node") / "data", *E2E_FLAGS) as node:
        yield node
    assert node.proc.returncode == 0


def limit_logged(node, limit: str, client_id: str) -> dict:
    """The node's log line for a hit of ``limit`` by ``client_id`` (it carries the node's running total)."""
    return node.wait_log(lambda d: d.get("limit") == limit and d.get("client_id") == client_id)


@pytest.mark.slow
def test_e2e_publish_rate_refuses_with_quota_exceeded_in_v5(limited_node):
    run = uuid.uuid4().hex[:6]
    with connected(limited_node.port, protocol=mqtt.MQTTv5) as sub, \
            connected(limited_node.port, protocol=mqtt.MQTTv5) as pub:
        sub.paho.subscribe(f"rate{run}/t", options=SubscribeOptions(qos=1))
        sub.subacks.get(timeout=WAIT_S)
        acks: queue.Queue = queue.Queue()
        pub.paho.on_publish = lambda c, u, mid, rc, props: acks.put((mid, rc.value))
        mids = {pub.paho.publish(f"rate{run}/t", b"%d" % i, 1).mid: b"%d" % i for i in range(10)}
        results = dict(acks.get(timeout=WAIT_S) for _ in mids)
        accepted = {mids[mid] for mid, rc in results.items() if rc == 0}
        refused = [mid for mid, rc in results.items() if rc == R.QUOTA_EXCEEDED]
        # Burst 2 and 2/s: the node reads the ten within well under 2 s, so at most 6 are accepted.
        assert 2 <= len(accepted) <= 6 and len(refused) == 10 - len(accepted)
        assert {m.payload for m in sub.receive(len(accepted))} == accepted  # refused ones were not stored
        check_nothing_before_sentinel(sub, sub, f"rate{run}/t")  # the subscriber's own rate is untouched
        doc = limit_logged(limited_node, "publish_rate", pub.client_id)
        assert doc["total"] >= 1 and "0x97" in doc["msg"]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_e2e_subscriptions_beyond_the_limit_are_refused_and_the_others_work(limited_node, protocol):
    run = uuid.uuid4().hex[:6]
    with connected(limited_node.port, protocol=protocol) as sub, \
            connected(limited_node.port, protocol=protocol) as pub:
        filters = [f"subs{run}/{name}" for name in "abc"]
        if protocol == mqtt.MQTTv5:
            sub.paho.subscribe([(f, SubscribeOptions(qos=1)) for f in filters])
        else:
            sub.paho.subscribe([(f, 1) for f in filters])
        codes = [getattr(rc, "value", rc) for rc in sub.subacks.get(timeout=WAIT_S)]
        assert codes == [1, 1, R.QUOTA_EXCEEDED if protocol == mqtt.MQTTv5 else 0x80]
        for f in filters:
            pub.publish(f, f.encode(), 1)
        assert sorted(m.topic for m in sub.receive(2)) == filters[:2]  # MQTT orders per topic only
        # No barrier: a refused subscription has no queue that a sentinel could follow. A fixed wait.
        quiet(sub.messages)
        assert limit_logged(limited_node, "subscriptions", sub.client_id)["total"] >= 1


@pytest.mark.slow
def test_e2e_topic_levels_v5_refuses_the_message_v311_closes(limited_node):
    run = uuid.uuid4().hex[:6]
    deep = f"deep{run}/b/c/d/e"
    with connected(limited_node.port, protocol=mqtt.MQTTv5) as pub:
        acks: queue.Queue = queue.Queue()
        pub.paho.on_publish = lambda c, u, mid, rc, props: acks.put(rc.value)
        pub.paho.publish(deep, b"x", 1)
        assert acks.get(timeout=WAIT_S) == R.TOPIC_NAME_INVALID
        pub.paho.subscribe(deep + "/#", options=SubscribeOptions(qos=1))
        assert [rc.value for rc in pub.subacks.get(timeout=WAIT_S)] == [R.TOPIC_FILTER_INVALID]
        assert pub.paho.is_connected()
        before = limit_logged(limited_node, "topic_levels", pub.client_id)["total"]
    old = Client(limited_node.port)
    old.connect()
    try:
        old.paho.publish(deep, b"x", 1)
        old.disconnects.get(timeout=WAIT_S)  # 3.1.1: the connection is closed
    finally:
        old.paho.loop_stop()
    assert limit_logged(limited_node, "topic_levels", old.client_id)["total"] > before
