"""The admin API's lists for the whole cluster: clients, sessions and queues of every gateway node.

The node asked answers from its own state and asks the others through the
store (``StoreApi.admin_call_all``): the store forwards the call to every
gateway node its presence says has clients, and relays their answers. Each
node answers :func:`list_here`; the node asked merges. Nodes that did not
answer in time are named, so a partial list never passes for a whole one.
Embedded (``lightgate serve``) there is no other node and the lists are the
node's own.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from gateway.ops.listing import ClientQuery, merge_pages
from gateway.ops.nodes import NodeView, node_here
from gateway.ops.records import ClientInfo, QueueInfo, SessionInfo
from store.api import AdminOp

__all__ = ["LIST_OPS", "ListView", "cluster_clients", "cluster_queues", "cluster_sessions", "list_here"]

LIST_OPS = frozenset({AdminOp.CLIENTS, AdminOp.SESSIONS, AdminOp.QUEUES, AdminOp.NODE})
"""The admin ops that list a node's state (the others are about one client)."""


class ListView(NodeView, Protocol):
    """What the lists read of a node: ``gateway.ops.administration.Administration``, which imports this module to
    answer other nodes' asks (so it names what it reads, and does not import it back)."""

    def clients(self) -> list[ClientInfo]:
        """The clients connected here."""

    async def sessions(self) -> list[SessionInfo]:
        """The sessions of the clients connected here, and the stored sessions of clients connected nowhere."""

    async def queues(self) -> list[QueueInfo]:
        """The queues the sessions read, with the slowest consumer's lag."""


async def list_here(admin: ListView, op: AdminOp, query: bytes) -> Any:
    """This node's answer to another node's list call (as msgspec encodes it to JSON)."""
    if op is AdminOp.CLIENTS:
        total, page = msgspec.json.decode(query, type=ClientQuery).page(admin.clients())
        return {"total": total, "clients": page}
    if op is AdminOp.SESSIONS:
        return await admin.sessions()
    if op is AdminOp.NODE:
        return node_here(admin)
    return await admin.queues()


async def cluster_clients(admin: ListView, query: ClientQuery) -> tuple[int, list[Any], list[str]]:
    """The page of ``query`` over the clients of every node: (how many match, the page, the nodes that did not
    answer).

    Raises:
        OSError: the store did not answer.
    """
    head = query.head()
    answers, missing = await admin.store.admin_call_all(AdminOp.CLIENTS, msgspec.json.encode(head))
    pages = [head.page(admin.clients())]
    for answer in answers.values():
        other = msgspec.json.decode(answer)
        pages.append((other["total"], other["clients"]))
    total, page = merge_pages(query, pages)
    return total, page, missing


async def cluster_sessions(admin: ListView) -> tuple[list[Any], list[str]]:
    """The sessions every node knows, one per client id (the live one where its client is connected), by client
    id; and the nodes that did not answer.

    Raises:
        OSError: the store did not answer.
    """
    answers, missing = await admin.store.admin_call_all(AdminOp.SESSIONS, b"")
    sessions: dict[str, Any] = {}
    for session in [*msgspec.to_builtins(await admin.sessions()),
                    *(s for answer in answers.values() for s in msgspec.json.decode(answer))]:
        known = sessions.get(session["client_id"])
        if known is None or session["connected"] and not known["connected"]:
            sessions[session["client_id"]] = session
    return [sessions[client_id] for client_id in sorted(sessions)], missing


async def cluster_queues(admin: ListView) -> tuple[list[Any], list[str]]:
    """The queues the sessions and shared groups of every node read, merged by queue (consumers added up, the
    slowest consumer's offset and lag); and the nodes that did not answer.

    Raises:
        OSError: the store did not answer.
    """
    answers, missing = await admin.store.admin_call_all(AdminOp.QUEUES, b"")
    queues: dict[str, dict[str, Any]] = {}
    for queue in [*msgspec.to_builtins(await admin.queues()),
                  *(q for answer in answers.values() for q in msgspec.json.decode(answer))]:
        known = queues.setdefault(queue["queue"], {**queue, "consumers": 0})
        known["max_offset"] = max(known["max_offset"], queue["max_offset"])
        known["min_offset"] = min(known["min_offset"], queue["min_offset"])
        known["consumers"] += queue["consumers"]
        known["lag"] = max(0, known["max_offset"] - known["min_offset"])
    return [queues[name] for name in sorted(queues)], missing
