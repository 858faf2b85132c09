"""A connection (gateway/node/connection.py) over a polled plain TCP socket: no task while idle, and everything a
client sees unchanged, with the embedded node in this process and raw clients over real sockets."""

import gc
import tracemalloc

import pytest
import trio
import trio.testing

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import (MQTT_5, MQTT_311, Connack, Connect, Disconnect, Publish, Suback, Subscribe,
                                  SubscriptionOptions)
from gateway.mqtt.reasons import ReasonCode
from gateway.node.transports import RECEIVE_BYTES
from tests.helpers.trio_mqtt import RawClient, embedded_node

WAIT_S = 10.0


async def connected(port: int, client_id: str, level: int = MQTT_5, keep_alive: int = 0) -> RawClient:
    client = RawClient(await trio.open_tcp_stream("127.0.0.1", port), level)
    await client.send(Connect(protocol_level=level, client_id=client_id, clean_start=True, keep_alive=keep_alive))
    with trio.fail_after(WAIT_S):
        connack = await client.receive()
    assert isinstance(connack, Connack) and connack.reason_code is ReasonCode.SUCCESS
    return client


def tasks() -> int:
    """The tasks of this trio run."""
    count = 0
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        count += 1
        pending.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return count


async def test_an_idle_plain_tcp_connection_has_no_task(tmp_path):
    """A task per idle device was 43% of its memory (issue 31, item 4): the poller hands a connection its reads,
    so a connected client that sends nothing costs no task once its CONNECT is answered."""
    async with embedded_node(tmp_path / "data") as port:
        await trio.testing.wait_all_tasks_blocked()
        before = tasks()
        clients = [await connected(port, f"idle-{index}") for index in range(50)]
        await trio.testing.wait_all_tasks_blocked()
        assert tasks() - before < 5  # the node's own (a commit, a log line), never one per connection
        for client in clients:
            await client.stream.aclose()


@pytest.mark.slow  # tracemalloc over 400 connections: about a minute
async def test_an_idle_connection_holds_at_most_2_8_kib_of_python_memory(tmp_path):
    """What the node keeps per idle device (issue 31, item 4, ``lightgate bench conns``: at most 3 KiB of RSS, which
    adds the allocator's overhead to what tracemalloc counts): 3.3 KiB traced before its empty lists, its decoder's
    empty buffer, its link's two bound methods and a second copy of its address went; 2.6 KiB with them gone. The
    clients are 3.1.1 and 5.0 ones with keep alive [MQTT-3.1.2-22], so their connections keep a timer too."""
    count = 400
    async with embedded_node(tmp_path / "data") as port:
        for level in (MQTT_311, MQTT_5):  # the node's first-use costs (caches per level) are not a connection's
            await connected(port, f"warm-up-{level}", level=level, keep_alive=60)
        clients = []
        gc.collect()
        tracemalloc.start(64)  # deep enough to see this test's own frames under each of its clients' objects
        try:
            base = tracemalloc.take_snapshot()
            for index in range(count):
                level = MQTT_311 if index % 2 else MQTT_5
                clients.append(await connected(port, f"idle-{index}", level=level, keep_alive=60))
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            held = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # The clients' sockets (trio connects in tasks of its own) and decoders are this process's too.
        mine = [tracemalloc.Filter(False, pattern, all_frames=True)
                for pattern in (__file__, trio.open_tcp_stream.__code__.co_filename)]
        node = sum(stat.size_diff for stat in held.filter_traces(mine).compare_to(base.filter_traces(mine), "filename"))
        assert node / count <= 2.8 * 1024, f"{node / count:.0f} B per idle connection"
        for client in clients:
            await client.stream.aclose()


async def test_a_connection_closed_while_its_socket_waits_in_the_pollers_next_round_is_read_no_more(tmp_path):
    """A read that fills its buffer leaves the socket for the poller's next round; a malformed packet in that read
    closes the connection first [MQTT-4.13.1-1]: the next round must not hand it the rest, the client gets its
    DISCONNECT (0x81) and the end, and the node goes on serving others."""
    async with embedded_node(tmp_path / "data") as port:
        flooder = await connected(port, "flooder")
        publish = encode(Publish(topic="flood/x", payload=b"p" * 1000, qos=0), MQTT_5)
        malformed = b"\x00\x00"  # packet type 0 is reserved
        burst = publish * (RECEIVE_BYTES // len(publish) - 1) + malformed
        burst += publish * (2 * RECEIVE_BYTES // len(publish))  # more than one read behind it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flooder.stream.send_all, burst)
            with trio.fail_after(WAIT_S):
                disconnect = await flooder.receive()
            assert isinstance(disconnect, Disconnect) and disconnect.reason_code is ReasonCode.MALFORMED_PACKET
            nursery.cancel_scope.cancel()  # the node stops reading: the rest of the burst need not go
        other = await connected(port, "other")
        await other.send(Subscribe(1, (("flood/#", SubscriptionOptions(qos=0)),)))
        with trio.fail_after(WAIT_S):
            assert isinstance(await other.receive(), Suback)
        await other.send(Publish(topic="flood/y", payload=b"after", qos=0))
        with trio.fail_after(WAIT_S):
            message = await other.receive()
        assert isinstance(message, Publish) and message.payload == b"after"
        await flooder.stream.aclose()
        await other.stream.aclose()
