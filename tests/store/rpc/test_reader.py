"""Log readers (store/rpc/reader.py) on a follower's RPC listener (store/rpc/front.py, refusing phase): admitted
with the store token, served ``ReadLog`` from the follower's own log exactly as the leader serves it, refused
everything else; gateways are still sent to the leader. Real stores, real sockets, the Spark live tail's reader."""

from __future__ import annotations

from functools import partial

import trio

from spark_analytics.live import LogReader
from store.api import MAIN_LOG, NewMessage, Position, PullRequest
from store.node import log_span
from store.rpc import wire as rpc
from store.rpc.access import StoreAccess
from store.rpc.front import RpcFront
from store.rpc.server import serve_rpc

TOKEN = "s3cret"


async def follower_and_leader(store, nursery) -> tuple[str, str]:
    """The same store's log behind a follower's refusing listener and a leader's server: their addresses."""
    access = StoreAccess(token=TOKEN)
    (served,) = await nursery.start(partial(serve_rpc, store, "127.0.0.1", 0, access=access))
    leader = "127.0.0.1:{}".format(served.socket.getsockname()[1])
    front = RpcFront(access)
    await nursery.start(front.refusing, lambda: leader, partial(log_span, store.log.log))
    (listener,) = await nursery.start(front.serve, "127.0.0.1", 0)
    return "127.0.0.1:{}".format(listener.socket.getsockname()[1]), leader


async def ask(address: str, *messages: object) -> list[object]:
    """Send ``messages`` on a new connection; every frame the store answers until it closes the connection."""
    host, port = address.rsplit(":", 1)
    answers: list[object] = []
    with trio.fail_after(20):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            for message in messages:
                await stream.send_all(rpc.encode(message))
            decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
            while (data := await stream.receive_some(1 << 16)):
                decoder.receive_data(data)
                while (answer := decoder.next_message()) is not rpc.NEED_DATA:
                    answers.append(answer)
    return answers


async def test_a_follower_serves_a_log_reader_the_bytes_the_leader_serves(store, nursery):
    await store.append([NewMessage("tele/a", f"m{i}".encode() * 50, "dev1", 1) for i in range(200)], durable=True)
    follower, leader = await follower_and_leader(store, nursery)

    def read_all(address: str) -> tuple[bool, list[bytes]]:
        with LogReader(address, TOKEN) as reader:
            spans, offset = [], 0
            while (span := reader.read(offset, 4096)).data:
                spans.append(span.data)
                offset = span.start + len(span.data)
            return reader.leads, spans

    leads, from_follower = await trio.to_thread.run_sync(read_all, follower)
    assert not leads and len(from_follower) > 3
    assert await trio.to_thread.run_sync(read_all, leader) == (False, from_follower)


async def test_a_follower_refuses_readers_without_the_token_and_anything_but_read_log(store, nursery):
    """Bad input gets a clear answer: no token, or a ``$`` name of no kind, is ``DENIED``; a reader that sends what
    is not a log read is ``DENIED`` and closed; a gateway is still sent to the leader (``NOT_LEADER``)."""
    follower, leader = await follower_and_leader(store, nursery)
    hello = partial(rpc.Hello, rpc.PROTOCOL_VERSION)
    (refused,) = await ask(follower, hello("$reader/spark-1"))
    assert (refused.kind, refused.message) == (rpc.ErrorKind.DENIED, "not authorized")
    (refused,) = await ask(follower, hello("$reader/", TOKEN))
    assert refused.kind is rpc.ErrorKind.DENIED
    welcome, read, closed = await ask(follower, hello("$reader/spark-1", TOKEN),
                                      rpc.ReadLog(1, Position(MAIN_LOG, 0), 0),
                                      rpc.Pull(2, [PullRequest("tele/a", 0)]))
    assert type(welcome) is rpc.Welcome and welcome.epoch == 0  # a follower: it leads no epoch
    assert type(read) is rpc.LogBytes and read.span.flushed == store.log.log.published_offset
    assert (closed.id, closed.kind) == (0, rpc.ErrorKind.DENIED) and "Pull" in closed.message
    (redirected,) = await ask(follower, hello("gw-a", TOKEN))
    assert (redirected.kind, redirected.message) == (rpc.ErrorKind.NOT_LEADER, leader)
