"""The CONNECT deadline and the keep alive close silent connections, not ones whose bytes wait unread behind a busy
event loop."""

from types import SimpleNamespace

import trio

from gateway.mqtt.state import State
from gateway.mqtt.actions import SessionOpened
from gateway.mqtt.channel import KEEPALIVE_TIMER, ChannelConfig
from gateway.mqtt.packets import Connect
from gateway.node.connection import Connection, Traffic
from gateway.node.poller import Poller
from gateway.node.timers import Timers
from gateway.node.transports import PolledSocket


def connection(sock: trio.socket.SocketType) -> Connection:
    backend = SimpleNamespace(channel_config=ChannelConfig(), connect_timeout_s=10.0, traffic=Traffic(), timers=Timers())
    return Connection(PolledSocket(trio.SocketStream(sock), Poller()), backend, "127.0.0.1:1")  # type: ignore[arg-type]


async def test_bytes_waiting_in_the_kernel_extend_the_deadline_and_silence_closes():
    waiting_server, waiting_client = trio.socket.socketpair()
    silent_server, silent_client = trio.socket.socketpair()
    with waiting_server, waiting_client, silent_server, silent_client:
        waiting, silent = connection(waiting_server), connection(silent_server)
        await waiting_client.send(b"\x10\x10")  # the start of a CONNECT, never read by the (not running) reader
        waiting._connect_deadline()
        silent._connect_deadline()
        assert not waiting._closing and waiting._due is not None  # re-armed: the client did its part
        assert silent._closing  # nothing arrived in time: closed


async def test_keepalive_expiry_asks_the_kernel_for_unread_bytes():
    waiting_server, waiting_client = trio.socket.socketpair()
    silent_server, silent_client = trio.socket.socketpair()
    with waiting_server, waiting_client, silent_server, silent_client:
        waiting, silent = connection(waiting_server), connection(silent_server)
        for conn in (waiting, silent):
            conn.channel.handle_in(Connect(client_id="dev", clean_start=True, keep_alive=1))
            conn.channel.handle_event(SessionOpened(False, None))  # the channel arms its keep-alive timer
            conn.channel.conn.last_rx -= 2  # 2 s of silence as the node saw it: past 1.5 x keep alive
        await waiting_client.send(b"\xc0\x00")  # a PINGREQ the busy node has not read
        waiting._fire(KEEPALIVE_TIMER)
        silent._fire(KEEPALIVE_TIMER)
        assert waiting.channel.state is State.CONNECTED and not waiting._closing
        assert silent.channel.state is not State.CONNECTED and silent._closing
