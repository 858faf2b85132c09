"""Device connections stay up through a store failover: real processes, real signals, real MQTT clients.

The simplest real failover is a store restart (SIGKILL, then a new process on the same data); the end-to-end one
is a replicated group whose leader is SIGKILLed (etcd, three replicas). Through either, with
``store.failover_wait_s`` longer than the outage, the gateway hides it: subscribers (5.0 and 3.1.1, persistent and
clean) stay connected and get every message published before, during and after it, in order per publisher; a
QoS 2 PUBREL that meets it gets its PUBCOMP once the store recorded the release; a CONNECT that meets it is
accepted after it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt
import pytest

from gateway.mqtt.packets import MQTT_5, Connack, Connect, Pubcomp, Publish, Pubrec, Pubrel
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.cluster import WAIT_S, Gateway, Store, free_port
from tests.helpers.etcd import running_etcd
from tests.helpers.mqtt_fixtures import Client, RawClient, raw_client, run_id, session5
from tests.helpers.processes import LightgateProcess
from tests.helpers.replicas import Group

pytestmark = pytest.mark.slow

WAIT_FLAGS = ("--store-failover-wait-s", str(WAIT_S))
"""A failover wait longer than any outage here (a restart, an election: seconds)."""


def link_broke(gateway: LightgateProcess, after: int) -> None:
    """Wait until ``gateway`` logged that its store connection broke (a line from index ``after`` on)."""
    gateway.wait_log(lambda doc: doc.get("msg", "").startswith(("the store closed", "store connection lost")),
                     after=after)


def met_the_outage(gateway: LightgateProcess, after: int) -> dict:
    """Wait until a store call met the outage: it waits for the store connection, or (without the wait) the
    gateway refused or closed something for it."""
    return gateway.wait_log(lambda doc: doc.get("msg", "").endswith("wait for the store connection")
                            or doc.get("msg", "").startswith(("closing connection", "store unavailable")),
                            after=after)


class Publisher:
    """An MQTT 5 QoS 1 publisher whose PUBACK reason codes are kept ([MQTT-3.4.2-1]: 0 is "stored")."""

    def __init__(self, port: int, run: str) -> None:
        self.client = Client(port, f"pub-{run}", protocol=mqtt.MQTTv5)
        self.codes: dict[int, int] = {}
        self.client.paho.on_publish = lambda c, u, mid, rc, props: self.codes.__setitem__(
            mid, int(getattr(rc, "value", rc)))
        self.client.connect()
        self.sent: list[tuple[bytes, mqtt.MQTTMessageInfo]] = []

    def publish(self, topic: str, payloads: list[bytes]) -> None:
        """Send, without waiting for the acknowledgements."""
        for payload in payloads:
            self.sent.append((payload, self.client.paho.publish(topic, payload, 1)))

    def acked(self) -> list[bytes]:
        """Wait for every acknowledgement; the payloads acknowledged as stored, in publish order."""
        for _, info in self.sent:
            info.wait_for_publish(timeout=WAIT_S)
        return [payload for payload, info in self.sent if self.codes.get(info.mid, 0x80) < 0x80]


def subscribers(port: int, topic: str, run: str) -> dict[str, Client]:
    """A 5.0 and a 3.1.1 subscriber, each persistent and clean, QoS 1 on ``topic``."""
    fleet = {"5.0 persistent": session5(port, f"s5p-{run}", 300)[0],
             "5.0 clean": session5(port, f"s5c-{run}", 0, clean=True)[0]}
    for name, clean in (("3.1.1 persistent", False), ("3.1.1 clean", True)):
        fleet[name] = Client(port, f"s3{'c' if clean else 'p'}-{run}", clean=clean)
        fleet[name].connect()
    for client in fleet.values():
        client.subscribe(topic, 1)
    return fleet


def until_sentinel(client: Client, sentinel: bytes) -> list[bytes]:
    """What ``client`` received up to ``sentinel`` (a barrier: one publisher, one queue, [MQTT-4.6.0-5])."""
    got = []
    while True:
        try:
            payload = client.messages.get(timeout=WAIT_S).payload
        except queue.Empty:
            pytest.fail(f"{client.client_id}: the sentinel did not arrive; got {got}")
        if payload == sentinel:
            return got
        got.append(payload)


def check_publishes_through_outage(gateway: LightgateProcess, port: int, outage: Callable[[], None],
                           recover: Callable[[], None], *, during: Callable[[], None] = lambda: None) -> None:
    """Subscribers of every kind, a publisher before, during and after an outage (``outage()`` breaks the store,
    ``during()`` runs once a call met it, ``recover()`` brings it back); each subscriber stays connected (the same
    socket: no new CONNACK, no disconnect) and gets every message acknowledged, in the publisher's order
    ([MQTT-4.6.0-5]); QoS 1 is at least once ([MQTT-4.3.2]): duplicates are counted and printed."""
    run = run_id()
    topic = f"fo{run}/x"
    fleet = subscribers(port, topic, run)
    publisher = Publisher(port, run)
    try:
        publisher.publish(topic, [b"before-%d" % i for i in range(5)])
        assert publisher.acked() == [b"before-%d" % i for i in range(5)]
        mark = len(gateway.logs)
        broke = time.monotonic()
        outage()
        link_broke(gateway, mark)
        publisher.publish(topic, [b"during-%d" % i for i in range(3)])
        met_the_outage(gateway, mark)
        during()
        recover()
        publisher.sent[5][1].wait_for_publish(timeout=WAIT_S)
        print(f"the first publish of the outage acknowledged {time.monotonic() - broke:.2f} s after it began")
        publisher.publish(topic, [b"after-%d" % i for i in range(5)])
        acked = publisher.acked()
        assert acked == [payload for payload, _ in publisher.sent]  # every publish stored, none refused
        sentinel = b"sentinel-" + run.encode()
        publisher.publish(topic, [sentinel])
        publisher.acked()
        for name, client in fleet.items():
            got = until_sentinel(client, sentinel)
            firsts = list(dict.fromkeys(got))
            print(f"{name}: {len(got)} received, {len(got) - len(firsts)} duplicates")
            assert firsts == acked, name
            assert client.disconnects.empty() and client.connacks.empty(), f"{name} was disconnected"
    finally:
        for client in (*fleet.values(), publisher.client):
            if client.paho.is_connected():
                client.disconnect()
            client.paho.loop_stop()


def completed_once(device: RawClient, subscriber: Client, topic: str) -> None:
    """The QoS 2 flow of packet id 9 that ``device`` released during the outage completes: PUBCOMP 0
    ([MQTT-4.3.3-1]); ``subscriber`` (connected throughout) gets its message exactly once ([MQTT-4.3.3-2])."""
    assert device.receive() == Pubcomp(9, ReasonCode.SUCCESS)
    device.send(Publish(topic, b"sentinel", qos=1, packet_id=10))
    device.receive()
    assert until_sentinel(subscriber, b"sentinel") == [b"once"]
    assert subscriber.disconnects.empty()


@pytest.fixture
def restartable(tmp_path):
    """A store and a gateway that waits for it through a restart: ``[store]`` (the list holds the live one)."""
    stores = [Store(tmp_path / "data", free_port())]
    gateway = Gateway(stores[0].port, *WAIT_FLAGS)
    try:
        yield stores, gateway
    finally:
        gateway.stop()
        stores[-1].stop()


def restart(stores: list[Store]) -> None:
    stores.append(stores[-1].restarted())


def test_subscribers_stay_connected_and_get_everything_through_a_store_restart(restartable):
    """A subscriber's pulls, commits and session saves that meet the outage wait for the store and go on: without
    the wait the gateway closes each subscriber (connection lost) and the clean ones lose their subscriptions."""
    stores, gateway = restartable
    check_publishes_through_outage(gateway, gateway.port, lambda: stores[-1].kill(), lambda: restart(stores))


def test_a_pubrel_during_a_store_restart_gets_its_pubcomp_and_the_message_arrives_once(restartable):
    """A QoS 2 PUBLISH acknowledged (PUBREC) before the outage, its PUBREL sent during it: the gateway records the
    release once the store is back and answers PUBCOMP 0, the publisher's connection up ([MQTT-4.3.3-1]: PUBCOMP
    after the PUBREL); the subscriber gets the message exactly once ([MQTT-4.3.3-2]: not stored again)."""
    stores, gateway = restartable
    run = run_id()
    topic = f"q2{run}/x"
    subscriber = Client(gateway.port, f"s2-{run}", protocol=mqtt.MQTTv5)
    subscriber.connect()
    subscriber.subscribe(topic, 2)
    try:
        with raw_client(gateway.port, MQTT_5) as device:
            device.connect(f"p2-{run}")
            device.send(Publish(topic, b"once", qos=2, packet_id=9))
            assert device.receive() == Pubrec(9)
            mark = len(gateway.logs)
            stores[-1].kill()
            link_broke(gateway, mark)
            device.send(Pubrel(9))
            met_the_outage(gateway, mark)
            restart(stores)
            completed_once(device, subscriber, topic)
    finally:
        subscriber.disconnect()


def test_a_connect_during_a_store_restart_is_accepted_after_it(restartable):
    """A CONNECT that finds no store connection waits for it (up to the failover wait) instead of being answered
    Server unavailable at once, and is accepted once the store is back ([MQTT-3.2.2-6]: a CONNACK of 0, then the
    session is used: a publish is acknowledged)."""
    stores, gateway = restartable
    mark = len(gateway.logs)
    stores[-1].kill()
    link_broke(gateway, mark)
    with raw_client(gateway.port, MQTT_5) as device:
        device.send(Connect(MQTT_5, f"c-{run_id()}", True))
        met_the_outage(gateway, mark)
        restart(stores)
        connack = device.receive()
        assert isinstance(connack, Connack) and connack.reason_code is ReasonCode.SUCCESS, connack
        device.send(Publish(f"c{run_id()}/x", b"after", qos=1, packet_id=1))
        assert device.receive().reason_code is ReasonCode.SUCCESS


def test_a_replicated_group_leader_kill_is_hidden_from_devices(tmp_path):
    """End to end: etcd, three replicas, a gateway given their addresses; the leader is SIGKILLed while subscribers
    of every kind are connected and a publisher publishes before, during and after the election: no subscriber is
    disconnected, each gets every acknowledged message in order. A QoS 2 PUBREL sent during the election gets
    PUBCOMP 0 from the new leader ([MQTT-4.3.3-1]) and its message arrives once ([MQTT-4.3.3-2]: the flow is in
    the log, so the new leader knows it); a CONNECT sent during it is accepted ([MQTT-3.2.2-6])."""
    run = run_id()
    topic = f"g2{run}/x"
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints)
        try:
            _, epoch = group.wait_leader()
            group.wait_isr(group.names)
            gateway = group.gateway(*WAIT_FLAGS)
            subscriber = Client(gateway.port, f"s2-{run}", protocol=mqtt.MQTTv5)
            subscriber.connect()
            subscriber.subscribe(topic, 2)
            try:
                with raw_client(gateway.port, MQTT_5) as device, raw_client(gateway.port, MQTT_5) as late:
                    device.connect(f"p2-{run}")
                    device.send(Publish(topic, b"once", qos=2, packet_id=9))
                    assert device.receive() == Pubrec(9)

                    def kill_leader() -> None:
                        group.replicas[group.leader()[0]].kill()

                    def in_the_window() -> None:
                        device.send(Pubrel(9))
                        late.send(Connect(MQTT_5, f"late-{run}", True))

                    check_publishes_through_outage(gateway, gateway.port, kill_leader, lambda: group.wait_leader(epoch),
                                           during=in_the_window)
                    completed_once(device, subscriber, topic)
                    connack = late.receive()
                    assert isinstance(connack, Connack) and connack.reason_code is ReasonCode.SUCCESS, connack
            finally:
                subscriber.disconnect()
                gateway.stop()
        finally:
            group.stop()
