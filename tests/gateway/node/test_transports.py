"""A connection's transports (gateway/node/transports.py): a polled plain TCP socket and a read-and-written stream,
over real sockets; the receiver stands in for the connection they serve."""

import socket
import struct

import pytest
import trio
import trio.testing

from gateway.node.poller import Poller
from gateway.node.transports import RECEIVE_BYTES, PolledSocket, StreamTransport


class Receiver:
    """Records what a transport hands it and tells it; pauses after ``pause_after`` reads, fails on ``fail_on``."""

    def __init__(self, poller: Poller | None = None, pause_after: int = 0, fail_on: bytes = b"") -> None:
        self.closing = False
        self.reads: list[tuple[bytes, bool]] = []  # (data, read in a poller round)
        self.failures: list[Exception] = []
        self.stalls = 0
        self.closes = 0
        self._poller = poller
        self.pause_after = pause_after
        self._fail_on = fail_on
        self._changed = trio.Event()
        self.held = False  # paused whatever was read (the node's work queued for the connection)

    async def until(self, condition) -> None:
        """Return once ``condition()`` holds (checked whenever the transport hands or tells something)."""
        with trio.fail_after(5):
            while not condition():
                await self._changed.wait()

    def _told(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def paused(self) -> bool:
        return self.held or bool(self.pause_after) and len(self.reads) >= self.pause_after

    def received(self, data: bytes) -> bool:
        if self._fail_on and data == self._fail_on:
            raise RuntimeError("a bug in the connection")
        self.reads.append((data, self._poller is not None and self._poller.round is not None))
        self._told()
        return bool(data)

    def receive_failed(self, exc: Exception) -> None:
        self.failures.append(exc)
        self._told()

    def stalled(self) -> None:
        self.stalls += 1
        self._told()

    def failed(self, exc: Exception) -> None:
        self.failures.append(exc)
        self._told()

    def close(self) -> None:
        self.closing = True
        self.closes += 1
        self._told()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair: the server's end non-blocking, as trio's sockets are."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def polled(server: socket.socket, poller: Poller) -> PolledSocket:
    return PolledSocket(trio.SocketStream(trio.socket.from_stdlib_socket(server)), poller)


async def test_a_polled_socket_is_read_in_the_pollers_rounds_until_its_receiver_pauses_then_until_the_end():
    """Once a pause ends (the CONNECT answered), the socket's next bytes are read in the poller's step, in their
    arrival order, with no task: a SUBSCRIBE sent on reading the CONNACK comes before another client's PUBLISH
    sent after it (issue 31, item 6)."""
    poller = Poller()
    server, client = tcp_pair()
    transport = polled(server, poller)
    receiver = Receiver(poller, pause_after=1)
    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            transport.start(receiver)
            client.send(b"connect")
            await receiver.until(lambda: receiver.reads)
            assert receiver.reads == [(b"connect", True)] and len(poller) == 1  # in the set while paused
            receiver.pause_after = 0  # the pause ends before the next bytes: nothing to resume
            client.send(b"subscribe")
            await receiver.until(lambda: len(receiver.reads) == 2)
            assert receiver.reads == [(b"connect", True), (b"subscribe", True)] and receiver.stalls == 0
            client.shutdown(socket.SHUT_WR)
            await receiver.until(lambda: receiver.closes)
            assert receiver.reads[-1] == (b"", True) and len(poller) == 0 and receiver.closes == 1
            nursery.cancel_scope.cancel()
    await transport.aclose()


@pytest.mark.parametrize("paused_by", ["its first read", "node work queued between reads"])
async def test_bytes_that_arrive_during_a_pause_wait_unread_until_the_transport_resumes(paused_by):
    poller = Poller()
    server, client = tcp_pair()
    transport = polled(server, poller)
    receiver = Receiver(poller, pause_after=1)
    earlier: list[tuple[bytes, bool]] = []
    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            transport.start(receiver)
            if paused_by == "its first read":
                client.send(b"first")
                await receiver.until(lambda: receiver.reads)
                earlier = [(b"first", True)]
            else:
                receiver.pause_after, receiver.held = 0, True
            client.send(b"during")
            await receiver.until(lambda: receiver.stalls)  # the poller reported it while paused: told once
            assert receiver.reads == earlier and receiver.stalls == 1
            receiver.pause_after, receiver.held = 0, False
            transport.resume()  # the pause ended: the socket is re-armed
            await receiver.until(lambda: len(receiver.reads) == len(earlier) + 1)
            assert receiver.reads == [*earlier, (b"during", True)]
            nursery.cancel_scope.cancel()
    await transport.aclose()


async def test_what_a_polled_read_raises_ends_that_socket_only_and_the_poller_goes_on():
    poller = Poller()
    server, client = tcp_pair()
    other_server, other_client = tcp_pair()
    transport, other = polled(server, poller), polled(other_server, poller)
    receiver, other_receiver = Receiver(poller, fail_on=b"boom"), Receiver(poller)
    with client, other_client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            transport.start(receiver)
            other.start(other_receiver)
            client.send(b"boom")
            await receiver.until(lambda: receiver.failures)
            assert isinstance(receiver.failures[0], RuntimeError) and len(poller) == 1
            other_client.send(b"still read")
            await other_receiver.until(lambda: other_receiver.reads)
            nursery.cancel_scope.cancel()
    await transport.aclose()
    await other.aclose()


async def test_a_polled_socket_waiting_for_bytes_is_closed_when_the_poller_stops():
    """An idle connection has no task that a node's cancellation would end: the poller's end tells it."""
    poller = Poller()
    server, client = tcp_pair()
    transport = polled(server, poller)
    receiver = Receiver(poller)
    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            transport.start(receiver)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert receiver.closes == 1 and len(poller) == 0
    await transport.aclose()


async def test_a_polled_socket_writes_in_place_until_its_buffer_is_full_then_would_block():
    server, client = tcp_pair()
    transport = PolledSocket(trio.SocketStream(trio.socket.from_stdlib_socket(server)), Poller())
    with client:
        chunk = b"x" * RECEIVE_BYTES
        written = 0
        with pytest.raises(trio.WouldBlock):
            for _ in range(10_000):  # far more than any socket buffer holds
                written += transport.send_nowait(chunk)
        assert written > 0
        assert transport.bytes_waiting() is False
        client.send(b"unread")
        with trio.fail_after(5):
            while not transport.bytes_waiting():
                await trio.sleep(0.001)
    await transport.aclose()


async def test_a_stream_is_read_once_per_call_never_written_in_place_and_a_reset_is_a_lost_connection():
    server, client = tcp_pair()
    transport = StreamTransport(trio.SocketStream(trio.socket.from_stdlib_socket(server)), None)
    receiver = Receiver()
    with client:
        client.send(b"one read")
        with trio.fail_after(5):
            assert await transport.read(receiver) is True
        assert receiver.reads == [(b"one read", False)]
        with pytest.raises(trio.WouldBlock):
            transport.send_nowait(b"x")
        assert transport.bytes_waiting() is False  # not knowable under TLS or WebSocket framing
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with trio.fail_after(5):  # closed with SO_LINGER 0: a reset
        assert await transport.read(receiver) is False
    assert len(receiver.failures) == 1 and isinstance(receiver.failures[0], OSError | trio.BrokenResourceError)
    await transport.aclose()
