"""The store connection (store/rpc/connection.py): reconnecting to the address its resolver gives, against a real
store restarted on another port (its CommitLog and RocksDB reopened from the same data directory)."""

from functools import partial

import trio

from store.api import NewMessage, PullRequest, StoreUnavailable
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from store.rpc.client import RemoteStore
from store.rpc.server import serve_rpc
from tests.helpers.ports import free_port

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


async def serve(data, port: int, stopped: trio.Event, closed: trio.Event,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A store node over ``data`` served on ``port`` until ``stopped``; then closed (flushed, as at a clean stop),
    and ``closed`` set."""
    async with open_store(data, CommitLogConfig()) as node, trio.open_nursery() as nursery:
        await nursery.start(partial(serve_rpc, node, "127.0.0.1", port))
        task_status.started()
        await stopped.wait()
        nursery.cancel_scope.cancel()
    closed.set()


async def test_a_client_reconnects_to_the_address_its_resolver_gives_after_the_store_moved(tmp_path, nursery):
    """The store stops at one port and comes back on another: the client's calls fail meanwhile
    (``StoreUnavailable``), then its next connection goes where the resolver now points, its watch is registered
    there again, and what it appended before the move is read back from the restarted store."""
    first, second = free_port(), free_port()
    where = {"port": first}
    first_stopped, first_closed, second_stopped = trio.Event(), trio.Event(), trio.Event()
    await nursery.start(serve, tmp_path / "data", first, first_stopped, first_closed)
    async with RemoteStore.connect(resolver=lambda: ("127.0.0.1", where["port"]), node="gw-a",
                                   timeout_s=WAIT_S) as remote:
        assert remote.address == f"127.0.0.1:{first}"
        remote.watch("tele/a")
        (before,) = await remote.append([NewMessage("tele/a", b"before", "dev1", 1)])
        connects = remote.client_statistics().connects
        first_stopped.set()
        with trio.fail_after(WAIT_S):
            while remote.connected:
                await trio.lowlevel.checkpoint()
        try:
            await remote.max_offsets(["tele/a"])
        except StoreUnavailable:
            pass
        else:
            raise AssertionError("a call with no connection to the store must raise StoreUnavailable")
        where["port"] = second
        with trio.fail_after(WAIT_S):
            await first_closed.wait()
        await nursery.start(serve, tmp_path / "data", second, second_stopped, trio.Event())
        with trio.fail_after(WAIT_S):
            await remote.wait_reconnected(connects)
        assert remote.address == f"127.0.0.1:{second}"
        with trio.fail_after(WAIT_S):
            events = await remote.events()  # the resync after reconnecting: the watched queue at its head
        assert events == {"tele/a": 1}
        (after,) = await remote.append([NewMessage("tele/a", b"after", "dev1", 1)])
        assert after > before
        (result,) = await remote.pull([PullRequest("tele/a", 0)])
        assert [record.payload for _, record in result.messages] == [b"before", b"after"]
        with trio.fail_after(WAIT_S):  # and the restarted store routes the new message's event to the watch
            while (await remote.events()).get("tele/a", 0) < 2:
                pass
    second_stopped.set()
