"""Retained messages end to end: paho 3.1.1 and 5.0 clients, through the CommitLog, dispatch and retain/."""

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.subscribeoptions import SubscribeOptions

from tests.helpers.mqtt_fixtures import WAIT_S, connected, check_nothing_before_sentinel, run_id, running_node

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_new_subscribers_get_the_latest_retained_message_with_retain_set(interop_node, protocol):
    run = run_id()
    with connected(interop_node.port, protocol=protocol) as pub:
        pub.publish(f"r{run}/dev1/status", b"online", qos=1, retain=True)
        pub.publish(f"r{run}/dev1/status", b"offline", qos=1, retain=True)
        pub.publish(f"r{run}/dev2/status", b"online", qos=0, retain=True)
        pub.publish(f"r{run}/dev3/status", b"gone", qos=1, retain=True)
        pub.publish(f"r{run}/dev3/status", b"", qos=1, retain=True)  # an empty payload deletes it
        pub.publish(f"r{run}/dev4/status", b"live only", qos=1, retain=False)
        with connected(interop_node.port, protocol=protocol) as exact, \
                connected(interop_node.port, protocol=protocol) as wild:
            exact.subscribe(f"r{run}/dev1/status", 1)
            wild.subscribe(f"r{run}/+/status", 1)
            (got,) = exact.receive(1)
            assert (got.topic, got.payload, got.retain, got.qos) == (f"r{run}/dev1/status", b"offline", True, 1)
            got = sorted(wild.receive(2), key=lambda m: m.topic)
            assert [(m.topic, m.payload, m.retain) for m in got] == [
                (f"r{run}/dev1/status", b"offline", True), (f"r{run}/dev2/status", b"online", True)]
            assert got[1].qos == 0  # delivered at min(subscription QoS, message QoS)
            check_nothing_before_sentinel(wild, pub, f"r{run}/dev5/status")  # retained ones come before live ones
            pub.publish(f"r{run}/dev1/status", b"back", qos=1, retain=True)
            (live,) = exact.receive(1)
            assert (live.payload, live.retain) == (b"back", False)  # live traffic: RETAIN cleared [MQTT-3.3.1-9]


def test_retain_handling_2_sends_nothing_and_1_only_for_new_subscriptions(interop_node):
    run = run_id()
    with connected(interop_node.port, protocol=mqtt.MQTTv5) as pub:
        pub.publish(f"h{run}/cfg", b"v1", qos=1, retain=True)
    with connected(interop_node.port, protocol=mqtt.MQTTv5) as sub:
        sub.paho.subscribe(f"h{run}/cfg", options=SubscribeOptions(qos=1, retainHandling=2))
        sub.subacks.get(timeout=WAIT_S)
        check_nothing_before_sentinel(sub, sub, f"h{run}/cfg")
        sub.paho.subscribe(f"h{run}/#", options=SubscribeOptions(qos=1, retainHandling=1))
        sub.subacks.get(timeout=WAIT_S)
        assert [m.payload for m in sub.receive(1)] == [b"v1"]
        sub.paho.subscribe(f"h{run}/#", options=SubscribeOptions(qos=1, retainHandling=1))  # not new: nothing
        sub.subacks.get(timeout=WAIT_S)
        check_nothing_before_sentinel(sub, sub, f"h{run}/cfg", copies=2)  # h/cfg and h/#


def test_retain_as_published_keeps_the_flag_on_live_messages(interop_node):
    run = run_id()
    with connected(interop_node.port, protocol=mqtt.MQTTv5) as sub, \
            connected(interop_node.port, protocol=mqtt.MQTTv5) as pub:
        sub.paho.subscribe(f"p{run}/x", options=SubscribeOptions(qos=1, retainAsPublished=True))
        sub.subacks.get(timeout=WAIT_S)
        pub.publish(f"p{run}/x", b"kept", qos=1, retain=True)
        (got,) = sub.receive(1)
        assert got.retain is True


def test_retained_messages_survive_a_restart(tmp_path):
    run = run_id()
    with running_node(tmp_path / "data") as node:
        with connected(node.port) as pub:
            pub.publish(f"s{run}/door", b"closed", qos=1, retain=True)
    with running_node(tmp_path / "data") as node:
        with connected(node.port) as sub:
            sub.subscribe(f"s{run}/#", 1)
            (got,) = sub.receive(1)
            assert (got.topic, got.payload, got.retain) == (f"s{run}/door", b"closed", True)
