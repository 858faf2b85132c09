"""Takeovers over raw sockets against a `lightgate serve` process: the will of the connection taken over, and
what of its session the new connection may resume (issue 21, items 2 and 3)."""

import time

import pytest

from gateway.mqtt.packets import MQTT_5, MQTT_311, Disconnect, Publish
from gateway.mqtt.properties import Properties
from tests.helpers.mqtt_fixtures import QUIET_S, WAIT_S, RawClient, raw_client, run_id

TAKEOVERS = 100


def _payloads_until(watcher: RawClient, sentinel: bytes) -> list[bytes]:
    """The payloads the watcher receives up to the sentinel (excluded)."""
    payloads = []
    while True:
        packet = watcher.receive()
        assert isinstance(packet, Publish), packet
        if packet.payload == sentinel:
            return payloads
        payloads.append(packet.payload)


def _sentinel(port: int, topic: str) -> None:
    """Publish the sentinel: everything published before it reached the watcher first."""
    with raw_client(port) as pub:
        pub.connect(f"sentinel-{run_id()}")
        pub.send(Publish(topic, b"sentinel", 0), Disconnect())


# --- wills at takeover ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
def test_the_will_of_every_connection_taken_over_is_published(interop_node, level):
    """[MQTT-3.1.2-8]: the will goes when the network connection closes without a DISCONNECT, as a takeover
    closes it (with no will delay). Every other old connection is also closed by its client just before the
    new one connects (the will of a lost connection and the takeover race)."""
    run = run_id()
    client_id = f"will-{run}"
    with raw_client(interop_node.port, level) as watcher:
        watcher.connect(f"watch-{run}")
        watcher.subscribe(f"will{run}/#", qos=0)
        old = RawClient(interop_node.port, level)
        old.connect(client_id, will_topic=f"will{run}/x", will_payload=b"0")
        for i in range(1, TAKEOVERS + 1):
            if i % 2 == 0:
                old.close()
            new = RawClient(interop_node.port, level)
            new.connect(client_id, will_topic=f"will{run}/x", will_payload=str(i).encode())
            old.close()
            old = new
        old.send(Disconnect())  # the last one leaves politely: no will
        old.close()
        _sentinel(interop_node.port, f"will{run}/x")
        assert _payloads_until(watcher, b"sentinel") == [str(i).encode() for i in range(TAKEOVERS)]


@pytest.mark.slow
def test_a_delayed_will_is_not_published_when_the_session_resumes_in_time(interop_node):
    """[MQTT-3.1.3-9]: a new connection to the session before the Will Delay Interval passed: no will."""
    run = run_id()
    client_id = f"delayed-{run}"
    delay_s = 2
    persistent = Properties(session_expiry_interval=300)
    will = Properties(will_delay_interval=delay_s)
    with raw_client(interop_node.port, MQTT_5) as watcher:
        watcher.connect(f"watch-{run}")
        watcher.subscribe(f"will{run}/#", qos=0)
        old = None
        for i in range(TAKEOVERS + 1):
            if old is not None and i % 2 == 0:
                old.close()
            new = RawClient(interop_node.port, MQTT_5)
            new.connect(client_id, clean=False, properties=persistent, will_topic=f"will{run}/x",
                        will_payload=str(i).encode(), will_properties=will)
            if old is not None:
                old.close()
            old = new
        last_takeover = time.monotonic()
        old.send(Disconnect())  # normal disconnection: its will is deleted
        old.close()
        # A will fires only once its delay has passed: listen until then (and a little more), then the sentinel.
        watcher.sock.settimeout(max(QUIET_S, delay_s + QUIET_S - (time.monotonic() - last_takeover)))
        with pytest.raises(TimeoutError):
            pytest.fail(f"a will arrived: {watcher.sock.recv(65536)!r}")
        watcher.sock.settimeout(WAIT_S)
        _sentinel(interop_node.port, f"will{run}/x")
        assert _payloads_until(watcher, b"sentinel") == []


@pytest.mark.slow
def test_a_delayed_will_is_published_when_a_clean_start_ends_its_session(interop_node):
    """Section 3.1.3.2.2: the will goes when its delay passes or the session ends, whichever is first; a new
    connection with Clean Start 1 ends the old session, so its delayed will goes then."""
    run = run_id()
    client_id = f"ended-{run}"
    rounds = 20
    with raw_client(interop_node.port, MQTT_5) as watcher:
        watcher.connect(f"watch-{run}")
        watcher.subscribe(f"will{run}/#", qos=0)
        old = None
        for i in range(rounds + 1):
            new = RawClient(interop_node.port, MQTT_5)
            new.connect(client_id, clean=True, properties=Properties(session_expiry_interval=300),
                        will_topic=f"will{run}/x", will_payload=str(i).encode(),
                        will_properties=Properties(will_delay_interval=3600))
            if old is not None:
                old.close()
            old = new
        old.send(Disconnect())
        old.close()
        _sentinel(interop_node.port, f"will{run}/x")
        assert _payloads_until(watcher, b"sentinel") == [str(i).encode() for i in range(rounds)]


# --- what a takeover resumes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5])
def test_a_takeover_does_not_resume_a_session_that_ended_with_the_connection_taken_over(interop_node, level):
    """[MQTT-3.1.2-6]: the state of a Clean Session 1 connection (5.0: Session Expiry 0) is not reused by a
    Clean Session 0 (Clean Start 0) connection that takes it over: Session Present 0, no old subscriptions."""
    run = run_id()
    client_id = f"np-{run}"
    old = RawClient(interop_node.port, level)
    old.connect(client_id, clean=level == MQTT_311)  # 5.0: Clean Start 0, but Session Expiry 0
    old.subscribe(f"np{run}/old", qos=0)
    persistent = Properties(session_expiry_interval=300) if level == MQTT_5 else Properties()
    new = RawClient(interop_node.port, level)
    try:
        assert not new.connect(client_id, clean=False, properties=persistent).session_present
        new.subscribe(f"np{run}/new", qos=0)
        with raw_client(interop_node.port) as pub:
            pub.connect(f"pub-{run}")
            pub.send(Publish(f"np{run}/old", b"old", 0), Publish(f"np{run}/new", b"sentinel", 0), Disconnect())
        assert _payloads_until(new, b"sentinel") == []
    finally:
        old.close()
        new.close()
    again = RawClient(interop_node.port, level)  # and the new session is the one kept
    try:
        assert again.connect(client_id, clean=False, properties=persistent).session_present
    finally:
        again.close()
