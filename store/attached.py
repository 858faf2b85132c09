"""A gateway node attached to the store: what is routed to it (its events, its clients that moved away) and the
admin calls the store forwards to it about its clients (``StoreNode.attach``, ``admin_call``, ``admin_call_all``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from itertools import count
from typing import final

import trio

from notify import EventMailbox
from store.api import AdminOp

__all__ = ["ADMIN_TIMEOUT_S", "Attachment", "admin_call", "admin_call_all"]


@final
class Attachment:
    """What the store routes to one attached node: its events, its clients that moved away, admin asks.

    Resource handling: :meth:`close` ends the node's ``events`` and ``moved`` (``trio.EndOfChannel``) and fails
    the asks it has not answered.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.events = EventMailbox()
        self.moved = EventMailbox()  # {client id: 0}: clients not this node's any more
        self._asks_in, self.asks = trio.open_memory_channel[tuple[int, str, AdminOp, bytes]](math.inf)
        self._pending: dict[int, _Ask] = {}  # asks sent to this node, by id
        self._ask_ids = count(1)

    def close(self) -> None:
        self.events.close()
        self.moved.close()
        self._asks_in.close()
        for ask in self._pending.values():
            ask.value = OSError(f"the gateway node {self.name} went away before answering")
            ask.done.set()

    async def ask(self, client_id: str, op: AdminOp, query: bytes = b"") -> bytes | None:
        """Ask this node to run admin ``op`` about its client ``client_id`` (or list op ``op`` with ``query``) and
        wait for its answer.

        Raises:
            OSError: the node did not answer within ``ADMIN_TIMEOUT_S``, or went away.
        """
        ask_id = next(self._ask_ids)
        ask = self._pending[ask_id] = _Ask()
        try:
            try:
                self._asks_in.send_nowait((ask_id, client_id, op, query))
            except trio.ClosedResourceError:
                raise OSError(f"the gateway node {self.name} went away") from None
            with trio.move_on_after(ADMIN_TIMEOUT_S):
                await ask.done.wait()
        finally:
            del self._pending[ask_id]
        if not ask.done.is_set():
            raise OSError(f"the gateway node {self.name} did not answer within {ADMIN_TIMEOUT_S} s")
        if isinstance(ask.value, OSError):
            raise ask.value
        return ask.value

    def answer(self, ask_id: int, value: bytes | None) -> None:
        """The node's answer to ask ``ask_id`` (dropped if it came too late)."""
        ask = self._pending.get(ask_id)
        if ask is not None:
            ask.value = value
            ask.done.set()


@final
class _Ask:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: bytes | None | OSError = None


ADMIN_TIMEOUT_S = 20.0
"""How long an admin call waits for the answer of the node a client is connected to (a disconnect waits up to
15 s for the client's connection to close)."""


async def admin_call(attached: Mapping[str, Attachment], owner: str | None, node: str, client_id: str,
                     op: AdminOp) -> bytes | None:
    """Run admin ``op`` on ``owner``, the node ``client_id`` is connected to (``Leases.where``), for ``node``'s admin
    API; None when it is present on no other attached node (``node`` answers from what it has).

    Raises:
        OSError: that node did not answer in time, or went away.
    """
    attachment = attached.get(owner) if owner is not None and owner != node else None
    if attachment is None:
        await trio.lowlevel.checkpoint()
        return None
    return await attachment.ask(client_id, op)


async def admin_call_all(attached: Mapping[str, Attachment], nodes: Iterable[str], node: str, op: AdminOp,
                         query: bytes) -> tuple[dict[str, bytes], list[str]]:
    """Run list ``op`` at once on every other attached node of ``nodes`` (those with clients:
    ``Leases.nodes_with_clients``), for ``node``'s admin API: (the answers by node name, the nodes that did not
    answer in time or went away)."""
    answers: dict[str, bytes] = {}
    missing: list[str] = []

    async def ask(name: str, attachment: Attachment) -> None:
        try:
            answer = await attachment.ask("", op, query)
        except OSError:
            missing.append(name)
            return
        if answer is not None:
            answers[name] = answer

    async with trio.open_nursery() as nursery:
        for name in sorted(set(nodes) - {node}):
            attachment = attached.get(name)
            if attachment is not None:
                nursery.start_soon(ask, name, attachment)
    return answers, sorted(missing)
