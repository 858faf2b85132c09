"""A connection (gateway/node/connection.py) over a polled plain TCP socket: no task while idle, and everything a
client sees unchanged, with the embedded node in this process and raw clients over real sockets."""

import trio
import trio.testing

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_5, Connack, Connect, Disconnect, Publish, Suback, Subscribe, SubscriptionOptions
from gateway.mqtt.reasons import ReasonCode
from gateway.node.transports import RECEIVE_BYTES
from tests.helpers.trio_mqtt import RawClient, embedded_node

WAIT_S = 10.0


async def connected(port: int, client_id: str) -> RawClient:
    client = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
    await client.send(Connect(client_id=client_id, clean_start=True))
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
