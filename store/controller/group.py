"""A store group's state in etcd and the rules that change it: membership, election, the ISR, the leader lease.

Keys, under ``/lightgate/groups/<group>/`` (docs/cluster.md, "The controller (etcd)"):

- ``replicas``: the configured member names, a JSON list (the group size and the quorum come from it);
- ``members/<name>``: a live replica, JSON ``{"address"}`` of its RPC listener (and ``"metrics"``, its
  ``/metrics`` endpoint's, when it serves one), attached to its etcd lease;
- ``leader``: JSON ``{"name", "epoch", "address"}``, attached to the leader's lease (it vanishes with it);
- ``epoch``: the last epoch ever elected, a decimal string;
- ``isr``: JSON ``{"epoch", "members"}``, the in-sync set and the epoch of the leader that wrote it;
- ``election/<epoch>/<name>``: a candidate's position JSON ``{"last_epoch", "end"}``, attached to its lease.

API (the role loop, ``store/replica/role.py``, is its one user in the store):

- ``async with GroupController.open(config) as group``: a lease, its keep-alive task, ``members/<name>`` (once
  an earlier incarnation's lease has ended: a ``leader`` key with this name is always this lease's;
  :class:`ReplicaNameTaken` when another live process holds the name), and ``replicas`` created from the config
  when absent; on exit the lease is revoked, so a leader's key goes at once. No etcd member answering raises
  :class:`~store.controller.etcd.EtcdUnavailable`.
- ``group.lost`` / ``await group.wait_lost()``: the lease ended (etcd answered TTL 0, or no keep-alive succeeded
  for ``lease_s``). The controller is then spent: every call raises :class:`LeaseLost`; the role loop stops
  leading, leaves the ``async with`` and opens a new controller (a new lease) to re-register.
- ``await group.state()`` -> :class:`GroupState`; ``await group.wait_state_change(revision)``: the next state
  after any change under the group's prefix past ``revision`` (a watch: the role loop never polls).
- ``await group.elect((last_epoch, end))``: the election rules below; returns the state with a leader.
- ``await group.set_isr(epoch, members)`` -> bool: fenced by the leader key (ours, that epoch, our lease).
- ``group.leader_lease_valid()``, ``group.leader_lease_deadline``: the leader lease (below), checked cheaply.
- ``await group.resign()``: delete the leader key if it is ours, for a clean handover.
- ``add_replica(name)``, ``remove_replica(name)``, ``status()``: membership and ``lightgate store status``;
  also on ``async with GroupAdmin.open(endpoints, group) as admin``, which reads the group and changes its
  membership without joining it (no lease, no member key): what the ``lightgate store`` commands use.

Election: when no ``leader`` key exists, a replica that may win (in the ISR; any configured replica when the
group has no ISR yet, the first election; any live replica under ``unclean_election``) writes its position
under ``election/<E+1>/``, waits ``election_window_s`` or until every live replica that may win has written,
and the best position (highest last epoch, then end offset, then name) runs the transaction: ``epoch`` still E
and no ``leader`` -> ``epoch`` = E+1 and ``leader`` = itself, with its lease. The transaction decides: never two
leaders of one epoch. A candidate that sees no leader appear within ``RETRY_LEASES`` leases (the best one died,
or hangs) runs the transaction itself next round: any ISR member holds every confirmed record, so any of them
is a safe leader; the best position only truncates least. Replicas that may not win wait for a leader.

Leader lease: a keep-alive renews the etcd lease from the time it is received, which is after it was sent, so
the etcd lease lasts at least until ``sent + lease_s``. The leader acknowledges only before ``sent +
leader_lease_s`` (``leader_lease_s < lease_s``) of the last keep-alive that succeeded: an old leader stops
acknowledging before its key can vanish, so before a new leader can be elected.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from store.controller.etcd import CALL_TIMEOUT_S, Compare, Delete, EtcdClient, EtcdError, Put
from store.tasks import background

ROOT = "/lightgate/groups/"
RETRY_LEASES = 3
"""How many etcd leases a candidate waits for the best candidate's transaction before running it itself: a
live best candidate runs it within one window; a dead one's position vanishes with its lease."""


class LeaseLost(Exception):
    """This replica's etcd lease ended: it is no longer a member (nor the leader) until it opens a new one."""


class ReplicaNameTaken(Exception):
    """Another live process holds this replica's name in the group."""


class MembershipRefused(Exception):
    """A membership change that would break the group (removing its leader, or below the quorum the ISR needs)."""


@dataclass(frozen=True, slots=True)
class GroupConfig:
    endpoints: tuple[str, ...]
    group: str
    name: str
    address: str
    replicas: tuple[str, ...]
    lease_s: float = 3.0
    leader_lease_s: float = 2.0
    unclean_election: bool = False
    election_window_s: float = 0.3
    metrics_address: str = ""  # host:port of the replica's /metrics ("": none), for ``lightgate store status``

    def __post_init__(self) -> None:
        if not 0 < self.leader_lease_s < self.lease_s:
            raise ValueError(f"replication.leader_lease_s ({self.leader_lease_s}) must be above 0 and below "
                             f"replication.lease_s ({self.lease_s}): an old leader must stop acknowledging "
                             "before its etcd lease ends")
        if not self.replicas:
            raise ValueError("a store group needs at least one replica name")


@dataclass(frozen=True, slots=True)
class GroupState:
    leader: str | None
    leader_address: str | None
    epoch: int
    isr: tuple[str, ...]
    isr_epoch: int
    replicas: tuple[str, ...]
    members: dict[str, str] = field(default_factory=dict)  # live name -> RPC address
    revision: int = 0
    has_isr: bool = False  # False until the first election wrote one
    candidates: dict[str, tuple[int, int]] = field(default_factory=dict)  # election/<epoch + 1>/: name -> position
    metrics: dict[str, str] = field(default_factory=dict)  # live name -> its /metrics address (those that serve one)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _loads(raw: bytes | None, default: Any) -> Any:
    try:
        return json.loads(raw) if raw else default
    except ValueError:
        return default


def parse_state(prefix: str, values: dict[str, bytes], revision: int) -> GroupState:
    """The group's state from every key under its ``prefix``."""
    leader = _loads(values.get(prefix + "leader"), {})
    isr = _loads(values.get(prefix + "isr"), {})
    epoch = int(values.get(prefix + "epoch") or b"0")
    registered = {key[len(prefix + "members/"):]: _loads(raw, {})
                  for key, raw in values.items() if key.startswith(prefix + "members/")}
    members = {name: doc.get("address", "") for name, doc in registered.items()}
    round_prefix = f"{prefix}election/{epoch + 1}/"
    candidates = {key[len(round_prefix):]: (int(doc.get("last_epoch", 0)), int(doc.get("end", 0)))
                  for key, raw in values.items() if key.startswith(round_prefix)
                  for doc in [_loads(raw, {})]}
    return GroupState(
        leader=leader.get("name"), leader_address=leader.get("address"), epoch=epoch,
        isr=tuple(isr.get("members", ())), isr_epoch=int(isr.get("epoch", 0)),
        replicas=tuple(_loads(values.get(prefix + "replicas"), [])), members=members, revision=revision,
        has_isr=prefix + "isr" in values, candidates=candidates,
        metrics={name: doc["metrics"] for name, doc in registered.items() if doc.get("metrics")})


def may_win(state: GroupState, name: str, unclean: bool) -> bool:
    """Whether ``name`` may be elected now: in the ISR, or configured when there is no ISR yet, or live and
    configured under unclean election."""
    if unclean or not state.has_isr:
        return name in state.replicas
    return name in state.isr


def best_candidate(candidates: dict[str, tuple[int, int]]) -> str:
    """The best position: highest last epoch, then end offset, then name."""
    return max(candidates, key=lambda name: (*candidates[name], name))


class GroupAdmin:
    """A store group read, and its membership changed, without joining it: what ``lightgate store status``,
    ``add-replica`` and ``remove-replica`` use (and :class:`GroupController`, a replica's, builds on)."""

    def __init__(self, etcd: EtcdClient, group: str) -> None:
        self.etcd = etcd
        self.group = group
        self.prefix = f"{ROOT}{group}/"

    @classmethod
    @asynccontextmanager
    async def open(cls, endpoints: Sequence[str], group: str) -> AsyncIterator[GroupAdmin]:
        async with EtcdClient.open(endpoints) as etcd:
            yield cls(etcd, group)

    async def state(self) -> GroupState:
        values, revision = await self.etcd.get_prefix(self.prefix)
        return parse_state(self.prefix, values, revision)

    async def wait_state_change(self, revision: int) -> GroupState:
        """The state after the first change under the group's prefix past ``revision`` (a watch, not a poll)."""
        await self._next_change(revision)
        return await self.state()

    async def _next_change(self, revision: int, key: str | None = None) -> None:
        """Return at the first change past ``revision`` of ``key`` (of any key under the group's prefix)."""
        watch = self.etcd.watch(key or self.prefix, revision + 1, prefix=key is None)
        try:
            async for _ in watch:
                return
        finally:
            await watch.aclose()

    async def add_replica(self, name: str) -> tuple[str, ...]:
        """Add ``name`` to the configured replicas (the quorum grows with them); the replicas now."""
        return await self._change_replicas(lambda state: (*state.replicas, name) if name not in state.replicas
                                           else state.replicas)

    async def remove_replica(self, name: str) -> tuple[str, ...]:
        """Remove ``name`` from the configured replicas; the replicas now.

        Raises :class:`MembershipRefused` for the leader (stop or resign it first), the last replica, or when the
        ISR left would not be a majority of the replicas left (acks=quorum would stop). The leader drops a removed
        member from the ISR itself.
        """
        def without(state: GroupState) -> tuple[str, ...]:
            if name not in state.replicas:
                return state.replicas
            left = tuple(replica for replica in state.replicas if replica != name)
            if name == state.leader:
                raise MembershipRefused(f"{name} is the leader of group {self.group}: stop it first")
            if not left:
                raise MembershipRefused(f"{name} is the last replica of group {self.group}")
            in_sync = [member for member in state.isr if member in left]
            if state.has_isr and len(in_sync) < len(left) // 2 + 1:
                raise MembershipRefused(
                    f"removing {name} leaves the in-sync set {in_sync} below a majority of {list(left)}")
            return left
        return await self._change_replicas(without)

    async def _change_replicas(self, change: Callable[[GroupState], tuple[str, ...]]) -> tuple[str, ...]:
        """Write ``change(state)`` as the replicas, unless ``replicas``, ``isr`` or ``leader`` changed since the
        state it was decided on was read (then decide again)."""
        while True:
            state = await self.state()
            replicas = change(state)
            if replicas == state.replicas:
                return replicas
            unchanged = [Compare(self.prefix + key, "mod", "<", state.revision + 1)
                         for key in ("replicas", "isr", "leader")]
            changed, _ = await self.etcd.txn(unchanged, [Put(self.prefix + "replicas", _json_bytes(list(replicas)))])
            if changed:
                return replicas

    async def status(self) -> dict[str, Any]:
        """The group as ``lightgate store status`` shows it (JSON-able)."""
        state = await self.state()
        return {"group": self.group, "leader": state.leader, "leader_address": state.leader_address,
                "epoch": state.epoch, "isr": list(state.isr), "isr_epoch": state.isr_epoch,
                "replicas": list(state.replicas), "members": dict(sorted(state.members.items())),
                "metrics": dict(sorted(state.metrics.items()))}


class GroupController(GroupAdmin):
    """One replica's view of its store group in etcd, while its lease lives (see the module docstring)."""

    def __init__(self, etcd: EtcdClient, config: GroupConfig, lease: int, granted_at: float) -> None:
        super().__init__(etcd, config.group)
        self.config = config
        self.lease = lease
        self.lost = trio.Event()
        self._last_renewal_sent = granted_at  # the send time of the grant, then of the last keep-alive answered

    @classmethod
    @asynccontextmanager
    async def open(cls, config: GroupConfig) -> AsyncIterator[GroupController]:  # type: ignore[override]
        async with EtcdClient.open(config.endpoints, min(CALL_TIMEOUT_S, config.lease_s / 3)) as etcd:
            sent = time.monotonic()
            lease, _ = await etcd.lease_grant(math.ceil(config.lease_s))
            self = cls(etcd, config, lease, sent)
            try:
                async with background(self._keep_alive):
                    await self._register()
                    yield self
            finally:
                with trio.move_on_after(config.lease_s) as cleanup:  # by then the lease has ended anyway
                    cleanup.shield = True
                    try:
                        await etcd.lease_revoke(lease)
                    except EtcdError:
                        pass  # etcd unreachable: the lease ends by itself within lease_s

    async def _register(self) -> None:
        """``members/<name>`` on this lease, once no other lease holds it: a replica restarted after a crash
        waits for its previous lease to end (taking that incarnation's ``leader`` key with it), so a ``leader``
        key naming this replica is always this lease's. Raises :class:`ReplicaNameTaken` when the key stays
        held for two leases (another live process runs under this name)."""
        member = self.prefix + "members/" + self.config.name
        with trio.move_on_after(2 * self.config.lease_s):
            while True:
                registered, _ = await self.etcd.txn(
                    [Compare(member, "create", "==", 0)],
                    [Put(member, _json_bytes({"address": self.config.address,
                                              **({"metrics": self.config.metrics_address}
                                                 if self.config.metrics_address else {})}), self.lease)])
                if registered:
                    await self.etcd.txn([Compare(self.prefix + "replicas", "create", "==", 0)],
                                        [Put(self.prefix + "replicas", _json_bytes(list(self.config.replicas)))])
                    return
                _, revision = await self.etcd.get(member)
                if revision:
                    await self._next_change(revision, member)
        raise ReplicaNameTaken(f"replica {self.config.name} of group {self.group} is registered by another live "
                               f"process: its key did not go within {2 * self.config.lease_s:g} s")

    async def _keep_alive(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        interval = self.config.lease_s / 3
        task_status.started()
        while True:
            sent = time.monotonic()
            ttl = None
            with trio.move_on_after(interval):
                try:
                    ttl = await self.etcd.lease_keepalive(self.lease, interval)
                except EtcdError:
                    pass
            if ttl == 0:
                break
            if ttl is not None:
                self._last_renewal_sent = sent
            elif time.monotonic() >= self._last_renewal_sent + self.config.lease_s:
                break
            await trio.sleep(max(0.0, sent + interval - time.monotonic()))
        self.lost.set()

    # The leader lease.

    @property
    def leader_lease_deadline(self) -> float:
        """The ``time.monotonic()`` after which a leader must not acknowledge anything."""
        if self.lost.is_set():
            return 0.0
        return self._last_renewal_sent + self.config.leader_lease_s

    def leader_lease_valid(self) -> bool:
        return time.monotonic() < self.leader_lease_deadline

    async def wait_lost(self) -> None:
        await self.lost.wait()

    def _check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(f"the etcd lease of replica {self.config.name} ended")

    # State: the group's, read under the lease.

    async def state(self) -> GroupState:
        self._check()
        return await super().state()

    async def wait_state_change(self, revision: int) -> GroupState:
        """The state after the first change under the group's prefix past ``revision``.

        Raises :class:`LeaseLost` when the lease ends first.
        """
        self._check()
        async with background() as nursery:
            nursery.start_soon(self._cancel_when_lost, nursery.cancel_scope)
            await self._next_change(revision)
        return await self.state()

    async def _cancel_when_lost(self, scope: trio.CancelScope) -> None:
        await self.lost.wait()
        scope.cancel()

    # Election.

    async def elect(self, position: tuple[int, int]) -> GroupState:
        """Take part in the election of a leader (if none): returns the state once a leader exists."""
        name = self.config.name
        state = await self.state()
        waited_rounds = 0
        while state.leader is None:
            if not may_win(state, name, self.config.unclean_election):
                state = await self.wait_state_change(state.revision)
                continue
            epoch = state.epoch
            await self.etcd.put(f"{self.prefix}election/{epoch + 1}/{name}",
                                _json_bytes({"last_epoch": position[0], "end": position[1]}), self.lease)
            state = await self._gather(epoch)
            if state.leader is not None or state.epoch != epoch:
                continue
            if best_candidate(state.candidates) == name or waited_rounds:
                await self._run_election(state)
                state = await self.state()
                continue
            state = await self._wait_for_leader(state)
            waited_rounds += 1
        return state

    async def _gather(self, epoch: int) -> GroupState:
        """The state once every live replica that may win reported its position for ``epoch + 1`` or the window
        passed (or a leader appeared)."""
        state = await self.state()
        with trio.move_on_after(self.config.election_window_s):
            while state.leader is None and state.epoch == epoch:
                voters = {member for member in state.members
                          if may_win(state, member, self.config.unclean_election)}
                if voters <= set(state.candidates):
                    break
                state = await self.wait_state_change(state.revision)
        return await self.state()

    async def _run_election(self, state: GroupState) -> bool:
        """The election transaction for ``state.epoch + 1``; whether this replica won it."""
        name, new_epoch = self.config.name, state.epoch + 1
        compares = [Compare(self.prefix + "leader", "create", "==", 0)]
        compares.append(Compare(self.prefix + "epoch", "value", "==", str(state.epoch).encode()) if state.epoch
                        else Compare(self.prefix + "epoch", "create", "==", 0))
        ops: list[Put | Delete] = [Put(self.prefix + "epoch", str(new_epoch).encode()),
                                   Put(self.prefix + "leader", self._leader_value(new_epoch), self.lease),
                                   Delete(f"{self.prefix}election/{new_epoch}/", prefix=True)]
        if name not in state.isr:  # the first election, or an unclean one: the ISR starts as the new leader
            ops.append(Put(self.prefix + "isr", _json_bytes({"epoch": new_epoch, "members": [name]})))
        won, _ = await self.etcd.txn(compares, ops)
        return won

    async def _wait_for_leader(self, state: GroupState) -> GroupState:
        with trio.move_on_after(RETRY_LEASES * self.config.lease_s):
            while state.leader is None:
                state = await self.wait_state_change(state.revision)
        return await self.state()

    def _leader_value(self, epoch: int) -> bytes:
        return _json_bytes({"name": self.config.name, "epoch": epoch, "address": self.config.address})

    def _fence(self, epoch: int) -> list[Compare]:
        """The compares that hold only while this replica leads ``epoch`` under its current lease."""
        return [Compare(self.prefix + "leader", "value", "==", self._leader_value(epoch)),
                Compare(self.prefix + "leader", "lease", "==", self.lease)]

    async def set_isr(self, epoch: int, members: Sequence[str]) -> bool:
        """Write the ISR as the leader of ``epoch``; False when fenced (no longer that leader: step down)."""
        self._check()
        written, _ = await self.etcd.txn(
            self._fence(epoch), [Put(self.prefix + "isr", _json_bytes({"epoch": epoch, "members": list(members)}))])
        return written

    async def resign(self) -> bool:
        """Delete the leader key if this replica holds it; whether it did."""
        self._check()
        state = await self.state()
        if state.leader != self.config.name:
            return False
        resigned, _ = await self.etcd.txn(self._fence(state.epoch), [Delete(self.prefix + "leader")])
        return resigned
