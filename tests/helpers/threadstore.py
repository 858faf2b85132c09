"""A store node serving its RPC on a trio thread of this process: for the back-end clients' blocking and asyncio
faces, which run trio clients on threads of their own."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from store.log.commitlog import CommitLogConfig
from store.node import open_store
from store.rpc.server import serve_rpc

WAIT_S = 30.0
"""Generous: two busy cores."""


@contextmanager
def store_node(tmp_path: Path) -> Iterator[int]:
    """A store node serving its RPC on a free port, on a trio thread; its port. Stops when the block ends."""
    started: list[int] = []
    ready = threading.Event()
    token: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.Event] = []

    async def main() -> None:
        token.append(trio.lowlevel.current_trio_token())
        stop.append(trio.Event())
        async with open_store(tmp_path / "data", CommitLogConfig()) as store, trio.open_nursery() as nursery:
            listeners = await nursery.start(lambda task_status: serve_rpc(store, "127.0.0.1", 0,
                                                                          task_status=task_status))
            started.append(listeners[0].socket.getsockname()[1])
            ready.set()
            await stop[0].wait()
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(WAIT_S)
    try:
        yield started[0]
    finally:
        trio.from_thread.run_sync(stop[0].set, trio_token=token[0])
        thread.join(WAIT_S)
        thread.join(WAIT_S)
