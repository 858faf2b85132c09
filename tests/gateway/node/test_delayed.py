"""Delayed publish through `lightgate serve`: ``$delayed/<seconds>/<topic>`` (gateway/mqtt/delayed.py, store/timer/).

A message is delivered to ``<topic>`` once its delay has passed and never on the ``$delayed/...`` name; QoS,
retain, MQTT 5 properties and the publisher's client id are kept, and Message Expiry counts from the due time. A
delay over ``delayed.max_delay_s`` and a client over ``delayed.max_pending_per_client`` are refused with a reason
code (MQTT 5) or a close (3.1.1), never dropped unseen. A delayed message's id (MQTT 5 acks, HTTP publish) lists
and cancels it through the admin API, and a cancelled one is never delivered.
"""

from __future__ import annotations

import queue
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.packets import MQTT_5, Puback, Pubcomp, Publish, Pubrec, Pubrel
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.admin import Admin, admin_port
from tests.helpers.mqtt_fixtures import (WAIT_S, Client, connected, properties, raw_client, run_id, running_node,
                                         subscribe5)
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


def delayed_id(properties) -> str:
    """The ``delayed-id`` User Property of an acknowledgement's properties (paho's or the codec's)."""
    pairs = getattr(properties, "UserProperty", None) or getattr(properties, "user_properties", ())
    (found,) = [value for name, value in pairs if name == "delayed-id"]
    return found


def test_the_mqtt5_ack_of_a_delayed_publish_carries_its_id_which_lists_and_cancels_it(tmp_path):
    """PUBACK / PUBREC carry the id as a User Property [MQTT-3.4.2.2.3, 3.5.2.2.3], left out when the client's
    Maximum Packet Size has no room for it [MQTT-3.4.2-3] [MQTT-3.1.2-24]; MQTT 3.1.1 acks have no properties."""
    run = run_id()
    topic = f"d/{run}/ids"
    with running_node(tmp_path / "data") as node:
        admin = Admin(admin_port(node))
        with connected(node.port, protocol=mqtt.MQTTv5, client_id=f"pub-{run}") as pub:
            got: queue.Queue = queue.Queue()
            pub.paho.on_publish = lambda c, u, mid, rc, props: got.put(props)
            pub.paho.publish(f"$delayed/600/{topic}", b"one", 1)
            paho_id = delayed_id(got.get(timeout=WAIT_S))
        with raw_client(node.port, MQTT_5) as raw:
            raw.connect(f"raw-{run}")
            raw.send(Publish(f"$delayed/600/{topic}", b"two", qos=2, packet_id=1))
            pubrec = raw.receive()
            assert isinstance(pubrec, Pubrec) and pubrec.reason_code == ReasonCode.SUCCESS
            raw_id = delayed_id(pubrec.properties)
            raw.send(Pubrel(1))
            assert isinstance(raw.receive(), Pubcomp)
        with raw_client(node.port, MQTT_5) as small:
            small.connect(f"small-{run}", properties=Properties(maximum_packet_size=20))  # a CONNACK fits
            small.send(Publish(f"$delayed/600/{topic}", b"three", qos=1, packet_id=1))
            assert small.receive() == Puback(1)  # stored, acknowledged without the id that would not fit
        with raw_client(node.port) as old:
            old.connect(f"old-{run}")
            old.send(Publish(f"$delayed/600/{topic}", b"four", qos=1, packet_id=1))
            assert old.receive() == Puback(1)
        listed = admin.get(f"/api/v1/delayed?topic={topic}")
        assert listed["cursor"] is None and len(listed["messages"]) == 4
        first = listed["messages"][0]
        assert (first["id"], first["topic"], first["client_id"], first["qos"], first["retain"], first["bytes"]) == (
            paho_id, topic, f"pub-{run}", 1, False, 3)
        assert [m["id"] for m in admin.get(f"/api/v1/delayed?client_id=raw-{run}")["messages"]] == [raw_id]
        pages, cursor = [], ""
        while cursor is not None:
            page = admin.get(f"/api/v1/delayed?topic={topic}&limit=3" + (f"&cursor={cursor}" if cursor else ""))
            pages.append([m["id"] for m in page["messages"]])
            cursor = page["cursor"]
        assert pages == [[m["id"] for m in listed["messages"][:3]], [listed["messages"][3]["id"]]]
        assert admin.request("DELETE", f"/api/v1/delayed/{paho_id}")[0] == 200
        assert admin.request("DELETE", f"/api/v1/delayed/{paho_id}")[0] == 404  # cancelled already
        assert admin.request("DELETE", "/api/v1/delayed/0-fffffff")[0] == 404  # unknown
        assert admin.request("DELETE", "/api/v1/delayed/not-an-id")[0] == 400
        assert admin.request("GET", "/api/v1/delayed?limit=0")[0] == 400
        assert [m["id"] for m in admin.get(f"/api/v1/delayed?topic={topic}")["messages"]] == [
            m["id"] for m in listed["messages"][1:]]
        admin.close()


def test_a_cancelled_delayed_message_is_never_delivered(tmp_path):
    run = run_id()
    topic = f"d/{run}/cancel"
    with running_node(tmp_path / "data") as node:
        port = admin_port(node)
        admin = Admin(port)
        with connected(node.port, protocol=mqtt.MQTTv5, client_id=f"sub-{run}") as sub, \
                connected(node.port, protocol=mqtt.MQTTv5, client_id=f"pub-{run}") as pub:
            assert subscribe5(sub, topic, qos=1) == [1]
            got: queue.Queue = queue.Queue()
            pub.paho.on_publish = lambda c, u, mid, rc, props: got.put(props)
            pub.paho.publish(f"$delayed/2/{topic}", b"cancelled", 1)
            cancelled = delayed_id(got.get(timeout=WAIT_S))
            status, _, body = admin.request("POST", "/api/v1/publish", {"topic": topic, "payload": "http cancelled",
                                                                        "qos": 1, "delay_s": 2})
            assert status == 200 and body["id"], body
            assert admin.request("DELETE", f"/api/v1/delayed/{cancelled}")[0] == 200
            assert admin.request("DELETE", f"/api/v1/delayed/{body['id']}")[0] == 200
            pub.paho.publish(f"$delayed/3/{topic}", b"kept", 1)  # due after both: the barrier
            assert sub.messages.get(timeout=WAIT_S).payload == b"kept"  # the cancelled ones, due before, never came
        assert metric(port, "lightgate_delayed_cancelled_total") == 2
        assert metric(port, "lightgate_delayed_dequeued_total") == 1 and metric(port, "lightgate_delayed_pending") == 0
        admin.close()
