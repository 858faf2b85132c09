"""Delayed publish through cluster gateways: the timer lives in the store, so a message published through one
gateway is delivered at its due time to a subscriber of another, once, and the store's cap answers over the RPC;
the admin API of any gateway lists and cancels it (the store does, over the RPC)."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
import pytest

from tests.helpers.admin import Admin, admin_port
from tests.helpers.cluster import Gateway, Store, free_port, store_statistics
from tests.helpers.mqtt_fixtures import WAIT_S, connected, run_id, subscribe5

pytestmark = pytest.mark.slow


def test_a_delayed_message_crosses_gateways_at_its_due_time_and_the_cap_is_the_stores(tmp_path):
    run = run_id()
    topic = f"d/{run}/cmd"
    store = Store(tmp_path / "data", free_port(), "--delayed-max-pending-per-client", "1")
    gateways = []
    try:
        gateways = [Gateway(store.port), Gateway(store.port)]
        with connected(gateways[0].port, protocol=mqtt.MQTTv5, client_id=f"sub-{run}") as sub, \
                connected(gateways[1].port, protocol=mqtt.MQTTv5, client_id=f"pub-{run}") as pub:
            assert subscribe5(sub, topic, qos=1) == [1]
            acks = []
            pub.paho.on_publish = lambda c, u, mid, rc, props: acks.append(rc.value)
            sent = time.monotonic()
            pub.paho.publish(f"$delayed/1/{topic}", b"later", 1).wait_for_publish(timeout=WAIT_S)
            pub.paho.publish(f"$delayed/60/{topic}", b"over", 1).wait_for_publish(timeout=WAIT_S)
            message = sub.messages.get(timeout=WAIT_S)
            assert message.payload == b"later" and message.topic == topic
            assert time.monotonic() - sent >= 1.0 - 0.05
            assert acks == [0, 0x97]  # the second was over the store's cap of 1 (0x97 over the RPC)
            pub.publish(topic, b"sentinel", 1)
            assert sub.messages.get(timeout=WAIT_S).payload == b"sentinel"  # "later" came once, nothing else
        stats = store_statistics(store.port)
        assert stats.timers.pending == 0 and stats.timers.fired == 1
    finally:
        for process in (*reversed(gateways), store):
            process.stop()


def test_a_delayed_message_published_through_one_gateway_is_listed_and_cancelled_through_another(tmp_path):
    run = run_id()
    topic = f"d/{run}/cancel"
    store = Store(tmp_path / "data", free_port())
    gateways = []
    try:
        gateways = [Gateway(store.port), Gateway(store.port)]
        admin = Admin(admin_port(gateways[1]))
        with connected(gateways[1].port, protocol=mqtt.MQTTv5, client_id=f"sub-{run}") as sub, \
                connected(gateways[0].port, protocol=mqtt.MQTTv5, client_id=f"pub-{run}") as pub:
            assert subscribe5(sub, topic, qos=1) == [1]
            ids = []
            pub.paho.on_publish = lambda c, u, mid, rc, props: ids.append(dict(props.UserProperty)["delayed-id"])
            for delay_s, payload in ((2, b"cancelled"), (3, b"kept")):
                pub.paho.publish(f"$delayed/{delay_s}/{topic}", payload, 1).wait_for_publish(timeout=WAIT_S)
            listed = admin.get(f"/api/v1/delayed?client_id=pub-{run}")["messages"]
            assert [(m["id"], m["topic"]) for m in listed] == [(ids[0], topic), (ids[1], topic)]
            assert admin.request("DELETE", f"/api/v1/delayed/{ids[0]}")[0] == 200  # over the RPC, at the store
            assert admin.request("DELETE", f"/api/v1/delayed/{ids[0]}")[0] == 404
            assert admin.request("DELETE", "/api/v1/delayed/0-fffffff")[0] == 404
            assert sub.messages.get(timeout=WAIT_S).payload == b"kept"  # "cancelled", due before, never came
        admin.close()
        stats = store_statistics(store.port)
        assert (stats.timers.pending, stats.timers.fired, stats.timers.cancelled) == (0, 1, 1)
    finally:
        for process in (*reversed(gateways), store):
            process.stop()
