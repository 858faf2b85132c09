"""The listeners: TLS, mTLS, WebSocket (ws, wss) and connection admission.

Two layers: ``serve_listeners`` in-process with an echo handler (handshakes, refusals, the WebSocket stream
adapter, the cap), then `lightgate serve` end to end with paho clients over every transport. Certificates come
from trustme: a test CA, the node's certificate for 127.0.0.1, and client certificates (CN = the user).
"""

import datetime
import functools
import logging
import os
import socket
import ssl
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import trio
import trustme
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket

from gateway.app.config import OPTIONS
from gateway.node.admission import Admission
from gateway.node.listeners import (
    ListenerError,
    ListenerSpec,
    Peer,
    listener_specs,
    serve_listeners,
    server_ssl_context,
)
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connect_packet, connected, running_node, wait_until
from tests.helpers.processes import ROOT

DEFAULTS = {o.key: o.default for o in OPTIONS}

ACL = """\
pattern
allow both home/%u/#
"""


@dataclass
class Pki:
    """PEM files of a test CA, the node's certificate and client certificates (by name: the CN, or a flaw)."""

    directory: Path
    ca: trustme.CA

    @property
    def ca_file(self) -> str:
        return str(self.directory / "ca.pem")

    def cert(self, name: str) -> str:
        return str(self.directory / f"{name}.pem")

    def key(self, name: str) -> str:
        return str(self.directory / f"{name}.key")

    def server_flags(self) -> tuple[str, ...]:
        return ("--tls-certfile", self.cert("server"), "--tls-keyfile", self.key("server"),
                "--tls-cafile", self.ca_file)

    def client_context(self, leaf: str | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        if leaf is not None:
            context.load_cert_chain(self.cert(leaf), self.key(leaf))
        return context


def _write(pki: Pki, name: str, leaf: trustme.LeafCert) -> None:
    leaf.cert_chain_pems[0].write_to_path(pki.cert(name))
    leaf.private_key_pem.write_to_path(pki.key(name))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"), trustme.CA())
    pki.ca.cert_pem.write_to_path(pki.ca_file)
    _write(pki, "server", pki.ca.issue_cert("127.0.0.1", "localhost"))
    for user in ("alice", "bob"):
        _write(pki, user, pki.ca.issue_cert(f"{user}@devices.example", common_name=user))
    _write(pki, "untrusted", trustme.CA().issue_cert("mallory@devices.example", common_name="alice"))
    past = datetime.datetime(2001, 1, 1, tzinfo=datetime.timezone.utc)
    _write(pki, "expired", pki.ca.issue_cert("alice@devices.example", common_name="alice", not_after=past))
    _write(pki, "nameless", pki.ca.issue_cert("nameless@devices.example"))
    return pki


# --- serve_listeners in-process ---------------------------------------------------------------


class Echo:
    """A handler that sends back what it receives, in pieces of at most ``piece`` bytes, and records its peers."""

    def __init__(self, piece: int = 65536) -> None:
        self.piece = piece
        self.peers: list[Peer] = []
        self.errors: list[Exception] = []

    async def __call__(self, stream: trio.abc.Stream, peer: Peer) -> None:
        self.peers.append(peer)
        async with stream:
            try:
                while data := await stream.receive_some(self.piece):
                    await stream.send_all(data)
            except trio.BrokenResourceError as exc:
                self.errors.append(exc)


@asynccontextmanager
async def listening(handler, *specs: ListenerSpec, **options):
    """Serve ``specs`` until the block ends; yields the bound port of each kind."""
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(functools.partial(serve_listeners, handler, specs, **options))
        yield {b.kind: b.port for b in bound}
        nursery.cancel_scope.cancel()


async def until_logged(caplog, text: str) -> logging.LogRecord:
    """Wait for the log record whose message contains ``text`` (the server logs after the client saw the close)."""
    with trio.fail_after(WAIT_S):
        while True:
            for record in caplog.records:
                if text in record.getMessage():
                    return record
            await trio.sleep(0.01)


async def tls_stream(port: int, context: ssl.SSLContext) -> trio.SSLStream:
    stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context, https_compatible=True)
    await stream.do_handshake()
    return stream


async def closed_by_server(stream: trio.SSLStream) -> bool:
    """The server ended the connection: with a TLS alert, or by closing the socket without one."""
    try:
        return await stream.receive_some(10) == b""
    except trio.BrokenResourceError:
        return True


async def echoes(stream: trio.abc.Stream, data: bytes) -> bool:
    await stream.send_all(data)
    got = b""
    while len(got) < len(data):
        more = await stream.receive_some(65536)
        if not more:
            return False
        got += more
    return got == data


async def test_tls_passes_the_verified_common_name_and_refuses_untrusted_certificates(pki, caplog):
    context = server_ssl_context(pki.cert("server"), pki.key("server"), pki.ca_file)
    echo = Echo()
    async with listening(echo, ListenerSpec("tls", "127.0.0.1", 0, context)) as ports:
        with trio.fail_after(WAIT_S):
            anonymous = await tls_stream(ports["tls"], pki.client_context())
            assert await echoes(anonymous, b"hello")
            alice = await tls_stream(ports["tls"], pki.client_context("alice"))
            assert await echoes(alice, b"hello")
            assert [(p.listener, p.identity) for p in echo.peers] == [("tls", None), ("tls", "alice")]
            assert echo.peers[1].host == "127.0.0.1" and echo.peers[1].address.startswith("127.0.0.1:")
            for flaw, why in (("untrusted", "unable to get local issuer certificate"),
                              ("expired", "certificate has expired")):
                caplog.clear()
                refused = await tls_stream(ports["tls"], pki.client_context(flaw))  # TLS 1.3: the server checks later
                assert await closed_by_server(refused)
                record = await until_logged(caplog, "TLS handshake failed")
                assert "CERTIFICATE_VERIFY_FAILED" in record.getMessage() and why in record.getMessage()
                assert record.ctx["peer"].startswith("127.0.0.1:") and record.ctx["listener"] == "tls"
            assert await echoes(alice, b"still here")  # the refusals did not disturb the others
            assert len(echo.peers) == 2
            await anonymous.aclose()
            await alice.aclose()


async def test_mtls_refuses_a_handshake_without_a_client_certificate(pki, caplog):
    context = server_ssl_context(pki.cert("server"), pki.key("server"), pki.ca_file, require_client_cert=True)
    echo = Echo()
    async with listening(echo, ListenerSpec("tls", "127.0.0.1", 0, context)) as ports:
        with trio.fail_after(WAIT_S):
            refused = await tls_stream(ports["tls"], pki.client_context())
            assert await closed_by_server(refused)
            record = await until_logged(caplog, "TLS handshake failed")
            assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in record.getMessage()
            assert echo.peers == []


async def test_a_handshake_that_never_comes_is_dropped(pki, caplog):
    context = server_ssl_context(pki.cert("server"), pki.key("server"))
    caplog.set_level(logging.INFO)
    async with listening(Echo(), ListenerSpec("tls", "127.0.0.1", 0, context), handshake_timeout_s=0.2) as ports:
        with trio.fail_after(WAIT_S):
            silent = await trio.open_tcp_stream("127.0.0.1", ports["tls"])
            assert await silent.receive_some(10) == b""
            await until_logged(caplog, "TLS handshake timed out")


async def test_websocket_messages_are_a_byte_stream(pki):
    echo = Echo(piece=4)
    async with listening(echo, ListenerSpec("ws", "127.0.0.1", 0),
                         ListenerSpec("wss", "127.0.0.1", 0, server_ssl_context(
                             pki.cert("server"), pki.key("server"), pki.ca_file))) as ports:
        with trio.fail_after(WAIT_S):
            for port, use_ssl in ((ports["ws"], False), (ports["wss"], pki.client_context("bob"))):
                async with open_websocket("127.0.0.1", port, "/mqtt", use_ssl=use_ssl, subprotocols=["mqtt"]) as ws:
                    assert ws.subprotocol == "mqtt"
                    for message in (b"abcdef", b"", b"gh"):  # an empty message is no end of stream
                        await ws.send_message(message)
                    got = [await ws.get_message()]
                    while sum(map(len, got)) < 8:
                        got.append(await ws.get_message())
                    assert b"".join(got) == b"abcdefgh"  # in order, across and within messages
                    assert max(map(len, got)) == 4  # each receive_some(4) sent back as one message
    assert [(p.listener, p.identity) for p in echo.peers] == [("ws", None), ("wss", "bob")]
    assert echo.errors == []


async def test_a_text_websocket_message_breaks_the_stream():
    echo = Echo()
    async with listening(echo, ListenerSpec("ws", "127.0.0.1", 0)) as ports:
        with trio.fail_after(WAIT_S):
            async with open_websocket("127.0.0.1", ports["ws"], "/mqtt", use_ssl=False, subprotocols=["mqtt"]) as ws:
                await ws.send_message("text")
                with pytest.raises(ConnectionClosed):
                    await ws.get_message()
    assert [str(e) for e in echo.errors] == ["a text WebSocket message: MQTT is sent in binary messages only"]


@pytest.mark.parametrize(("path", "subprotocols", "status", "why"), [
    ("/other", ["mqtt"], 404, "no MQTT endpoint at '/other'"),
    ("/mqtt", [], 400, "must offer the WebSocket subprotocol 'mqtt'"),
    ("/mqtt", ["mqttv3.1"], 400, "must offer the WebSocket subprotocol 'mqtt'"),
])
async def test_a_wrong_websocket_path_or_subprotocol_is_refused(caplog, path, subprotocols, status, why):
    echo = Echo()
    async with listening(echo, ListenerSpec("ws", "127.0.0.1", 0, path="/mqtt")) as ports:
        with trio.fail_after(WAIT_S), pytest.raises(ConnectionRejected) as refused:
            async with open_websocket("127.0.0.1", ports["ws"], path, use_ssl=False, subprotocols=subprotocols):
                pass
    assert refused.value.status_code == status and why in refused.value.body.decode()
    record = await until_logged(caplog, "WebSocket upgrade refused")
    assert why in record.getMessage() and record.ctx["status"] == status and record.ctx["path"] == path
    assert echo.peers == []


async def test_the_connection_cap_closes_at_accept_and_frees_a_slot_on_close(caplog):
    admission = Admission(max_connections=1)
    async with listening(Echo(), ListenerSpec("tcp", "127.0.0.1", 0), admission=admission) as ports:
        with trio.fail_after(WAIT_S):
            first = await trio.open_tcp_stream("127.0.0.1", ports["tcp"])
            assert await echoes(first, b"in")
            second = await trio.open_tcp_stream("127.0.0.1", ports["tcp"])
            assert await second.receive_some(10) == b""  # closed before anything was read
            record = await until_logged(caplog, "connection refused")
            assert "maximum number of connections" in record.getMessage()
            assert record.ctx["peer"].startswith("127.0.0.1:") and record.ctx["refused_max_connections"] == 1
            for _ in range(3):  # a flood of refusals is counted, not logged line by line
                refused = await trio.open_tcp_stream("127.0.0.1", ports["tcp"])
                assert await refused.receive_some(10) == b""
            assert admission.counters.refused_max_connections == 4
            assert len([r for r in caplog.records if "connection refused" in r.getMessage()]) == 1
            assert await echoes(first, b"still in")
            await first.aclose()
            while admission.connections:  # the server notices the close
                await trio.sleep(0.01)
            third = await trio.open_tcp_stream("127.0.0.1", ports["tcp"])
            assert await echoes(third, b"in again")
            await third.aclose()
    assert admission.counters.refused_max_connections == 4


async def test_refused_connections_get_no_tls_handshake(pki, caplog):
    context = server_ssl_context(pki.cert("server"), pki.key("server"))
    admission = Admission(connect_rate=0.01, connect_burst=1)
    async with listening(Echo(), ListenerSpec("tls", "127.0.0.1", 0, context), admission=admission) as ports:
        with trio.fail_after(WAIT_S):
            admitted = await tls_stream(ports["tls"], pki.client_context())
            with pytest.raises(trio.BrokenResourceError):
                await tls_stream(ports["tls"], pki.client_context())  # closed before the ServerHello
            record = await until_logged(caplog, "connection refused")
            assert "connect rate" in record.getMessage() and record.ctx["refused_connect_rate"] == 1
            assert await echoes(admitted, b"fine")
            await admitted.aclose()


# --- listener_specs and server_ssl_context ----------------------------------------------------


def test_only_plain_tcp_by_default():
    assert listener_specs(DEFAULTS) == [ListenerSpec("tcp", "127.0.0.1", 1883)]


def test_specs_from_the_options(pki):
    conf = {**DEFAULTS, "tls.port": 8883, "ws.port": 8080, "ws.host": "0.0.0.0", "wss.port": 8084,
            "ws.path": "/m", "tls.certfile": pki.cert("server"), "tls.keyfile": pki.key("server"),
            "tls.cafile": pki.ca_file, "tls.require_client_cert": True}
    specs = listener_specs(conf)
    assert [(s.kind, s.host, s.port) for s in specs] == [
        ("tcp", "127.0.0.1", 1883), ("tls", "127.0.0.1", 8883), ("ws", "0.0.0.0", 8080), ("wss", "127.0.0.1", 8084)]
    assert specs[1].ssl_context is specs[3].ssl_context and specs[1].ssl_context.context.verify_mode == ssl.CERT_REQUIRED
    assert specs[2].ssl_context is None and specs[2].path == "/m"
    assert [s.port for s in listener_specs({**conf, "node.port": 0})] == [0, 0, 0, 0]  # free ports for tests


@pytest.mark.parametrize(("changes", "message"), [
    ({"tls.port": 8883, "tls.keyfile": ""}, "need tls.certfile and tls.keyfile"),
    ({"wss.port": 8084, "tls.certfile": "/nonexistent/cert.pem", "tls.keyfile": "/nonexistent/key.pem"},
     "cannot load tls.certfile /nonexistent/cert.pem"),
    ({"tls.port": 8883, "tls.cafile": "/nonexistent/ca.pem"}, "cannot load tls.cafile /nonexistent/ca.pem"),
    ({"tls.port": 8883, "tls.cafile": "", "tls.require_client_cert": True}, "tls.require_client_cert needs tls.cafile"),
    ({"tls.port": 8883, "tls.cafile": "", "auth.use_identity_as_username": True},
     "auth.use_identity_as_username needs a listener that verifies client certificates"),
    ({"auth.use_identity_as_username": True}, "auth.use_identity_as_username needs"),
    ({"ws.port": 8080, "ws.path": "mqtt"}, "ws.path must start with '/'"),
])
def test_bad_listener_options_say_which_and_why(pki, changes, message):
    conf = {**DEFAULTS, "tls.certfile": pki.cert("server"), "tls.keyfile": pki.key("server"),
            "tls.cafile": pki.ca_file, **changes}
    with pytest.raises(ListenerError, match=message) as raised:
        listener_specs(conf)
    assert isinstance(raised.value, OSError)  # the node's start reports it as it reports a taken port


def test_a_key_that_does_not_match_is_refused(pki):
    with pytest.raises(ListenerError, match="cannot load tls.certfile"):
        server_ssl_context(pki.cert("server"), pki.key("alice"))


def test_a_missing_certificate_stops_the_start_with_the_reason(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--port", "0", "--data", str(tmp_path / "data"),
         "--tls-port", "8883", "--tls-certfile", str(tmp_path / "none.pem"), "--tls-keyfile", str(tmp_path / "none.key")],
        capture_output=True, text=True, timeout=WAIT_S * 3, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stderr
    assert f"cannot load tls.certfile {tmp_path / 'none.pem'}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before the store was opened


# --- `lightgate serve` end to end with paho -------------------------------------------------------


class ListenerClient(Client):
    """tests/helpers/mqtt_fixtures.py's paho wrapper over ``transport`` ("tcp" or "websockets"), with TLS if asked."""

    def __init__(self, port: int, *, transport: str = "tcp", tls: ssl.SSLContext | None = None,
                 protocol=mqtt.MQTTv311) -> None:
        super().__init__(port, protocol=protocol)
        plain = self.paho
        kwargs = {"clean_session": True} if protocol != mqtt.MQTTv5 else {}
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=protocol,
                                transport=transport, **kwargs)
        for callback in ("on_message", "on_connect", "on_disconnect", "on_subscribe", "on_unsubscribe"):
            setattr(self.paho, callback, getattr(plain, callback))
        if transport == "websockets":
            self.paho.ws_set_options(path="/mqtt")
        if tls is not None:
            self.paho.tls_set_context(tls)


def listener_client(port: int, **kwargs):
    return connected(port, ListenerClient, **kwargs)


def ports_of(node) -> dict[str, int]:
    ready = node.wait_log(lambda doc: doc.get("msg") == "gateway node ready")
    return {kind: ready[f"{kind}_port"] for kind in ("tls", "ws", "wss") if f"{kind}_port" in ready}


@contextmanager
def lightgate(tmp_path, *flags: str):
    """A `lightgate serve` node that must stop cleanly and log no error."""
    with running_node(tmp_path / "data", *flags) as node:
        yield node
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


@pytest.fixture(scope="module")
def secure_node(pki, tmp_path_factory):
    """A node with every listener, client certificates optional."""
    flags = ("--tls-port", "8883", "--ws-port", "8080", "--wss-port", "8084", *pki.server_flags())
    with lightgate(tmp_path_factory.mktemp("secure"), *flags) as node:
        node.ports = ports_of(node)
        yield node


def check_round_trip(subscriber: Client, publisher: Client, topic: str) -> None:
    subscriber.subscribe(topic, 1)
    publisher.publish(topic, b"over " + topic.encode(), 1)
    [message] = subscriber.receive(1)
    assert (message.topic, message.payload) == (topic, b"over " + topic.encode())


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_paho_over_tls(secure_node, pki, protocol):
    port = secure_node.ports["tls"]
    assert port not in (secure_node.port, 8883)  # `--port 0`: every listener on a free port
    topic = f"tls/{uuid.uuid4().hex[:6]}"
    with listener_client(port, tls=pki.client_context(), protocol=protocol) as sub, \
            listener_client(port, tls=pki.client_context("alice"), protocol=protocol) as pub:
        check_round_trip(sub, pub, topic)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ws", "wss"])
@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
def test_paho_over_websockets(secure_node, pki, kind, protocol):
    tls = pki.client_context() if kind == "wss" else None
    topic = f"{kind}/{uuid.uuid4().hex[:6]}"
    with listener_client(secure_node.ports[kind], transport="websockets", tls=tls, protocol=protocol) as sub, \
            listener_client(secure_node.port, protocol=protocol) as pub:  # across listeners, both ways
        check_round_trip(sub, pub, topic)
        check_round_trip(pub, sub, topic + "/back")


@pytest.mark.slow
def test_paho_with_an_untrusted_certificate_is_refused_and_logged(secure_node, pki):
    client = ListenerClient(secure_node.ports["tls"], tls=pki.client_context("untrusted"))
    try:
        client.paho.connect("127.0.0.1", client.port)  # TLS 1.3: the client's side of the handshake completes
        client.paho.loop_start()
        client.disconnects.get(timeout=WAIT_S)  # then the server refuses the certificate and closes
        assert client.connacks.empty()
    finally:
        client.paho.loop_stop()
    doc = secure_node.wait_log(lambda doc: doc.get("msg", "").startswith("TLS handshake failed"))
    assert "unable to get local issuer certificate" in doc["msg"] and doc["listener"] == "tls"


@pytest.mark.slow
def test_a_wrong_websocket_path_gets_404_from_the_node(secure_node):
    request = (b"GET /wrong HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")
    with socket.create_connection(("127.0.0.1", secure_node.ports["ws"]), timeout=WAIT_S) as raw:
        raw.sendall(request)
        response = b""
        while chunk := raw.recv(4096):
            response += chunk
    assert response.startswith(b"HTTP/1.1 404 ")
    assert b"no MQTT endpoint at '/wrong'" in response
    doc = secure_node.wait_log(lambda doc: doc.get("msg", "").startswith("WebSocket upgrade refused"))
    assert doc["path"] == "/wrong" and doc["status"] == 404


@pytest.mark.slow
def test_mtls_identity_is_the_user_name(pki, tmp_path):
    acl = tmp_path / "acl.txt"
    acl.write_text(ACL)
    flags = ("--tls-port", "8883", *pki.server_flags(), "--tls-require-client-cert",
             "--auth-use-identity-as-username", "--auth-acl-file", str(acl))
    with lightgate(tmp_path, *flags) as node:
        port = ports_of(node)["tls"]
        with listener_client(port, tls=pki.client_context("alice")) as alice, \
                listener_client(port, tls=pki.client_context("bob"), protocol=mqtt.MQTTv5) as bob:
            check_round_trip(alice, alice, "home/alice/lamp")  # %u = alice: the CN, no password sent
            assert [int(getattr(rc, "value", rc)) for rc in alice.subscribe("home/bob/#")] == [0x80]
            assert [int(getattr(rc, "value", rc)) for rc in bob.subscribe("home/bob/#")] == [1]
        nameless = ListenerClient(port, tls=pki.client_context("nameless"))
        nameless.paho.connect("127.0.0.1", port)
        nameless.paho.loop_start()
        try:
            _, rc = nameless.connacks.get(timeout=WAIT_S)
            assert rc.is_failure and rc.value == 0x87  # paho's name for 3.1.1 code 5, not authorised
        finally:
            nameless.paho.loop_stop()
        doc = node.wait_log(lambda doc: doc.get("msg", "").startswith("connection refused"))
        assert "no verified client certificate" in doc["msg"] and doc["reason"] == "NOT_AUTHORIZED"
        with socket.create_connection(("127.0.0.1", node.port), timeout=WAIT_S) as plain:  # no certificate at all
            plain.sendall(connect_packet("plain-" + uuid.uuid4().hex[:6]))
            assert plain.recv(4) == b"\x20\x02\x00\x05"  # CONNACK: not authorised


def closed_at_accept(sock: socket.socket) -> bool:
    """The server closed the socket without sending anything (a reset counts: it may not have read our bytes)."""
    try:
        return sock.recv(4) == b""
    except ConnectionResetError:
        return True


@contextmanager
def sourced(port: int, source: str):
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(source, 0)) as sock:
        yield sock


def mqtt_admitted(port: int, source: str = "127.0.0.1") -> bool:
    with sourced(port, source) as sock:
        try:
            sock.sendall(connect_packet("probe-" + uuid.uuid4().hex[:6]))
            return sock.recv(4) == b"\x20\x02\x00\x00"
        except ConnectionResetError:
            return False


@pytest.mark.slow
def test_max_connections_refuses_the_next_and_keeps_the_earlier_working(tmp_path):
    with lightgate(tmp_path, "--limits-max-connections", "2") as node:
        with listener_client(node.port) as sub, listener_client(node.port) as pub:
            with sourced(node.port, "127.0.0.1") as third:
                assert closed_at_accept(third)
            doc = node.wait_log(lambda doc: doc.get("msg", "").startswith("connection refused"))
            assert "maximum number of connections" in doc["msg"] and doc["refused_max_connections"] == 1
            assert doc["peer"].startswith("127.0.0.1:")
            check_round_trip(sub, pub, "limits/" + uuid.uuid4().hex[:6])
        wait_until(lambda: mqtt_admitted(node.port), what="a free slot after the clients left")


@pytest.mark.slow
def test_connect_rate_is_per_source_address(tmp_path):
    with lightgate(tmp_path, "--limits-connect-rate", "0.01", "--limits-connect-burst", "2") as node:
        assert mqtt_admitted(node.port, "127.0.0.2")
        assert mqtt_admitted(node.port, "127.0.0.2")
        with sourced(node.port, "127.0.0.2") as third:
            assert closed_at_accept(third)
        doc = node.wait_log(lambda doc: doc.get("msg", "").startswith("connection refused"))
        assert "connect rate" in doc["msg"] and doc["peer"].startswith("127.0.0.2:")
        assert doc["refused_connect_rate"] == 1
        assert mqtt_admitted(node.port, "127.0.0.3")  # another source has its own bucket
