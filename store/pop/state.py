"""The state of POP groups, sans-IO: who holds which message of a group's queue, until when, at which attempt.

Made only by applying control records (store/control.py: ``PopCheckpoint``, ``PopAcked``, ``PopRevived``,
``PopRestated``) in log order, so a replica or a rebuild derives the same (store/pop/applier.py keeps it). A
message of a group's queue is, for that group, either *in flight* (handed out by the checkpoint that names it,
invisible to the other members until its deadline), *to retry* (its deadline passed: the next pop hands it out
again, attempt + 1), or done: below the cursor and neither (acknowledged, dead-lettered or lost to retention).
The group's committed offset is the lowest offset not done.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import final

import msgspec

from store.api import PopStatistics
from store.control import Control, PopAcked, PopCheckpoint, PopRestated, PopRevived

__all__ = ["MAX_INFLIGHT", "InFlight", "PopBook", "PopGroup"]

MAX_INFLIGHT = 10_000
"""Messages a group may have in flight or waiting for a retry (as ``store.groups.MAX_UNACKED``): a group whose
members pop and never acknowledge stops getting more until the invisible times pass, so its state stays bounded."""


class InFlight(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A message handed out: by the checkpoint at CommitLog offset ``ck``, visible again at ``deadline_ms``."""

    ck: int
    deadline_ms: int
    attempt: int
    member: str


@final
class PopGroup(msgspec.Struct, array_like=True):
    """One group's queue (see the module docstring); encoded as it is when the applier persists it."""

    cursor: int
    max_attempts: int
    inflight: dict[int, InFlight] = {}
    retry: dict[int, int] = {}  # queue offset -> the attempt it is handed out with next

    def committed(self, without: frozenset[int] = frozenset(), cursor: int | None = None) -> int:
        """The lowest offset not done (``without``: as if these were done too; ``cursor``: as if it were there)."""
        low = self.cursor if cursor is None else max(self.cursor, cursor)
        for offsets in (self.inflight, self.retry):
            for offset in offsets:
                if offset < low and offset not in without:
                    low = offset
        return low

    def held_by(self, offset: int, ck: int) -> InFlight | None:
        """The message at ``offset`` if the checkpoint ``ck`` holds it now (else a handle of it is stale)."""
        found = self.inflight.get(offset)
        return found if found is not None and found.ck == ck else None

    def plan(self, max_count: int) -> tuple[list[int], int]:
        """What a pop of ``max_count`` takes: the offsets to retry (lowest first), and how many from the cursor; the
        in-flight cap (``MAX_INFLIGHT``) counts."""
        room = min(max_count, MAX_INFLIGHT - len(self.inflight) - len(self.retry))
        if room <= 0:
            return [], 0
        retries = sorted(self.retry)[:room]
        return retries, room - len(retries)

    def due(self, now_ms: int) -> Iterator[tuple[int, InFlight]]:
        """The messages in flight whose invisible time passed at ``now_ms``."""
        return ((offset, held) for offset, held in self.inflight.items() if held.deadline_ms <= now_ms)

    def next_deadline(self) -> int | None:
        return min((held.deadline_ms for held in self.inflight.values()), default=None)

    def restated(self, group: str, queue: str) -> PopRestated:
        return PopRestated(group, queue, self.cursor, self.max_attempts,
                           [(o, h.ck, h.deadline_ms, h.attempt, h.member) for o, h in sorted(self.inflight.items())],
                           sorted(self.retry.items()))


@final
class PopBook:
    """Every POP group's state, keyed ``(group, queue)``; :meth:`apply` is the only way it changes."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], PopGroup] = {}
        self.popped = 0  # since this start, by the records applied: messages handed out, acks that matched,
        # retries, dead letters
        self.acked = 0
        self.revived = 0
        self.dead = 0

    def apply(self, offset: int, control: Control) -> tuple[str, str] | None:
        """Apply the POP control record at CommitLog ``offset``; the key of the group it changed (None: not one)."""
        if isinstance(control, PopCheckpoint):
            key = (control.group, control.queue)
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = PopGroup(control.cursor, control.max_attempts, {}, {})
            group.max_attempts = control.max_attempts
            group.cursor = max(group.cursor, control.cursor)
            deadline = control.pop_ms + control.invisible_ms
            for queue_offset, attempt in zip(control.offsets, control.attempts):
                group.retry.pop(queue_offset, None)
                self.popped += queue_offset not in group.inflight  # else a change of its invisible time
                group.inflight[queue_offset] = InFlight(offset, deadline, attempt, control.member)
            for queue_offset in control.gone:
                group.retry.pop(queue_offset, None)
            return key
        if isinstance(control, PopAcked):
            group = self.groups.get(key := (control.group, control.queue))
            if group is not None:
                self.acked += sum(1 for found in _take(group, control.acks) if found is not None)
            return key
        if isinstance(control, PopRevived):
            group = self.groups.get(key := (control.group, control.queue))
            if group is not None:
                for queue_offset, found in zip((o for o, _ in control.retries), _take(group, control.retries)):
                    if found is not None:
                        group.retry[queue_offset] = found.attempt + 1
                        self.revived += 1
                self.dead += sum(1 for found in _take(group, control.dead) if found is not None)
            return key
        if isinstance(control, PopRestated):
            key = (control.group, control.queue)
            self.groups[key] = PopGroup(
                control.cursor, control.max_attempts,
                {o: InFlight(ck, deadline, attempt, member) for o, ck, deadline, attempt, member in control.inflight},
                dict(control.retry))
            return key
        return None

    def statistics(self) -> PopStatistics:
        """The groups' figures now (``StoreStatistics.pops``)."""
        groups = self.groups.values()
        return PopStatistics(len(self.groups), sum(len(group.inflight) for group in groups),
                             sum(len(group.retry) for group in groups), self.popped, self.acked, self.revived, self.dead)

    def restate(self) -> Iterator[PopRestated]:
        """A ``PopRestated`` per group with messages in flight or to retry (a group with none is its cursor, which
        its ``Committed`` offset keeps)."""
        for (name, queue), group in list(self.groups.items()):
            if group.inflight or group.retry:
                yield group.restated(name, queue)


def _take(group: PopGroup, pairs: list[tuple[int, int]]) -> Iterator[InFlight | None]:
    """Take each ``(queue offset, checkpoint)`` out of flight when that checkpoint holds it; yields what it was
    (None: a stale pair, left as it is)."""
    for queue_offset, ck in pairs:
        found = group.held_by(queue_offset, ck)
        if found is not None:
            del group.inflight[queue_offset]
        yield found
