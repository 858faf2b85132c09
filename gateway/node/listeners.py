"""Listeners: turn the configured TCP, TLS, WebSocket and secure WebSocket endpoints into streams for MQTT.

Each listener accepts TCP connections (gateway/node/accept.py: at the descriptor
limit, one log line per episode and back-off); per connection, in this order:

1. admission (gateway/node/admission.py): the node-wide connection cap and the
   per-source connect rate. A refused socket is closed at once, before any
   TLS, WebSocket or MQTT work, and logged with the peer address (at most one
   line per kind of refusal every ``REFUSAL_LOG_INTERVAL_S``);
2. TLS (``tls`` and ``wss``): the handshake, bounded in time; a failure (an
   untrusted or bad client certificate, a client speaking plain MQTT) is logged
   with the peer and the SSL reason and ends that connection only. A client
   certificate the context verified gives the peer its identity (the CN);
3. WebSocket (``ws`` and ``wss``): the HTTP upgrade, bounded in time; a wrong
   path is answered 404 and a missing ``mqtt`` subprotocol 400, both logged.
   The accepted WebSocket is adapted to a byte stream (:class:`WebSocketStream`);
4. the handler gets the stream and a :class:`Peer`; or, for a plain TCP
   connection, ``adopt`` does if given: it takes the socket without a task (a
   task per idle device is memory) and the connection's admission slot.

Resource handling: the handler owns the stream it gets and closes it (as
gateway/node/connection.py's ``Connection.run`` does); the listener closes the socket of
every connection that never reached the handler. ``adopt`` owns the socket and the admission slot it gets: it
closes the socket and calls ``ended()`` once, when it is done.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, wrap_server_stream

from gateway.node.accept import CapacityLog, serve_accepting
from gateway.node.binding import naming_the_address
from gateway.node.admission import Admission, Verdict

__all__ = [
    "BoundListener",
    "ListenerError",
    "ListenerSpec",
    "Peer",
    "TlsContext",
    "WebSocketStream",
    "listener_specs",
    "serve_listeners",
    "server_ssl_context",
]

LOGGER = logging.getLogger(__name__)

Kind = Literal["tcp", "tls", "ws", "wss"]

MQTT_SUBPROTOCOL = "mqtt"
"""The WebSocket subprotocol MQTT 3.1.1 and 5.0 name (section 6); a client must offer it."""

WS_RECEIVE_BYTES = 64 * 1024
"""One socket read of a WebSocket connection (trio-websocket reads 4 KiB by default: a burst of PUBLISHes would take
many wake-ups)."""

WS_CLOSE_TIMEOUT_S = 1.0
"""How long a closing WebSocket waits for the client's closing frame before it drops the socket: a takeover of the
client's session waits for the close, so a client that never answers must not hold it up for long."""

REFUSAL_LOG_INTERVAL_S = 10.0
"""After a refusal is logged, more of the same kind go unlogged this long (each line has the running counts): a
connection flood must not become a log flood."""

NORMAL_CLOSE_CODES = frozenset({1000, 1001, 1005})
"""WebSocket close codes that end a connection cleanly (normal, going away, no code given): read as end of stream."""

Handler = Callable[[trio.abc.Stream, "Peer"], Awaitable[None]]

Adopt = Callable[[trio.SocketStream, "Peer", Callable[[], None]], None]
"""Takes a plain TCP connection with no task (``serve_listeners``): the stream, its peer, and ``ended``."""


class ListenerError(OSError):
    """A listener cannot be set up: a certificate, key or CA file is missing or unreadable, or the TLS options
    contradict each other. An OSError, like a port that is taken, so a node's start reports both the same way."""


@final
class TlsContext:
    """The server TLS context of the ``tls`` and ``wss`` listeners, which ``reload`` replaces while they serve
    (SIGHUP: renewed certificates). Each handshake takes the context in effect when it starts."""

    def __init__(self, certfile: str, keyfile: str, cafile: str = "", require_client_cert: bool = False) -> None:
        """Raises ListenerError: see :func:`server_ssl_context`."""
        self.context = server_ssl_context(certfile, keyfile, cafile, require_client_cert)
        self._loaded = self._signature(certfile, keyfile, cafile, require_client_cert)

    @staticmethod
    def _signature(*options: str | bool) -> tuple[object, ...]:
        """The options and the (mtime, size, inode) of each file they name: what makes a reload necessary."""
        files = []
        for option in options:
            try:
                st = Path(option).stat() if isinstance(option, str) and option else None
            except OSError:
                st = None
            files.append((st.st_mtime_ns, st.st_size, st.st_ino) if st is not None else None)
        return (options, tuple(files))

    def reload(self, certfile: str, keyfile: str, cafile: str = "", require_client_cert: bool = False) -> bool:
        """Load the files again if they (or the options) changed; True when a new context is now in effect.

        Raises:
            ListenerError: a file is missing or broken; the context in effect stays.
        """
        signature = self._signature(certfile, keyfile, cafile, require_client_cert)
        if signature == self._loaded:
            return False
        self.context = server_ssl_context(certfile, keyfile, cafile, require_client_cert)
        self._loaded = signature
        return True


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """One configured listener. ``ssl_context`` is needed by ``tls`` and ``wss`` (a ``TlsContext`` can be reloaded);
    ``path`` is the WebSocket path."""

    kind: Kind
    host: str
    port: int
    ssl_context: ssl.SSLContext | TlsContext | None = None
    path: str = "/mqtt"
    reuse_port: bool = False  # SO_REUSEPORT: several cluster gateway processes share the port (docs/cluster.md)


@dataclass(frozen=True, slots=True)
class BoundListener:
    """Where a listener listens (port 0 in its spec picks a free port)."""

    kind: Kind
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is connected: ``address`` is host:port (for logs), ``host`` the address alone (per-source limits),
    ``identity`` the CN of the client certificate the TLS handshake verified (None without one)."""

    address: str
    host: str
    listener: Kind
    identity: str | None = None


def server_ssl_context(certfile: str, keyfile: str, cafile: str = "", require_client_cert: bool = False
                       ) -> ssl.SSLContext:
    """A server TLS context: the node's certificate and key, and client certificates checked against ``cafile``.

    With ``cafile`` a client may present a certificate (it must then verify);
    ``require_client_cert`` refuses handshakes without one (mTLS).

    Raises:
        ListenerError: a file is missing or not PEM, the key is encrypted, or
            client certificates are required without a CA to check them.
    """
    if not certfile or not keyfile:
        raise ListenerError("the tls and wss listeners need tls.certfile and tls.keyfile")
    if require_client_cert and not cafile:
        raise ListenerError("tls.require_client_cert needs tls.cafile, the CA that client certificates must chain to")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile, password=b"")  # never prompt on a terminal for a passphrase
    except OSError as exc:  # ssl.SSLError is one
        raise ListenerError(f"cannot load tls.certfile {certfile} with tls.keyfile {keyfile} "
                            f"(PEM, key not encrypted): {exc}") from exc
    if cafile:
        try:
            context.load_verify_locations(cafile)
        except OSError as exc:
            raise ListenerError(f"cannot load tls.cafile {cafile} (PEM certificates): {exc}") from exc
    context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL if cafile else ssl.CERT_NONE
    return context


def listener_specs(conf: Mapping[str, Any]) -> list[ListenerSpec]:
    """The listeners the options ask for: plain TCP first (always), then ``tls``, ``ws``, ``wss`` where their port
    is not 0. An empty ``<kind>.host`` means ``node.host``. When ``node.port`` is 0 (tests, several nodes on one
    machine) every listener picks a free port, as the admin listener does; the node logs them.

    Raises:
        ListenerError: see :func:`server_ssl_context`; also a WebSocket path that does not start with ``/``,
            and ``auth.use_identity_as_username`` without a listener that verifies client certificates.
    """
    host = conf["node.host"]
    specs = [ListenerSpec("tcp", host, conf["node.port"])]
    secure = None
    if conf["tls.port"] or conf["wss.port"]:
        secure = TlsContext(conf["tls.certfile"], conf["tls.keyfile"], conf["tls.cafile"],
                            conf["tls.require_client_cert"])
    if conf["auth.use_identity_as_username"] and (secure is None or secure.context.verify_mode == ssl.CERT_NONE):
        raise ListenerError("auth.use_identity_as_username needs a listener that verifies client certificates: "
                            "set tls.cafile and tls.port or wss.port")
    path = conf["ws.path"]
    if (conf["ws.port"] or conf["wss.port"]) and not path.startswith("/"):
        raise ListenerError(f"ws.path must start with '/', not {path!r}")
    free = conf["node.port"] == 0
    optional: tuple[tuple[Kind, TlsContext | None], ...] = (("tls", secure), ("ws", None), ("wss", secure))
    for kind, context in optional:
        port = conf[f"{kind}.port"]
        if port:
            specs.append(ListenerSpec(kind, conf[f"{kind}.host"] or host, 0 if free else port, context, path))
    return specs


async def serve_listeners(
    handler: Handler,
    specs: Sequence[ListenerSpec],
    *,
    adopt: Adopt | None = None,
    admission: Admission | None = None,
    handshake_timeout_s: float = 10.0,
    max_message_size: int = 2 * 1024 * 1024,
    connect_message_size: int | None = None,
    task_status: trio.TaskStatus[list[BoundListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open every listener in ``specs`` and serve each connection with ``handler(stream, peer)`` until cancelled.

    Args:
        handler: runs once per connection that passed admission and its handshakes; it owns the stream.
        adopt: called instead of ``handler`` for the plain TCP connections (see the module docstring); it must not
            block, and once it returned its ``ended()`` releases the connection's admission slot. None: ``handler``.
        specs: the listeners; all of them are listening before ``task_status.started`` is called.
        admission: decides each accepted socket (None: everyone is admitted).
        handshake_timeout_s: a TLS handshake and a WebSocket upgrade must each finish within this.
        max_message_size: the largest WebSocket message accepted (larger: closed with code 1009).
        connect_message_size: the same until the handler lifts it (``WebSocketStream.lift_message_limit``, once
            the client is accepted); None: ``max_message_size`` from the start.

    ``task_status.started`` receives the bound listeners, in the order of ``specs``.

    Raises:
        BindError: a listener cannot bind (the port is taken, the host is not local): the message names the
            address and the option to change.

    Error handling: a connection's failure before the handler (refusal, failed
    handshake, wrong path) is logged and ends that connection only.
    """
    refusals = _RefusalLog()
    async with trio.open_nursery() as nursery:
        bound: list[BoundListener] = []
        for spec in specs:
            with naming_the_address(spec.kind, spec.host, spec.port):
                if spec.reuse_port:
                    listeners = await _open_shared_listeners(spec.port, spec.host)
                else:
                    listeners = await trio.open_tcp_listeners(spec.port, host=spec.host)
            host, port = listeners[0].socket.getsockname()[:2]
            bound.append(BoundListener(spec.kind, host, port))
            accepted = _Accepted(spec, handler, adopt if spec.kind == "tcp" else None, admission, refusals,
                                 handshake_timeout_s, max_message_size, connect_message_size or max_message_size)
            await nursery.start(serve_accepting, listeners, accepted, CapacityLog(spec.kind))
            LOGGER.info("listener ready", extra={"ctx": {"listener": spec.kind, "host": host, "port": port}})
        task_status.started(bound)


async def _open_shared_listeners(port: int, host: str) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners`` with SO_REUSEPORT set before binding: the kernel spreads the connections over
    every process listening so on the port.

    Raises:
        OSError: the address does not resolve, or the port is taken by a socket without SO_REUSEPORT.
    """
    listeners = []
    for family, kind, proto, _, address in await trio.socket.getaddrinfo(
            host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE):
        sock = trio.socket.socket(family, kind, proto)
        try:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
            if family == trio.socket.AF_INET6:
                sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
            await sock.bind(address)
            sock.listen()
        except OSError:
            sock.close()
            for listener in listeners:
                listener.socket.close()
            raise
        listeners.append(trio.SocketListener(sock))
    return listeners


def _common_name(certificate: dict[str, Any] | None) -> str | None:
    """The first CN of a verified certificate's subject (``ssl.SSLSocket.getpeercert()`` form), as Mosquitto uses."""
    for rdn in (certificate or {}).get("subject", ()):
        for name, value in rdn:
            if name == "commonName" and value:
                return value
    return None


def _websocket_refusal(request: WebSocketRequest, path: str) -> tuple[int, str] | None:
    """The HTTP status and reason to refuse an upgrade with, or None to accept it."""
    requested = request.path.split("?", 1)[0]
    if requested != path:
        return 404, f"no MQTT endpoint at {requested!r} (it is at {path!r})"
    if MQTT_SUBPROTOCOL not in request.proposed_subprotocols:
        return 400, f"the client must offer the WebSocket subprotocol {MQTT_SUBPROTOCOL!r}"
    return None


@final
class _RefusalLog:
    """Logs the first refusal of each kind, then at most one every ``REFUSAL_LOG_INTERVAL_S``."""

    def __init__(self) -> None:
        self._quiet_until: dict[Verdict, float] = {}

    def refused(self, verdict: Verdict, peer: Peer, admission: Admission, now: float) -> None:
        if now < self._quiet_until.get(verdict, 0.0):
            return
        self._quiet_until[verdict] = now + REFUSAL_LOG_INTERVAL_S
        counters = admission.counters
        LOGGER.warning("connection refused: %s", verdict.value, extra={"ctx": {
            "peer": peer.address, "listener": peer.listener, "connections": admission.connections,
            "refused_max_connections": counters.refused_max_connections,
            "refused_connect_rate": counters.refused_connect_rate}})


def _nothing() -> None:
    """An adopted connection's ``ended`` when no admission counts connections."""


@final
class _Accepted:
    """What one listener does with each accepted socket (see the module docstring)."""

    def __init__(self, spec: ListenerSpec, handler: Handler, adopt: Adopt | None, admission: Admission | None,
                 refusals: _RefusalLog, handshake_timeout_s: float, max_message_size: int,
                 connect_message_size: int) -> None:
        self._spec = spec
        self._handler = handler
        self._adopt = adopt
        self._admission = admission
        # One bound method for every connection this listener adopts (64 B each if made per connection).
        self._ended: Callable[[], None] = _nothing if admission is None else admission.release
        self._refusals = refusals
        self._timeout_s = handshake_timeout_s
        self._max_message_size = max_message_size
        self._connect_message_size = min(connect_message_size, max_message_size)

    async def __call__(self, stream: trio.SocketStream) -> bool:
        """Called by ``serve_accepting`` (gateway/node/accept.py), which closes ``stream`` afterwards unless this
        returns True (``adopt`` kept it)."""
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:  # the client is already gone
            return False
        peer = Peer(f"{host}:{port}", host, self._spec.kind)
        admission = self._admission
        if admission is not None:
            now = time.monotonic()
            verdict = admission.admit(host, now)
            if verdict is not Verdict.ADMITTED:
                self._refusals.refused(verdict, peer, admission, now)
                return False
        if self._adopt is not None:
            try:
                self._adopt(stream, peer, self._ended)
            except Exception as exc:  # not kept: closed here, its slot released
                LOGGER.error("connection failed: %r", exc, exc_info=exc,
                             extra={"ctx": {"peer": peer.address, "listener": peer.listener}})
                if admission is not None:
                    admission.release()
                return False
            return True
        try:
            if self._spec.kind == "tcp":  # no frames in between: an idle device's task stack is memory
                await self._handler(stream, peer)
            else:
                await self._secure(stream, peer)
        except Exception as exc:  # one connection's failure must not stop the listener
            LOGGER.error("connection failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"peer": peer.address, "listener": peer.listener}})
        finally:
            if admission is not None:
                admission.release()
        return False

    async def _secure(self, stream: trio.SocketStream, peer: Peer) -> None:
        context = self._spec.ssl_context
        if isinstance(context, TlsContext):
            context = context.context  # the one in effect now (SIGHUP may have replaced it)
        if context is None:
            await self._upgrade(stream, peer)
            return
        tls = trio.SSLStream(stream, context, server_side=True, https_compatible=True)
        with trio.move_on_after(self._timeout_s) as waited:
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                reason = exc.__cause__ or exc  # the ssl.SSLError, e.g. CERTIFICATE_VERIFY_FAILED and why
                LOGGER.warning("TLS handshake failed: %s", reason,
                               extra={"ctx": {"peer": peer.address, "listener": peer.listener}})
                return
        if waited.cancelled_caught:
            LOGGER.info("TLS handshake timed out after %s s", self._timeout_s,
                        extra={"ctx": {"peer": peer.address, "listener": peer.listener}})
            return
        identity = _common_name(tls.getpeercert())
        await self._upgrade(tls, Peer(peer.address, peer.host, peer.listener, identity))

    async def _upgrade(self, stream: trio.abc.Stream, peer: Peer) -> None:
        if self._spec.kind not in ("ws", "wss"):
            await self._handler(stream, peer)
            return
        ctx = {"peer": peer.address, "listener": peer.listener}
        async with trio.open_nursery() as nursery:  # runs the WebSocket's reader task
            request: WebSocketRequest | None = None
            with trio.move_on_after(self._timeout_s):
                request = await wrap_server_stream(nursery, stream, max_message_size=self._connect_message_size,
                                                   receive_buffer_size=WS_RECEIVE_BYTES)
            if request is None:
                LOGGER.info("WebSocket upgrade not received within %s s", self._timeout_s, extra={"ctx": ctx})
                nursery.cancel_scope.cancel()
                return
            refusal = _websocket_refusal(request, self._spec.path)
            if refusal is not None:
                status, why = refusal
                LOGGER.warning("WebSocket upgrade refused: %s", why, extra={"ctx": {
                    **ctx, "status": status, "path": request.path, "subprotocols": list(request.proposed_subprotocols)}})
                with contextlib.suppress(ConnectionClosed):  # the client may be gone already
                    await request.reject(status, body=why.encode())
                nursery.cancel_scope.cancel()
                return
            try:
                connection = await request.accept(subprotocol=MQTT_SUBPROTOCOL)
            except ConnectionClosed:
                LOGGER.info("WebSocket client left during the upgrade", extra={"ctx": ctx})
                nursery.cancel_scope.cancel()
                return
            try:
                await self._handler(WebSocketStream(connection, self._max_message_size), peer)
            finally:
                nursery.cancel_scope.cancel()


@final
class WebSocketStream(trio.abc.Stream):
    """An accepted WebSocket as a byte stream, for a handler written for TCP.

    MQTT packets may span several binary messages or share one (MQTT 5.0,
    section 6), so received messages are concatenated; each ``send_all`` is
    one binary message. A text message breaks the stream (MQTT allows binary
    frames only). A close with a normal code is the end of the stream (``b""``);
    any other close raises ``trio.BrokenResourceError``.

    Messages are bounded by what the connection was opened with (the listener's
    ``connect_message_size``) until :meth:`lift_message_limit` raises the bound to
    ``max_message_size``: a client not yet accepted cannot make the node buffer
    a message of the size an accepted one may send.

    Resource handling: :meth:`aclose` closes the WebSocket and its transport,
    waiting at most ``WS_CLOSE_TIMEOUT_S`` for the client's closing frame.
    """

    def __init__(self, connection: WebSocketConnection, max_message_size: int | None = None) -> None:
        self._connection = connection
        self._pending = b""  # a message larger than a receive_some asked for, read from ``_taken`` on
        self._taken = 0
        self._closed = False
        self._max_message_size = max_message_size

    def lift_message_limit(self) -> None:
        """Accept messages up to ``max_message_size`` from now on (the client was accepted)."""
        if self._max_message_size is not None:
            # trio-websocket reads the bound per received frame; it has no public setter.
            self._connection._max_message_size = self._max_message_size

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the WebSocket stream was closed")
        if not self._pending:
            self._pending = await self._next_message()
            self._taken = 0
        else:
            await trio.lowlevel.checkpoint()
        start = self._taken
        if max_bytes is None or max_bytes >= len(self._pending) - start:
            data = self._pending if not start else self._pending[start:]
            self._pending = b""
            return data
        # A slice per read, not the rest of the message copied per read (quadratic for a 2 MB message).
        self._taken = start + max_bytes
        return self._pending[start:self._taken]

    async def _next_message(self) -> bytes:
        """The next non-empty binary message; ``b""`` at a normal close."""
        while True:
            try:
                message = await self._connection.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                if reason is None or reason.code in NORMAL_CLOSE_CODES:
                    return b""
                raise trio.BrokenResourceError(f"WebSocket closed: {reason}") from exc
            if isinstance(message, str):
                raise trio.BrokenResourceError("a text WebSocket message: MQTT is sent in binary messages only")
            if message:
                return message

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the WebSocket stream was closed")
        if not data:
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._connection.send_message(bytes(data))
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(f"WebSocket closed: {exc.reason}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._closed = True
        self._pending = b""
        with trio.move_on_after(WS_CLOSE_TIMEOUT_S):
            await self._connection.aclose()  # on timeout it closes the transport without the client's frame
