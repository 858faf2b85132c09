"""Watching a replicated store group: each replica's own ``/metrics`` (``store.metrics_port``), the leader's view
through a gateway's ``/metrics`` and the dashboard's ``/api/v1/overview``, and ``lightgate store status`` with every live replica's figures.

Real processes (etcd, three `lightgate store` replicas, a gateway), real SIGKILLs; every figure is waited for as a
condition on the scraped text, never after a sleep.
"""

from __future__ import annotations

import pytest

from store.api import PullRequest
from tests.helpers.admin import Admin, admin_port
from tests.helpers.cluster import ask_store
from tests.helpers.etcd import running_etcd
from tests.helpers.mqtt_fixtures import run_id
from tests.helpers.prometheus import metric, scraped
from tests.helpers.replicas import Group, publish_acked, store_command, wait_for

pytestmark = pytest.mark.slow

NAMES = ("r0", "r1", "r2")


def status(etcd: list[str]) -> dict:
    return store_command("status", "--replication-group", "g", *(f for e in etcd for f in ("--etcd", e)))


def past_the_last(store_port: int, topic: str) -> int:
    """Just past the start of ``topic``'s last record in the log: what a replica holds once it holds that record
    (held offsets are record boundaries). Not the leader's written offset read after the acknowledgements: the
    gateway's own records (sessions, offsets) go on after them, and a follower need not hold those yet (a scrape
    got 21,511 written against 21,406 held, under load)."""
    async def last(client) -> int:
        (result,) = await client.pull([PullRequest(topic, 0, max_count=1000, max_bytes=1 << 20)])
        return result.messages[-1][1].offset

    return ask_store(store_port, last) + 1


def test_each_replica_its_gateway_and_status_show_roles_epochs_the_isr_and_lag(tmp_path):
    with running_etcd(tmp_path) as etcd:
        group = Group(tmp_path, etcd.endpoints, NAMES, metrics=True)
        try:
            leader, epoch = group.wait_leader()
            group.wait_isr(NAMES)
            followers = [name for name in NAMES if name != leader]
            port = {name: replica.metrics_port for name, replica in group.replicas.items()}
            wait_for(lambda: scraped(port[leader], "lightgate_replication_isr_size") == 3, "the leader's ISR of 3")
            assert metric(port[leader], "lightgate_replication_leader") == 1
            assert metric(port[leader], "lightgate_replication_epoch") == epoch == 1
            assert metric(port[leader], "lightgate_replication_elections_total") == 1
            for name in followers:  # a follower serves no gateway: only its own endpoint shows it
                wait_for(lambda: scraped(port[name], "lightgate_replication_epoch") == epoch, f"{name}'s epoch")
                assert metric(port[name], "lightgate_replication_leader") == 0
                assert metric(port[name], "lightgate_replication_elections_total") == 0
                assert scraped(port[name], "lightgate_replication_isr_size") is None  # the leader's figure

            gateway = group.gateway()
            try:
                run = run_id()
                assert len(publish_acked(gateway.port, f"t{run}/a", 20, payload=b"x" * 1000)) == 20
                end = past_the_last(group.replicas[leader].port, f"t{run}/a")
                for name in followers:  # under quorum every ISR member holds what was acknowledged
                    assert metric(port[leader], f'lightgate_replication_follower_held_offset{{replica="{name}"}}') \
                        >= end
                    assert metric(port[leader], f'lightgate_replication_follower_in_isr{{replica="{name}"}}') == 1
                    wait_for(lambda: scraped(port[leader], f'lightgate_replication_follower_lag_bytes'
                                                           f'{{replica="{name}"}}') == 0, f"{name} caught up")
                    wait_for(lambda: scraped(port[name], "lightgate_replication_lag_bytes") == 0,
                             f"{name} caught up, by its own account")
                    assert metric(port[name], "lightgate_replication_written_offset") >= end
                    wait_for(lambda: (scraped(port[name], "lightgate_replication_confirm_offset") or 0) >= end,
                             f"{name}'s confirm offset at {end}")  # the leader's, one fetch later
                gateway_admin = admin_port(gateway)  # the leader's view, through the store RPC
                assert metric(gateway_admin, "lightgate_replication_isr_size") == 3
                assert metric(gateway_admin, "lightgate_replication_epoch") == 1
                for name in followers:
                    assert metric(gateway_admin, f'lightgate_replication_follower_held_offset{{replica="{name}"}}') \
                        >= end
                view = Admin(gateway_admin).get("/api/v1/overview")["replication"]  # what the dashboard shows
                assert (view["group"], view["leader"], view["epoch"], sorted(view["isr"])) == ("g", leader, 1,
                                                                                           sorted(NAMES))
                assert {f["name"]: (f["in_isr"], f["held"] >= end) for f in view["followers"]} == \
                    {name: (True, True) for name in followers}

                shown = status(etcd.endpoints)
                assert sorted(shown["figures"]) == sorted(NAMES)
                assert shown["figures"][leader]["role"] == "leader" and shown["figures"][leader]["isr_size"] == 3
                assert sorted(shown["figures"][leader]["followers"]) == sorted(followers)
                assert all(shown["figures"][name]["role"] == "follower" and shown["figures"][name]["epoch"] == 1
                           for name in followers)

                dead, survivor = followers
                group.replicas[dead].kill()
                # the dead follower holds everything so far: it leaves the ISR only once it lags, after a write
                # that waits for it (quorum) for replication.max_lag_s
                assert len(publish_acked(gateway.port, f"t{run}/b", 1)) == 1
                wait_for(lambda: scraped(port[leader], "lightgate_replication_isr_size") == 2, "the ISR shrunk to 2")
                assert metric(port[leader], f'lightgate_replication_follower_in_isr{{replica="{dead}"}}') == 0
                assert metric(port[leader], "lightgate_replication_isr_shrinks_total") == 1
                assert metric(port[leader], f'lightgate_replication_follower_lag_bytes{{replica="{dead}"}}') > 0
                group.wait_isr([leader, survivor])
            finally:
                gateway.stop()

            group.replicas[leader].kill()
            new, new_epoch = group.wait_leader(after_epoch=epoch)
            assert (new, new_epoch) == (survivor, 2)
            wait_for(lambda: scraped(port[new], "lightgate_replication_leader") == 1, "the new leader's role")
            assert metric(port[new], "lightgate_replication_epoch") == 2
            assert metric(port[new], "lightgate_replication_elections_total") == 1
            assert metric(port[new], "lightgate_replication_leader_changes_total") == 1

            shown = status(etcd.endpoints)
            assert (shown["leader"], shown["epoch"]) == (new, 2)
            assert sorted(shown["figures"]) == [new]  # the dead replicas' member keys went with their leases
            figures = shown["figures"][new]
            assert (figures["role"], figures["epoch"], figures["elections"]) == ("leader", 2, 1)
        finally:
            group.stop()
