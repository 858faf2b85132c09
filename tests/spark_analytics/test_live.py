"""The live tail's blocking RPC reader (spark_analytics/live.py) against a real store node's RPC server."""

import socket

import pytest
import trio

from spark_analytics.live import LogReader
from store.rpc.front import RpcFront
from store.rpc.server import serve_rpc


async def test_a_read_beyond_the_flushed_end_raises_value_error_and_the_reader_goes_on(store, nursery):
    """The store answers a bad offset with its ``invalid_offset`` error kind: the reader raises ``ValueError`` (its
    callers' contract), not a ``ConnectionError`` that would fail the Spark task as if the store were gone."""
    listeners = await nursery.start(serve_rpc, store, "127.0.0.1", 0)
    address = "127.0.0.1:{}".format(listeners[0].socket.getsockname()[1])

    def read() -> None:
        with LogReader(address) as reader:
            bounds = reader.read(0, 0)
            with pytest.raises(ValueError, match="beyond the flushed end"):
                reader.read(bounds.flushed + 4096, 1024)
            assert reader.read(0, 0).flushed == bounds.flushed

    await trio.to_thread.run_sync(read)


async def test_a_reader_given_the_replicas_of_a_replicated_store_reads_from_the_leader(store, nursery):
    """``store=`` lists the replicas: an unreachable one first, then one that does not lead (NOT_LEADER, naming the
    leader); the reader ends up on the leader and reads."""
    listeners = await nursery.start(serve_rpc, store, "127.0.0.1", 0)
    leader = "127.0.0.1:{}".format(listeners[0].socket.getsockname()[1])
    front = RpcFront()
    await nursery.start(front.refusing, lambda: leader)
    (refusing,) = await nursery.start(front.serve, "127.0.0.1", 0)
    with socket.socket() as unused:  # bound, never listening: connections to it are refused
        unused.bind(("127.0.0.1", 0))
        addresses = "127.0.0.1:{},127.0.0.1:{}".format(unused.getsockname()[1], refusing.socket.getsockname()[1])

        def read() -> str:
            with LogReader(addresses) as reader:
                reader.read(0, 0)
                return reader.address

        assert await trio.to_thread.run_sync(read) == leader
