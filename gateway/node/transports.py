"""Transports: the byte streams a connection reads and writes, one interface and its two kinds.

A ``Connection`` (gateway/node/connection.py) has one read path and one write path, both through its
``Transport``; which kind it has decides how the bytes move:

- ``PolledSocket``: a plain TCP socket in the node's one epoll set (gateway/node/poller.py). From
  :meth:`PolledSocket.start` on, every read is made in the poller's step and handed to the connection there: an
  idle connection has no task (a trio task per device was 43% of its memory, ``lightgate bench conns``). The
  socket stays in the set while reading is paused, so its bytes keep their place in arrival order. It is written
  in place while the socket takes the bytes whole (no task, no switch), the rest by the connection's writer task.
- ``StreamTransport``: a TLS or WebSocket trio stream: read by the connection's task with ``receive_some``, one
  read per :meth:`StreamTransport.read`, and written by its writer task only.

Dependencies point one way: the connection uses its transport, a polled socket the poller; the transport knows
the connection only as a ``Receiver``.

Resource handling: a transport owns its stream; the connection that has it closes it (:meth:`Transport.aclose`).
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from typing import Protocol, final

import trio

from gateway.node.listeners import WebSocketStream
from gateway.node.poller import Poller

__all__ = ["RECEIVE_BYTES", "PolledSocket", "Receiver", "StreamTransport", "Transport", "stream_transport"]

RECEIVE_BYTES = 64 * 1024
"""One read takes up to this much: a burst of small PUBLISHes is decoded in one wake-up."""

RECEIVE_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
"""What a stream's read raises when the connection is lost (the client reset it, the TLS session broke)."""


class Receiver(Protocol):
    """What a transport hands its reads to: the connection."""

    @property
    def closing(self) -> bool:
        """The connection is closing: read nothing more."""
        ...

    def paused(self) -> bool:
        """Reading waits (back-pressure): a stream's task reads again once it ends, a polled socket is told
        (:meth:`PolledSocket.resume`)."""
        ...

    def received(self, data: bytes) -> bool:
        """Process bytes read (``b""``: the client closed); False once reading must end."""
        ...

    def receive_failed(self, exc: Exception) -> None:
        """A read failed: the connection is lost."""
        ...

    def stalled(self) -> None:
        """A polled socket has bytes it did not read because reading is paused: call
        :meth:`PolledSocket.resume` once the pause ends."""
        ...

    def failed(self, exc: Exception) -> None:
        """Processing a read raised (a bug): end this connection only."""
        ...

    def close(self) -> None:
        """Reading ended (the client closed, the poller stopped): close the connection."""
        ...


class Transport(Protocol):
    """What a connection needs from its byte stream (see the module docstring)."""

    accepted: Callable[[], None] | None
    """What to do once the client is accepted (CONNACK sent): a WebSocket widens its message bound; None: nothing."""

    def send_nowait(self, data: bytes) -> int:
        """Write in place, now, what the socket takes of ``data``; returns how much that was.

        Raises:
            trio.WouldBlock: nothing can be written without waiting (always, for a stream): :meth:`send_all`.
            OSError: the connection is lost.
        """
        ...

    async def send_all(self, data: bytes) -> None:
        """Write all of ``data`` (the connection's writer task).

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError: the connection is lost.
        """
        ...

    def resume(self) -> None:
        """The receiver's pause ended: a polled socket has the poller report it again (a stream's task reads again
        by itself)."""
        ...

    def bytes_waiting(self) -> bool:
        """Whether the kernel holds bytes from the client that no read has taken (a busy node's, not the client's,
        delay); False where that cannot be known (TLS, WebSocket)."""
        ...

    async def linger(self, max_bytes: int) -> None:
        """Half-close, then read and discard input until the client closes too or ``max_bytes`` arrive, so the
        socket is not closed with unread input (the kernel would send a reset). The caller bounds it in time."""
        ...

    async def aclose(self) -> None:
        """Close the stream."""
        ...


def stream_transport(stream: trio.abc.Stream) -> StreamTransport:
    """The transport of a TLS or WebSocket stream a listener accepted (gateway/node/listeners.py), read by its
    connection's task (a plain TCP socket is a ``PolledSocket``).

    A WebSocket's close handshake lingers by itself (``WebSocketStream.aclose``); TLS lingers on its TCP
    connection (trio sends no close_notify alone): the client sees the end at once, as plain TCP clients do.
    """
    if isinstance(stream, WebSocketStream):
        return StreamTransport(stream, None, stream.lift_message_limit)
    return StreamTransport(stream, stream.transport_stream if isinstance(stream, trio.SSLStream) else stream)


async def _drain(stream: trio.abc.Stream, max_bytes: int) -> None:
    """Read and discard until the end, a lost connection or ``max_bytes``."""
    read = 0
    try:
        while read < max_bytes:
            data = await stream.receive_some(RECEIVE_BYTES)
            if not data:
                return
            read += len(data)
    except RECEIVE_ERRORS:
        return


@final
class PolledSocket:
    """A plain TCP socket read in the step of the node's ``Poller`` and written in place (see the module docstring).

    The socket joins the poller's set at :meth:`start` and stays in it until reading ends, paused or not, so the
    kernel queues it for the poller in the order its bytes arrive (gateway/node/poller.py). Each read is handed to
    the receiver in the poller's step whenever the receiver is not paused (a SUBSCRIBE sent on reading the
    CONNACK is read before a PUBLISH that another connection sent after it). While the receiver is paused the
    socket is not read: the poller's report is kept (``_parked``), the receiver told (``stalled``), and the socket
    re-armed at :meth:`resume`. When reading ends (the client closed, a read failed, the receiver said so or
    failed, the poller stopped), the socket leaves the set and the receiver is closed; nothing waits in between.
    """

    __slots__ = ("_socket", "_stream", "_fd", "_poller", "_receiver", "_parked")

    accepted = None  # nothing to widen
    read_size = RECEIVE_BYTES  # a Readable of the poller's

    def __init__(self, stream: trio.SocketStream, poller: Poller) -> None:
        self._socket = stream.socket
        self._stream: trio.SocketStream | None = None  # made again only to write with a task or to linger (_streamed)
        self._fd = self._socket.fileno()
        self._poller = poller
        self._receiver: Receiver | None = None  # from start() to the end of reading (a cycle the end breaks)
        self._parked = False  # the poller reported bytes while the receiver was paused: not read yet

    def start(self, receiver: Receiver) -> None:
        """Hand every read to ``receiver``, in the poller's step, from now until reading ends."""
        self._receiver = receiver
        self._poller.register(self._fd, self)

    def resume(self) -> None:
        """The receiver's pause ended: have the poller report the socket again if it reported it meanwhile."""
        if self._parked:
            self._parked = False
            self._poller.rearm(self._fd)

    def _stop(self) -> None:
        """Out of the poller's set for good: reading ended."""
        self._poller.unregister(self._fd)
        self._receiver = None

    def gone(self) -> None:
        """The poller stopped reading the socket (it stopped): the connection ends."""
        receiver = self._receiver
        self._receiver = None
        if receiver is not None:
            receiver.close()

    def readable(self) -> int:
        """The poller saw bytes (or the end) on the socket: read once and hand it to the receiver, in the poller's
        step; returns the bytes read."""
        receiver = self._receiver
        if receiver is None or receiver.closing:
            self._stop()  # the connection closes: it reads nothing more
            return 0
        if receiver.paused():  # read once the pause ends (resume)
            if not self._parked:
                self._parked = True
                receiver.stalled()
            return 0
        try:
            data = os.read(self._fd, RECEIVE_BYTES)
        except BlockingIOError:
            return 0
        except OSError as exc:
            self._stop()
            receiver.receive_failed(exc)
            receiver.close()
            return 0
        try:
            reading = receiver.received(data)
        except Exception as exc:  # one connection's bug: it ends this connection only
            self._stop()
            receiver.failed(exc)
            return len(data)
        if not reading:
            self._stop()
            receiver.close()
        return len(data)

    def send_nowait(self, data: bytes) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            raise trio.WouldBlock from None

    async def send_all(self, data: bytes) -> None:
        await self._streamed().send_all(data)

    def _streamed(self) -> trio.SocketStream:
        """The socket as a trio stream: an idle connection does not keep one (its objects were 0.18 KiB)."""
        if self._stream is None:
            self._stream = trio.SocketStream(self._socket)
        return self._stream

    def bytes_waiting(self) -> bool:
        poll = select.poll()  # not select.select: descriptors above 1,023 are normal with 10,000 devices
        try:
            poll.register(self._socket.fileno(), select.POLLIN)
            return bool(poll.poll(0))
        except (OSError, ValueError):  # closed meanwhile
            return False

    async def linger(self, max_bytes: int) -> None:
        self._stop()  # the connection drains its input now: the poller must not read it
        try:
            await self._streamed().send_eof()
        except RECEIVE_ERRORS:
            return
        await _drain(self._streamed(), max_bytes)

    async def aclose(self) -> None:
        self._stop()  # before the descriptor is closed: its number is reused
        await self._streamed().aclose()


@final
class StreamTransport:
    """A TLS or WebSocket trio stream, read and written by its connection's tasks (see the module docstring).

    Args:
        stream: the stream the listener made.
        half_close: what :meth:`linger` half-closes and drains (TLS: the TCP connection below it); None: nothing
            (a WebSocket's close handshake does it).
        accepted: see ``Transport.accepted``.
    """

    __slots__ = ("_stream", "_half_close", "accepted")

    def __init__(self, stream: trio.abc.Stream, half_close: trio.abc.Stream | None,
                 accepted: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self._half_close = half_close
        self.accepted = accepted

    async def read(self, receiver: Receiver) -> bool:
        """Hand one read to ``receiver.received``; False: reading ended.

        Raises:
            Exception: what ``receiver.received`` raised (a bug: it ends this connection only).
        """
        try:
            data = await self._stream.receive_some(RECEIVE_BYTES)
        except RECEIVE_ERRORS as exc:
            receiver.receive_failed(exc)
            return False
        return receiver.received(data)

    def send_nowait(self, data: bytes) -> int:
        raise trio.WouldBlock

    def resume(self) -> None:
        pass  # the connection's task reads again after the pause

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    def bytes_waiting(self) -> bool:
        return False

    async def linger(self, max_bytes: int) -> None:
        stream = self._half_close
        if stream is None:
            return
        if isinstance(stream, trio.abc.HalfCloseableStream):
            try:
                await stream.send_eof()
            except RECEIVE_ERRORS:
                return
        await _drain(stream, max_bytes)

    async def aclose(self) -> None:
        await self._stream.aclose()
