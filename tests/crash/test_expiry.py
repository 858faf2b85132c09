"""Session expiry and delayed wills through restarts of real processes (store/ledger.py, store/leases.py).

A detached MQTT 5 session with Session Expiry Interval E, disconnected at D, is gone at D + E whatever restarts
happen in between; one connected when its node stopped counts as disconnected when the node starts again. Once
gone, a CONNECT with Clean Start 0 gets Session Present 0 [MQTT-3.2.2-2] [MQTT-3.2.2-3] and nothing of the old
session. A long expiry keeps its session, and a will waiting for its delay is published after the restart
[MQTT-3.1.2-8] unless the session resumed first. Every wait is on a condition (the admin API or the store's
session list, a message), with a bounded timeout.
"""

from __future__ import annotations

import pytest
import rocksdict

from gateway.mqtt.packets import MQTT_5
from gateway.mqtt.properties import Properties
from tests.helpers.admin import Admin, admin_port
from tests.helpers.base import BaseNode, base_tree
from tests.helpers.cluster import Gateway, Store, ask_store, free_port, wait_for
from tests.helpers.mqtt_fixtures import (WAIT_S, Node, RawClient, check_nothing_before_sentinel, kill, run_id,
                                         session5, subscribe5, wait_until)
from tests.helpers.processes import WAIT_S as START_WAIT_S
from tests.helpers.prometheus import metric

pytestmark = pytest.mark.slow

SHORT_S = 2  # the Session Expiry Interval of the sessions that must be gone after the restart
LONG_S = 3600  # ... and of the ones that must still be there
SESSIONS = 5
WILL_DELAY_S = int(START_WAIT_S) + 5
"""The delay of the wills pending at a kill, counted from their close before it: longer than the restart may take
(a node that is not ready within ``START_WAIT_S`` fails the test), so the session that resumes after it does so
before its will is due. At 5 s a restart on a loaded machine took longer (3.8 to 6.4 s at load 12) and that will
was published, as the delay had passed."""


def detach(port: int, client_id: str, expiry_s: int, *filters: str) -> None:
    """Leave a detached session: connect with ``expiry_s``, subscribe to ``filters`` (QoS 1), DISCONNECT."""
    client, _ = session5(port, client_id, expiry_s)
    for filter in filters:
        subscribe5(client, filter)
    client.disconnect()


def stop(process, how: str) -> None:
    if how == "sigkill":
        kill(process)
    else:
        assert process.stop() == 0


def gone_in_admin(admin: Admin, client_id: str) -> bool:
    status, _, _ = admin.request("GET", f"/api/v1/sessions/{client_id}")
    return status == 404


def check_expired_and_kept(port: int, short: list[str], long: str, topic: str) -> None:
    """Each of ``short`` resumes nothing [MQTT-3.2.2-2]; ``long`` resumes with the message queued for it."""
    for client_id in short:
        client, present = session5(port, client_id, SHORT_S)
        assert not present, client_id
        client.disconnect()
    keeper, present = session5(port, long, LONG_S)
    assert present  # [MQTT-3.2.2-3]
    assert keeper.messages.get(timeout=WAIT_S).topic == topic
    keeper.disconnect()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_embedded_sessions_expire_through_a_restart(tmp_path, how):
    run = run_id()
    topic = f"ex/{run}/t"
    node = Node(tmp_path / "data")
    detached = [f"gone-{run}-{i}" for i in range(SESSIONS)]
    connected = [f"live-{run}-{i}" for i in range(SESSIONS)]
    keeper_id = f"keep-{run}"
    try:
        for client_id in detached + connected + [keeper_id]:
            client, _ = session5(node.port, client_id, LONG_S if client_id == keeper_id else SHORT_S)
            subscribe5(client, f"ex/{run}/+")
            if client_id != keeper_id:
                subscribe5(client, f"only/{run}/#")  # held by the short sessions alone: released by their expiry
            if client_id in connected:
                continue  # still connected when the node stops
            client.disconnect()
        publisher, _ = session5(node.port, f"pub-{run}", 0, clean=True)
        publisher.publish(topic, b"queued")
        publisher.disconnect()
        assert metric(admin_port(node), "lightgate_active_filters") == 2
        stop(node, how)

        node = Node(tmp_path / "data")
        admin = Admin(admin_port(node))
        try:
            for client_id in detached + connected:
                wait_until(lambda: gone_in_admin(admin, client_id), WAIT_S, f"{client_id} expired after the restart")
            assert not gone_in_admin(admin, keeper_id)
            wait_until(lambda: metric(admin.port, "lightgate_active_filters") == 1, WAIT_S,
                       f"only/{run}/# released by the expired sessions, ex/{run}/+ still held by the long one")
        finally:
            admin.close()
        check_expired_and_kept(node.port, detached + connected, keeper_id, topic)
    finally:
        node.stop()
    assert not node.errors(), node.errors()


def test_a_session_stored_without_a_ledger_entry_expires_one_expiry_after_the_start(tmp_path):
    """Sessions kept before the client ledger existed were made permanent by every restart: the first start that
    finds one counts it as closed then. The data directory is BASE's (tests/helpers/base.py: session blobs beside
    the log) without its ledger, as a version before the ledger left it."""
    run = run_id()
    node = BaseNode(base_tree(tmp_path / "base"), tmp_path / "data")
    try:
        detach(node.port, f"old-{run}", SHORT_S, f"ex/{run}/+")
        detach(node.port, f"keep-{run}", LONG_S)
        assert node.stop() == 0
        index = str(tmp_path / "data" / "index")
        if "clients" in rocksdict.Rdict.list_cf(index):  # as a data directory of an earlier version
            db = rocksdict.Rdict(index, column_families={name: rocksdict.Options(raw_mode=True)
                                                         for name in rocksdict.Rdict.list_cf(index)},
                                 options=rocksdict.Options(raw_mode=True))
            db.drop_column_family("clients")
            db.close()

        node = Node(tmp_path / "data")
        admin = Admin(admin_port(node))
        try:
            found = node.wait_log(lambda doc: doc.get("msg", "").startswith("stored sessions without a client ledger"))
            assert found["sessions"] == 2
            wait_until(lambda: gone_in_admin(admin, f"old-{run}"), WAIT_S, "the session without an entry expired")
            assert not gone_in_admin(admin, f"keep-{run}")
        finally:
            admin.close()
    finally:
        node.stop()
    assert not node.errors(), node.errors()


def will_client(port: int, client_id: str, topic: str, delay_s: int) -> RawClient:
    """A raw MQTT 5 connection with a QoS 1 will delayed ``delay_s`` and a long session, CONNACKed."""
    client = RawClient(port, MQTT_5)
    client.connect(client_id, clean=False, will_topic=topic, will_payload=b"gone", will_qos=1,
                   will_properties=Properties(will_delay_interval=delay_s),
                   properties=Properties(session_expiry_interval=LONG_S))
    return client


def test_wills_pending_or_held_at_a_kill_are_published_after_the_restart_unless_the_session_resumed(tmp_path):
    """Two wills are pending (``WILL_DELAY_S``) when the node is killed, and a third client is still connected;
    after the restart the will whose session resumed is never published, the others are [MQTT-3.1.2-8] (the
    crashed client's connection closed without a DISCONNECT: its will is due from the restart), and they are the
    barrier the first would arrive before (the lost will, closed after it with the same delay, is due after it)."""
    run = run_id()
    node = Node(tmp_path / "data")
    try:
        detach(node.port, f"watch-{run}", LONG_S, f"will/{run}/+")
        resumed = will_client(node.port, f"back-{run}", f"will/{run}/back", WILL_DELAY_S)
        lost = will_client(node.port, f"lost-{run}", f"will/{run}/lost", WILL_DELAY_S)
        crashed = will_client(node.port, f"crashed-{run}", f"will/{run}/crashed", 0)
        resumed.close()  # no DISCONNECT: the wills wait for their delay
        lost.close()
        kill(node)
        crashed.close()

        node = Node(tmp_path / "data")
        back, present = session5(node.port, f"back-{run}", LONG_S)
        assert present
        watcher, present = session5(node.port, f"watch-{run}", LONG_S)
        assert present
        wills = {(will.topic, will.payload) for will in (watcher.messages.get(timeout=WILL_DELAY_S + WAIT_S)
                                                         for _ in range(2))}
        assert wills == {(f"will/{run}/lost", b"gone"), (f"will/{run}/crashed", b"gone")}
        check_nothing_before_sentinel(watcher, back, f"will/{run}/sentinel")
        back.disconnect()
        watcher.disconnect()
    finally:
        node.stop()


def back_on_the_store(gateway: Gateway, after: int) -> None:
    """Wait for ``gateway`` to reconnect to the restarted store: until then it answers CONNECT with 0x88."""
    gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"), after=after)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_cluster_sessions_expire_through_a_store_restart(tmp_path, how):
    run = run_id()
    topic = f"ex/{run}/t"
    store = Store(tmp_path / "data", free_port())
    gateway = None
    detached = [f"gone-{run}-{i}" for i in range(SESSIONS)]
    keeper_id = f"keep-{run}"
    try:
        gateway = Gateway(store.port)
        for client_id in detached + [keeper_id]:
            detach(gateway.port, client_id, LONG_S if client_id == keeper_id else SHORT_S, f"ex/{run}/+")
        publisher, _ = session5(gateway.port, f"pub-{run}", 0, clean=True)
        publisher.publish(topic, b"queued")
        publisher.disconnect()
        before = len(gateway.logs)
        stop(store, how)
        store = store.restarted()
        back_on_the_store(gateway, before)

        def stored() -> set[str]:
            return set(ask_store(store.port, lambda client: client.sessions()))

        wait_for(lambda: not stored() & set(detached), "the 2 s sessions expired after the store's restart")
        assert keeper_id in stored()
        check_expired_and_kept(gateway.port, detached, keeper_id, topic)
    finally:
        if gateway is not None:
            gateway.stop()
        store.stop()


def test_cluster_clients_connected_through_a_store_kill_stay_and_one_that_left_meanwhile_expires(tmp_path):
    """The gateway keeps running while its store is killed: it adopts its restored lease and registers its
    connected clients again, which keep their sessions; a client that left during the outage (its close never
    reached the store) expires once the gateway had its chance to register it."""
    run = run_id()
    store = Store(tmp_path / "data", free_port())
    gateway = None
    try:
        gateway = Gateway(store.port)
        live, _ = session5(gateway.port, f"live-{run}", SHORT_S)
        subscribe5(live, f"ex/{run}/+")
        leaving, _ = session5(gateway.port, f"leaving-{run}", SHORT_S)
        before = len(gateway.logs)
        kill(store)
        leaving.disconnect()
        store = store.restarted()
        back_on_the_store(gateway, before)

        def stored() -> set[str]:
            return set(ask_store(store.port, lambda client: client.sessions()))

        wait_for(lambda: f"leaving-{run}" not in stored(), "the session left during the outage expired")
        assert f"live-{run}" in stored()
        publisher, _ = session5(gateway.port, f"pub-{run}", 0, clean=True)
        publisher.publish(f"ex/{run}/t", b"after")
        assert live.messages.get(timeout=WAIT_S).payload == b"after"
        publisher.disconnect()
        live.disconnect()
    finally:
        if gateway is not None:
            gateway.stop()
        store.stop()
