"""End to end against `lightgate serve`: crash and restart, shared subscriptions, $SYS, takeover, malformed input."""

import queue

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.actions import InFlight, Subscription
from gateway.mqtt.packets import MQTT_5, Disconnect, Puback, Publish, Subscribe, SubscriptionOptions
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.session import merge_committed
from gateway.mqtt.session import Session, SessionState
from tests.helpers.mqtt_fixtures import (
    WAIT_S, Client, connected, kill, check_nothing_before_sentinel, properties, raw_client, recv_until_closed, run_id,
    running_node,
)


def manual_ack_client(port: int, client_id: str) -> Client:
    """A persistent 3.1.1 client that acknowledges QoS 1 messages only when the test says so."""
    client = Client(port, client_id, clean=False)
    client.paho.manual_ack_set(True)
    return client


# --- node crash ------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_loses_nothing_acknowledged_and_replays_nothing_acknowledged(tmp_path):
    run = run_id()
    flags = ("--commitlog-flush", "sync", "--log-level", "debug")
    with running_node(tmp_path / "data", *flags) as first:
        sub = manual_ack_client(first.port, f"crash-{run}")
        sub.connect()
        sub.subscribe(f"crash{run}/#", 1)
        pub = Client(first.port)
        pub.connect()
        for i in range(10):
            pub.publish(f"crash{run}/m", str(i).encode(), 1)  # returns once PUBACKed
        got = sub.receive(10)
        assert [m.payload for m in got] == [str(i).encode() for i in range(10)]
        for msg in got[:6]:
            sub.paho.ack(msg.mid, msg.qos)
        first.wait_log(lambda doc: doc.get("msg") == "offsets committed"
                       and doc.get("client_id") == f"crash-{run}"
                       and doc.get("offsets", {}).get(f"crash{run}/#", 0) >= 6)
        for i in range(10, 15):
            pub.publish(f"crash{run}/m", str(i).encode(), 1)  # acknowledged to the publisher before the crash
        assert [m.payload for m in sub.receive(5)] == [str(i).encode() for i in range(10, 15)]
        kill(first)
        sub.paho.loop_stop()
        pub.paho.loop_stop()
    with running_node(tmp_path / "data", *flags) as second:
        again = Client(second.port, f"crash-{run}", clean=False)
        assert again.connect().session_present
        got = again.receive(9)
        assert [m.payload for m in got] == [str(i).encode() for i in range(6, 15)]  # in order, none acked again
        check_nothing_before_sentinel(again, again, f"crash{run}/m")
        again.disconnect()


def test_merge_committed_lets_the_queues_commits_win_where_they_are_ahead():
    subs = (Subscription("a/+", "a/+"), Subscription("b", "b"), Subscription("$share/g/c", "c", group="g"))
    state = SessionState("dev", 60, subs, offsets={"a/+": 3, "b": 9}, cursors={"a/+": 5, "b": 9},
                         inflight=(InFlight(1, "a/+", 3, 1),))
    merged = merge_committed(state, {"a/+": 7, "b": 4, "c": 50})
    assert merged.offsets == {"a/+": 7, "b": 9}  # highest wins; the group owns the shared offset
    assert merged.cursors == {"a/+": 7, "b": 9}
    assert merge_committed(state, {"b": 2}) is state
    resumed = Session("dev", 60, merged)  # the in-flight offset 3 was acknowledged: it is not resent
    assert resumed.inflight == ()


# --- shared subscriptions --------------------------------------------------------------


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["3.1.1", "5.0"])
def test_shared_subscription_delivers_each_message_to_one_member(interop_node, protocol):
    run = run_id()
    with connected(interop_node.port, protocol=protocol) as a, connected(interop_node.port, protocol=protocol) as b, \
            connected(interop_node.port, protocol=protocol) as plain, connected(interop_node.port) as pub:
        merged: queue.Queue = queue.Queue()
        for name, member in (("a", a), ("b", b)):
            member.paho.on_message = lambda c, u, msg, name=name: merged.put((name, msg))
            assert [int(getattr(rc, "value", rc)) for rc in member.subscribe(f"$share/g{run}/sh{run}/+", 1)] == [1]
        plain.subscribe(f"sh{run}/+", 1)
        for i in range(40):
            pub.paho.publish(f"sh{run}/x", str(i).encode(), 1)
        assert sorted(int(m.payload) for m in plain.receive(40)) == list(range(40))  # not shared: all of them
        got = [merged.get(timeout=WAIT_S) for _ in range(40)]
        # Each to exactly one member. Which member gets how many is who asks first: the group hands messages out
        # one by one to whoever pops (a member takes at most its window; tests/interop/test_shared_pop.py shows a
        # member that holds its messages leaving the rest to the other), so an even split is not a promise here.
        assert sorted(int(m.payload) for _, m in got) == list(range(40))
        pub.publish(f"sh{run}/x", b"sentinel", 1)  # a barrier: the group hands its queue out in order
        assert merged.get(timeout=WAIT_S)[1].payload == b"sentinel"
        assert all(m.topic == f"sh{run}/x" for _, m in got)


def test_shared_member_leaving_unacknowledged_hands_its_messages_to_another(interop_node):
    run = run_id()
    topic = f"hand{run}/t"
    with connected(interop_node.port) as keeper:
        with raw_client(interop_node.port) as leaver:  # takes messages, never acknowledges them, then goes
            leaver.connect(f"leaver-{run}")
            leaver.subscribe(f"$share/g{run}/{topic}", 1)
            with connected(interop_node.port) as pub:
                for i in range(5):
                    pub.publish(topic, str(i).encode(), 1)
            held = [leaver.receive() for _ in range(5)]
            assert [p.payload for p in held] == [str(i).encode() for i in range(5)]
            leaver.send(Puback(held[0].packet_id), Puback(held[1].packet_id))
            keeper.subscribe(f"$share/g{run}/{topic}", 1)
        # The PUBACKs were read before the close: 0 and 1 count as delivered, 2..4 go to the other member.
        assert [m.payload for m in keeper.receive(3)] == [b"2", b"3", b"4"]
        check_nothing_before_sentinel(keeper, keeper, topic)  # 0 and 1 would come again before it


@pytest.mark.slow
def test_shared_group_offset_lives_in_the_store_across_a_crash(tmp_path):
    run = run_id()
    flags = ("--commitlog-flush", "sync")
    with running_node(tmp_path / "data", *flags) as first:
        member = Client(first.port, f"member-{run}", clean=False)
        member.connect()
        member.subscribe(f"$share/g{run}/grp{run}/#", 1)
        with connected(first.port) as pub:
            pub.publish(f"grp{run}/a", b"online", 1)
            (msg,) = member.receive(1)
            assert msg.payload == b"online"
            member.disconnect()  # the session stays, so does its group
            for i in range(3):
                pub.publish(f"grp{run}/a", f"offline{i}".encode(), 1)
        kill(first)
    with running_node(tmp_path / "data", *flags) as second:
        again = Client(second.port, f"member-{run}", clean=False)
        assert again.connect().session_present
        assert [m.payload for m in again.receive(3)] == [b"offline0", b"offline1", b"offline2"]
        check_nothing_before_sentinel(again, again, f"grp{run}/a")
        again.disconnect()


def test_shared_subscription_no_local_is_a_protocol_error_in_5(interop_node):
    with raw_client(interop_node.port, MQTT_5) as client:
        client.connect(f"nolocal-{run_id()}")
        client.send(Subscribe(1, (("$share/g/x", SubscriptionOptions(1, no_local=True)),)))
        disconnect = client.receive()
        assert disconnect.reason_code is ReasonCode.PROTOCOL_ERROR
        assert "MQTT-3.8.3-4" in disconnect.properties.reason_string
        assert recv_until_closed(client.sock) == b""


# --- $SYS --------------------------------------------------------------------------------


@pytest.mark.slow
def test_sys_topics_are_published_and_hidden_from_leading_wildcards(tmp_path):
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0.5") as node:
        with connected(node.port) as sys_watcher, connected(node.port) as wild:
            sys_watcher.subscribe("$SYS/broker/#", 0)
            wild.subscribe("#", 0)
            wild.subscribe("+/broker/uptime", 0)
            with connected(node.port) as pub:
                pub.publish("plain/topic", b"x" * 100, 1)
                seen: dict[str, bytes] = {}
                wanted = {f"$SYS/broker/{name}" for name in ("uptime", "clients/connected", "messages/received",
                                                             "messages/sent", "bytes/received", "bytes/sent")}
                while not (wanted <= seen.keys() and int(seen["$SYS/broker/bytes/received"]) > 100):
                    msg = sys_watcher.messages.get(timeout=WAIT_S)
                    seen[msg.topic] = msg.payload
                assert int(seen["$SYS/broker/clients/connected"]) >= 3
                assert int(seen["$SYS/broker/bytes/received"]) > 100
            (msg,) = wild.receive(1)
            assert msg.topic == "plain/topic"  # '#' and '+/...' never see $SYS
            check_nothing_before_sentinel(wild, wild, "plain/broker/uptime", copies=2)  # `#` and `+/broker/uptime`


# --- takeover ----------------------------------------------------------------------------


def test_takeover_hands_the_session_and_its_unacknowledged_messages_over(interop_node):
    run = run_id()
    with raw_client(interop_node.port) as old:
        old.connect(f"take-{run}", clean=False)
        old.subscribe(f"take{run}/#", 1)
        with connected(interop_node.port) as pub:
            pub.publish(f"take{run}/a", b"in flight", 1)
        first = old.receive()
        assert isinstance(first, Publish) and first.payload == b"in flight"
        new = Client(interop_node.port, f"take-{run}", clean=False)
        assert new.connect().session_present
        assert recv_until_closed(old.sock) == b""  # 3.1.1: the old connection is closed without a packet
    (msg,) = new.receive(1)
    assert (msg.payload, msg.dup) == (b"in flight", True)
    new.disconnect()


# --- malformed input -----------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [
    b"\x30\x02\x00\x05",  # PUBLISH whose topic length runs past the packet
    b"\x82\x05\x00\x01\x00\x01a",  # SUBSCRIBE whose options byte is missing
    b"\x00\x00",  # packet type 0 (reserved)
    b"\xe2\x00",  # DISCONNECT with reserved flags set
], ids=["publish-topic-overrun", "subscribe-truncated", "reserved-type", "bad-flags"])
def test_malformed_packet_disconnects_the_sender_only(interop_node, garbage):
    run = run_id()
    with connected(interop_node.port, protocol=mqtt.MQTTv5) as sub, connected(interop_node.port) as pub:
        sub.subscribe(f"mal{run}/#", 1)
        with raw_client(interop_node.port) as bad:
            bad.connect(f"bad-{run}")
            bad.sock.sendall(garbage)
            assert recv_until_closed(bad.sock) == b""
        pub.publish(f"mal{run}/ok", b"carry on", 1)
        (msg,) = sub.receive(1)
        assert msg.payload == b"carry on"
        assert sub.paho.is_connected() and pub.paho.is_connected()


def test_session_expiry_set_to_zero_at_disconnect_ends_the_session(interop_node):
    run = run_id()
    client = Client(interop_node.port, f"exp-{run}", protocol=mqtt.MQTTv5, clean=False)
    client.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=3600))
    client.subscribe(f"exp{run}/#", 1)
    client.paho.disconnect(properties=properties(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    client.disconnects.get(timeout=WAIT_S)
    client.paho.loop_stop()
    again = Client(interop_node.port, f"exp-{run}", protocol=mqtt.MQTTv5, clean=False)
    assert not again.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)).session_present
    again.disconnect()


def _own_then_sentinel(port: int, client, topic: str, own: bytes, sentinel: bytes) -> list[bytes]:
    """``client`` publishes ``own`` (QoS 1), another client then ``sentinel``: the payloads ``client`` gets up to
    the sentinel (messages a crash made it get again included)."""
    client.send(Publish(topic, own, 1, packet_id=7))
    got = []
    with raw_client(port, MQTT_5) as other:
        other.connect(f"other-{run_id()}")
        other.send(Publish(topic, sentinel, 1, packet_id=1))
        while True:
            packet = client.receive()
            if isinstance(packet, Publish):
                if packet.qos:
                    client.send(Puback(packet.packet_id))
                if packet.payload == sentinel:
                    return got
                got.append(packet.payload)


@pytest.mark.slow
@pytest.mark.parametrize("crash", [True, False], ids=["sigkill", "clean restart"])
def test_no_local_holds_for_a_persistent_session_across_a_restart(tmp_path, crash):
    """[MQTT-3.8.3-3]: a No Local subscription never gets its own client id's messages, also once the session
    is resumed from the store after the node restarted."""
    run = run_id()
    client_id, topic = f"nl-{run}", f"nl{run}/x"
    expiry = Properties(session_expiry_interval=3600)
    with running_node(tmp_path / "data") as first:
        with raw_client(first.port, MQTT_5) as client:
            client.connect(client_id, clean=False, properties=expiry)
            client.send(Subscribe(1, ((topic, SubscriptionOptions(qos=1, no_local=True)),)))
            client.receive()
            assert _own_then_sentinel(first.port, client, topic, b"own before", b"first sentinel") == []
            if crash:
                kill(first)
            else:
                client.send(Disconnect())
    with running_node(tmp_path / "data") as second:
        with raw_client(second.port, MQTT_5) as client:
            assert client.connect(client_id, clean=False, properties=expiry).session_present
            got = _own_then_sentinel(second.port, client, topic, b"own after", b"second sentinel")
            assert b"own before" not in got and b"own after" not in got
