"""Read order across connections (gateway/node/order.py): a SUBSCRIBE read before a PUBLISH on another connection
gets that PUBLISH, whatever path the PUBLISH takes (issue 21, item 1).

The end-to-end tests send the SUBSCRIBE and the PUBLISH from two raw sockets
back to back, so the node reads both in the same read round (gateway/node/poller.py),
the SUBSCRIBE first; then, after the SUBACK, a sentinel PUBLISH: the
subscriber's first message must be the PUBLISH, not the sentinel.
"""

import uuid

import pytest
import trio

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_311, Pingreq, Pingresp, Publish, Suback, Subscribe, SubscriptionOptions
from gateway.node.order import ReadOrder
from tests.helpers.cluster import Gateway, Store, free_port
from tests.helpers.cpu import one_cpu
from tests.helpers.mqtt_fixtures import RawClient, raw_client

TRIES = 1000
CLUSTER_TRIES = 200  # each try is a few store round trips between three processes
CONNACK_TRIES = 200  # each try is a new connection (2-5 of 10 were missed before issue 31)


# --- ReadOrder ----------------------------------------------------------------------------------------------------


async def test_an_append_waits_for_the_activations_read_before_it_and_not_for_later_ones():
    order = ReadOrder()
    assert not order.fenced and order.passed(order.mark())
    first = order.open(['a/+'])
    mark = order.mark()  # an append read now
    second = order.open(['a/b'])  # an activation read after it
    assert order.fenced and not order.passed(mark)
    order.close(second)
    assert not order.passed(mark)  # the activation read before it is still open
    done = trio.Event()

    async def append() -> None:
        await order.wait(mark)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(append)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        order.close(first)
        order.close(first)  # idempotent
    assert done.is_set() and not order.fenced


async def test_a_mark_taken_while_later_fences_stay_open_passes_once_the_earlier_ones_close():
    order = ReadOrder()
    first = order.open(['a/b'])
    mark = order.mark()
    order.open(['a/b'])  # read later, stays open
    order.close(first)
    assert order.passed(mark) and order.fenced
    with trio.fail_after(1):
        await order.wait(mark)


def test_an_append_is_fenced_only_by_the_open_activations_of_filters_matching_its_topic():
    """The read order matters only between an append and the subscriptions that would get it: a publish to
    another topic is not held behind activations in flight (issue 31, item 5)."""
    order = ReadOrder()
    first = order.open(["fleet/1/+/x", "fleet/1/y"])
    second = order.open(["#", "fleet/1/+/x"])
    assert order.fenced
    assert order.fences("fleet/1/a/x") and order.fences("fleet/1/y") and order.fences("canary/t")  # "#" matches all
    assert not order.fences("$SYS/uptime")  # "#" matches no "$" topic [MQTT-4.7.2-1]
    order.close(second)
    assert order.fences("fleet/1/a/x")  # still held by the first fence
    assert not order.fences("canary/t") and not order.fences("fleet/1/a/y") and not order.fences("fleet/1")
    order.close(first)
    assert not order.fenced and not order.fences("fleet/1/a/x") and not order.fences("fleet/1/y")
    order.open(["$SYS/#"])
    assert order.fences("$SYS/uptime") and not order.fences("canary/t")


# --- end to end ---------------------------------------------------------------------------------------------------


def _missed(port: int, filter_of, tries: int) -> list[int]:
    """Send SUBSCRIBE(filter_of(topic)) on one socket and PUBLISH(topic) on another back to back, ``tries``
    times; the tries whose PUBLISH the subscriber did not get."""
    run = uuid.uuid4().hex[:6]
    missed = []
    with raw_client(port) as sub, raw_client(port) as pub, one_cpu():
        sub.connect(f"sub-{run}")
        pub.connect(f"pub-{run}")
        for i in range(tries):
            topic = f"order{run}-{i}/a/x"  # a new first level each try
            subscribe = encode(Subscribe(1 + i, ((filter_of(topic), SubscriptionOptions(qos=0)),)), MQTT_311)
            publish = encode(Publish(topic, b"first", 0), MQTT_311)
            sub.sock.sendall(subscribe)  # no wait between the two: the node reads them in one round
            pub.sock.sendall(publish)
            suback = sub.receive()
            assert isinstance(suback, Suback), (i, suback)
            pub.send(Publish(topic, b"sentinel", 0))  # read after the SUBACK: it always arrives
            first = _next_publish(sub)
            if first.payload == b"sentinel":
                missed.append(i)
            else:
                second = _next_publish(sub)
                assert (first.payload, second.payload) == (b"first", b"sentinel"), (i, first, second)
            _writes_done(pub)
    return missed


def _missed_after_connack(port: int, tries: int) -> list[int]:
    """As :func:`_missed`, each try from a new subscriber connection whose SUBSCRIBE goes as soon as its CONNACK
    is read: the tries whose PUBLISH (sent on the other socket after that SUBSCRIBE) the subscriber did not get."""
    run = uuid.uuid4().hex[:6]
    missed = []
    with raw_client(port) as pub, one_cpu():
        pub.connect(f"pub-{run}")
        for i in range(tries):
            topic = f"fresh{run}-{i}/a/x"
            subscribe = encode(Subscribe(1, ((topic, SubscriptionOptions(qos=0)),)), MQTT_311)
            publish = encode(Publish(topic, b"first", 0), MQTT_311)
            with raw_client(port) as sub:
                sub.connect(f"sub-{run}-{i}")  # CONNACK read: the node has answered the CONNECT
                sub.sock.sendall(subscribe)  # then back to back, as in _missed
                pub.sock.sendall(publish)
                suback = sub.receive()
                assert isinstance(suback, Suback), (i, suback)
                pub.send(Publish(topic, b"sentinel", 0))
                first = _next_publish(sub)
                if first.payload == b"sentinel":
                    missed.append(i)
                else:
                    assert _next_publish(sub).payload == b"sentinel", i
                _writes_done(pub)
    return missed


def _writes_done(pub: RawClient) -> None:
    """Return once the node is done writing the subscriber its messages (a PINGREQ on the other connection,
    answered after them: the node does one thing at a time).

    A segment that arrives for a socket while the node is writing to it waits in the kernel until the write
    ends, so a PUBLISH sent after it on another socket could be read first: the next try's SUBSCRIBE must not
    be sent while the sentinel's write may still hold the subscriber's socket (that was a miss in ~10,000).
    """
    pub.send(Pingreq())
    assert isinstance(pub.receive(), Pingresp)


def _next_publish(client: RawClient) -> Publish:
    packet = client.receive()
    assert isinstance(packet, Publish), packet
    return packet


FILTERS = {
    "exact": lambda topic: topic,
    "first-level": lambda topic: topic.split("/")[0] + "/#",  # the implicit first-level queue
    "wildcard first holder": lambda topic: topic.rsplit("/", 1)[0] + "/+",  # a filter no one held before
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", FILTERS)
def test_a_publish_read_after_a_subscribe_on_another_connection_reaches_it(interop_node, kind):
    assert _missed(interop_node.port, FILTERS[kind], TRIES) == []


@pytest.mark.slow
def test_a_subscribe_sent_as_soon_as_the_connack_is_read_comes_before_a_publish_sent_after_it(interop_node):
    """The socket of a connection whose CONNECT is being answered stays in the poller's set: its next bytes
    are read in their arrival order, not after those of older connections (issue 31, item 6)."""
    assert _missed_after_connack(interop_node.port, CONNACK_TRIES) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exact", "wildcard first holder"])
def test_a_publish_read_after_a_subscribe_reaches_it_on_a_cluster_gateway(tmp_path, kind):
    store = Store(tmp_path / "data", free_port())
    try:
        gateway = Gateway(store.port)
        try:
            assert _missed(gateway.port, FILTERS[kind], CLUSTER_TRIES) == []
        finally:
            gateway.stop()
        assert not gateway.errors(), gateway.errors()
    finally:
        store.stop()
