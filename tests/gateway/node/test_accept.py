"""Accept loops at the file-descriptor limit: one line per episode, back-off, and accepting again afterwards.

The limit is real: the test lowers this process's RLIMIT_NOFILE so that the
client's socket takes the last descriptor and the node's ``accept`` fails
with EMFILE, as a node full of connections does.
"""

import gc
import logging
import os
import resource
import socket

import trio

from gateway.node.accept import CapacityLog, serve_accepting

WAIT_S = 30.0


def _lowest_free_descriptor() -> int:
    """The next descriptor a socket would get: a limit at it leaves none (limits bound numbers, not counts)."""
    free = os.dup(0)
    os.close(free)
    return free


async def test_refused_accepts_are_logged_once_per_episode_without_a_traceback(caplog):
    """trio.serve_listeners logged a traceback every 0.1 s while the node was at its descriptor limit
    (issue 21); now the episode is one warning, the loop backs off, and the end says how many were refused."""
    caplog.set_level(logging.INFO)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    served = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        served.set()

    log = CapacityLog("test")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_accepting, listeners, handler, log)
        client = socket.socket()
        gc.collect()  # an earlier test's sockets in cycles: closed now, not by a collection while the limit holds,
        gc.disable()  # which would free a descriptor below it and let the accept succeed (seen in `make test`)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_descriptor(), hard))  # the client took the last
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))  # the kernel completes it; the node's accept finds no descriptor
            with trio.fail_after(WAIT_S):
                while log.refused < 4:  # 0.1 + 0.2 + 0.4 s of back-off
                    await trio.sleep(0.05)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            gc.enable()
        with trio.fail_after(WAIT_S):
            await served.wait()  # descriptors are back: the waiting connection is accepted
        client.close()
        nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records if r.name == "gateway.node.accept"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("accept failed: EMFILE")
    assert messages[1].startswith("accepting again after") and int(messages[1].split()[3]) >= 4
    assert not any(r.exc_info for r in caplog.records)
    assert log.episodes == 1 and log.refused == 0
