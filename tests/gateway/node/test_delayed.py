"""Delayed publish through `lightgate serve`: ``$delayed/<seconds>/<topic>`` (gateway/mqtt/delayed.py, store/timer/).

A message is delivered to ``<topic>`` once its delay has passed and never on the ``$delayed/...`` name; QoS,
retain, MQTT 5 properties and the publisher's client id are kept, and Message Expiry counts from the due time. A
delay over ``delayed.max_delay_s`` and a client over ``delayed.max_pending_per_client`` are refused with a reason
code (MQTT 5) or a close (3.1.1), never dropped unseen.
"""

from __future__ import annotations

import queue
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from tests.helpers.admin import Admin, admin_port
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connected, properties, run_id, running_node, subscribe5
from tests.helpers.prometheus import metric

pytestmark = pytest.mark.slow


def acks(client: Client) -> queue.Queue:
    """The (mid, reason code) of every PUBACK the client gets."""
    got: queue.Queue = queue.Queue()
    client.paho.on_publish = lambda c, u, mid, rc, props: got.put((mid, rc.value if hasattr(rc, "value") else rc))
    return got


def test_a_delayed_publish_reaches_the_real_topic_after_its_delay_with_what_it_carried(tmp_path):
    run = run_id()
    topic = f"d/{run}/cmd"
    with running_node(tmp_path / "data") as node, \
            connected(node.port, protocol=mqtt.MQTTv5, client_id=f"sub-{run}") as sub, \
            connected(node.port, protocol=mqtt.MQTTv5, client_id=f"pub-{run}") as pub:
        assert subscribe5(sub, topic, qos=1) == [1]
        assert subscribe5(sub, "$delayed/#", qos=1) == [1]
        sent = time.monotonic()
        info = pub.paho.publish(f"$delayed/2/{topic}", b"switch off", 1, False, properties=properties(
            PacketTypes.PUBLISH, UserProperty=[("k", "v")], ContentType="text/plain", MessageExpiryInterval=1))
        info.wait_for_publish(timeout=WAIT_S)  # PUBACK: the delayed message is stored [MQTT-4.3.2-2]
        message = sub.messages.get(timeout=WAIT_S)
        assert time.monotonic() - sent >= 2.0 - 0.05  # not before its delay (the clock's ms rounding aside)
        assert message.topic == topic and message.payload == b"switch off" and message.qos == 1
        assert message.properties.UserProperty == [("k", "v")] and message.properties.ContentType == "text/plain"
        # Message Expiry counts from the due time: 1 s would have run out during the 2 s delay [MQTT-3.3.2-5].
        assert message.properties.MessageExpiryInterval <= 1
        pub.publish(topic, b"sentinel", 1)  # nothing came on the $delayed/... name before it
        assert sub.messages.get(timeout=WAIT_S).payload == b"sentinel"
        assert sub.messages.empty()
        port = admin_port(node)
        assert metric(port, "lightgate_delayed_pending") == 0
        assert metric(port, "lightgate_delayed_scheduled_total") == metric(port, "lightgate_delayed_dequeued_total") == 1
        assert metric(port, "lightgate_delayed_lateness_seconds_count") == 1
        assert metric(port, 'lightgate_delayed_lateness_seconds_bucket{le="1.0"}') == 1  # within the promised second


def test_retain_is_kept_and_applies_at_the_due_time(tmp_path):
    run = run_id()
    topic = f"d/{run}/state"
    with running_node(tmp_path / "data") as node:
        with connected(node.port) as live, connected(node.port) as pub:
            live.subscribe(topic, 1)
            pub.publish(f"$delayed/1/{topic}", b"later", 1, retain=True)
            with connected(node.port) as early:
                early.subscribe(topic, 1)  # before the due time: no retained message yet
                got = live.messages.get(timeout=WAIT_S)  # live delivery: RETAIN 0 [MQTT-3.3.1-9]
                assert got.payload == b"later" and not got.retain
                assert early.messages.get(timeout=WAIT_S).payload == b"later"  # live too
                assert early.messages.empty()
        with connected(node.port) as sub:
            sub.subscribe(topic, 1)  # the retained message, sent at subscribe time [MQTT-3.3.1-6]
            got = sub.messages.get(timeout=WAIT_S)
            assert got.payload == b"later" and got.retain


def test_a_delay_over_the_maximum_is_refused_with_a_reason_code_or_a_close(tmp_path):
    run = run_id()
    with running_node(tmp_path / "data", "--delayed-max-delay-s", "5") as node:
        with connected(node.port, protocol=mqtt.MQTTv5, client_id=f"p5-{run}") as pub:
            got = acks(pub)
            pub.paho.publish(f"$delayed/6/d/{run}", b"x", 1)
            assert got.get(timeout=WAIT_S)[1] == 0x90  # topic name not accepted [MQTT-3.4.2-1]
            pub.paho.publish(f"$delayed/soon/d/{run}", b"x", 1)
            assert got.get(timeout=WAIT_S)[1] == 0x90
            pub.paho.publish(f"$delayed/5/d/{run}", b"x", 1)
            assert got.get(timeout=WAIT_S)[1] == 0
        old = Client(node.port, f"p3-{run}")
        old.connect()
        old.paho.publish(f"$delayed/6/d/{run}", b"x", 1)  # 3.1.1 cannot refuse: the connection closes
        assert old.disconnects.get(timeout=WAIT_S) is not None
        old.paho.loop_stop()


def test_a_client_over_its_cap_of_pending_delayed_messages_is_refused_never_dropped(tmp_path):
    run = run_id()
    with running_node(tmp_path / "data", "--delayed-max-pending-per-client", "2") as node:
        with connected(node.port, protocol=mqtt.MQTTv5, client_id=f"p5-{run}") as pub:
            got = acks(pub)
            for _ in range(3):
                pub.paho.publish(f"$delayed/600/d/{run}", b"x", 1)
            assert [got.get(timeout=WAIT_S)[1] for _ in range(3)] == [0, 0, 0x97]  # quota exceeded
        for qos in (0, 1):  # 3.1.1 (any QoS) and MQTT 5 QoS 0 have no reason to give: the connection closes
            for protocol in (mqtt.MQTTv311, mqtt.MQTTv5) if qos == 0 else (mqtt.MQTTv311,):
                client = Client(node.port, f"p5-{run}", protocol=protocol)
                client.connect()
                client.paho.publish(f"$delayed/600/d/{run}", b"x", qos)
                assert client.disconnects.get(timeout=WAIT_S) is not None
                client.paho.loop_stop()


def test_http_publish_takes_delay_s_or_deliver_at(tmp_path):
    run = run_id()
    topic = f"d/{run}/http"
    with running_node(tmp_path / "data", "--delayed-max-delay-s", "60") as node:
        admin = Admin(admin_port(node))
        with connected(node.port) as sub:
            sub.subscribe(topic, 1)
            sent = time.monotonic()
            status, _, body = admin.request("POST", "/api/v1/publish", {"topic": topic, "payload": "a", "qos": 1,
                                                                        "delay_s": 1})
            assert status == 200 and body["deliver_at"] > 0, body
            status, _, body = admin.request("POST", "/api/v1/publish", {"topic": topic, "payload": "b", "qos": 1,
                                                                        "deliver_at": body["deliver_at"] + 500})
            assert status == 200, body
            assert [m.payload for m in sub.receive(2)] == [b"a", b"b"]
            assert time.monotonic() - sent >= 1.0 - 0.05
        status, _, body = admin.request("POST", "/api/v1/publish", {"topic": topic, "delay_s": 61})
        assert status == 400 and "max_delay_s" in body["error"], body
        status, _, body = admin.request("POST", "/api/v1/publish", {"topic": topic, "delay_s": 1, "deliver_at": 1})
        assert status == 400, body
        admin.close()
