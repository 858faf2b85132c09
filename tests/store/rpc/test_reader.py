"""Log readers (store/rpc/reader.py) on a follower's RPC listener (store/rpc/front.py, refusing phase): admitted
with the store token, served ``ReadLog`` from the follower's own log exactly as the leader serves it, refused
everything else; gateways are still sent to the leader. Real stores, real sockets, the Spark live tail's reader."""

from __future__ import annotations

import threading
from functools import partial

import trio

from spark_analytics.framing import DecodeOptions
from spark_analytics.live import LiveRange, LogReader, read_live
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


async def half_confirmed(store, count: int) -> tuple:
    """``count`` messages appended, the log held as a follower's whose leader confirmed the first half only: the
    log, its published offset and its written end."""
    offsets = await store.append([NewMessage("tele/a", f"m{i}".encode(), "dev1", 1) for i in range(count)],
                                 durable=True)
    log = store.log.log
    log.hold_confirm(offsets[count // 2])
    return log, log.published_offset, log.written_offset


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


async def test_a_live_range_past_a_lagging_follower_waits_for_it_and_reads_every_record(store, nursery):
    """The driver planned the range on a replica that had published more than the follower the executor reads:
    the follower's answers stop at its published offset, the reader asks again (no record is skipped, the range
    does not end early), and once the follower confirms the rest it reads every record of the range once."""
    log, held, end = await half_confirmed(store, 100)
    waiting = threading.Event()

    def read_span(offset: int, max_bytes: int):
        if offset >= held:  # the reader asks at the follower's published end: it waits there
            waiting.set()
        return log_span(log, offset, max_bytes)

    front = RpcFront(StoreAccess(token=TOKEN))
    await nursery.start(front.refusing, lambda: "", read_span)
    (listener,) = await nursery.start(front.serve, "127.0.0.1", 0)
    rng = LiveRange("127.0.0.1:{}".format(listener.socket.getsockname()[1]), TOKEN, 0, end)

    async with trio.open_nursery() as reading:
        got: list[bytes] = []

        async def read() -> None:
            frames = await trio.to_thread.run_sync(lambda: list(read_live(rng, DecodeOptions())))
            got.extend(payload for batch in frames for payload in batch.payload().to_pylist())

        reading.start_soon(read)
        assert await trio.to_thread.run_sync(waiting.wait, 20)
        log.confirm(end)
    assert got == [f"m{i}".encode() for i in range(100)]


async def test_an_empty_span_never_reports_a_bound_past_its_start(store):
    """A confirm that lands between the read of a follower's bytes and the read of its published offset must not
    make the answer say "published up to the end, nothing here": the Spark reader would take that for the end of
    the range and skip the records it did not get (the bound is taken before the read)."""
    log, held, end = await half_confirmed(store, 10)

    class ConfirmDuringRead:
        """The follower's log, with its leader's confirm arriving just after the bytes were read."""

        def __getattr__(self, name: str):
            return getattr(log, name)

        def read_span(self, offset: int, max_bytes: int):
            answer = log.read_span(offset, max_bytes)
            log.confirm(end)
            return answer

    span = log_span(ConfirmDuringRead(), held, 4096)
    assert span.data or span.flushed <= span.start
