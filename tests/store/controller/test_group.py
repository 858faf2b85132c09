"""A store group in etcd (store/controller/group.py): registration, election, ISR fencing, the leader lease,
membership, against a real etcd (1 member; 3 for the member-loss and leader-lease tests)."""

import time
import uuid
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from store.controller.etcd import EtcdClient
from store.controller.group import (GroupAdmin, GroupConfig, GroupController, LeaseLost, MembershipRefused,
                                    ReplicaNameTaken)
from tests.helpers.etcd import running_etcd

WAIT_S = 30  # every wait on etcd below is bounded by this (two shared cores)


def config(endpoints, group: str, name: str, replicas=("a", "b", "c"), **options) -> GroupConfig:
    return GroupConfig(endpoints=tuple(endpoints), group=group, name=name, address=f"127.0.0.1:{ord(name[0])}",
                       replicas=tuple(replicas), **options)


def new_group() -> str:
    return uuid.uuid4().hex[:12]


async def open_all(stack: AsyncExitStack, endpoints, group: str, names, **options) -> dict[str, GroupController]:
    return {name: await stack.enter_async_context(GroupController.open(config(endpoints, group, name, **options)))
            for name in names}


async def elect_all(controllers, positions) -> dict[str, object]:
    """Every controller's ``elect`` at once; the state each returned."""
    states = {}

    async def one(name: str) -> None:
        states[name] = await controllers[name].elect(positions[name])
    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            for name in positions:
                nursery.start_soon(one, name)
    return states


async def test_open_registers_the_member_and_creates_replicas_once(etcd):
    group = new_group()
    async with GroupController.open(config(etcd.endpoints, group, "a")) as a:
        state = await a.state()
        assert state.members == {"a": "127.0.0.1:97"} and state.replicas == ("a", "b", "c")
        assert state.leader is None and state.epoch == 0 and not state.has_isr
        async with GroupController.open(config(etcd.endpoints, group, "b", replicas=("b", "x"))) as b:
            state = await b.state()
            assert state.replicas == ("a", "b", "c")  # the key wins over a later setting
            assert set(state.members) == {"a", "b"}
        changed = await a.wait_state_change(state.revision)
        assert set(changed.members) == {"a"}  # b's lease was revoked on exit: its member key went at once
        assert a.leader_lease_valid()
    async with EtcdClient.open(etcd.endpoints) as client:
        assert (await client.get_prefix(f"/lightgate/groups/{group}/members/"))[0] == {}


async def test_a_clean_stop_hands_leadership_to_the_best_isr_member(etcd):
    group = new_group()
    async with AsyncExitStack() as stack:
        controllers = await open_all(stack, etcd.endpoints, group, "ac")
        async with GroupController.open(config(etcd.endpoints, group, "b")) as b:
            states = await elect_all({**controllers, "b": b}, {"a": (0, 10), "b": (0, 30), "c": (0, 20)})
            assert {(s.leader, s.epoch) for s in states.values()} == {("b", 1)}  # the best position, epoch 1
            assert states["b"].isr == ("b",) and states["b"].leader_address == "127.0.0.1:98"
            assert await b.set_isr(1, ["b", "a", "c"])
        states = await elect_all(controllers, {"a": (1, 30), "c": (1, 25)})
        assert {(s.leader, s.epoch) for s in states.values()} == {("a", 2)}
        assert (await controllers["a"].state()).isr == ("b", "a", "c")  # the new leader shrinks it, not etcd


@pytest.mark.slow
async def test_only_isr_members_may_win_unless_unclean(etcd):
    group = new_group()
    async with AsyncExitStack() as stack:
        controllers = await open_all(stack, etcd.endpoints, group, "bc")
        async with GroupController.open(config(etcd.endpoints, group, "a")) as a:
            await elect_all({"a": a}, {"a": (0, 5)})
            assert await a.set_isr(1, ["a", "b"])
        # c is outside the ISR: with the best position and alone in the election it still never wins.
        with trio.move_on_after(2):
            await controllers["c"].elect((1, 1000))
            pytest.fail("c, outside the ISR, returned from an election with no eligible candidate")
        assert (await controllers["c"].state()).leader is None
        assert (await controllers["c"].state()).candidates == {}
        states = await elect_all(controllers, {"b": (1, 5), "c": (1, 1000)})
        assert {(s.leader, s.epoch) for s in states.values()} == {("b", 2)}


async def test_unclean_election_lets_a_replica_outside_the_isr_win_and_resets_the_isr(etcd):
    group = new_group()
    async with GroupController.open(config(etcd.endpoints, group, "a")) as a:
        await elect_all({"a": a}, {"a": (0, 5)})
        assert await a.set_isr(1, ["a"])
    async with GroupController.open(config(etcd.endpoints, group, "c", unclean_election=True)) as c:
        states = await elect_all({"c": c}, {"c": (0, 2)})
        assert (states["c"].leader, states["c"].epoch, states["c"].isr) == ("c", 2, ("c",))


async def test_concurrent_election_transactions_make_one_leader_per_epoch(etcd):
    """Every candidate runs the transaction for the same epoch at once (as after a retry): exactly one wins."""
    group = new_group()
    async with AsyncExitStack() as stack:
        controllers = await open_all(stack, etcd.endpoints, group, "abc")
        for epoch in (1, 2, 3):
            state = await controllers["a"].state()
            assert state.leader is None and state.epoch == epoch - 1
            wins = {}

            async def run(name: str) -> None:
                wins[name] = await controllers[name]._run_election(state)
            async with trio.open_nursery() as nursery:
                for name in controllers:
                    nursery.start_soon(run, name)
            assert sum(wins.values()) == 1
            winner = next(name for name, won in wins.items() if won)
            after = await controllers["b"].state()
            assert (after.leader, after.epoch) == (winner, epoch)
            assert await controllers[winner].set_isr(epoch, ["a", "b", "c"])
            assert await controllers[winner].resign()


async def test_set_isr_is_fenced_by_the_epoch(etcd):
    group = new_group()
    async with AsyncExitStack() as stack:
        controllers = await open_all(stack, etcd.endpoints, group, "ab")
        await elect_all(controllers, {"a": (0, 9), "b": (0, 1)})
        a, b = controllers["a"], controllers["b"]
        assert await a.set_isr(1, ["a", "b"])
        assert not await b.set_isr(1, ["b"])  # not the leader
        assert not await a.set_isr(2, ["a"])  # not the leader of that epoch
        assert await a.resign()
        assert not await a.resign()  # no longer ours
        states = await elect_all({"b": b}, {"b": (1, 1)})
        assert (states["b"].leader, states["b"].epoch) == ("b", 2)
        assert not await a.set_isr(1, ["a"])  # the old leader is fenced
        assert not await a.set_isr(2, ["a"])
        assert (await a.state()).isr == ("a", "b")
        assert await b.set_isr(2, ["b"])
        assert (await a.state()).isr == ("b",) and (await a.state()).isr_epoch == 2


async def test_a_lease_etcd_ends_is_lost_and_the_controller_refuses(etcd):
    """The controller is spent once its lease ended: calls raise LeaseLost, which leaves ``open`` as itself (not
    in an exception group), so the role loop's ``except LeaseLost`` reopens it."""
    with pytest.raises(LeaseLost):
        async with GroupController.open(config(etcd.endpoints, new_group(), "a")) as a:
            await elect_all({"a": a}, {"a": (0, 0)})
            async with EtcdClient.open(etcd.endpoints) as client:
                await client.lease_revoke(a.lease)  # as etcd does when the lease expires
            with trio.fail_after(WAIT_S):
                await a.wait_lost()
            assert not a.leader_lease_valid()
            with pytest.raises(LeaseLost):
                await a.set_isr(1, ["a"])
            await a.state()


async def test_waiting_for_a_change_ends_when_the_lease_does(etcd):
    """The role loop waits on wait_state_change; a lease that ends meanwhile (the keep-alive task sets ``lost``)
    ends the wait with LeaseLost, though nothing changed in etcd."""
    async with GroupController.open(config(etcd.endpoints, new_group(), "a")) as a:
        state = await a.state()
        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                async def wait() -> None:
                    with pytest.raises(LeaseLost):
                        await a.wait_state_change(state.revision)
                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                a.lost.set()


async def test_membership_changes_and_refusals(etcd):
    """``lightgate store add-replica/remove-replica/status`` through a GroupAdmin, which does not join the group."""
    group = new_group()
    async with AsyncExitStack() as stack:
        controllers = await open_all(stack, etcd.endpoints, group, "ab")
        await elect_all(controllers, {"a": (0, 9), "b": (0, 1)})
        async with GroupAdmin.open(etcd.endpoints, group) as admin:
            assert await admin.add_replica("d") == ("a", "b", "c", "d")
            assert await admin.add_replica("d") == ("a", "b", "c", "d")
            with pytest.raises(MembershipRefused, match="leader"):
                await admin.remove_replica("a")
            with pytest.raises(MembershipRefused, match="majority"):  # ISR [a] of [a, b, c]: 1 < 2
                await admin.remove_replica("d")
            assert await controllers["a"].set_isr(1, ["a", "b"])
            assert await admin.remove_replica("d") == ("a", "b", "c")
            assert await admin.remove_replica("c") == ("a", "b")
            assert await admin.status() == {
                "group": group, "leader": "a", "leader_address": "127.0.0.1:97", "epoch": 1, "isr": ["a", "b"],
                "isr_epoch": 1, "replicas": ["a", "b"], "members": {"a": "127.0.0.1:97", "b": "127.0.0.1:98"},
                "metrics": {}}
        assert (await controllers["b"].state()).replicas == ("a", "b")


@pytest.mark.slow
async def test_the_leader_lease_ends_before_etcd_drops_the_leader(tmp_path):
    """A leader cut off from etcd (the one member it talks to frozen) stops acknowledging (its leader lease is
    invalid) before its leader key vanishes, so before anyone else can be elected; then it loses its lease."""
    with running_etcd(tmp_path, size=3) as cluster:
        group = new_group()
        # b's lease is long: when the frozen member led etcd, the two left elect a raft leader (a second or more on a
        # loaded machine) and b's keep-alives wait meanwhile; the lease under test is a's.
        async with GroupController.open(config(cluster.endpoints[:1], group, "a")) as a, \
                GroupController.open(config(cluster.endpoints[1:], group, "b", lease_s=8.0, leader_lease_s=5.0)) as b:
            await elect_all({"a": a}, {"a": (0, 0)})
            assert await a.set_isr(1, ["a", "b"])
            state = await b.state()
            assert state.leader == "a" and a.leader_lease_valid()
            cluster.freeze(0)
            try:
                with trio.fail_after(WAIT_S):
                    while state.leader is not None:
                        state = await b.wait_state_change(state.revision)
                vanished = time.monotonic()
                assert not a.leader_lease_valid()
                assert a.leader_lease_deadline < vanished
                states = await elect_all({"b": b}, {"b": (1, 0)})
                assert (states["b"].leader, states["b"].epoch) == ("b", 2)
                with trio.fail_after(WAIT_S):
                    await a.wait_lost()
            finally:
                cluster.thaw(0)


@pytest.mark.slow
async def test_a_three_member_etcd_losing_one_still_elects(tmp_path):
    """The leases are long here: the raft election among the two members left (when the killed one led etcd) must
    not cost a replica its lease on a loaded machine; what is tested is that the calls move to a live member."""
    with running_etcd(tmp_path, size=3) as cluster:
        group = new_group()
        async with AsyncExitStack() as stack:
            controllers = await open_all(stack, cluster.endpoints, group, "ab", lease_s=8.0, leader_lease_s=5.0)
            async with GroupController.open(config(cluster.endpoints, group, "c", lease_s=8.0,
                                                   leader_lease_s=5.0)) as c:
                await elect_all({**controllers, "c": c}, {"a": (0, 1), "b": (0, 2), "c": (0, 3)})
                assert await c.set_isr(1, ["a", "b", "c"])
                cluster.kill(0)  # the member every client asked first
            state = await controllers["a"].state()
            with trio.fail_after(WAIT_S):  # c's leader key goes with its lease (revoked, or expired)
                while state.leader is not None:
                    state = await controllers["a"].wait_state_change(state.revision)
            states = await elect_all(controllers, {"a": (1, 5), "b": (1, 4)})
            assert {(s.leader, s.epoch) for s in states.values()} == {("a", 2)}
            assert (await controllers["b"].status())["members"].keys() == {"a", "b"}


@pytest.mark.slow
async def test_a_best_candidate_that_never_runs_the_transaction_is_passed_over(etcd):
    """The best position belongs to a live replica that hangs (its keys are kept alive, its transaction never
    comes): after waiting a few leases the next candidate runs the transaction itself and wins."""
    group = new_group()
    async with GroupController.open(config(etcd.endpoints, group, "a")) as a:
        await elect_all({"a": a}, {"a": (0, 0)})
        assert await a.set_isr(1, ["a", "b", "c"])
    async with GroupController.open(config(etcd.endpoints, group, "b", lease_s=2.0, leader_lease_s=1.0)) as b, \
            GroupController.open(config(etcd.endpoints, group, "c")) as hung:
        await hung.etcd.put(f"/lightgate/groups/{group}/election/2/c", b'{"end":99,"last_epoch":1}', hung.lease)
        started = time.monotonic()
        states = await elect_all({"b": b}, {"b": (1, 5)})
        assert (states["b"].leader, states["b"].epoch) == ("b", 2)
        assert time.monotonic() - started >= 3 * 2.0  # it did wait for c first


@pytest.mark.slow
async def test_a_restarted_replica_waits_for_its_previous_lease_and_its_leader_key(etcd):
    """A replica restarted after a crash finds its previous incarnation's keys on a lease etcd has not ended yet:
    it registers once they are gone, so a ``leader`` key with its name is never the dead incarnation's."""
    group = new_group()
    prefix = f"/lightgate/groups/{group}/"
    async with EtcdClient.open(etcd.endpoints) as client:
        crashed, _ = await client.lease_grant(2)  # the dead incarnation's lease: nobody keeps it alive
        await client.put(prefix + "members/a", b'{"address":"127.0.0.1:97"}', crashed)
        await client.put(prefix + "epoch", b"1")
        await client.put(prefix + "leader", b'{"address":"127.0.0.1:97","epoch":1,"name":"a"}', crashed)
        async with GroupController.open(config(etcd.endpoints, group, "a")) as a:
            state = await a.state()
            assert state.leader is None and state.members == {"a": "127.0.0.1:97"}
            assert await client.lease_keepalive(crashed) == 0


@pytest.mark.slow
async def test_a_second_live_process_under_one_replica_name_is_refused(etcd):
    group = new_group()
    async with GroupController.open(config(etcd.endpoints, group, "a")):
        with pytest.raises(ReplicaNameTaken, match="replica a of group"):
            async with GroupController.open(config(etcd.endpoints, group, "a", lease_s=2.0, leader_lease_s=1.0)):
                pytest.fail("two live processes registered as replica a")
