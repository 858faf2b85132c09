"""POP groups across processes: a `lightgate store` and `lightgate gateway`s. The store's POP figures reach a
gateway's /metrics (docs/operations.md, "Metrics"); a gateway SIGKILLed while its shared subscription member holds
messages loses none of them (docs/consumer-groups.md, "MQTT shared subscriptions")."""

import paho.mqtt.client as mqtt
import pytest
import trio

from gateway.mqtt.packets import MQTT_5, Puback, Publish
from gateway.mqtt.properties import Properties as Mqtt5Properties
from store.api import NewMessage
from tests.helpers.admin import admin_port
from tests.helpers.cluster import WAIT_S, ask_store, run_id, running_cluster, wait_for
from tests.helpers.mqtt_fixtures import check_nothing_before_sentinel, connected, raw_client
from tests.helpers.prometheus import metric

pytestmark = pytest.mark.slow

POP_METRICS = ("groups", "inflight", "waiting", "popped_total", "acked_total", "revived_total",
               "dead_lettered_total")


def pop_figures(port: int) -> tuple[float, ...]:
    return tuple(metric(port, f"lightgate_pop_{name}") for name in POP_METRICS)


def test_a_gateway_exports_its_stores_pop_figures(tmp_path):
    """Three messages popped (invisible 30 s, two attempts at most): the first acknowledged, the others given back
    at once (revived), popped again as attempt 2; the second acknowledged, the third given back again: dead-lettered.
    A change of invisible time is not a pop."""
    with running_cluster(tmp_path, 1) as (store, (gateway,)):
        port = admin_port(gateway)
        run = run_id()
        group, queue = f"workers{run}", f"jobs{run}/#"

        async def pop(client, count: int) -> list:
            popped: list = []
            with trio.fail_after(WAIT_S):
                while len(popped) < count:
                    popped += await client.pop(group, queue, "m", count - len(popped), invisible_s=30.0,
                                               wait_s=WAIT_S, max_attempts=2, start="earliest")
            return popped

        async def hand_out(client) -> list:
            await client.append([NewMessage(f"jobs{run}/a", b"%d" % i, "dev-1", 1) for i in range(3)])
            return await pop(client, 3)

        popped = ask_store(store.port, hand_out)
        assert pop_figures(port) == (1, 3, 0, 3, 0, 0, 0)

        async def settle_first(client) -> None:
            longer = await client.change_invisible(popped[0].handle, 60.0)  # not a pop
            assert await client.pop_ack([longer]) == [True]
            for message in popped[1:]:
                assert await client.change_invisible(message.handle, 0.0) is not None  # given back: revived

        ask_store(store.port, settle_first)
        wait_for(lambda: pop_figures(port) == (1, 0, 2, 3, 1, 2, 0), "the two given back to be revived")

        async def second_round(client) -> None:
            again = await pop(client, 2)
            assert sorted((m.record.payload, m.attempt) for m in again) == [(b"1", 2), (b"2", 2)]
            by_payload = {m.record.payload: m for m in again}
            assert await client.pop_ack([by_payload[b"1"].handle]) == [True]
            assert await client.change_invisible(by_payload[b"2"].handle, 0.0) is not None  # its last attempt

        ask_store(store.port, second_round)
        wait_for(lambda: pop_figures(port) == (1, 0, 0, 5, 2, 2, 1), "the last one to be dead-lettered")
        gateway.stop()
        assert not gateway.errors() and not store.errors()


def test_a_gateway_sigkilled_while_its_shared_member_holds_messages_loses_none_and_acked_ones_never_come_again(
        tmp_path):
    """Two gateways (invisible time 2 s), one member of ``$share/g/...`` (QoS 1) on each. Member A on gw1 (Receive
    Maximum 10) takes the first 10 messages and PUBACKs 5; member B on gw2 takes the next 10. gw1 is SIGKILLed with
    A's 5 un-acknowledged: they reach B after their invisible time (MQTT 5.0 section 4.8.2 lets the server send a
    QoS 1 message to another member once the first lost its connection), each once; the 5 A acknowledged never
    come again; every message is acknowledged once to the group, and redelivered only while it was not."""
    with running_cluster(tmp_path, 2, "--mqtt-shared-invisible-s", "2") as (store, (gw1, gw2)):
        port = admin_port(gw2)
        run = run_id()
        topic, share = f"jobs{run}/t", f"$share/g{run}/jobs{run}/#"
        with raw_client(gw1.port, MQTT_5) as member_a, connected(gw2.port, protocol=mqtt.MQTTv5) as member_b, \
                connected(gw2.port) as publisher:
            member_a.connect(f"a-{run}", properties=Mqtt5Properties(receive_maximum=10))
            member_a.subscribe(share, 1)
            for i in range(10):
                publisher.publish(topic, b"%d" % i, 1)
            held = [member_a.receive() for _ in range(10)]  # its window is full: nothing acknowledged yet
            assert all(isinstance(p, Publish) and p.qos == 1 for p in held)
            member_b.subscribe(share, 1)
            for i in range(10, 20):
                publisher.publish(topic, b"%d" % i, 1)
            first = {m.payload for m in member_b.receive(10)}
            assert first == {b"%d" % i for i in range(10, 20)}  # A had no room
            member_a.send(*(Puback(p.packet_id) for p in held[:5]))
            wait_for(lambda: metric(port, "lightgate_pop_acked_total") == 15, "A's five PUBACKs to reach the store")

            gw1.kill()  # A's connection goes with it; its five handles are never given back
            again = {m.payload for m in member_b.receive(5)}  # after the invisible time
            assert again == {p.payload for p in held[5:]}
            wait_for(lambda: metric(port, "lightgate_pop_acked_total") == 20, "B's acks of the five")
            assert (metric(port, "lightgate_pop_popped_total"), metric(port, "lightgate_pop_revived_total"),
                    metric(port, "lightgate_pop_inflight"), metric(port, "lightgate_pop_waiting"),
                    metric(port, "lightgate_pop_dead_lettered_total")) == (25, 5, 0, 0, 0)
            check_nothing_before_sentinel(member_b, publisher, topic)  # no second copy of any, acked or not
        assert first | again | {p.payload for p in held[:5]} == {b"%d" % i for i in range(20)}  # lost: 0
        for process in (store, gw2):
            assert not process.errors(), process.errors()
