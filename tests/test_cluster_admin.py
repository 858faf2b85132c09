"""Cluster administration: the admin API of any gateway node acts on, and reports, a client where it is connected.

One `lightgate store` and two `lightgate gateway`s; a paho device on the first, admin calls on the second. The
second gateway reaches the first through the store's presence (the store forwards the call to the node the client
is connected to, and relays its answer).
"""

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from mqtt_fixtures import properties
from test_cluster import WAIT_S, running_cluster, run_id
from test_gateway_admin import Admin, admin_port
from test_gateway_server import Client

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
