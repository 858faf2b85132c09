"""A store frozen past the lease (SIGSTOP: a GC or swap stall, a paused VM) must not blame its gateways for it.

Real processes: one `lightgate store` with a short lease, one `lightgate gateway`, paho devices with wills. The
store is stopped for several leases and continued: it notices its own stall and gives its gateways a lease to
speak again, so no will fires and no device is dropped; a publish made during the pause waits for the store and is
acknowledged once stored, never before. The opposite (a frozen gateway, which must lose its lease)
is tests/cluster/test_fencing.py.
"""

import signal
import time

import pytest

from tests.helpers.cluster import WAIT_S, Gateway, Store, free_port, run_id
from tests.helpers.mqtt_fixtures import Client, check_nothing_before_sentinel, connected

pytestmark = pytest.mark.slow

LEASE_S = 2.0
"""The store's lease in this test: short, so a pause of several leases takes seconds; long enough that the
heartbeats (every 0.4 s) keep the lease of a gateway that runs on a busy machine."""

PAUSE_S = 3.5 * LEASE_S
"""How long the store stays stopped: the stimulus (several leases), not a wait for anything."""

DEVICES = 10


def test_a_store_paused_past_the_lease_fires_no_will_and_drops_no_device(tmp_path):
    store = Store(tmp_path / "data", free_port(), "--store-lease-s", str(LEASE_S))
    gateway = Gateway(store.port)
    run = run_id()
    devices = [Client(gateway.port, f"dev{i}-{run}", will=(f"will{run}/{i}", b"gone", 1)) for i in range(DEVICES)]
    try:
        with connected(gateway.port) as watcher:
            watcher.subscribe(f"will{run}/#", 1)
            for i, device in enumerate(devices):
                device.connect()
                device.subscribe(f"cmd{run}/{i}", 1)
            stopped = len(store.logs)
            store.proc.send_signal(signal.SIGSTOP)
            try:
                during = devices[0].paho.publish(f"cmd{run}/0", b"during the pause", 1)  # it waits for the store
                time.sleep(PAUSE_S)  # the pause itself (what the test does to the store), not a synchronisation
                assert not during.is_published()  # never acknowledged before it is stored
            finally:
                store.proc.send_signal(signal.SIGCONT)
            during.wait_for_publish(timeout=WAIT_S)
            assert during.is_published()
            assert [m.payload for m in devices[0].receive(1)] == [b"during the pause"]
            for i, device in enumerate(devices):  # each device is still connected, through the same gateway
                device.publish(f"cmd{run}/{i}", f"after the pause {i}".encode(), 1)
                assert [m.payload for m in device.receive(1)] == [f"after the pause {i}".encode()]
                assert device.disconnects.empty() and device.paho.is_connected()
            check_nothing_before_sentinel(watcher, watcher, f"will{run}/x")  # no will fired
            assert watcher.disconnects.empty()
        assert [doc for doc in store.logs[stopped:] if doc.get("msg", "").startswith("store stalled")]
        assert not [doc for doc in store.logs if doc.get("msg") == "gateway node lease ended"]
        assert not [doc for doc in gateway.logs if doc.get("msg", "").startswith("store lease lost")]
        ids = {device.client_id for device in devices}
        assert not [doc for doc in gateway.logs if doc.get("client_id") in ids and "closing" in doc.get("msg", "")]
    finally:
        for device in devices:
            device.paho.loop_stop()
        gateway.stop()
        store.proc.send_signal(signal.SIGCONT)
        store.stop()
