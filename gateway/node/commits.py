"""Offset commits of every connection of a node, written together.

Sessions commit their offsets after a number of acknowledgements or on a
timer; with thousands of sessions acknowledging at once, one store write (one
thread hand-off, one WAL append, or one RPC) per session would cost more than
the deliveries. ``CommitBatcher`` gathers the commits that arrive while a
write is under way and writes them in the next one, as group commit does for
CommitLog flushes (store/log/aio.py).

A connection does not wait for its commits (``post``): offsets are committed
lazily anyway (every N acknowledgements or on a timer), and a connection that
waited would hold its next pulls behind a store write. A crash can lose the
commits not yet written; the session then resumes a little earlier and the
client sees those messages again (QoS 1/2 are at least once).

The store never moves an offset back (a late commit of a connection taken over on another node leaves the
newer one), and refuses the commits of a client of an ended store lease (cluster mode, store/leases.py:
``LeaseLost``, logged here). A write that a full data disk refused goes back to the pending commits (a newer
offset of the same queue wins) and is tried again once the disk has room (gateway/node/owed.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import final

import logging

import trio

from gateway.node.owed import OwedWrites
from store.api import LeaseLost, LogFullError, StoreApi

LOGGER = logging.getLogger(__name__)

__all__ = ["CommitBatcher"]

OWED_OWNER = "$commits"
"""The owner of the owed commit write (gateway/node/owed.py): ``$`` keeps it apart from client ids."""


@final
class _Round:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


@final
class CommitBatcher:
    """Writes ``{owner: {queue: offset}}`` commits in batches; each caller returns once its commit is written."""

    def __init__(self, store: StoreApi, nursery: trio.Nursery, owed: OwedWrites | None = None) -> None:
        """``nursery`` runs the writes that ``post`` starts; ``owed`` retries those a full disk refused (the
        node's, shared with its other store writes; default: one of its own)."""
        self._store = store
        self._nursery = nursery
        self.owed = owed if owed is not None else OwedWrites(nursery)
        self._pending: dict[str, dict[str, int]] = {}  # owner -> {queue: offset}
        self._next = _Round()  # the round that will carry what is pending
        self._busy = False
        self._free = trio.Event()  # set when a write ends
        self.writes = 0
        self.commits = 0

    def post(self, owner: str, offsets: Mapping[str, int]) -> None:
        """Commit ``owner``'s next offsets without waiting; a failed write is logged.

        A later commit of the same queue replaces an unwritten one: posts take
        effect in the order they are made.
        """
        self._add(owner, offsets)
        if not self._busy and not self.owed.owes(OWED_OWNER, OWED_OWNER):  # owed: the disk is full, it waits
            self._busy = True  # the task below takes the round: no second writer starts meanwhile
            self._nursery.start_soon(self._drain)

    async def _drain(self) -> None:
        self._busy = False  # taken over from post(): _write holds it while it writes
        while self._pending and not self._busy:
            written = await self._write()
            if isinstance(written.error, LogFullError):  # logged once by the store; pending again, owed
                return
            if written.error is not None:
                LOGGER.error("offset commit failed: %r", written.error)

    async def forget(self, owner: str) -> None:
        """Drop ``owner``'s unwritten commits and wait out a write in progress (before its offsets are deleted)."""
        self._pending.pop(owner, None)
        while self._busy:
            await self._free.wait()

    def _add(self, owner: str, offsets: Mapping[str, int]) -> None:
        self._pending.setdefault(owner, {}).update(offsets)
        self.commits += 1

    async def commit(self, owner: str, offsets: Mapping[str, int]) -> None:
        """Commit ``owner``'s next offsets and return once they are written.

        Raises:
            OSError: the write that carried this commit failed.
        """
        self._add(owner, offsets)
        mine = self._next
        while not mine.done.is_set():
            if self._busy:
                await self._free.wait()
                continue
            await self._write()
        if isinstance(mine.error, LogFullError):
            raise mine.error  # the offsets are pending again: they are written once the disk has room
        if mine.error is not None:
            raise OSError(f"offsets of {owner!r} not committed: {mine.error!r}") from mine.error

    async def _write_owed(self) -> None:
        """The owed write: what is pending (raises the round's failure, so that it stays owed)."""
        while self._pending:  # posts made meanwhile started no write of their own (``post``)
            if self._busy:
                await self._free.wait()
                continue
            written = await self._write()
            if written.error is not None:
                raise written.error

    async def _write(self) -> _Round:
        """Write what is pending as one round; the round says whether it failed."""
        self._busy = True
        current, pending = self._next, self._pending
        self._next, self._pending = _Round(), {}
        try:
            if pending:
                try:
                    await self._store.commit_offsets(pending)
                except LeaseLost:  # acknowledged on connections of an ended lease: not this node's to write
                    LOGGER.info("offsets of an ended store lease not committed", extra={"ctx": {"owners": len(pending)}})
            self.writes += 1
        except LogFullError as exc:  # pending again, under any newer offsets; written once the disk has room
            current.error = exc
            for owner, offsets in pending.items():
                again = self._pending.setdefault(owner, {})
                for queue, offset in offsets.items():
                    again.setdefault(queue, offset)
            self.owed.owe(OWED_OWNER, self._write_owed, key=OWED_OWNER)
        except Exception as exc:  # every caller of the round raises it
            current.error = exc
        finally:
            current.done.set()
            self._busy = False
            free, self._free = self._free, trio.Event()
            free.set()
        return current
