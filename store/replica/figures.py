"""What a replica's role loop shows its operator: the role it has now, the epoch, the log it copies or leads, and
what it counted across roles (elections won, truncations, leader changes).

The role loop (store/replica/role.py) keeps one ``RoleFigures`` for the process; the follower's fetch loop and the
leader's ``Replication`` add to it, and the composition root reads ``statistics()`` when its ``/metrics`` is scraped
(gateway/app/store_node.py), so the figures of a follower, which serves no gateway, reach the operator too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from store.api import ReplicationStatistics

if TYPE_CHECKING:
    from store.log.commitlog import CommitLog

__all__ = ["Leading", "RoleFigures"]


class Leading(Protocol):
    """A leader's replication state as the figures read it: ``store.replica.leader.Replication``, which adds to
    them (so this module names the one call it makes, and does not import it back)."""

    def statistics(self) -> ReplicationStatistics:
        """The leader's figures, the role loop's counts included."""


@dataclass
class RoleFigures:
    """The figures of one replica process (plain counters: read at scrape time only)."""

    group: str
    name: str
    epoch: int = 0  # the epoch of the leader it follows or of its own lead
    leader_end: int = -1  # following: the leader's written end as its last Frames said
    elections: int = 0
    truncations: int = 0
    leader_changes: int = 0
    log: CommitLog | None = None  # the log it copies (None: between roles, or leading)
    replication: Leading | None = None  # leading: the leader's replication state
    _leader: tuple[str, int] | None = field(default=None, repr=False)  # the last (leader, epoch) it saw

    def saw_leader(self, name: str, epoch: int) -> None:
        """The controller names ``name`` the leader of ``epoch``: a change is counted if it differs from the last."""
        if self._leader is not None and self._leader != (name, epoch):
            self.leader_changes += 1
        self._leader = (name, epoch)
        self.epoch = epoch

    def statistics(self) -> ReplicationStatistics | None:
        """The figures now (None before the role loop opened its log)."""
        if self.replication is not None:
            return self.replication.statistics()
        if self.log is None:
            return None
        return ReplicationStatistics(
            role="follower", group=self.group, name=self.name, epoch=self.epoch,
            confirm_offset=self.log.confirm_offset, written_offset=self.log.written_offset,
            leader_end=self.leader_end, elections=self.elections, truncations=self.truncations,
            leader_changes=self.leader_changes)
