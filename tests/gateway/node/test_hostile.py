"""Hostile and careless clients against the embedded node in-process, over real sockets: answers they can read,
packets that fit what they declared, closes that do not destroy the answer, one log line and no traceback.

The sans-IO fuzzing of the CONNECT path is tests/gateway/mqtt/test_connect_fuzz.py.
"""

import contextlib
import logging
import socket
import ssl

import pytest
import trio
import trustme
from hypothesis import HealthCheck, given, settings

from gateway.app.config import OPTIONS
from gateway.app.embedded import serve_gateway
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, RemoteProtocolError, Role, encode
from gateway.mqtt.packets import (
    MQTT_5, MQTT_311, Connack, Connect, Disconnect, Packet, Puback, Publish, Suback, Subscribe, SubscriptionOptions,
)
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from gateway.node import connection as server
from tests.helpers.mqtt_fixtures import running_node
from tests.helpers.strategies import mutated
from tests.helpers.trio_mqtt import embedded_node

DEFAULTS = {o.key: o.default for o in OPTIONS}
WAIT_S = 20.0

BAD_PUBLISH = b"\x36\x00"
"""A PUBLISH with QoS 3: malformed at both levels ([MQTT-3.3.1-4])."""

JUNK = b"\x00" * (100 * 1024)
"""More than one read of the server's (64 KiB), and less than what it reads while lingering (256 KiB)."""


class Peer:
    """One client socket and a decoder at its level; records how the stream ended."""

    def __init__(self, stream: trio.SocketStream, level: int) -> None:
        self.stream = stream
        self.level = level
        self.decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)
        self.ending: str | None = None  # "eof" or "reset", once the server ended the stream

    @classmethod
    async def open(cls, port: int, level: int = MQTT_5) -> "Peer":
        return cls(await trio.open_tcp_stream("127.0.0.1", port), level)

    async def send(self, *packets: Packet, raw: bytes = b"") -> None:
        await self.stream.send_all(b"".join(encode(p, self.level) for p in packets) + raw)

    async def receive(self) -> Packet | None:
        """The next packet, or None once the server ended the stream (``ending`` says how)."""
        with trio.fail_after(WAIT_S):
            while (packet := self.decoder.next_packet()) is NEED_DATA:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    self.ending = "reset"
                    return None
                if not data:
                    self.ending = "eof"
                    return None
                self.decoder.feed(data)
        return packet

    async def rest(self) -> list[Packet]:
        """Every packet until the server ends the stream."""
        packets = []
        while (packet := await self.receive()) is not None:
            packets.append(packet)
        return packets


@pytest.fixture
async def inprocess_port(tmp_path, caplog):
    """An embedded node on a free port; yields the port. No line it logs may carry a traceback."""
    caplog.set_level(logging.INFO)
    async with embedded_node(tmp_path / "data") as port:
        yield port
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


# --- item 5: a malformed CONNECT is answered at its level --------------------------------------------------


@pytest.mark.parametrize("level, answer", [(MQTT_5, [ReasonCode.MALFORMED_PACKET]), (MQTT_311, [])])
async def test_a_malformed_connect_gets_its_answer_and_one_log_line(inprocess_port, caplog, level, answer):
    """[MQTT-3.1.4-1] / section 3.2.2.2: a malformed MQTT 5 CONNECT gets CONNACK 0x81 in 5.0 form (it got an
    internal error and a traceback instead); a 3.1.1 one is closed (3.1.1 has no return code for it). Either way
    one log line and no traceback."""
    data = bytearray(encode(Connect(level, "malformed"), level))
    data[9] |= 0x01  # the reserved flag [MQTT-3.1.2-3]
    peer = await Peer.open(inprocess_port, level)
    await peer.stream.send_all(bytes(data))
    packets = await peer.rest()
    assert [p.reason_code for p in packets if isinstance(p, Connack)] == answer and len(packets) == len(answer)
    port = peer.stream.socket.getsockname()[1]
    lines = [r for r in caplog.records if str(port) in str(getattr(r, "ctx", {}).get("peer", ""))]
    assert len(lines) == 1, [r.getMessage() for r in lines]


# --- item 4: nothing sent exceeds the client's Maximum Packet Size -----------------------------------------


@pytest.mark.parametrize("limit", [2, 4, 5, 10, 15, 16])
async def test_no_packet_over_the_clients_maximum_packet_size_reaches_it(inprocess_port, limit):
    """[MQTT-3.1.2-24]: a client declaring a Maximum Packet Size of 2..15 got the node's 16-byte CONNACK. Now every
    byte it receives is within its limit: the full CONNACK from 16 on, CONNACK 0x95 without a reason string from
    5, and below that a close without a packet."""
    peer = await Peer.open(inprocess_port)
    await peer.send(Connect(MQTT_5, f"limit-{limit}", properties=Properties(maximum_packet_size=limit)))
    received = b""
    with trio.fail_after(WAIT_S):
        while chunk := await peer.stream.receive_some(4096):
            received += chunk
            if limit >= 16:
                break
    peer.decoder.feed(received)
    packets = []
    while (packet := peer.decoder.next_packet()) is not NEED_DATA:
        packets.append(packet)
    assert sum(len(encode(p, MQTT_5)) for p in packets) == len(received)
    assert all(len(encode(p, MQTT_5)) <= limit for p in packets)
    expected = [ReasonCode.SUCCESS] if limit >= 16 else [ReasonCode.PACKET_TOO_LARGE] if limit >= 5 else []
    assert [p.reason_code for p in packets] == expected


# --- item 6: the last packet is not lost to a reset --------------------------------------------------------


async def test_a_refusing_connack_is_followed_by_an_orderly_close_while_the_client_keeps_writing(inprocess_port):
    """The server refuses (a malformed CONNECT: its reserved flag set, [MQTT-3.1.2-3], CONNACK 0x81) while more
    input waits unread: it half-closes and drains, so the client reads the CONNACK and then end of stream, not a
    reset (which can destroy the CONNACK before the client reads it)."""
    peer = await Peer.open(inprocess_port)
    connect = bytearray(encode(Connect(MQTT_5, "refused-writer"), MQTT_5))
    connect[9] |= 0x01  # the CONNECT flags byte: fixed header (2), protocol name (6), level (1)
    await peer.send(raw=bytes(connect) + JUNK)
    packets = await peer.rest()
    assert [type(p) for p in packets] == [Connack] and packets[0].reason_code is ReasonCode.MALFORMED_PACKET
    assert peer.ending == "eof"


async def test_a_disconnect_reason_is_followed_by_an_orderly_close_while_the_client_keeps_writing(inprocess_port):
    """[MQTT-4.13.2-1]: the server sends DISCONNECT with the reason before it closes; the client that is still
    writing reads it and then end of stream, not a reset."""
    peer = await Peer.open(inprocess_port)
    await peer.send(Connect(MQTT_5, "disconnected-writer"))
    assert isinstance(await peer.receive(), Connack)
    await peer.stream.send_all(BAD_PUBLISH + JUNK)
    packets = await peer.rest()
    assert [type(p) for p in packets] == [Disconnect] and packets[0].reason_code is ReasonCode.MALFORMED_PACKET
    assert peer.ending == "eof"


async def test_a_reconnect_with_the_same_client_id_does_not_wait_for_the_lingering_close(inprocess_port, monkeypatch):
    """The registration of a closed connection is released before its socket lingers: a device that reconnects
    at once (keeping its old socket open, so the old one lingers to the end) is taken in at once."""
    monkeypatch.setattr(server, "LINGER_S", 60.0)  # a takeover waiting for the linger would wait 60 s
    old = await Peer.open(inprocess_port)
    await old.send(Connect(MQTT_5, "comeback", clean_start=False))
    assert isinstance(await old.receive(), Connack)
    await old.stream.send_all(BAD_PUBLISH)
    assert isinstance(await old.receive(), Disconnect) and await old.receive() is None and old.ending == "eof"
    new = await Peer.open(inprocess_port)
    await new.send(Connect(MQTT_5, "comeback", clean_start=False))
    with trio.fail_after(30):  # well below the linger: a loaded machine may take seconds, a lingering close 60
        connack = await new.receive()
    assert isinstance(connack, Connack) and connack.reason_code is ReasonCode.SUCCESS
    await old.stream.aclose()


async def test_a_tls_client_sees_the_end_at_once_and_nothing_is_logged_as_a_failure(tmp_path, caplog, monkeypatch):
    """TLS is half-closed on its TCP connection: the client reads the DISCONNECT and then the end of the stream at
    once (not after the linger), and the close logs no failure."""
    monkeypatch.setattr(server, "LINGER_S", 60.0)
    caplog.set_level(logging.INFO)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    settings = {**DEFAULTS, "node.data": str(tmp_path / "data"), "node.port": 0, "admin.port": 0,
                "mqtt.sys_interval_s": 0, "tls.port": 8883, "tls.certfile": str(cert), "tls.keyfile": str(key)}
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_gateway, settings)
        tls_port = next(r.ctx["port"] for r in caplog.records if getattr(r, "ctx", {}).get("listener") == "tls")
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", tls_port, ssl_context=context)
        peer = Peer(stream, MQTT_5)
        await peer.send(Connect(MQTT_5, "tls-writer"))
        assert isinstance(await peer.receive(), Connack)
        await peer.stream.send_all(BAD_PUBLISH + JUNK[:8192])
        with trio.fail_after(10):
            packets = await peer.rest()
        assert [type(p) for p in packets] == [Disconnect] and peer.ending in ("eof", "reset")
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# --- item 7: a wildcard overlapping a deny rule -----------------------------------------------------------

DENY_ONE = "default allow\npattern\ndeny subscribe test/nosubscribe\n"
"""The interoperability suites' ACL: everything allowed but subscribing to `test/nosubscribe`."""


@pytest.fixture
async def acl_node(tmp_path, caplog, request):
    """A node with the ACL ``DENY_ONE`` in the wildcard mode ``request.param`` (default: the default)."""
    caplog.set_level(logging.INFO)
    acl = tmp_path / "acl.txt"
    acl.write_text(DENY_ONE)
    settings = {**DEFAULTS, "node.data": str(tmp_path / "data"), "node.port": 0, "admin.port": 0,
                "mqtt.sys_interval_s": 0, "auth.acl_file": str(acl),
                "auth.acl_wildcard_mode": getattr(request, "param", DEFAULTS["auth.acl_wildcard_mode"])}
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(serve_gateway, settings)
        yield port
        nursery.cancel_scope.cancel()
    assert not [r for r in caplog.records if r.exc_info]


async def _subscribed(port: int, level: int, client_id: str, *filters: str, clean: bool = True,
                      **connect) -> tuple[Peer, list[ReasonCode]]:
    peer = await Peer.open(port, level)
    await peer.send(Connect(level, client_id, clean, **connect))
    assert isinstance(await peer.receive(), Connack)
    await peer.send(Subscribe(1, tuple((f, SubscriptionOptions(qos=1)) for f in filters)))
    suback = await peer.receive()
    assert isinstance(suback, Suback)
    return peer, list(suback.reason_codes)


async def _publish(port: int, *messages: tuple[str, bool]) -> None:
    """Publish QoS 1 messages (topic, retain) with the payload b"p", each acknowledged (stored) before the next."""
    peer = await Peer.open(port)
    await peer.send(Connect(MQTT_5, "publisher"))
    assert isinstance(await peer.receive(), Connack)
    for index, (topic, retain) in enumerate(messages, start=1):
        await peer.send(Publish(topic, b"p", 1, retain, packet_id=index))
        assert isinstance(await peer.receive(), Puback)
    await peer.stream.aclose()


async def _topics_until(peer: Peer, sentinel: str, copies: int = 1) -> list[str]:
    """The topics of the PUBLISHes received up to the ``copies``-th ``sentinel`` (one per subscription it matches;
    each subscription delivers in order): the barrier that shows what did not come before it."""
    topics = []
    while True:
        packet = await peer.receive()
        assert isinstance(packet, Publish), packet
        topics.append(packet.topic)
        if packet.qos:
            await peer.send(Puback(packet.packet_id))
        if topics.count(sentinel) == copies:
            return topics


@pytest.mark.parametrize("level, refused", [(MQTT_311, ReasonCode.UNSPECIFIED_ERROR),
                                            (MQTT_5, ReasonCode.NOT_AUTHORIZED)])
async def test_a_wildcard_over_a_denied_topic_is_granted_and_never_delivers_it(acl_node, level, refused):
    """`deny subscribe test/nosubscribe` refused `#` and `+/+` too. As Mosquitto and EMQX do: they are granted,
    the exact filter gets SUBACK 0x80 (3.1.1) / 0x87 (5.0), and no message on the denied topic reaches the
    wildcards, retained ones included."""
    await _publish(acl_node, ("test/nosubscribe", True), ("test/kept", True))
    peer, codes = await _subscribed(acl_node, level, "wild", "#", "+/+", "test/nosubscribe")
    assert codes == [ReasonCode.GRANTED_QOS_1, ReasonCode.GRANTED_QOS_1, refused]
    await _publish(acl_node, ("test/nosubscribe", False), ("test/sentinel", False))
    topics = await _topics_until(peer, "test/sentinel", copies=2)  # through `#` and `+/+`
    assert "test/nosubscribe" not in topics
    assert topics.count("test/kept") == 2


async def test_a_resumed_session_never_gets_the_denied_topic(acl_node):
    """The messages a persistent `#` subscription missed while away are filtered the same way."""
    peer, _ = await _subscribed(acl_node, MQTT_311, "away", "#", clean=False)
    await peer.send(Disconnect())
    await peer.stream.aclose()
    await _publish(acl_node, ("test/nosubscribe", False), ("test/sentinel", False))
    back = await Peer.open(acl_node, MQTT_311)
    await back.send(Connect(MQTT_311, "away", False))
    connack = await back.receive()
    assert isinstance(connack, Connack) and connack.session_present
    assert await _topics_until(back, "test/sentinel") == ["test/sentinel"]


@pytest.mark.parametrize("acl_node", ["refuse"], indirect=True)
async def test_refuse_mode_keeps_refusing_wildcards_that_overlap_a_deny_rule(acl_node):
    _, codes = await _subscribed(acl_node, MQTT_5, "strict", "#", "+/+", "test/+", "other/+")
    assert codes == [ReasonCode.NOT_AUTHORIZED] * 3 + [ReasonCode.GRANTED_QOS_1]


@pytest.fixture(scope="module")
def node_process(tmp_path_factory):
    """A `lightgate serve` subprocess, for checks of what it logs (JSON lines: a traceback is an "exc" field)."""
    with running_node(tmp_path_factory.mktemp("hostile") / "data", "--admin-port", "0") as process:
        yield process


@pytest.mark.slow
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_mutated_connects_over_a_socket_get_an_answer_or_a_close_and_no_traceback(node_process, data):
    """Item 5's property end to end: whatever CONNECT bytes arrive (then end of input), the node answers with at
    most one CONNACK the client can read at the CONNECT's level, or closes; it logs no traceback and no error.
    When the CONNECT is whole and valid and bytes follow it, they are read once the session is open: a malformed
    packet there ends an accepted connection with a DISCONNECT (MQTT 5, [MQTT-4.13.2-1]) after the CONNACK."""
    server_side = MqttDecoder(role=Role.SERVER)
    server_side.feed(data)
    with contextlib.suppress(RemoteProtocolError):
        server_side.next_packet()
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=server_side.protocol_level or MQTT_311)
    with socket.create_connection(("127.0.0.1", node_process.port), timeout=WAIT_S) as raw:
        raw.sendall(data)
        raw.shutdown(socket.SHUT_WR)
        while chunk := raw.recv(65536):
            decoder.feed(chunk)
    packets = []
    while (packet := decoder.next_packet()) is not NEED_DATA:  # raises if the bytes are not packets at that level
        packets.append(packet)
    assert not packets or isinstance(packets[0], Connack)  # [MQTT-3.2.0-1]: the CONNACK first
    assert len(packets) <= 1 or (len(packets) == 2 and packets[0].reason_code is ReasonCode.SUCCESS
                                 and isinstance(packets[1], Disconnect)), packets
    assert not [doc for doc in node_process.logs if "exc" in doc or doc.get("level") == "error"]
