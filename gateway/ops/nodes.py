"""The cluster view of the admin API: every node of the deployment, its role, its process's CPU share and memory.

Embedded (``lightgate serve``) there is one node, the gateway and the store in
one process. In a cluster the list holds the store node (its figures come with
its statistics), the gateway node asked, and the other gateway nodes, asked
through the store as the cluster-wide lists are (gateway/ops/clusterlists.py:
the store asks the nodes its presence says have clients, so a gateway node
with no client connected is listed only by its own admin API).

Each process measures itself (store/usage.py). A CPU share needs two
measurements: :class:`CpuShares` keeps each process's previous one, and the
share is the CPU time between the two over the wall time between them (100 is
one core busy; RocksDB's and the CommitLog's threads can take it over 100). A
process seen for the first time gets its average since it started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, final

import msgspec

from gateway.node.node import GatewayNode
from gateway.ops.records import NodeInfo
from store.api import AdminOp, StoreApi
from store.usage import ProcessUsage, process_usage

__all__ = ["CpuShares", "NodeAnswer", "NodeView", "cluster_nodes", "node_here"]

MIN_INTERVAL_S = 0.5
"""A share is measured over at least this much wall time: two looks closer together (a second browser tab) get
the share measured before, not the noise of a few milliseconds."""


class NodeView(Protocol):
    """What the cluster views read of a node: ``gateway.ops.administration.Administration``, which imports them to
    answer other nodes' asks (so they name what they read, and do not import it back)."""

    node: GatewayNode
    store: StoreApi


class NodeAnswer(msgspec.Struct, frozen=True):
    """A gateway node's answer to another node's ``AdminOp.NODE`` call."""

    name: str
    clients: int
    usage: ProcessUsage


def node_here(admin: NodeView) -> NodeAnswer:
    """This gateway node's process and its connected clients."""
    return NodeAnswer(admin.store.node, len(admin.node.registry), process_usage())


@dataclass(slots=True)
class _Look:
    cpu_s: float
    at: float  # the clock's time of the look
    share: float | None  # the share measured at this look


@final
class CpuShares:
    """The previous look at each process, by (node name, pid): what its next CPU share is measured against.

    Resource handling: holds one look per process of the last listing only (a restarted process's old pid is
    dropped when it is not listed any more).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._looks: dict[tuple[str, int], _Look] = {}

    def shares(self, usages: list[tuple[str, ProcessUsage]]) -> list[float | None]:
        """The CPU share (% of one core) of each (node name, usage), measured now; None when it cannot be told."""
        now = self._clock()
        looks: dict[tuple[str, int], _Look] = {}
        shares: list[float | None] = []
        for name, usage in usages:
            key = (name, usage.pid)
            look = self._looks.get(key)
            if look is None:
                share = 100.0 * usage.cpu_s / usage.age_s if usage.age_s > 0 else None
                look = _Look(usage.cpu_s, now, share)
            elif now - look.at >= MIN_INTERVAL_S:
                look = _Look(usage.cpu_s, now, 100.0 * max(0.0, usage.cpu_s - look.cpu_s) / (now - look.at))
            looks[key] = look
            shares.append(None if look.share is None else round(look.share, 1))
        self._looks = looks
        return shares


async def cluster_nodes(admin: NodeView, shares: CpuShares) -> tuple[list[NodeInfo], list[str]]:
    """The nodes of the deployment, the store node first, then the gateway nodes by name; and the nodes that did
    not answer (``store`` when the store's statistics carry no process figures).

    Raises:
        OSError: the store did not answer.
    """
    here = node_here(admin)
    store = (await admin.store.statistics()).process
    missing: list[str] = []
    if store is not None and store.pid == here.usage.pid:  # a LocalStore: lightgate serve
        rows = [("embedded", NodeAnswer(here.name, here.clients, store), True)]
    else:
        answers, missing = await admin.store.admin_call_all(AdminOp.NODE, b"")
        others = [msgspec.json.decode(answer, type=NodeAnswer) for answer in answers.values()]
        rows = [("gateway", node, node is here) for node in sorted([here, *others], key=lambda n: n.name)]
        if store is None:
            missing = ["store", *missing]
        else:
            rows.insert(0, ("store", NodeAnswer("store", 0, store), False))
    measured = shares.shares([(node.name, node.usage) for _, node, _ in rows])
    return [NodeInfo(node.name, role, node.usage.pid, share, round(node.usage.cpu_s, 3), node.usage.rss_bytes,
                     round(node.usage.age_s, 1), None if role == "store" else node.clients, this)
            for (role, node, this), share in zip(rows, measured)], missing
