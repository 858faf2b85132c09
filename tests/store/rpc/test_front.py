"""The store's RPC listener across a replica's roles (store/rpc/front.py), with the client that follows the leader
(store/rpc/connection.py): real stores, real sockets, one process."""

import logging
from functools import partial

import pytest
import trio

from store.api import NewMessage, PullRequest, StoreUnavailable
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from store.rpc.client import RemoteStore
from store.rpc.front import RpcFront
from store.rpc.server import RpcServer, serve_rpc

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


async def in_scope(run, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """``run`` (a phase) started, in a cancel scope handed to ``task_status``: the role loop's way to end it."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            task_status.started(scope)


async def test_a_leading_phase_that_ends_closes_its_connections_and_the_refusal_sends_the_client_to_the_leader(
        tmp_path, nursery, caplog):
    """Replica 1 leads (its listener serves its store), then stops leading: the connection of its leading phase is
    closed, and the client's next Hello there is refused with NOT_LEADER naming replica 2, where the client goes
    (one "store leader is now" line) and appends; replica 1 logs one refusal line for the phase."""
    caplog.set_level(logging.INFO)
    front = RpcFront()
    (listener,) = await nursery.start(partial(front.serve, "127.0.0.1", 0))
    port = listener.socket.getsockname()[1]
    async with open_store(tmp_path / "one", CommitLogConfig()) as one, \
            open_store(tmp_path / "two", CommitLogConfig()) as two, trio.open_nursery() as phases:
        (other,) = await phases.start(partial(serve_rpc, two, "127.0.0.1", 0))
        leader = "127.0.0.1:{}".format(other.socket.getsockname()[1])
        leading = await phases.start(in_scope, partial(front.serving, RpcServer(one)))
        async with RemoteStore.connect("127.0.0.1", port, node="gw-a", timeout_s=WAIT_S) as remote:
            await remote.append([NewMessage("tele/a", b"on one", "dev1", 1)])
            connects = remote.client_statistics().connects
            leading.cancel()
            await phases.start(in_scope, partial(front.refusing, lambda: leader))
            with trio.fail_after(WAIT_S):
                await remote.wait_reconnected(connects)
            assert remote.address == leader
            await remote.append([NewMessage("tele/a", b"on two", "dev1", 1)])
            (result,) = await remote.pull([PullRequest("tele/a", 0)])
            assert [record.payload for _, record in result.messages] == [b"on two"]
        phases.cancel_scope.cancel()
    messages = [record.getMessage() for record in caplog.records]
    assert messages.count(f"store leader is now {leader}") == 1
    assert messages.count("RPC connections refused: this replica does not lead") == 1


async def test_a_replica_that_knows_no_leader_is_not_fatal_to_a_first_connection(nursery):
    """A refusal naming no leader (an election in progress) is retried with backoff: a first connection that meets
    only such refusals ends as one that found no store (``StoreUnavailable`` after ``timeout_s``), not as a store
    that refused this node (``StoreRpcError``)."""
    front = RpcFront()
    await nursery.start(front.refusing, lambda: "")
    (listener,) = await nursery.start(partial(front.serve, "127.0.0.1", 0))
    with pytest.raises(StoreUnavailable, match="within 0.5 s"):
        async with RemoteStore.connect("127.0.0.1", listener.socket.getsockname()[1], node="gw-a", timeout_s=0.5):
            pass
