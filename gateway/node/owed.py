"""Store writes a full data disk refused, kept per owner and done in order once there is room.

Some writes cannot be refused to the client: MQTT has no negative answer for
an UNSUBSCRIBE in 3.1.1, none at all for a DISCONNECT, a session expiry or an
offset commit, and the client has moved on by then. While the disk is full the
store refuses them (``LogFullError``, store/space.py); the node then owes them:
the client sees their effect at once (the session in memory has changed), and
the store gets them later, in the order they were made, retried every
``FULL_RETRY_S`` until the disk has room.

An owner's owed writes are always done before its next write (``attempt``,
``settle``): a release owed from an UNSUBSCRIBE must not undo a later SUBSCRIBE
of the same filter, and an expired session whose deletion is owed must not be
resumed. A CONNECT or SUBSCRIBE that meets an owner still owing is refused for
lack of space, as the write it needs would be.

Owed writes live in the node's memory: a node that stops before the disk has
room loses them (the store keeps the state it had: a session saved earlier
resumes from that save, a filter held stays held until its session ends).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import final

import trio

from store.api import FULL_RETRY_S, LogFullError

__all__ = ["OwedWrites", "Write"]

LOGGER = logging.getLogger(__name__)

Write = Callable[[], Awaitable[object]]
"""A store write, done by calling it; it raises ``LogFullError`` while the disk is full."""


@dataclass(eq=False)
class _Owner:
    writes: list[tuple[Hashable | None, Write]] = field(default_factory=list)
    lock: trio.Lock = field(default_factory=trio.Lock)  # one settles the owner's writes at a time, in order


@final
class OwedWrites:
    """The writes owed per owner (a client id, a shared group's owner), and the task that retries them.

    Resource handling: the retry task runs in ``nursery`` while anything is owed.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._owners: dict[str, _Owner] = {}
        self._retrying = False
        self.owed = 0  # writes owed now
        self.done = 0  # owed writes done since the node started

    def owes(self, owner: str, key: Hashable) -> bool:
        """Whether ``owner`` owes a write with this ``key``."""
        entry = self._owners.get(owner)
        return entry is not None and any(k == key for k, _ in entry.writes)

    def owe(self, owner: str, write: Write, key: Hashable | None = None) -> None:
        """Do ``write`` after ``owner``'s other owed writes, once the disk has room.

        A write with a ``key`` the owner owes already is not added again: such a
        write must do the latest state when it runs (a session save does).
        """
        if key is not None and self.owes(owner, key):
            return
        writes = self._owners.setdefault(owner, _Owner()).writes
        writes.append((key, write))
        self.owed += 1
        if not self._retrying:
            self._retrying = True
            LOGGER.info("store writes held back by the full data disk: sessions and subscriptions change now, "
                        "the store follows once space frees")
            self._nursery.start_soon(self._retry)

    async def attempt(self, owner: str, write: Write, key: Hashable | None = None) -> bool:
        """Do ``write`` now, after ``owner``'s owed writes; on a full disk owe it instead. True if it was done.

        Raises what ``write`` raises, except ``LogFullError``.
        """
        entry = self._owners.get(owner)
        if entry is None:
            try:
                await write()
                return True
            except LogFullError:
                self.owe(owner, write, key)
                return False
        async with entry.lock:
            try:
                await self._settle(owner, entry)
                await write()
                return True
            except LogFullError:
                self.owe(owner, write, key)
                return False

    async def settle(self, owner: str) -> None:
        """Do ``owner``'s owed writes now, in order (before a write that must come after them).

        Raises:
            LogFullError: the disk is still full; what was not done stays owed.
            OSError: the store failed otherwise (unreachable...); likewise.
        """
        entry = self._owners.get(owner)
        if entry is not None:
            async with entry.lock:
                await self._settle(owner, entry)

    async def _settle(self, owner: str, entry: _Owner) -> None:
        writes = entry.writes
        while writes:
            try:
                await writes[0][1]()
            except OSError:  # LogFullError included (or the store is away): it stays first
                raise
            except Exception:  # a bug, raised to the caller: the write is not tried again
                writes.pop(0)
                self.owed -= 1
                raise
            writes.pop(0)
            self.owed -= 1
            self.done += 1
        if self._owners.get(owner) is entry:
            del self._owners[owner]

    async def _retry(self) -> None:
        """Every ``FULL_RETRY_S``, settle every owner until nothing is owed; one line when done."""
        done = self.done
        try:
            while self._owners:
                await trio.sleep(FULL_RETRY_S)
                for owner in list(self._owners):
                    try:
                        await self.settle(owner)
                    except OSError:  # still full (or the store is away): next round
                        break
                    except Exception as exc:  # a bug in a write: it is dropped, the others go on
                        LOGGER.error("owed store write failed: %r", exc, exc_info=exc, extra={"ctx": {"owner": owner}})
        finally:
            self._retrying = False
            if self._owners:  # the node stops before space frees
                LOGGER.warning("store writes held back by the full data disk are lost: the node stopped first",
                               extra={"ctx": {"writes": self.owed}})
        LOGGER.info("store writes held back by the full data disk are done", extra={"ctx": {"writes": self.done - done}})
