"""One store replica's life: follow while another replica leads, lead once elected, follow again when it must stop.

The loop RocketMQ's controller mode gives a broker (``AutoSwitchHAService``): a replica starts as a follower over
its own data (the log, and the index its dispatcher keeps warm), finds the leader through the controller
(store/controller/), and copies the leader's log (store/replica/follower.py). When the controller names no leader,
it stands for election with its position (the epoch of its last record, its log's end). The winner appends the new
epoch's entry at its log's end, records the in-sync set of its epoch (itself and the live members of the last one)
and opens the store node in leader mode: gateways and back-end clients are served, and every acknowledgement waits
for what ``replication.acks`` promises (store/replica/leader.py). A leader that is fenced (its lease ran out, or the
controller refused it), whose etcd lease ended, or that sees another leader or a later epoch, closes the node
(its clients' connections close; they are redirected) and follows again; the follower's first fetch truncates what
the new leader does not have (the epoch file says where).

The RPC listener outlives the roles (store/rpc/front.py): while following it answers every Hello ``NOT_LEADER``
with the leader's address, except a log reader's, served from the follower's own log (store/rpc/reader.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from store.controller.etcd import EtcdError
from store.controller.group import GroupConfig, GroupController, GroupState, LeaseLost
from store.dispatch import Dispatcher
from store.log.aio import AsyncCommitLog
from store.log.commitlog import CommitLogConfig
from store.node import StoreNode, log_span, open_follower, open_store
from store.replica.figures import RoleFigures
from store.replica.follower import LeaderChanged, ReplicaExpired, follow
from store.replica.leader import Replication
from store.rpc.front import RpcFront
from store.rpc.server import RpcServer

__all__ = ["ReplicaConfig", "run_replica"]

LOGGER = logging.getLogger(__name__)

ETCD_RETRY_S = (0.1, 0.25, 0.5, 1.0)
"""Waits before registering again while etcd does not answer, the last repeated."""

REDIRECT_RETRY_S = 0.1
"""A leader the controller names that does not serve this replica yet (still opening its store) or any more (the
controller will name the next one) is asked again after this."""

EXPIRED_RETRY_S = 60.0
"""A follower whose log fell below its leader's retention asks again this often (and logs why each time): it stays
out of the in-sync set until an operator empties its directory (docs/cluster.md, "Membership")."""

COPY_RETRY_S = 1.0
"""A follower whose own log cannot be written (its disk is full) tries again this often: it copies on as soon as
space is freed, and meanwhile the leader counts it out of the in-sync set once it lags ``max_lag_s``."""


@dataclass(frozen=True)
class ReplicaConfig:
    """What a replica needs besides its RPC front: its data, its group, and how it acknowledges."""

    data: Path
    log_config: CommitLogConfig
    group: GroupConfig
    acks: str = "quorum"
    max_lag_s: float = 3.0
    token: str = ""
    store_options: Mapping[str, Any] = field(default_factory=dict)  # open_store's keyword arguments


ServerOf = Callable[[StoreNode], RpcServer]
"""The RPC server the front serves while this replica leads (its access rules come from the composition root)."""


async def run_replica(config: ReplicaConfig, front: RpcFront, server_of: ServerOf,
                      *, figures: RoleFigures | None = None,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Be a replica of ``config.group`` until cancelled: follow, stand for election, lead, and again. An etcd lease
    that ends (a stall, a partition) costs this replica its membership: it registers again with a new one.
    ``figures``: kept up to date for the replica's ``/metrics`` (store/replica/figures.py)."""
    figures = figures if figures is not None else RoleFigures(config.group.group, config.group.name)
    started = False
    unreachable = 0  # attempts in a row that found no etcd
    while True:
        try:
            async with GroupController.open(config.group) as controller:
                unreachable = 0
                if not started:
                    started = True
                    task_status.started()
                while True:
                    state, confirmed = await _follow_until_elected(config, controller, front, figures)
                    await _lead(config, controller, front, server_of, state, confirmed, figures)
        except* LeaseLost:  # out of the nurseries of a phase, wrapped in their groups
            LOGGER.warning("store replica's etcd lease ended: registering again", extra={"ctx": {
                "group": config.group.group, "name": config.group.name}})
        except* EtcdError as group:  # etcd down or unreachable: no role can be held; try again
            if unreachable % 10 == 0:
                LOGGER.warning("etcd not reachable: this replica neither leads nor follows until it is", extra={
                    "ctx": {"group": config.group.group, "name": config.group.name, "attempts": unreachable + 1,
                            "error": str(group.exceptions[0])}})
            unreachable += 1
            await trio.sleep(ETCD_RETRY_S[min(unreachable, len(ETCD_RETRY_S)) - 1])


async def _follow_until_elected(config: ReplicaConfig, controller: GroupController, front: RpcFront,
                                figures: RoleFigures) -> tuple[GroupState, int]:
    """Follow whichever replica leads; return the state in which this replica won an election (the new epoch's
    entry appended to its log: from its end on, the log is the new epoch's) and its confirm offset then."""
    name = config.group.name
    async with open_follower(config.data, config.log_config) as (alog, dispatcher), trio.open_nursery() as nursery:
        figures.log, figures.replication = alog.log, None
        leader_address = ""
        refusing = trio.CancelScope()

        async def refuse(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with refusing:
                await front.refusing(lambda: leader_address, partial(log_span, alog.log), task_status=task_status)

        await nursery.start(refuse)
        state = await controller.state()
        while True:
            if state.leader is None:
                latest = alog.log.epochs.latest
                state = await controller.elect((latest[0] if latest else 0, alog.log.written_offset))
                if state.leader == name:
                    await trio.to_thread.run_sync(alog.log.epochs.append, state.epoch, alog.log.written_offset)
                    figures.elections += 1
                    figures.saw_leader(name, state.epoch)
                    figures.log = None
                    LOGGER.info("elected leader of the store group", extra={"ctx": {
                        "group": config.group.group, "epoch": state.epoch, "log_end": alog.log.written_offset,
                        "confirmed": alog.log.confirm_offset}})
                    refusing.cancel()
                    return state, alog.log.confirm_offset
                continue
            leader_address = state.leader_address or ""
            if state.leader == name:  # the key of an earlier process of this replica: it goes with that lease
                state = await _next_leader(controller, state)
                continue
            LOGGER.info("following the leader", extra={"ctx": {"leader": state.leader, "epoch": state.epoch,
                                                               "address": leader_address}})
            figures.saw_leader(state.leader, state.epoch)
            state = await _copy_until_change(config, controller, alog, dispatcher, state, figures)


async def _copy_until_change(config: ReplicaConfig, controller: GroupController, alog: AsyncCommitLog,
                             dispatcher: Dispatcher, state: GroupState, figures: RoleFigures) -> GroupState:
    """Copy the log of ``state``'s leader until the controller names another leader or epoch; the state then."""
    host, port = (state.leader_address or "").rsplit(":", 1)
    async with trio.open_nursery() as nursery:
        async def copy() -> None:
            while True:
                try:
                    await follow(alog, dispatcher, (host, int(port)), name=config.group.name, epoch=state.epoch,
                                 token=config.token, figures=figures)
                except LeaderChanged as exc:  # not serving yet, or replaced: the controller will say which
                    LOGGER.debug("the leader did not serve this replica", extra={"ctx": {"why": str(exc)}})
                    await trio.sleep(REDIRECT_RETRY_S)
                except ReplicaExpired as exc:  # its log ends below the leader's retention: only an empty one joins
                    LOGGER.error("replica cannot catch up: empty its data directory and start it again", extra={
                        "ctx": {"error": str(exc), "data": str(config.data), "retry_s": EXPIRED_RETRY_S}})
                    await trio.sleep(EXPIRED_RETRY_S)
                except OSError as exc:  # this replica's own write failed (a full disk): it lags, and may leave the ISR
                    LOGGER.warning("replica cannot write its copy of the log; retrying", extra={"ctx": {
                        "error": str(exc), "retry_s": COPY_RETRY_S}})
                    await trio.sleep(COPY_RETRY_S)

        nursery.start_soon(copy)
        changed = await _next_leader(controller, state)
        nursery.cancel_scope.cancel()
    return changed


async def _next_leader(controller: GroupController, state: GroupState) -> GroupState:
    """Wait until the leader or the epoch differs from ``state``'s."""
    while True:
        new = await controller.wait_state_change(state.revision)
        if (new.leader, new.epoch) != (state.leader, state.epoch):
            return new
        state = new


async def _lead(config: ReplicaConfig, controller: GroupController, front: RpcFront, server_of: ServerOf,
                state: GroupState, confirmed: int, figures: RoleFigures) -> None:
    """Serve as the leader of ``state.epoch`` until this replica must stop (see the module docstring); the node
    is closed on return and the caller follows again."""
    name = config.group.name
    # The live members of the last in-sync set hold every record below this replica's confirm offset (the last one
    # its leader told it), so they stay in it; the dead ones (no etcd lease: the old leader among them) leave.
    isr = [name, *(m for m in state.isr if m != name and m in state.members)]
    if not await controller.set_isr(state.epoch, isr):
        LOGGER.warning("fenced before leading: another replica leads", extra={"ctx": {"epoch": state.epoch}})
        return
    replication = Replication(name=name, epoch=state.epoch, replicas=state.replicas, isr=isr, acks=config.acks,
                              max_lag_s=config.max_lag_s, controller=controller, confirmed=confirmed,
                              figures=figures)
    async with open_store(config.data, config.log_config, replication=replication, **config.store_options) as node, \
            trio.open_nursery() as nursery:
        figures.replication = replication
        await nursery.start(front.serving, server_of(node))
        LOGGER.info("store group leader serving", extra={"ctx": {
            "group": config.group.group, "epoch": state.epoch, "log_end": node.log.log.written_offset,
            "isr": isr}})

        async def until_fenced() -> None:
            await replication.wait_fenced()
            nursery.cancel_scope.cancel()

        async def until_replaced() -> None:
            current = state
            while True:  # membership changes are applied as they come; another leader or epoch ends the phase
                current = await controller.wait_state_change(current.revision)
                if (current.leader, current.epoch) != (state.leader, state.epoch):
                    break
                if current.replicas != replication.replicas:
                    LOGGER.info("store group replicas changed", extra={"ctx": {"replicas": list(current.replicas)}})
                    replication.set_replicas(current.replicas)
            nursery.cancel_scope.cancel()

        nursery.start_soon(until_fenced)
        nursery.start_soon(until_replaced)
    figures.replication = None
    LOGGER.warning("no longer the store group's leader: following again", extra={"ctx": {
        "group": config.group.group, "epoch": state.epoch, "fenced": replication.fenced}})
