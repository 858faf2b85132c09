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
    """Records what a transport hands it; pauses after ``pause_after`` reads, fails on ``fail_on``."""

    def __init__(self, poller: Poller | None = None, pause_after: int = 0, fail_on: bytes = b"") -> None:
        self.closing = False
        self.reads: list[tuple[bytes, bool]] = []  # (data, read in a poller round)
        self.failures: list[Exception] = []
        self._poller = poller
        self.pause_after = pause_after
        self._fail_on = fail_on
        self._arrived = trio.Event()
        self.held = False  # paused whatever was read (the node's work queued for the connection)

    async def wait_reads(self, count: int) -> None:
        """Return once ``count`` reads were handed over."""
        while len(self.reads) < count:
            await self._arrived.wait()

    def paused(self) -> bool:
        return self.held or bool(self.pause_after) and len(self.reads) >= self.pause_after

    def received(self, data: bytes) -> bool:
        if self._fail_on and data == self._fail_on:
            raise RuntimeError("a bug in the connection")
        self.reads.append((data, self._poller is not None and self._poller.round is not None))
        self._arrived.set()
        self._arrived = trio.Event()
        return bool(data)

    def receive_failed(self, exc: Exception) -> None:
        self.failures.append(exc)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair: the server's end non-blocking, as trio's sockets are."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def polled(server: socket.socket, poller: Poller) -> PolledSocket:
    return PolledSocket(trio.SocketStream(trio.socket.from_stdlib_socket(server)), poller)


async def read_until_paused(transport: PolledSocket, receiver: Receiver, client: socket.socket, data: bytes) -> None:
    """Send ``data`` and have the transport read it into ``receiver``, which pauses after it."""
    client.send(data)
    with trio.fail_after(5):
        assert await transport.read(receiver) is True  # paused: call again once it resumes


async def test_a_polled_socket_is_read_in_the_pollers_rounds_until_its_receiver_pauses_then_until_the_end():
    """Once a pause ends (the CONNECT answered), the socket's next bytes are read in the poller's step, in their
    arrival order, not when the connection's task next runs: a SUBSCRIBE sent on reading the CONNACK comes before
    another client's PUBLISH sent after it (issue 31, item 6)."""
    poller = Poller()
    server, client = tcp_pair()
    transport = polled(server, poller)
    receiver = Receiver(poller, pause_after=1)
    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            await read_until_paused(transport, receiver, client, b"connect")
            assert receiver.reads == [(b"connect", True)] and len(poller) == 1  # in the set while paused
            receiver.pause_after = 0  # the pause ends; no task reads
            client.send(b"subscribe")
            with trio.fail_after(5):
                await receiver.wait_reads(2)
            assert receiver.reads == [(b"connect", True), (b"subscribe", True)]
            client.shutdown(socket.SHUT_WR)
            with trio.fail_after(5):
                assert await transport.read(receiver) is False  # the end
            assert receiver.reads[-1] == (b"", True) and len(poller) == 0
            nursery.cancel_scope.cancel()
    await transport.aclose()


async def test_bytes_that_arrive_during_a_pause_wait_unread_until_the_task_reads_again():
    poller = Poller()
    server, client = tcp_pair()
    witness_server, witness_client = tcp_pair()
    transport = polled(server, poller)
    witness_transport = polled(witness_server, poller)
    receiver = Receiver(poller, pause_after=1)
    witness = Receiver(poller, pause_after=1)
    with client, witness_client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            await read_until_paused(transport, receiver, client, b"first")
            client.send(b"during")
            witness_client.send(b"after")  # read once the poller has seen "during"
            with trio.fail_after(5):
                assert await witness_transport.read(witness) is True
            assert receiver.reads == [(b"first", True)]  # the paused receiver is not handed it
            receiver.pause_after = 0
            nursery.start_soon(transport.read, receiver)  # the task reads again: the socket is re-armed
            with trio.fail_after(5):
                await receiver.wait_reads(2)
            assert receiver.reads == [(b"first", True), (b"during", True)]
            nursery.cancel_scope.cancel()
    await transport.aclose()
    await witness_transport.aclose()


async def test_a_pause_that_begins_between_reads_wakes_the_waiting_task_and_its_bytes_wait_for_the_next_read():
    poller = Poller()
    server, client = tcp_pair()
    transport = polled(server, poller)
    receiver = Receiver(poller)
    answers = []

    async def read() -> None:
        answers.append(await transport.read(receiver))

    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            with trio.fail_after(5):
                async with trio.open_nursery() as reading:
                    reading.start_soon(read)
                    await trio.testing.wait_all_tasks_blocked()  # the task waits in read()
                    receiver.held = True
                    client.send(b"held")
            assert answers == [True] and receiver.reads == []  # woken to wait for the pause's end; nothing read
            receiver.held = False
            nursery.start_soon(read)
            with trio.fail_after(5):
                await receiver.wait_reads(1)
            assert receiver.reads == [(b"held", True)]
            nursery.cancel_scope.cancel()
    await transport.aclose()


async def test_what_a_polled_read_raises_is_raised_in_the_reading_task_and_the_poller_goes_on():
    poller = Poller()
    server, client = tcp_pair()
    transport = PolledSocket(trio.SocketStream(trio.socket.from_stdlib_socket(server)), poller)
    with client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            client.send(b"boom")
            with pytest.raises(RuntimeError, match="a bug in the connection"), trio.fail_after(5):
                await transport.read(Receiver(poller, fail_on=b"boom"))
            assert len(poller) == 0
            nursery.cancel_scope.cancel()
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
