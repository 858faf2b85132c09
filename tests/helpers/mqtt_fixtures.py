"""A `lightgate serve` node in a subprocess and the clients that talk to it: paho clients, raw packets, waits.

The end-to-end suites of every folder use these; the module-scoped ``node`` and ``interop_node`` fixtures over them
are in tests/conftest.py.
"""

import queue
import signal
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connack, Connect, Packet, Suback, Subscribe, SubscriptionOptions
from gateway.mqtt.properties import Properties as Mqtt5Properties
from tests.helpers.processes import LightgateProcess

__all__ = [
    "WAIT_S", "Client", "Node", "connect_packet", "connected", "kill", "check_nothing_before_sentinel", "properties",
    "publish5", "quiet", "RawClient", "raw_client", "recv_until_closed", "run_id", "running_node", "session5", "subscribe5",
    "wait_until", "check_hung_member_holds_only_its_window",
]

QUIET_S = 1.0
"""How long a test listens to show that a message does NOT arrive (the existing e2e tests' choice)."""

WAIT_S = 20.0  # every condition below is waited for with this timeout, never slept for


class Node(LightgateProcess):
    """A `lightgate serve` subprocess on a free port, with its log lines collected."""

    def __init__(self, data: Path, *flags: str) -> None:
        super().__init__("serve", "--port", "0", "--data", str(data), *flags)
        self.data = data
        self.port = self.ready("gateway node ready")


@contextmanager
def running_node(data: Path, *flags: str):
    node = Node(data, *flags)
    try:
        yield node
    finally:
        node.stop()


class Client:
    """A paho client whose received messages and connection events land in queues."""

    def __init__(self, port: int, client_id: str | None = None, *, protocol=mqtt.MQTTv311, clean=True,
                 keepalive: int = 60, will: tuple[str, bytes, int] | None = None) -> None:
        self.client_id = client_id or "c-" + uuid.uuid4().hex[:8]
        kwargs = {"clean_session": clean} if protocol != mqtt.MQTTv5 else {}
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol,
                                **kwargs)
        self.protocol = protocol
        self.messages: queue.Queue = queue.Queue()
        self.connacks: queue.Queue = queue.Queue()
        self.disconnects: queue.Queue = queue.Queue()
        self.subacks: queue.Queue = queue.Queue()
        self.paho.on_message = lambda c, u, msg: self.messages.put(msg)
        self.paho.on_connect = lambda c, u, flags, rc, props: self.connacks.put((flags, rc))
        self.paho.on_disconnect = lambda c, u, flags, rc, props: self.disconnects.put(rc)
        self.paho.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.put(rcs)
        self.unsubacks: queue.Queue = queue.Queue()
        self.paho.on_unsubscribe = lambda c, u, mid, rcs, props: self.unsubacks.put(mid)
        if will is not None:
            self.paho.will_set(*will)
        self.port = port
        self.keepalive = keepalive
        self.clean = clean

    def connect(self, **kwargs):
        if self.protocol == mqtt.MQTTv5:
            kwargs.setdefault("clean_start", self.clean)
        self.paho.connect("127.0.0.1", self.port, keepalive=self.keepalive, **kwargs)
        self.paho.loop_start()
        flags, rc = self.connacks.get(timeout=WAIT_S)
        assert not rc.is_failure, rc
        return flags

    def subscribe(self, topic: str, qos: int = 1):
        self.paho.subscribe(topic, qos)
        return self.subacks.get(timeout=WAIT_S)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False):
        info = self.paho.publish(topic, payload, qos, retain)
        info.wait_for_publish(timeout=WAIT_S)
        assert info.is_published()

    def receive(self, count: int) -> list:
        return [self.messages.get(timeout=WAIT_S) for _ in range(count)]

    def disconnect(self):
        self.paho.disconnect()
        self.disconnects.get(timeout=WAIT_S)
        self.paho.loop_stop()


@contextmanager
def connected(port: int, client_class: type | None = None, **kwargs):
    """A connected ``client_class`` (default ``Client``), disconnected at the end of the block."""
    client = (client_class or Client)(port, **kwargs)
    client.connect()
    try:
        yield client
    finally:
        if client.paho.is_connected():
            client.disconnect()
        client.paho.loop_stop()


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return len(data).to_bytes(2, "big") + data


def connect_packet(client_id: str, keepalive: int = 60, will: tuple[str, bytes] | None = None) -> bytes:
    flags = 0x02 | (0x04 | 0x08 if will else 0)  # clean session; will with QoS 1
    body = _string("MQTT") + bytes([4, flags]) + keepalive.to_bytes(2, "big") + _string(client_id)
    if will:
        body += _string(will[0]) + _string(will[1])
    return bytes([0x10, len(body)]) + body


def recv_until_closed(raw: socket.socket, timeout: float = WAIT_S) -> bytes:
    """Read until the server closes (returns the last read: b"" on a clean close); a read waits ``timeout`` at
    most (``socket.timeout`` then)."""
    raw.settimeout(timeout)
    while True:
        try:
            data = raw.recv(4096)
        except ConnectionResetError:
            return b""
        if not data:
            return data


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


def session5(port: int, client_id: str, expiry_s: int, *, clean: bool = False) -> tuple[Client, bool]:
    """An MQTT 5 client connected with ``expiry_s``: (the client, Session Present)."""
    client = Client(port, client_id, protocol=mqtt.MQTTv5, clean=clean)
    flags = client.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=expiry_s))
    return client, flags.session_present


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


def check_nothing_before_sentinel(subscriber: Client, publisher: Client, topic: str, copies: int = 1) -> None:
    """Assert that nothing more arrives at ``subscriber`` through the subscriptions ``topic`` matches: ``publisher``
    publishes a sentinel on ``topic`` and the next ``copies`` messages (one per matching subscription) must be it.

    A barrier, not a wait: a subscription reads one light queue, in the order the log appended to it, so whatever
    was still to come through it arrives before the sentinel ([MQTT-4.6.0-5])."""
    sentinel = b"sentinel-" + uuid.uuid4().hex.encode()
    publisher.publish(topic, sentinel, qos=1)
    got = [subscriber.messages.get(timeout=WAIT_S) for _ in range(copies)]
    early = [(m.topic, m.payload) for m in got if m.payload != sentinel]
    assert not early, f"arrived before the sentinel: {early}"


def quiet(messages: queue.Queue, timeout: float = QUIET_S) -> None:
    """Assert that nothing more arrives within ``timeout``: only where no barrier can exist (see the callers)."""
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


def check_hung_member_holds_only_its_window(hung_port: int, other_port: int) -> None:
    """A shared subscription's member connected to ``hung_port`` with a Receive Maximum of 2 takes two messages and
    never acknowledges them: the member on ``other_port`` must get the next eight while it hangs, then its two once
    it disconnects (within ``WAIT_S``, shorter than the nodes' invisible time), and nothing more."""
    run = run_id()
    topic, share = f"win{run}/t", f"$share/g{run}/win{run}/t"
    with raw_client(hung_port, MQTT_5) as hung, connected(other_port) as pub:
        hung.connect(f"win-{run}", properties=Mqtt5Properties(receive_maximum=2))
        hung.subscribe(share, 1)
        for i in range(2):
            pub.publish(topic, str(i).encode(), 1)
        assert [hung.receive().payload for _ in range(2)] == [b"0", b"1"]  # its window is full
        with connected(other_port) as other:
            other.subscribe(share, 1)
            for i in range(2, 10):
                pub.publish(topic, str(i).encode(), 1)
            assert [m.payload for m in other.receive(8)] == [str(i).encode() for i in range(2, 10)]
            hung.close()
            assert sorted(m.payload for m in other.receive(2)) == [b"0", b"1"]
            check_nothing_before_sentinel(other, pub, topic)
