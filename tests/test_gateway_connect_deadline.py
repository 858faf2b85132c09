"""The CONNECT deadline closes silent connections, not ones whose CONNECT waits unread behind a busy event loop."""

from types import SimpleNamespace

import trio

from gateway.channel import ChannelConfig
from gateway.server import Connection, Traffic
from gateway.timers import Timers


def connection(sock: trio.socket.SocketType) -> Connection:
    backend = SimpleNamespace(channel_config=ChannelConfig(), connect_timeout_s=10.0, traffic=Traffic(), timers=Timers())
    return Connection(trio.SocketStream(sock), backend, "127.0.0.1:1", "127.0.0.1")  # type: ignore[arg-type]


async def test_bytes_waiting_in_the_kernel_extend_the_deadline_and_silence_closes():
    waiting_server, waiting_client = trio.socket.socketpair()
    silent_server, silent_client = trio.socket.socketpair()
    with waiting_server, waiting_client, silent_server, silent_client:
        waiting, silent = connection(waiting_server), connection(silent_server)
        await waiting_client.send(b"\x10\x10")  # the start of a CONNECT, never read by the (not running) reader
        waiting._connect_deadline()
        silent._connect_deadline()
        assert not waiting._closing and waiting._deadline is not None  # re-armed: the client did its part
        assert silent._closing  # nothing arrived in time: closed
