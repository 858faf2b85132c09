"""Transports: the byte streams a connection reads and writes, one interface and its two kinds.

A ``Connection`` (gateway/node/connection.py) has one read path and one write path, both through its
``Transport``; which kind it has decides how the bytes move:

- ``PolledSocket``: a plain TCP socket in the node's one epoll set (gateway/node/poller.py). It is read in the
  poller's step, every read of a round handed to the connection there (the connection's own task only waits; the
  socket stays in the set while reading is paused, so its bytes keep their place in arrival order); it is
  written in place while the socket takes the bytes whole (no task, no switch), the rest by the connection's
  writer task.
- ``StreamTransport``: a TLS or WebSocket trio stream: read by the connection's task with ``receive_some``, one
  read per :meth:`Transport.read`, and written by its writer task only.

Resource handling: a transport owns its stream; the connection that has it closes it (:meth:`Transport.aclose`).
"""

from __future__ import annotations

import os
import select
from collections.abc import Awaitable, Callable
from typing import Protocol, final

import outcome
import trio

from gateway.node.listeners import WebSocketStream
from gateway.node.poller import Poller

__all__ = ["RECEIVE_BYTES", "PolledSocket", "Receiver", "StreamTransport", "Transport", "transport_for"]

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
        """Reading waits (back-pressure); the connection calls :meth:`Transport.read` again once it resumes."""
        ...

    def received(self, data: bytes) -> bool:
        """Process bytes read (``b""``: the client closed); False once reading must end."""
        ...

    def receive_failed(self, exc: Exception) -> None:
        """A read failed: the connection is lost."""
        ...


class Transport(Protocol):
    """What a connection needs from its byte stream (see the module docstring)."""

    accepted: Callable[[], None] | None
    """What to do once the client is accepted (CONNACK sent): a WebSocket widens its message bound; None: nothing."""

    def read(self, receiver: Receiver) -> Awaitable[bool]:
        """Hand what the client sends to ``receiver.received``: a stream one read, a polled socket every read
        until the receiver pauses. True: call again (once the receiver resumes); False: reading ended.

        Raises:
            Exception: what ``receiver.received`` raised (a bug: it ends this connection only).
        """
        ...

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


def transport_for(stream: trio.abc.Stream, poller: Poller) -> Transport:
    """The transport of a stream a listener accepted (gateway/node/listeners.py): a plain TCP socket is polled by
    ``poller``, TLS and WebSocket streams are read by their connection's task.

    A WebSocket's close handshake lingers by itself (``WebSocketStream.aclose``); TLS lingers on its TCP
    connection (trio sends no close_notify alone): the client sees the end at once, as plain TCP clients do.
    """
    if type(stream) is trio.SocketStream:
        return PolledSocket(stream, poller)
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

    The socket joins the poller's set at the first :meth:`read` and stays in it until reading ends, paused or
    not, so the kernel queues it for the poller in the order its bytes arrive (gateway/node/poller.py). Each read
    is handed to the receiver in the poller's step, whenever the receiver is not paused, even while the reading
    task is away (back from a pause, the task may not have run yet: a SUBSCRIBE sent on reading the CONNACK must
    still be read before a PUBLISH that another connection sent after it). While the receiver is paused the
    socket is not read: the poller's report is kept (``_parked``) and the socket is re-armed when the task reads
    again. The waiting task is woken when reading ends or pauses, with the answer of :meth:`read`; a failure of
    the receiver is raised again in that task, so it ends this connection only. The task waits in trio itself,
    not in a frame of ours: a frame per idle device is memory (``lightgate bench conns``).
    """

    __slots__ = ("_stream", "_fd", "_poller", "_receiver", "_task", "_ended", "_failure", "_parked")

    accepted = None  # nothing to widen

    def __init__(self, stream: trio.SocketStream, poller: Poller) -> None:
        self._stream = stream
        self._fd = stream.socket.fileno()
        self._poller = poller
        self._receiver: Receiver | None = None  # from the first read to the end (a cycle the end breaks)
        self._task: trio.lowlevel.Task | None = None  # the task waiting in read()
        self._ended = False  # a polled read ended the connection (or failed)
        self._failure: Exception | None = None  # what the receiver raised while no task waited
        self._parked = False  # the poller reported bytes while the receiver was paused: not read yet

    def read(self, receiver: Receiver) -> Awaitable[bool]:
        if self._receiver is None and not self._ended:
            self._receiver = receiver
            self._poller.register(self._fd, self._on_readable, RECEIVE_BYTES)
        elif self._parked:
            self._parked = False
            self._poller.rearm(self._fd)
        if self._ended:
            return _answer(outcome.Value(False) if self._failure is None else outcome.Error(self._failure))
        if receiver.paused():  # a read in the poller's step paused it while this task was away
            return _answer(outcome.Value(True))
        self._task = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    def _stop(self) -> None:
        """Out of the poller's set for good: reading ended."""
        self._poller.unregister(self._fd)
        self._task = None
        self._receiver = None

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._stop()
        return trio.lowlevel.Abort.SUCCEEDED

    def _on_readable(self) -> int:
        """The poller saw bytes (or the end) on the socket: read once and hand it to the receiver, in the poller's
        step; returns the bytes read. Wakes the reading task, if it waits, when reading must stop: it ended or is
        paused."""
        receiver = self._receiver
        if receiver is None or receiver.closing or self._ended:
            self._stop()  # the reading task is about to leave: read nothing more
            return 0
        if receiver.paused():  # a pause that began outside a read (node work queued): the task waits for its end
            self._parked = True
            task = self._task
            if task is not None:
                self._task = None
                trio.lowlevel.reschedule(task, outcome.Value(True))
            return 0
        self._parked = False
        data = b""
        try:
            data = os.read(self._fd, RECEIVE_BYTES)
        except BlockingIOError:
            return 0
        except OSError as exc:
            receiver.receive_failed(exc)
            self._ended = True
        else:
            try:
                self._ended = not receiver.received(data)
            except Exception as exc:  # raised again in the reading task: this connection only
                self._failure = exc
                self._ended = True
        task = self._task  # after the read: closing the connection in it may have aborted the wait
        if self._ended or receiver.paused():
            self._task = None
            if self._ended:
                self._stop()
            if task is not None:
                trio.lowlevel.reschedule(task, outcome.Value(not self._ended) if self._failure is None
                                         else outcome.Error(self._failure))
        return len(data)

    def send_nowait(self, data: bytes) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            raise trio.WouldBlock from None

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    def bytes_waiting(self) -> bool:
        poll = select.poll()  # not select.select: descriptors above 1,023 are normal with 10,000 devices
        try:
            poll.register(self._stream.socket.fileno(), select.POLLIN)
            return bool(poll.poll(0))
        except (OSError, ValueError):  # closed meanwhile
            return False

    async def linger(self, max_bytes: int) -> None:
        self._stop()  # the connection drains its input now: the poller must not read it
        try:
            await self._stream.send_eof()
        except RECEIVE_ERRORS:
            return
        await _drain(self._stream, max_bytes)

    async def aclose(self) -> None:
        self._stop()  # before the descriptor is closed: its number is reused
        await self._stream.aclose()


async def _answer(result: outcome.Outcome[bool]) -> bool:
    """The answer of a :meth:`PolledSocket.read` known at once (reading ended or paused in the poller's step)."""
    await trio.lowlevel.checkpoint()
    return result.unwrap()


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
        try:
            data = await self._stream.receive_some(RECEIVE_BYTES)
        except RECEIVE_ERRORS as exc:
            receiver.receive_failed(exc)
            return False
        return receiver.received(data)

    def send_nowait(self, data: bytes) -> int:
        raise trio.WouldBlock

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
