"""Shared helpers of the interoperability tests: a `lightgate serve` node per module, paho clients, raw packets.

The node process and the paho client wrapper are the ones of tests/test_gateway_server.py;
this module adds what the interop suites need on top (SIGKILL, MQTT 5 properties,
manual acknowledgements, condition waits). Import the fixture into a test module
with ``from mqtt_fixtures import interop_node  # noqa: F401``.
"""

import queue
import signal
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_311, Connack, Connect, Packet, Suback, Subscribe, SubscriptionOptions
from test_gateway_server import WAIT_S, Client, Node, _connect_packet, _recv_until_closed, connected, running_node

__all__ = [
    "WAIT_S", "Client", "Node", "connect_packet", "connected", "interop_node", "kill", "properties", "publish5",
    "quiet", "RawClient", "raw_client", "recv_until_closed", "run_id", "running_node", "subscribe5", "wait_until",
]

connect_packet = _connect_packet
recv_until_closed = _recv_until_closed

QUIET_S = 1.0
"""How long a test listens to show that a message does NOT arrive (the existing e2e tests' choice)."""


@pytest.fixture(scope="module")
def interop_node(tmp_path_factory):
    """One node for a test module; it must stop cleanly and log no error."""
    with running_node(tmp_path_factory.mktemp("node") / "data", "--mqtt-connect-timeout-s", "2") as node:
        yield node
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


def run_id() -> str:
    """A prefix that keeps the topics and client ids of one test apart from the others on a shared node."""
    return uuid.uuid4().hex[:6]


def kill(node: Node) -> None:
    """SIGKILL the node: no shutdown code runs, as in a crash."""
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait(timeout=WAIT_S)


def properties(packet_type: int, **values) -> Properties:
    """paho MQTT 5 properties, e.g. ``properties(PacketTypes.PUBLISH, MessageExpiryInterval=5)``."""
    props = Properties(packet_type)
    for name, value in values.items():
        setattr(props, name, value)
    return props


def publish5(client: Client, topic: str, payload: bytes, qos: int = 1, retain: bool = False, **props) -> None:
    """Publish with MQTT 5 properties (``MessageExpiryInterval=5``...) and wait until the flow is complete."""
    info = client.paho.publish(topic, payload, qos, retain,
                               properties=properties(PacketTypes.PUBLISH, **props) if props else None)
    info.wait_for_publish(timeout=WAIT_S)
    assert info.is_published()


def subscribe5(client: Client, topic: str, qos: int = 1, sub_id: int | None = None, **options) -> list[int]:
    """SUBSCRIBE with MQTT 5 options (``noLocal=True``...) and a Subscription Identifier; the SUBACK's codes."""
    props = properties(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=sub_id) if sub_id else None
    client.paho.subscribe(topic, options=SubscribeOptions(qos=qos, **options), properties=props)
    return [rc.value for rc in client.subacks.get(timeout=WAIT_S)]


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition") -> None:
    """Poll ``condition`` until it holds (for state paho exposes only by polling)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def quiet(messages: queue.Queue, timeout: float = QUIET_S) -> None:
    """Assert that nothing more arrives."""
    with pytest.raises(queue.Empty):
        extra = messages.get(timeout=timeout)
        pytest.fail(f"unexpected message {extra.topic} {extra.payload!r}")


class RawClient:
    """A client that sends exactly the packets a test writes (no automatic acknowledgements), over LightGate's codec."""

    def __init__(self, port: int, level: int = MQTT_311) -> None:
        self.level = level
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a packet goes when sent, as a client's
        self._decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)

    def send(self, *packets: Packet) -> None:
        self.sock.sendall(b"".join(encode(packet, self.level) for packet in packets))

    def receive(self) -> Packet:
        """The next packet from the server (fails the test on timeout or close)."""
        while True:
            packet = self._decoder.next_packet()
            if packet is not NEED_DATA:
                return packet
            data = self.sock.recv(65536)
            if not data:
                pytest.fail("the server closed the connection")
            self._decoder.feed(data)

    def connect(self, client_id: str, *, clean: bool = True, **fields) -> Connack:
        self.send(Connect(self.level, client_id, clean, **fields))
        connack = self.receive()
        assert isinstance(connack, Connack) and not connack.reason_code.is_failure, connack
        return connack

    def subscribe(self, filter: str, qos: int = 1) -> Suback:
        self.send(Subscribe(1, ((filter, SubscriptionOptions(qos=qos)),)))
        suback = self.receive()
        assert isinstance(suback, Suback), suback
        return suback

    def close(self) -> None:
        self.sock.close()


@contextmanager
def raw_client(port: int, level: int = MQTT_311):
    client = RawClient(port, level)
    try:
        yield client
    finally:
        client.close()

