"""Clients follow the leader of a replicated store: real processes, real sockets.

Store A is a real `lightgate store`; "B" is a replica that does not lead, as a process (tests/helpers/refusing_store.py:
the store's RPC listener, store/rpc/front.py, in its refusing phase naming A). A gateway or a back-end producer given
``B,A`` must end up on A (redirected by B's ``NOT_LEADER``, not fatal on the first connection), say so in one log
line, and work. Then the failover wait: a QoS 1 publish that meets a store outage (never sent to the store) waits
for the next store connection and is acknowledged once stored there, the device staying connected.
"""

import asyncio
import sys

import pytest
import trio

from gateway.mqtt.packets import MQTT_5, MQTT_311, Puback, Publish
from gateway.mqtt.reasons import ReasonCode
from store.clients.aio import AsyncioProducer
from store.clients.blocking import BlockingProducer
from store.clients.producer import Producer
from tests.helpers.cluster import WAIT_S, Gateway, Store, free_port, run_id
from tests.helpers.mqtt_fixtures import connected, raw_client
from tests.helpers.processes import LightgateProcess

pytestmark = pytest.mark.slow

REFUSED = "RPC connections refused: this replica does not lead"


class Refusing(LightgateProcess):
    """Replica B: refuses every Hello with ``NOT_LEADER`` naming ``leader``."""

    def __init__(self, port: int, leader: str) -> None:
        super().__init__(str(port), leader, command=[sys.executable, "-m", "tests.helpers.refusing_store"],
                         json_logs=False, wait_s=WAIT_S)
        self.wait_log(lambda doc: doc["msg"] == "ready")
        self.port = port

    def refusals_logged(self) -> int:
        return sum(doc["msg"] == REFUSED for doc in self.logs)


def leader_lines(process: LightgateProcess) -> list[dict]:
    return [doc for doc in process.logs if doc.get("msg", "").startswith("store leader is now")]


@pytest.fixture
def a_and_b(tmp_path):
    store = Store(tmp_path / "data", free_port())
    b = Refusing(free_port(), f"127.0.0.1:{store.port}")
    try:
        yield store, b
    finally:
        b.stop()
        store.stop()


def test_a_gateway_given_a_replica_that_does_not_lead_first_ends_up_on_the_leader(a_and_b):
    """The first store connection is refused with NOT_LEADER: not fatal; the gateway goes to the named leader, logs
    the leader once, and devices publish and receive through it ([MQTT-4.3.2-1]: the PUBACK follows the store's
    acknowledgement)."""
    store, b = a_and_b
    gateway = Gateway(f"127.0.0.1:{b.port},127.0.0.1:{store.port}")
    try:
        connected_line = gateway.wait_log(lambda doc: doc.get("msg") == "connected to the store")
        assert connected_line["store"] == f"127.0.0.1:{store.port}"
        run = run_id()
        with connected(gateway.port) as sub, connected(gateway.port) as pub:
            sub.subscribe(f"f{run}/x", 1)
            pub.publish(f"f{run}/x", b"via the leader", 1)
            assert sub.receive(1)[0].payload == b"via the leader"
        assert [doc["msg"] for doc in leader_lines(gateway)] == [f"store leader is now 127.0.0.1:{store.port}"]
        assert b.refusals_logged() == 1
    finally:
        gateway.stop()


def test_back_end_producers_given_a_replica_that_does_not_lead_first_end_up_on_the_leader(a_and_b):
    """The trio producer and its blocking and asyncio faces, given ``B,A``: each message is stored (its position
    comes back); B logs one line for all its refusals (one phase)."""
    store, b = a_and_b
    addresses = f"127.0.0.1:{b.port},127.0.0.1:{store.port}"
    run = run_id()

    async def produce() -> None:
        async with Producer.connect(addresses, timeout_s=WAIT_S) as producer:
            position = await (await producer.send(f"p{run}/trio", b"trio"))
            assert position.offset >= 0

    trio.run(produce)
    with BlockingProducer.connect(addresses, timeout_s=WAIT_S) as producer:
        assert producer.send(f"p{run}/blocking", b"blocking").result(timeout=WAIT_S).offset >= 0

    async def produce_asyncio() -> None:
        async with AsyncioProducer.connect(addresses, timeout_s=WAIT_S) as producer:
            assert (await (await producer.send(f"p{run}/asyncio", b"asyncio"))).offset >= 0

    asyncio.run(produce_asyncio())
    assert len([doc for doc in store.logs if doc.get("msg") == "gateway node connected"  # an open store: trusted
                and doc["node"].startswith("producer-")]) == 3
    assert b.refusals_logged() == 1


def test_a_publish_that_meets_a_store_restart_waits_for_it_and_is_acknowledged_stored(tmp_path):
    """With ``store.failover_wait_s`` longer than the outage, a QoS 1 PUBLISH the gateway could not send to the store
    (it was down) is appended once the store is back, then acknowledged: PUBACK 0 ([MQTT-4.3.2-1]: the message is
    stored before the PUBACK), delivered, and the device (MQTT 5.0, then 3.1.1, one outage each) stays connected:
    without the wait the 5.0 device would get PUBACK 0x80 and the 3.1.1 one would be closed (a 3.1.1 PUBACK cannot
    say "not stored")."""
    store = Store(tmp_path / "data", free_port())
    gateway = Gateway(store.port, "--store-failover-wait-s", str(WAIT_S))
    run = run_id()
    topic = f"w{run}/x"
    try:
        with connected(gateway.port, client_id=f"sub-{run}", clean=False) as sub:
            sub.subscribe(topic, 1)
            for level, payload in ((MQTT_5, b"five"), (MQTT_311, b"three")):
                with raw_client(gateway.port, level) as device:
                    device.connect(f"pub-{level}-{run}")
                    waits_before = len(gateway.logs)
                    store.kill()
                    gateway.wait_log(lambda doc: doc.get("msg", "").startswith(("the store closed",
                                                                                "store connection lost")),
                                     after=waits_before)
                    device.send(Publish(topic, payload, qos=1, packet_id=7))
                    gateway.wait_log(lambda doc: doc.get("msg") == "store calls wait for the store connection",
                                     after=waits_before)  # the publish waits: no answer yet, the store is down
                    store = store.restarted()
                    assert device.receive() == Puback(7, ReasonCode.SUCCESS)
                assert sub.messages.get(timeout=WAIT_S).payload == payload
    finally:
        gateway.stop()
        store.stop()
