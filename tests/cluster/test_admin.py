"""Cluster administration: the admin API of any gateway node acts on, and reports, a client where it is connected.

One `lightgate store` and two `lightgate gateway`s; paho devices on them, admin calls on either. A gateway reaches
the other through the store's presence (the store forwards the call to the node the client is connected to, or a
list call to every node with clients, and relays the answers).
"""

from contextlib import ExitStack

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from tests.helpers.admin import Admin, admin_port
from tests.helpers.cluster import WAIT_S, pop_once, run_id, running_cluster, wait_for
from tests.helpers.mqtt_fixtures import Client, properties

pytestmark = pytest.mark.slow

ADMINISTRATIVE_ACTION = 0x98


def disconnect_reason(device: Client) -> int:
    """The reason code of the DISCONNECT the device got; its loop stops (paho would reconnect)."""
    reason = device.disconnects.get(timeout=WAIT_S)
    device.paho.loop_stop()
    return getattr(reason, "value", reason)


def test_admin_calls_on_any_gateway_act_on_the_client_where_it_is_connected(tmp_path):
    with running_cluster(tmp_path) as (store, (gw1, gw2)):
        admin = Admin(admin_port(gw2))
        run = run_id()
        device_id = f"dev-{run}"
        expiry = properties(PacketTypes.CONNECT, SessionExpiryInterval=300)
        device = Client(gw1.port, device_id, protocol=mqtt.MQTTv5, clean=False)
        device.connect(properties=expiry)
        device.subscribe(f"cmd{run}/{device_id}", 1)
        try:
            info = admin.get(f"/api/v1/clients/{device_id}")
            assert (info["client_id"], info["protocol"], info["subscriptions"]) == (device_id, "5.0", 1)
            session = admin.get(f"/api/v1/sessions/{device_id}")
            assert session["connected"] is True  # live, from gw1: not the stored copy
            assert [s["filter"] for s in session["subscriptions"]] == [f"cmd{run}/{device_id}"]

            status, _, body = admin.request("DELETE", f"/api/v1/clients/{device_id}")
            assert (status, body) == (200, {"disconnected": device_id})
            assert disconnect_reason(device) == ADMINISTRATIVE_ACTION  # closed on gw1
            status, _, _ = admin.request("GET", f"/api/v1/clients/{device_id}")
            assert status == 404  # connected nowhere now

            device = Client(gw1.port, device_id, protocol=mqtt.MQTTv5, clean=False)
            assert device.connect(properties=expiry).session_present  # a disconnect keeps the session
            status, _, body = admin.request("DELETE", f"/api/v1/sessions/{device_id}")
            assert (status, body) == (200, {"deleted": device_id})
            assert disconnect_reason(device) == ADMINISTRATIVE_ACTION
            status, _, _ = admin.request("GET", f"/api/v1/sessions/{device_id}")
            assert status == 404
            device = Client(gw1.port, device_id, protocol=mqtt.MQTTv5, clean=False)
            assert not device.connect(properties=expiry).session_present  # the session is gone for good
        finally:
            device.paho.disconnect()
            device.paho.loop_stop()
            admin.close()
    for process in (store, gw1, gw2):
        assert not process.errors(), process.errors()


def test_the_lists_of_any_gateway_cover_the_clients_sessions_and_queues_of_every_gateway(tmp_path):
    """Clients interleaved over two gateways: a page asked of either one is sorted and counted across both;
    the sessions and queues lists show what the other gateway's clients have (through the store's presence)."""
    with running_cluster(tmp_path) as (store, gateways), ExitStack() as stack:
        run = run_id()
        ids = [f"all-{run}-{i}" for i in range(5)]
        for i, client_id in enumerate(ids):  # even ones on the first gateway, odd ones on the second
            device = Client(gateways[i % 2].port, client_id, protocol=mqtt.MQTTv5)
            stack.callback(device.paho.loop_stop)
            stack.callback(device.paho.disconnect)
            device.connect()
            device.subscribe(f"all{run}/{client_id}", 1)
        for gateway in gateways:
            admin = Admin(admin_port(gateway))
            stack.callback(admin.close)
            status, headers, body = admin.request("GET", f"/api/v1/clients?search=all-{run}&limit=2&offset=1")
            assert status == 200 and headers["x-total-count"] == "5" and "x-missing-nodes" not in headers
            assert [c["client_id"] for c in body] == ids[1:3]  # one from each gateway
            status, headers, body = admin.request("GET", f"/api/v1/clients?search=all-{run}&order=desc&offset=3")
            assert [c["client_id"] for c in body] == [ids[1], ids[0]]
            sessions = {s["client_id"]: s for s in admin.get("/api/v1/sessions")}
            assert all(sessions[c]["connected"] for c in ids)
            assert [s["filter"] for s in sessions[ids[0]]["subscriptions"]] == [f"all{run}/{ids[0]}"]
            queues = {q["queue"] for q in admin.get("/api/v1/queues")}
            assert {f"all{run}/{c}" for c in ids} <= queues
    for process in (store, *gateways):
        assert not process.errors(), process.errors()


def test_any_gateways_cluster_view_lists_the_store_and_the_gateways_with_their_processes(tmp_path):
    """The store node from its statistics, the gateway asked, and the other gateway through the store (it has a
    client, so the store's presence knows it): each with its own pid, CPU time and resident memory."""
    with running_cluster(tmp_path) as (store, (gw1, gw2)), ExitStack() as stack:
        device = Client(gw1.port, f"nodes-{run_id()}", protocol=mqtt.MQTTv5)
        stack.callback(device.paho.loop_stop)
        stack.callback(device.paho.disconnect)
        device.connect()
        admin = Admin(admin_port(gw2))
        stack.callback(admin.close)
        status, headers, nodes = admin.request("GET", "/api/v1/nodes")
        assert status == 200 and "x-missing-nodes" not in headers
        assert [(n["role"], n["pid"], n["here"]) for n in nodes] == [
            ("store", store.proc.pid, False),
            *sorted([("gateway", gw1.proc.pid, False), ("gateway", gw2.proc.pid, True)],
                    key=lambda row: next(n["name"] for n in nodes if n["pid"] == row[1]))]
        by_pid = {n["pid"]: n for n in nodes}
        assert (by_pid[store.proc.pid]["clients"], by_pid[gw1.proc.pid]["clients"]) == (None, 1)
        assert all(n["cpu_s"] > 0 and n["rss_bytes"] > 1 << 20 and n["cpu_percent"] is not None for n in nodes)
        assert len({n["name"] for n in nodes}) == 3
    for process in (store, gw1, gw2):
        assert not process.errors(), process.errors()



def test_the_dead_letters_of_a_pop_group_are_listed_and_re_driven_to_their_original_topic(tmp_path):
    with running_cluster(tmp_path, 1) as (store, (gateway,)):
        admin = Admin(admin_port(gateway))
        run = run_id()
        group, topic = f"workers{run}", f"jobs{run}/a"
        subscriber = Client(gateway.port, protocol=mqtt.MQTTv5)
        subscriber.connect()
        subscriber.subscribe(f"jobs{run}/#", 1)

        assert pop_once(store.port, group, topic, b"poison", f"jobs{run}/#") == [1]
        assert subscriber.messages.get(timeout=WAIT_S).payload == b"poison"
        wait_for(lambda: admin.get(f"/api/v1/dlq/{group}")["letters"], "the message to be dead-lettered")
        page = admin.get(f"/api/v1/dlq/{group}")
        (letter,) = page["letters"]
        assert (letter["origin_topic"], letter["origin_client"], letter["attempts"], letter["payload"]) == \
            (topic, "dev-1", 1, "poison")
        assert (page["next_offset"], page["redriven_below"]) == (1, 0)

        status, _, body = admin.request("POST", f"/api/v1/dlq/{group}")
        assert (status, body) == (200, {"group": group, "redriven": 1, "redriven_below": 1})
        again = subscriber.messages.get(timeout=WAIT_S)  # re-driven: appended to its topic again
        assert (again.topic, again.payload) == (topic, b"poison")
        status, _, body = admin.request("POST", f"/api/v1/dlq/{group}")
        assert body["redriven"] == 0 and admin.get(f"/api/v1/dlq/{group}")["redriven_below"] == 1
        status, _, body = admin.request("GET", f"/api/v1/dlq/{group}?limit=x")
        assert status == 400 and "limit" in body["error"]
        subscriber.disconnect()
