"""A gateway frozen past its store lease (SIGSTOP) wakes up (SIGCONT) and must not undo what happened meanwhile.

Real processes: one `lightgate store` with a short lease, two `lightgate gateway`s, paho devices. While the first
gateway is frozen, the store ends its lease (publishing the wills it held) and a device reconnects to the second
gateway. The newest connection must win ([MQTT-3.1.4-3]): the woken gateway learns from the store that its lease
ended (a new epoch in the Welcome) and closes its stale connections without a will or a write for them.
"""

import signal
from contextlib import contextmanager

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from tests.helpers.cluster import Gateway, Store, ask_store, free_port, run_id, wait_for
from tests.helpers.mqtt_fixtures import Client, connected, check_nothing_before_sentinel, properties

pytestmark = pytest.mark.slow

LEASE_S = 4.0
"""The store's lease in these tests: short, so a freeze past it takes seconds; long enough that the moved device's
CONNECT on the other gateway lands within it on a busy machine, and that heartbeats (every 0.8 s) keep the lease
of a gateway that is not frozen."""


@contextmanager
def frozen(gateway: Gateway):
    """SIGSTOP the gateway for the block, SIGCONT after (also when the block fails)."""
    gateway.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        gateway.proc.send_signal(signal.SIGCONT)


def test_a_gateway_frozen_past_its_lease_wakes_without_touching_what_its_clients_did_meanwhile(tmp_path):
    store = Store(tmp_path / "data", free_port(), "--store-lease-s", str(LEASE_S))
    gw1 = Gateway(store.port)
    gw2 = Gateway(store.port)
    run = run_id()
    mover, stayer = f"mover-{run}", f"stayer-{run}"
    expiry = properties(PacketTypes.CONNECT, SessionExpiryInterval=300)
    try:
        with connected(gw2.port) as watcher:
            watcher.subscribe(f"will{run}/#", 1)
            old = Client(gw1.port, mover, protocol=mqtt.MQTTv5, clean=False, will=(f"will{run}/{mover}", b"mover", 1))
            old.connect(properties=expiry)
            old.subscribe(f"cmd{run}/{mover}", 1)
            stay = Client(gw1.port, stayer, protocol=mqtt.MQTTv5, clean=False,
                          will=(f"will{run}/{stayer}", b"stayer", 1))
            stay.connect(properties=expiry)
            wait_for(lambda: ask_store(store.port, lambda client: client.load_session(mover)) is not None,
                     "gw1 to save the mover's session with its subscription")
            old.paho.loop_stop()  # both devices' sockets stay open and silent: they froze with their gateway
            stay.paho.loop_stop()
            with frozen(gw1):
                new = Client(gw2.port, mover, protocol=mqtt.MQTTv5, clean=False)
                assert new.connect(properties=expiry).session_present  # the device moved during the freeze
                assert not [doc for doc in store.logs if doc.get("msg") == "gateway node lease ended"
                            and doc.get("node") == gw1.node], "the machine is too slow for this lease"
                store.wait_log(lambda doc: doc.get("msg") == "gateway node lease ended" and doc.get("node") == gw1.node)
                [will] = watcher.receive(1)
                assert will.payload == b"stayer"  # fired by the store at the lease's end; the mover's is not
            gw1.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"))
            with connected(gw1.port) as pub:  # through the woken node, once it is back on the store
                pub.publish(f"cmd{run}/{mover}", b"to the newest connection", 1)
            try:
                assert [m.payload for m in new.receive(1)] == [b"to the newest connection"]
                assert new.disconnects.empty()  # the newest connection won ([MQTT-3.1.4-3])
                assert new.paho.is_connected()
            finally:
                new.disconnect()
            for client_id in (mover, stayer):  # the woken node closed its stale connections
                gw1.wait_log(lambda doc, c=client_id: doc.get("client_id") == c and "closing connection" in doc["msg"])
            check_nothing_before_sentinel(watcher, watcher, f"will{run}/x")  # no will for the mover, no second for the stayer
        fenced = gw1.wait_log(lambda doc: doc.get("msg", "").startswith("store lease lost"))
        assert fenced["clients"] == 2
        assert not [doc for doc in store.logs if doc.get("msg", "").startswith("writes of an ended lease")], \
            "the woken node sent writes for its stale clients"
        for stale in (old, stay):
            stale.paho.socket().close()
    finally:
        for process in (gw2, gw1, store):
            process.stop()
