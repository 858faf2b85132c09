"""SUBSCRIBEs a connection sends back to back are activated together (gateway/node/subscriptions.py): one
CommitLog write for their ``Activated`` records, and still each answered as if alone (issue 31, item 5).

Each test sends its SUBSCRIBEs in one ``sendall``, so the node reads them in one read round and the connection's
worker hands them to the node as one batch.
"""

import uuid

import pytest

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import (MQTT_5, MQTT_311, Pingreq, Pingresp, Publish, Suback, Subscribe, SubscriptionOptions,
                                  Unsuback, Unsubscribe)
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.admin import admin_port
from lightqueue.topics import TopicError
from tests.helpers.cpu import one_cpu
from tests.helpers.mqtt_fixtures import RawClient, raw_client, running_node
from tests.helpers.prometheus import metric

COUNT = 40


@pytest.fixture(scope="module")
def quiet_node(tmp_path_factory):
    """A node that writes nothing of its own meanwhile ($SYS off): its CommitLog writes are the test's."""
    with running_node(tmp_path_factory.mktemp("batch") / "data", "--mqtt-sys-interval-s", "0") as node:
        yield node
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


def _subscribes(filters: list[str], level: int) -> bytes:
    return b"".join(encode(Subscribe(1 + i, ((f, SubscriptionOptions(qos=1)),)), level) for i, f in enumerate(filters))


def _subacks(client: RawClient, count: int) -> list[Suback]:
    subacks = [client.receive() for _ in range(count)]
    assert all(isinstance(s, Suback) for s in subacks), subacks
    return subacks


def test_subscribes_read_together_are_one_commitlog_write(quiet_node):
    run = uuid.uuid4().hex[:6]
    port = admin_port(quiet_node)
    with raw_client(quiet_node.port) as sub:
        sub.connect(f"batch-{run}")
        before = metric(port, "lightgate_commitlog_writes_total")
        sub.sock.sendall(_subscribes([f"b{run}/{i}/+" for i in range(COUNT)], MQTT_311))
        subacks = _subacks(sub, COUNT)
        writes = metric(port, "lightgate_commitlog_writes_total") - before
    # [MQTT-3.8.4-1] [MQTT-3.8.4-2] one SUBACK per SUBSCRIBE, with its packet id, in order
    assert [(s.packet_id, s.reason_codes) for s in subacks] == [(1 + i, (ReasonCode.GRANTED_QOS_1,))
                                                                for i in range(COUNT)]
    assert 1 <= writes <= COUNT // 4, writes  # a few batches (the worker takes what was read), not one write each


def test_subscribes_read_together_each_get_their_retained_and_a_shared_one_joins_its_group(quiet_node):
    """[MQTT-3.8.4-3] each SUBACK comes once its subscription exists, and a message published after it is
    delivered; [MQTT-3.3.1-6] the retained messages of each new subscription are sent, none to a shared one
    (MQTT 5.0, section 4.8.2)."""
    run = uuid.uuid4().hex[:6]
    with raw_client(quiet_node.port, MQTT_5) as pub:
        pub.connect(f"pub-{run}")
        for i in range(3):
            pub.send(Publish(f"r{run}/{i}", b"kept %d" % i, 1, retain=True, packet_id=1 + i))
            pub.receive()  # its PUBACK: stored
        with raw_client(quiet_node.port, MQTT_5) as sub:
            sub.connect(f"sub-{run}")
            filters = [f"r{run}/0", f"$share/g{run}/r{run}/+", f"r{run}/+", f"r{run}/2"]
            sub.sock.sendall(_subscribes(filters, MQTT_5))
            retained: dict[str, int] = {}
            subacks = []
            while len(subacks) < len(filters):
                packet = sub.receive()
                if isinstance(packet, Suback):
                    subacks.append(packet)
                else:
                    assert isinstance(packet, Publish) and packet.retain, packet
                    retained[packet.topic] = retained.get(packet.topic, 0) + 1
            pub.send(Publish(f"r{run}/2", b"after", 0))
            while (packet := sub.receive()).retain:
                retained[packet.topic] = retained.get(packet.topic, 0) + 1
            assert isinstance(packet, Publish) and packet.payload == b"after", packet
    assert [(s.packet_id, s.reason_codes) for s in subacks] == [(1 + i, (ReasonCode.GRANTED_QOS_1,)) for i in range(4)]
    assert retained == {f"r{run}/0": 2, f"r{run}/1": 1, f"r{run}/2": 2}  # r/0 + r/+, r/+, r/2 + r/+


def test_a_publish_read_after_subscribes_read_together_reaches_the_last_of_them(quiet_node):
    """The read order (gateway/node/order.py) holds for a batch: a PUBLISH read after the last SUBSCRIBE of a
    batch, on another connection, is delivered to it (issue 21, item 1)."""
    run = uuid.uuid4().hex[:6]
    with raw_client(quiet_node.port) as sub, raw_client(quiet_node.port) as pub, one_cpu():
        sub.connect(f"sub-{run}")
        pub.connect(f"pub-{run}")
        for attempt in range(20):
            filters = [f"o{run}/{attempt}/{i}/+" for i in range(COUNT)]
            sub.sock.sendall(_subscribes(filters, MQTT_311))  # then at once, as test_order's
            pub.sock.sendall(encode(Publish(f"o{run}/{attempt}/{COUNT - 1}/x", b"first", 0), MQTT_311))
            _subacks(sub, COUNT)
            pub.send(Publish(f"o{run}/{attempt}/{COUNT - 1}/x", b"sentinel", 0))
            received = [_publish(sub).payload, _publish(sub).payload]
            assert received == [b"first", b"sentinel"], (attempt, received)


def test_new_subscriptions_at_their_queues_head_are_not_read_until_news_comes(quiet_node):
    """A new subscription whose queue has nothing past its start costs no store read (issue 31, item 5: the first
    pull of each new stream was ~15% of a SUBSCRIBE's cost); a message published after the SUBACK still comes,
    from the queue cache the news filled [MQTT-3.8.4-3]."""
    run = uuid.uuid4().hex[:6]
    port = admin_port(quiet_node)
    with raw_client(quiet_node.port) as sub, raw_client(quiet_node.port) as pub:
        sub.connect(f"sub-{run}", clean=False)
        pub.connect(f"pub-{run}")
        reads = metric(port, "lightgate_queue_cache_store_reads_total")
        filters = [f"h{run}/{i}/+" if i % 2 else f"h{run}/{i}/x" for i in range(COUNT)]
        sub.sock.sendall(_subscribes(filters, MQTT_311))
        _subacks(sub, COUNT)
        for i in range(COUNT):
            pub.send(Publish(f"h{run}/{i}/x", b"%d" % i, 0))
        received = sorted(int(_publish(sub).payload) for _ in range(COUNT))
        assert received == list(range(COUNT))
        assert metric(port, "lightgate_queue_cache_store_reads_total") == reads


def _publish(client: RawClient) -> Publish:
    packet = client.receive()
    assert isinstance(packet, Publish), packet
    return packet


async def test_activate_all_writes_once_and_a_refused_filter_fails_alone(store):
    before = store.statistics().log_writes
    starts = await store.activate_all(["act/+/x", "act/#/bad", "act/exact", "act/+/x"], "holder")
    assert store.statistics().log_writes == before + 1
    assert isinstance(starts[1], TopicError)
    assert starts[0] == starts[3] == 0 and starts[2] == 0  # new queues start at 0
    assert set(store.queues.held_by("holder")) == {"act/+/x", "act/exact"}


def test_a_subscribe_refused_whole_is_answered_after_the_ones_read_before_it(quiet_node):
    """SUBSCRIBEs read together are one run (``Channel.handle_subscribes``): one whose filter is refused (over
    ``limits.max_topic_length``: 0x8F) needs no activation, but its SUBACK still comes after those of the SUBSCRIBEs
    before it (it went first, ahead of theirs) [MQTT-3.8.4-1] [MQTT-3.8.4-2]; the others are granted."""
    run = uuid.uuid4().hex[:6]
    with raw_client(quiet_node.port, MQTT_5) as sub:
        sub.connect(f"order-{run}", clean=False)
        filters = [f"q{run}/a/+", f"q{run}/" + "x" * 5000, f"q{run}/c", f"q{run}/d/+"]
        sub.sock.sendall(_subscribes(filters, MQTT_5))
        subacks = _subacks(sub, len(filters))
    assert [(s.packet_id, s.reason_codes) for s in subacks] == [
        (1, (ReasonCode.GRANTED_QOS_1,)), (2, (ReasonCode.TOPIC_FILTER_INVALID,)), (3, (ReasonCode.GRANTED_QOS_1,)),
        (4, (ReasonCode.GRANTED_QOS_1,))]


def test_the_connections_reading_one_queue_each_get_its_news_as_they_come_and_go(quiet_node):
    """The node keeps the connection reading a queue alone as it is, and a set once several do (issue 31: a set per
    queue was an object per subscription): each reader gets every message published while it is subscribed
    [MQTT-4.5.0-1], through the changes from one reader to several and back, an UNSUBSCRIBE
    [MQTT-3.10.4-1] and a close."""
    run = uuid.uuid4().hex[:6]
    topic = f"readers{run}/t"
    clients = {name: RawClient(quiet_node.port) for name in "abcd"}
    try:
        for name in "abc":
            clients[name].connect(f"{name}-{run}")
            clients[name].subscribe(topic, 0)
        with raw_client(quiet_node.port) as pub:
            pub.connect(f"pub-{run}")

            def publish_to(payload: bytes, readers: str) -> None:
                pub.send(Publish(topic, payload, 0))
                for name in readers:
                    message = clients[name].receive()
                    assert isinstance(message, Publish) and message.payload == payload, (name, message)

            publish_to(b"1", "abc")
            clients["b"].send(Unsubscribe(2, (topic,)))
            assert isinstance(clients["b"].receive(), Unsuback)
            publish_to(b"2", "ac")
            clients["c"].close()
            publish_to(b"3", "a")  # alone again
            clients["d"].connect(f"d-{run}")
            clients["d"].subscribe(topic, 0)
            publish_to(b"4", "ad")
            clients["a"].send(Unsubscribe(2, (topic,)))
            assert isinstance(clients["a"].receive(), Unsuback)
            publish_to(b"5", "d")
            clients["b"].send(Pingreq())  # b got nothing since its UNSUBSCRIBE: its next packet answers this
            assert isinstance(clients["b"].receive(), Pingresp)
    finally:
        for client in clients.values():
            client.close()
