"""Cluster mode end to end: a `lightgate store` process and `lightgate gateway` processes, real MQTT clients.

Every process is started by the tests; conditions are waited for with a
timeout (``WAIT_S``), never slept for.
"""

import queue
import socket
import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from gateway.mqtt.packets import MQTT_5, MQTT_311, Connack, Connect, Pubcomp, Publish, Pubrec, Pubrel
from gateway.node.connection import CLOSE_TIMEOUT_S
from gateway.mqtt.reasons import ReasonCode
from store.leases import LEASE_S
from tests.helpers.cluster import WAIT_S, ask_store, run_id, running_cluster, store_statistics, wait_for
from tests.helpers.mqtt_fixtures import (
    QUIET_S, Client, check_hung_member_holds_only_its_window, connect_packet, connected, check_nothing_before_sentinel,
    properties, quiet, raw_client, recv_until_closed,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One store and two gateways for the delivery tests; they must stop cleanly and log no error."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as (store, gateways):
        yield store, gateways
    for process in (store, *gateways):
        assert process.proc.returncode == 0, process.args
        assert not process.errors(), process.errors()


def publisher(port: int, protocol: int) -> tuple[mqtt.Client, dict, queue.Queue]:
    """A paho publisher whose PUBACK reason codes land in ``acks`` (mid -> code) and disconnects in a queue."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{run_id()}", protocol=protocol)
    acks: dict[int, int] = {}
    disconnects: queue.Queue = queue.Queue()
    client.on_publish = lambda c, u, mid, rc, props: acks.__setitem__(mid, int(getattr(rc, "value", rc)))
    client.on_disconnect = lambda c, u, flags, rc, props: disconnects.put(rc)
    connacks: queue.Queue = queue.Queue()
    client.on_connect = lambda c, u, flags, rc, props: connacks.put(rc)
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert not connacks.get(timeout=WAIT_S).is_failure  # the session is open: publishes go to the store
    return client, acks, disconnects


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
@pytest.mark.parametrize("qos", [1, 2])
def test_publish_on_one_gateway_reaches_wildcard_subscribers_on_the_other(cluster, protocol, qos):
    _, (gw1, gw2) = cluster
    run = run_id()
    with connected(gw2.port, protocol=protocol) as plus, connected(gw2.port, protocol=protocol) as hash_, \
            connected(gw1.port, protocol=protocol) as local, connected(gw1.port, protocol=protocol) as pub:
        plus.subscribe(f"tele{run}/+/temp", qos)
        hash_.subscribe(f"tele{run}/#", qos)
        local.subscribe(f"tele{run}/dev0/temp", qos)
        for i in range(5):
            pub.publish(f"tele{run}/dev{i}/temp", f"t{i}".encode(), qos)
        pub.publish(f"tele{run}/dev0/humidity", b"h", qos)
        assert [(m.topic, m.payload, m.qos) for m in plus.receive(5)] == \
            [(f"tele{run}/dev{i}/temp", f"t{i}".encode(), qos) for i in range(5)]
        assert {m.topic for m in hash_.receive(6)} == {f"tele{run}/dev{i}/temp" for i in range(5)} | \
            {f"tele{run}/dev0/humidity"}
        assert [m.payload for m in local.receive(1)] == [b"t0"]  # the publisher's own node delivers too
        check_nothing_before_sentinel(plus, pub, f"tele{run}/dev9/temp")  # no humidity through `+/temp` before it


def test_retained_messages_published_on_one_gateway_reach_new_subscribers_on_the_other(cluster):
    _, (gw1, gw2) = cluster
    run = run_id()
    with connected(gw1.port) as pub:
        pub.publish(f"state{run}/lamp", b"on", 1, retain=True)
        pub.publish(f"state{run}/door", b"shut", 1, retain=True)
    with connected(gw2.port) as late:
        late.subscribe(f"state{run}/+", 1)
        got = late.receive(2)
        assert {(m.topic, m.payload, m.retain) for m in got} == {(f"state{run}/lamp", b"on", True),
                                                                  (f"state{run}/door", b"shut", True)}


def test_shared_subscription_members_on_both_gateways_share_the_messages(cluster):
    _, (gw1, gw2) = cluster
    run = run_id()
    with connected(gw1.port) as one, connected(gw2.port) as two, connected(gw1.port) as pub:
        one.subscribe(f"$share/workers/jobs{run}/#", 1)
        two.subscribe(f"$share/workers/jobs{run}/#", 1)
        for i in range(40):
            pub.publish(f"jobs{run}/j{i}", str(i).encode(), 1)

        def take(count: int) -> list[bytes]:
            """The next ``count`` payloads, from whichever member gets them."""
            received = []
            deadline = time.monotonic() + WAIT_S
            while len(received) < count and time.monotonic() < deadline:
                for member in (one, two):
                    try:
                        received.append(member.messages.get(timeout=0.05).payload)
                    except queue.Empty:
                        pass
            return received

        assert sorted(take(40), key=int) == [str(i).encode() for i in range(40)]  # each message once
        pub.publish(f"jobs{run}/last", b"last", 1)  # a barrier: the group hands its queue out in order
        assert take(1) == [b"last"]  # no second copy of any came before it
        one.disconnect()  # gw1's last member leaves: the store's group now has only gw2
        for i in range(40, 50):
            pub.publish(f"jobs{run}/j{i}", str(i).encode(), 1)
        assert sorted(m.payload for m in two.receive(10)) == sorted(str(i).encode() for i in range(40, 50))


def test_a_hung_shared_member_on_one_gateway_delays_only_its_window_and_gives_it_back_across_gateways(cluster):
    """The store's POP group balances per message across gateways: a member on gw1 that never acknowledges holds
    only its Receive Maximum (2) while the member on gw2 gets the rest; when it disconnects, gw1 gives its two back
    at once (no wait for the 30 s invisible time) and gw2's member gets them (5.0 section 4.8.2)."""
    _, (gw1, gw2) = cluster
    check_hung_member_holds_only_its_window(gw1.port, gw2.port)


def test_a_gateway_without_sessions_on_a_queue_gets_no_events_for_it(cluster):
    store, (gw1, gw2) = cluster
    run = run_id()
    with connected(gw2.port) as sub, connected(gw1.port) as pub:
        sub.subscribe(f"route{run}/x", 1)
        before = store_statistics(store.port).notify_by_node
        for i in range(10):
            pub.publish(f"route{run}/x", str(i).encode(), 1)
        assert len(sub.receive(10)) == 10
        after = store_statistics(store.port)
    # A node the store never sent an event has no entry yet (the test alone, first on a fresh cluster).
    assert after.notify_by_node.get(gw1.node, 0) == before.get(gw1.node, 0)  # the publisher's node: no session on it
    assert after.notify_by_node[gw2.node] > before.get(gw2.node, 0)
    assert after.notify_suppressed > 0


def test_connecting_to_the_other_gateway_takes_the_session_over_from_the_first(cluster):
    store, (gw1, gw2) = cluster
    run = run_id()
    device_id = f"mover-{run}"
    expiry = properties(PacketTypes.CONNECT, SessionExpiryInterval=300)
    with connected(gw2.port) as watcher, connected(gw1.port) as pub:
        watcher.subscribe(f"will{run}/#", 1)
        first = Client(gw1.port, device_id, protocol=mqtt.MQTTv5, clean=False,
                       will=(f"will{run}/{device_id}", b"taken over", 1))
        first.connect(properties=expiry)
        first.subscribe(f"cmd{run}/{device_id}", 1)
        wait_for(lambda: ask_store(store.port, lambda client: client.load_session(device_id)) is not None,
                 "gw1 to save the session with its subscription")
        second = Client(gw2.port, device_id, protocol=mqtt.MQTTv5, clean=False)
        assert second.connect(properties=expiry).session_present
        try:
            reason = first.disconnects.get(timeout=WAIT_S)  # gw1 closed it on hearing of gw2's connection
            first.paho.loop_stop()  # paho would reconnect (after 1 s) and take the session back
            assert getattr(reason, "value", reason) == 0x8E  # Session taken over
            [will] = watcher.receive(1)  # no will delay: it goes with the takeover, as on one node
            assert will.payload == b"taken over"
            pub.publish(f"cmd{run}/{device_id}", b"to the new connection", 1)
            assert [m.payload for m in second.receive(1)] == [b"to the new connection"]
            assert first.messages.empty()  # its connection is closed and paho's loop stopped: nothing can come
        finally:
            first.paho.loop_stop()
            second.disconnect()
    assert not gw1.errors() and not gw2.errors()


def test_a_will_delayed_on_one_gateway_does_not_fire_once_the_session_resumed_on_the_other(cluster):
    store, (gw1, gw2) = cluster
    run = run_id()
    device_id = f"lost-{run}"
    expiry = properties(PacketTypes.CONNECT, SessionExpiryInterval=300)
    delay_s = 3
    with connected(gw2.port) as watcher:
        watcher.subscribe(f"will{run}/#", 1)
        first = Client(gw1.port, device_id, protocol=mqtt.MQTTv5, clean=False,
                       will=(f"will{run}/{device_id}", b"late", 1, False,
                             properties(PacketTypes.WILLMESSAGE, WillDelayInterval=delay_s)))
        first.connect(properties=expiry)
        first.paho.loop_stop()
        first.paho.socket().close()  # the network goes, no DISCONNECT: gw1 delays the will
        gw1.wait_log(lambda doc: doc.get("client_id") == device_id and "connection lost" in doc.get("msg", ""))
        lost = time.monotonic()
        wait_for(lambda: ask_store(store.port, lambda client: client.load_session(device_id)) is not None,
                 "gw1 to save the session it keeps (it saves after closing the connection)")
        second = Client(gw2.port, device_id, protocol=mqtt.MQTTv5, clean=False)
        assert second.connect(properties=expiry).session_present
        try:
            # No barrier: a delayed will fires on a timer; listen past its delay (the behaviour), and a little more.
            quiet(watcher.messages, timeout=max(QUIET_S, delay_s + QUIET_S - (time.monotonic() - lost)))
        finally:
            second.disconnect()


def test_gateway_sigkill_devices_resume_on_the_other_and_wills_fire_within_the_lease(tmp_path):
    with running_cluster(tmp_path) as (store, (gw1, gw2)):
        run = run_id()
        device_id = f"dev-{run}"
        with connected(gw2.port) as watcher, connected(gw2.port) as pub:
            watcher.subscribe(f"will{run}/#", 1)
            device = Client(gw1.port, device_id, clean=False, will=(f"will{run}/{device_id}", b"offline", 1))
            device.connect()
            device.subscribe(f"cmd{run}/{device_id}", 1)
            for i in range(5):
                pub.publish(f"cmd{run}/{device_id}", f"before{i}".encode(), 1)
            assert [m.payload for m in device.receive(5)] == [f"before{i}".encode() for i in range(5)]
            wait_for(lambda: ask_store(store.port, lambda client: client.get_offsets(device_id)).get(
                f"cmd{run}/{device_id}") == 5, "gw1 to commit the acknowledged offsets (every second)")
            device.paho.loop_stop()  # the device's network goes with its gateway
            killed = time.monotonic()
            gw1.kill()
            for i in range(5):  # while the device is away: kept for its persistent session
                pub.publish(f"cmd{run}/{device_id}", f"after{i}".encode(), 1)
            [will] = watcher.receive(1)
            elapsed = time.monotonic() - killed
            assert (will.topic, will.payload) == (f"will{run}/{device_id}", b"offline")
            assert elapsed < LEASE_S + 5.0  # the lease bound (docs/cluster.md), plus process start-up slack
            resumed = Client(gw2.port, device_id, clean=False)
            flags = resumed.connect()
            try:
                assert flags.session_present
                assert [m.payload for m in resumed.receive(5)] == [f"after{i}".encode() for i in range(5)]
                check_nothing_before_sentinel(resumed, resumed, f"cmd{run}/{device_id}")  # nothing acknowledged comes again
            finally:
                resumed.disconnect()
            check_nothing_before_sentinel(watcher, watcher, f"will{run}/x")  # the will fired once


def test_a_normal_disconnect_leaves_no_will_for_the_store_to_fire(tmp_path):
    with running_cluster(tmp_path) as (store, (gw1, gw2)):
        run = run_id()
        with connected(gw2.port) as watcher:
            watcher.subscribe(f"will{run}/#", 1)
            device = Client(gw1.port, f"dev-{run}", will=(f"will{run}/dev", b"offline", 1))
            device.connect()
            device.disconnect()  # DISCONNECT: the will is dropped
            gw1.wait_log(lambda doc: doc.get("client_id") == f"dev-{run}" and "client disconnected" in doc["msg"])
            with connected(gw1.port) as probe:  # a store round trip of gw1 after it dropped the will
                probe.subscribe(f"probe{run}", 1)
            gw1.kill()
            store.wait_log(lambda doc: doc.get("msg") == "gateway node lease ended" and doc.get("node") == gw1.node)
            check_nothing_before_sentinel(watcher, watcher, f"will{run}/x")  # the store fired no will at the lease's end


def test_store_restart_no_false_puback_and_publishes_are_accepted_again(tmp_path):
    with running_cluster(tmp_path) as (store, (gw1, gw2)):
        run = run_id()
        topic = f"data{run}/x"
        with connected(gw2.port, client_id=f"sub-{run}", clean=False) as sub:
            sub.subscribe(topic, 1)
            client, acks, _ = publisher(gw1.port, mqtt.MQTTv5)
            sent: dict[int, bytes] = {}

            def publish(i: int) -> None:
                payload = f"m{i}".encode()
                sent[client.publish(topic, payload, 1).mid] = payload

            for i in range(20):
                publish(i)
            store.kill()  # publishes in flight and after: not acknowledged as stored
            index = 20
            while not any(code >= 0x80 for code in acks.values()):
                publish(index)
                index += 1
                wait_for(lambda: len(acks) == len(sent), "the PUBACKs")
            restarted = store.restarted()
            try:
                gw1.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"))
                gw2.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"))
                accepted_after = None
                while accepted_after is None:
                    mid = client.publish(topic, b"after", 1).mid
                    sent[mid] = b"after"
                    wait_for(lambda: mid in acks, "the PUBACK after the restart")
                    if acks[mid] == 0:
                        accepted_after = mid
                wait_for(lambda: len(acks) == len(sent), "every PUBACK")
                acknowledged = [sent[mid] for mid, code in acks.items() if code == 0]
                refused = [mid for mid, code in acks.items() if code >= 0x80]
                assert refused and set(acks[mid] for mid in refused) <= {0x80, 0x83}
                got = []
                while b"after" not in got or len(set(got)) < len(set(acknowledged)):
                    got.append(sub.messages.get(timeout=WAIT_S).payload)
                assert set(acknowledged) <= set(got)  # no false PUBACK: each acknowledged message was stored
            finally:
                client.loop_stop()
                restarted.stop()


def test_a_qos2_publisher_whose_release_meets_a_store_outage_is_closed_at_once_and_loses_nothing(tmp_path):
    """A PUBREL the store cannot record (it was killed, and the gateway waits for no failover:
    ``store.failover_wait_s`` 0; tests/cluster/test_failover.py has the wait) closes the publisher's connection at
    once: the gateway does not hold the socket while its store calls fail behind it. After the restart the
    publisher resumes its session, releases again and publishes on; both messages, acknowledged (PUBREC) as stored,
    arrive once ([MQTT-4.3.3-2], exactly once)."""
    with running_cluster(tmp_path, 1, "--store-failover-wait-s", "0") as (store, (gw1,)):
        run = run_id()
        topic = f"q2{run}/x"
        with connected(gw1.port, client_id=f"sub-{run}", clean=False) as sub:
            sub.subscribe(topic, 2)
            with raw_client(gw1.port, MQTT_311) as pub:
                pub.connect(f"pub-{run}", clean=False)
                pub.send(Publish(topic, b"m1", qos=2, packet_id=1))
                assert pub.receive() == Pubrec(1)  # stored
                store.kill()
                gw1.wait_log(lambda doc: doc.get("msg", "").startswith(("the store closed", "store connection lost")))
                pub.send(Pubrel(1))
                # Closed at once: long before the node's close timeout, which bounds only the store calls behind it.
                assert recv_until_closed(pub.sock, timeout=CLOSE_TIMEOUT_S / 2) == b""
            restarted = store.restarted()
            try:
                gw1.wait_log(lambda doc: doc.get("msg") == "connected to the store" and doc.get("reconnect"))
                with raw_client(gw1.port, MQTT_311) as pub:
                    pub.sock.settimeout(CLOSE_TIMEOUT_S / 2)  # its old connection holds nothing up (a takeover)
                    assert pub.connect(f"pub-{run}", clean=False).session_present
                    pub.send(Pubrel(1))  # the release the outage cut off, again [MQTT-4.4.0-1]
                    assert pub.receive() == Pubcomp(1)
                    pub.send(Publish(topic, b"m2", qos=2, packet_id=2))
                    assert pub.receive() == Pubrec(2)
                    pub.send(Pubrel(2))
                    assert pub.receive() == Pubcomp(2)
                assert [m.payload for m in sub.receive(2)] == [b"m1", b"m2"]
                check_nothing_before_sentinel(sub, sub, topic)  # each once
            finally:
                restarted.stop()


def test_a_311_publisher_is_disconnected_when_its_message_cannot_be_stored(tmp_path):
    with running_cluster(tmp_path, gateways=1) as (store, (gw1,)):
        client, acks, disconnects = publisher(gw1.port, mqtt.MQTTv311)
        try:
            client.publish("x/y", b"before", 1)
            wait_for(lambda: len(acks) == 1, "the PUBACK")
            store.kill()
            gw1.wait_log(lambda doc: doc.get("msg") in ("the store closed the connection", "store connection lost"))
            mid = client.publish("x/y", b"during", 1).mid
            disconnects.get(timeout=WAIT_S)  # 3.1.1 has no negative PUBACK: the gateway closes instead
            assert mid not in acks
        finally:
            client.loop_stop()


def test_while_the_store_is_down_a_connect_is_refused_at_once_and_the_outage_is_logged_once(tmp_path):
    """CONNACK 0x88 Server unavailable (5.0) / return code 3 (3.1.1) without waiting, one log line for the outage
    and one for its end, never a traceback; CONNECTs succeed again once the store is back."""
    with running_cluster(tmp_path, gateways=1) as (store, (gw1,)):
        store.stop()
        gw1.wait_log(lambda doc: doc.get("msg") in ("the store closed the connection", "store connection lost"))
        for attempt in range(3):
            with raw_client(gw1.port, MQTT_5) as raw:
                raw.send(Connect(MQTT_5, f"dev-{attempt}", True))
                connack = raw.receive()
                assert isinstance(connack, Connack) and connack.reason_code is ReasonCode.SERVER_UNAVAILABLE
            with socket.create_connection(("127.0.0.1", gw1.port), timeout=WAIT_S) as sock:
                sock.sendall(connect_packet(f"old-{attempt}"))
                assert sock.recv(4) == b"\x20\x02\x00\x03"  # 3.1.1 CONNACK, return code 3: Server unavailable
        outage = [doc for doc in gw1.logs if doc.get("msg", "").startswith("store unavailable")]
        assert len(outage) == 1, outage
        restarted = store.restarted()
        try:
            ended = gw1.wait_log(lambda doc: doc.get("msg") == "store available again: CONNECTs are accepted")
            assert ended["refused"] == 6
            with raw_client(gw1.port, MQTT_5) as raw:
                raw.connect("dev-after")
        finally:
            restarted.stop()
        assert not [doc for doc in gw1.logs if doc.get("level") == "error"], gw1.errors()
        assert len([doc for doc in gw1.logs if doc.get("msg", "").startswith("store available again")]) == 1
