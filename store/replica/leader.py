"""The leader's side of the replication data path: what its followers hold, the confirm offset, and the gate that
acknowledges a write only once the acks mode's replicas hold it (docs/storage.md, "Replication").

A follower fetches the log from its written end (``fetch``) and says what it holds (written, or fsynced under the
sync flush policy). A fetch is answered once there is news for it: at least its ``min_bytes`` past its offset, or,
after its ``max_wait_s``, anything (records, or a confirm offset it was not told); with nothing at all, after the
long poll (``FETCH_WAIT_S``). So a round carries many records while the log grows fast, and the follower's
confirm offset (its dispatch) lags by at most ``max_wait_s``. An acknowledgement that waits for followers (acks
``quorum``, ``all``) ends the wait at once: it never waits for a follower to fill its fetch. The confirm offset (what dispatch, pulls, notify and retained reads may see) is the minimum held
offset over the in-sync set (ISR), the leader included, and only moves forward. A follower that has not been
caught up with the leader's end for ``max_lag_s`` leaves the ISR: the controller records that first (fenced by the
epoch), and only then does the confirm offset stop waiting for it. A follower whose held offset reaches the confirm
offset joins it at once, locally, and the controller is told after.

Every acknowledgement also needs the leader's lease (``Controller.leader_lease_valid``): once it is gone, or the
controller refused an ISR change (a newer leader exists), ``wait_acked`` raises ``LeaderFenced`` for ever after, so an
old leader acknowledges nothing a new one may not have.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence, final

import trio

from store.api import FollowerStatistics, LeaderFenced, ReplicationStatistics
from store.log.aio import AsyncCommitLog
from store.replica.figures import RoleFigures
from store.log.errors import RetentionDeferred
from store.restate import CONFIRM_WAIT_S

__all__ = ["ACKS", "FETCH_WAIT_S", "Answer", "Controller", "Replication"]

LOGGER = logging.getLogger(__name__)

ACKS = ("leader", "quorum", "all")

FETCH_WAIT_S = 0.5
"""An up-to-date follower's fetch waits at most this for the next append (or confirm move): the long poll that
keeps the follower's latency to one round trip without a busy loop, and the connection alive when idle."""

INLINE_BYTES = 256 * 1024
"""A fetch of at most this much past the follower's offset is read on the event loop."""

LEASE_CHECK_S = 0.05
"""A waiting acknowledgement looks at the leader lease at least this often: the lease ends with time, not with an
event, and an ack must never be sent past it by more than this."""


class Controller(Protocol):
    """What the replication needs of the group's controller (store/controller/, over etcd)."""

    async def set_isr(self, epoch: int, members: list[str]) -> bool:
        """Record the ISR of ``epoch``; False when ``epoch`` is not the group's current one (this leader is
        fenced)."""

    def leader_lease_valid(self) -> bool:
        """Whether this leader may still acknowledge: its lease was renewed less than ``leader_lease_s`` ago."""


@dataclass(slots=True)
class _Follower:
    """What the leader knows of one follower from its fetches."""

    written: int = 0  # its log's end (the last fetch's offset)
    held: int = 0  # what it holds (written, or fsynced under its sync flush policy)
    fetched_at: float = -1.0  # trio time of its last fetch (-1: never)
    caught_up_at: float = -1.0  # the last time it had everything the leader had
    sent_written: int = -1  # the leader's written end when it last answered it
    sent_at: float = -1.0  # when
    sent_confirm: int = -1  # the confirm offset last sent to it


@dataclass(frozen=True, slots=True)
class Answer:
    """A fetch's answer (``wire.Frames`` without the request id)."""

    epoch: int
    data: bytes
    confirm: int
    epochs: list[tuple[int, int]]
    truncate_to: int = -1
    end: int = -1  # the leader's written end when it answered
    min_offset: int = 0  # where the leader's log starts (its retention deleted what is below)


@final
class Replication:
    """The leader's replication state of one group, for its epoch.

    ``open_store(..., replication=...)`` binds it to the node's log and dispatcher (:meth:`bind`), which it opens.

    Args:
        name: this replica's name (a member of ``replicas``).
        epoch: the leader epoch it leads.
        replicas: every configured member's name (the group size, and ``all``'s set).
        isr: the in-sync set the controller recorded for this epoch (the leader is always in it).
        acks: ``leader``, ``quorum`` or ``all`` (docs/storage.md, "Replication").
        max_lag_s: a follower not caught up for this long leaves the ISR.
        controller: records ISR changes and says whether the leader lease is valid.
        confirmed: a promoted follower's confirm offset: what it has past it (the old epoch's unconfirmed tail) is
            served only once the ISR holds it (``open_store`` holds the confirm offset there before recovery).
        figures: the replica's role loop figures (its group, its counts), shown with this leader's.
    """

    def __init__(self, *, name: str, epoch: int, replicas: Sequence[str], isr: Sequence[str],
                 acks: Literal["leader", "quorum", "all"], max_lag_s: float, controller: Controller,
                 confirmed: int | None = None, figures: RoleFigures | None = None) -> None:
        if acks not in ACKS:
            raise ValueError(f"replication.acks must be one of {', '.join(ACKS)}, not {acks!r}")
        if name not in replicas:
            raise ValueError(f"replica {name!r} is not one of the configured replicas {list(replicas)}")
        self.name = name
        self.epoch = epoch
        self.replicas = tuple(replicas)
        self.acks = acks
        self.max_lag_s = max_lag_s
        self.controller = controller
        self.confirmed = confirmed  # the confirm offset its last leader told it (a promoted follower), else None
        self.role = figures if figures is not None else RoleFigures("", name, epoch)
        self._followers = {member: _Follower() for member in self.replicas if member != name}
        self._isr = {name, *(member for member in isr if member in self._followers)}
        self._isr_recorded = set(self._isr)  # what the controller holds
        self._fenced: str | None = None  # why this leader may acknowledge nothing any more
        self._changed = trio.Event()  # an append, a confirm move, a fetch, an ISR change
        self._isr_due = trio.Event()  # the maintenance task has an ISR change to record
        self._ack_waiters = 0  # acknowledgements waiting for followers: a fetch with records for them answers at once
        self.shrinks = 0
        self.expands = 0
        now = trio.current_time()
        for member in self._isr - {name}:
            self._followers[member].caught_up_at = now  # the controller's ISR: in sync until max_lag_s says not

    def bind(self, log: AsyncCommitLog, wake_dispatch: Callable[[], None]) -> None:
        """Replicate ``log`` (its confirm offset held from now on; dispatch woken by ``wake_dispatch`` whenever it
        moves): ``open_store`` calls it once the startup appends are done."""
        log.log.hold_confirm()
        self.log = log
        self.wake_dispatch = wake_dispatch
        token = trio.lowlevel.current_trio_token()

        def restated(new_min_offset: int) -> None:
            """After the restatement (store/restate.py, the prelude before this one): every in-sync replica holds
            it before the leader's ``min_offset``, which its followers' retention follows, passes the records it
            restates; else retention is deferred (the restatement left in the log is harmless: applying is
            idempotent). Its append, from retention's thread, is announced here like the node's own."""
            token.run_sync_soon(self.appended)
            if not log.log.wait_confirmed(log.log.written_offset, CONFIRM_WAIT_S):
                raise RetentionDeferred(f"the replicas did not confirm the restatement within {CONFIRM_WAIT_S} s")

        log.log.add_retention_prelude(restated)

    # --- the leader's own writes --------------------------------------------------------------

    @property
    def held(self) -> int:
        """What the leader itself holds: written, or fsynced under the sync flush policy."""
        log = self.log.log
        return log.flushed_offset if log.config.flush == "sync" else log.written_offset

    def appended(self) -> None:
        """Records were appended: waiting fetches answer, and the confirm offset may move (a lone leader)."""
        self._advance()
        self._signal()

    async def wait_acked(self, end: int) -> None:
        """Return once the records below ``end`` are held as ``acks`` requires and the leader lease is valid.

        Raises:
            LeaderFenced: the lease is gone or the controller fenced this leader: nothing may be acknowledged.
        """
        waiting = False
        try:
            while True:
                self._check()
                self._advance()
                if self._acked(end):
                    self._check()
                    return
                if not waiting and self.acks != "leader":  # it waits for followers
                    waiting = True
                    self._ack_waiters += 1
                    if self._ack_waiters == 1:
                        self._signal()  # lingering fetches answer now
                changed = self._changed
                with trio.move_on_after(LEASE_CHECK_S):
                    await changed.wait()
        finally:
            self._ack_waiters -= waiting

    def acks_at_once(self) -> bool:
        """Whether a write is acknowledged as soon as it is written: acks ``leader``, under a valid lease."""
        return self.acks == "leader" and self._fenced is None and self.controller.leader_lease_valid()

    def _acked(self, end: int) -> bool:
        if self.acks == "leader":
            return self.held >= end
        if self.acks == "all":
            return self.held >= end and all(f.held >= end for f in self._followers.values())
        return len(self._isr) * 2 > len(self.replicas) and self.log.log.confirm_offset >= end

    def _check(self) -> None:
        if self._fenced is None and not self.controller.leader_lease_valid():
            self._fence("the leader lease has expired")
        if self._fenced is not None:
            raise LeaderFenced(f"not the leader of epoch {self.epoch} any more: {self._fenced}")

    def _fence(self, why: str) -> None:
        if self._fenced is None:
            self._fenced = why
            LOGGER.warning("replication leader fenced: it acknowledges nothing from now on",
                           extra={"ctx": {"epoch": self.epoch, "why": why}})
        self._signal()

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    async def wait_fenced(self) -> None:
        """Return once this leader may acknowledge nothing any more (the role loop then stops leading): fenced by
        the controller or a later epoch's fetch, or its lease ran out (looked at every ``LEASE_CHECK_S``, as the lease
        ends with time, not with an event)."""
        while self._fenced is None:
            if not self.controller.leader_lease_valid():
                self._fence("the leader lease has expired")
                return
            changed = self._changed
            with trio.move_on_after(LEASE_CHECK_S):
                await changed.wait()

    # --- followers ----------------------------------------------------------------------------

    async def fetch(self, follower: str, epoch: int, last_epoch: int, offset: int, held: int,
                    max_bytes: int, min_bytes: int = 1, max_wait_s: float = 0.0) -> Answer:
        """A follower's fetch: note what it holds, then answer the log from ``offset`` once there is news for it
        (see the module docstring: ``min_bytes``, ``max_wait_s``, at most ``FETCH_WAIT_S``), or where to
        truncate. Every answer carries the log's ``min_offset``; a fetch below it (an empty replica joining after
        retention) is answered with no data.

        Raises:
            LeaderFenced: the follower follows a later epoch: this leader is fenced.
            ValueError: ``follower`` is not a configured replica.
            OffsetExpired, InvalidOffset: as ``CommitLog.read_frames``.
        """
        progress = self._followers.get(follower)
        if progress is None:
            raise ValueError(f"{follower!r} is not a configured replica of this group")
        if epoch > self.epoch:
            self._fence(f"replica {follower} follows epoch {epoch}")
            raise LeaderFenced(f"not the leader of epoch {epoch}")
        log = self.log.log
        if epoch < self.epoch:  # it follows an older leader: it learns this one's epoch and comes back
            return Answer(self.epoch, b"", log.confirm_offset, log.epochs.entries, min_offset=log.min_offset)
        end = log.epochs.end_offset(last_epoch, log.written_offset) if last_epoch >= 0 else None
        if offset > (end if end is not None else 0):
            return Answer(self.epoch, b"", log.confirm_offset, log.epochs.entries,
                          truncate_to=end if end is not None else 0, min_offset=log.min_offset)
        if offset < log.min_offset:  # retention deleted it: an empty replica starts at min_offset, others cannot
            return Answer(self.epoch, b"", log.confirm_offset, log.epochs.entries, min_offset=log.min_offset)
        self._progress(follower, progress, offset, min(held, offset))
        await self._until_news(progress, offset, min_bytes, max_wait_s)
        written = log.written_offset
        if written - offset > INLINE_BYTES:  # a follower catching up: the read may miss the page cache
            data = await trio.to_thread.run_sync(log.read_frames, offset, max_bytes)
        else:  # the last appends, in the page cache: cheaper here than a hop to a worker thread and back
            data = log.read_frames(offset, max_bytes) if offset < written else b""
        progress.sent_written = written
        progress.sent_at = trio.current_time()
        progress.sent_confirm = log.confirm_offset
        return Answer(self.epoch, data, progress.sent_confirm, log.epochs.entries, end=written,
                      min_offset=log.min_offset)

    async def _until_news(self, progress: _Follower, offset: int, min_bytes: int, max_wait_s: float) -> None:
        """Wait until a fetch from ``offset`` has news worth a round trip (the module docstring says which). The
        condition is looked at again on every change: a change that is no news for this follower (another
        follower's fetch) does not answer it, so two caught-up followers never wake each other in turn."""
        log = self.log.log
        min_bytes = max(1, min_bytes)
        now = trio.current_time()
        lingered, polled = now + max_wait_s, now + FETCH_WAIT_S
        while self._fenced is None:
            new = log.written_offset - offset
            if new >= min_bytes or new > 0 and self._ack_waiters:
                return
            news = new > 0 or log.confirm_offset > progress.sent_confirm
            until = min(lingered, polled) if news else polled
            if trio.current_time() >= until:
                return
            changed = self._changed
            with trio.move_on_at(until):
                await changed.wait()

    def _progress(self, member: str, progress: _Follower, offset: int, held: int) -> None:
        now = trio.current_time()
        progress.written = offset
        progress.held = held
        progress.fetched_at = now
        if offset >= progress.sent_written >= 0:  # it had all the leader had when it was last answered
            progress.caught_up_at = max(progress.caught_up_at, progress.sent_at)
        if offset >= self.log.log.written_offset:
            progress.caught_up_at = now
        if member not in self._isr and held >= self.log.log.confirm_offset:
            self._isr.add(member)  # counts in the confirm minimum at once; the controller is told after
            progress.caught_up_at = now  # it holds all that is confirmed: its lag counts from here
            self.expands += 1
            LOGGER.info("replica joined the in-sync set", extra={"ctx": {"replica": member, "epoch": self.epoch}})
            self._isr_due.set()
        self._advance()
        self._signal()

    def _advance(self) -> None:
        """Move the confirm offset to the minimum held over the ISR, forward only, and wake dispatch."""
        log = self.log.log
        confirm = min([self.held, *(self._followers[m].held for m in self._isr if m != self.name)])
        confirm = min(confirm, log.written_offset)
        if confirm > log.confirm_offset:
            log.confirm(confirm)
            self.wake_dispatch()
            self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- ISR maintenance ----------------------------------------------------------------------

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """The group's configured replicas changed (``lightgate store add-replica`` / ``remove-replica``): a new one
        may fetch, and joins the ISR once it holds the confirm offset; a removed one no longer counts for ``all``
        nor the quorum, and leaves the ISR at the next maintenance round (the controller first)."""
        self.replicas = tuple(replicas)
        for member in self.replicas:
            if member != self.name:
                self._followers.setdefault(member, _Follower())
        for member in [m for m in self._followers if m not in self.replicas and m not in self._isr]:
            del self._followers[member]
        self._isr_due.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the ISR: remove the followers that lag more than ``max_lag_s`` (the controller first), record the
        ones that joined. Runs until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_after(self.max_lag_s / 4):
                await self._isr_due.wait()
            self._isr_due = trio.Event()
            if self._fenced is not None:
                continue
            now = trio.current_time()
            written = self.log.log.written_offset
            lagging = {m for m in self._isr - {self.name}  # one that has everything (waiting for more) is in sync
                       if m not in self.replicas or (self._followers[m].written < written
                                                     and now - self._followers[m].caught_up_at > self.max_lag_s)}
            if lagging:
                if await self._record(sorted(self._isr - lagging)):
                    self._isr -= lagging
                    for member in lagging - set(self.replicas):  # removed from the group: forgotten
                        del self._followers[member]
                    self.shrinks += len(lagging)
                    LOGGER.warning("replicas left the in-sync set: they lag more than replication.max_lag_s",
                                   extra={"ctx": {"replicas": sorted(lagging), "epoch": self.epoch,
                                                  "max_lag_s": self.max_lag_s}})
                    self._advance()
                    self._signal()
            elif self._isr != self._isr_recorded:
                await self._record(sorted(self._isr))
            self._advance()  # a lone leader's fsyncs, under the sync flush policy

    async def _record(self, members: list[str]) -> bool:
        """Have the controller record ``members`` as the ISR; False if it did not (tried again next round, or
        fenced: it refused)."""
        try:
            recorded = await self.controller.set_isr(self.epoch, members)
        except Exception as exc:  # the controller is unreachable: the ISR stays as it is, the lease decides
            LOGGER.warning("the ISR change could not be recorded; retrying", extra={"ctx": {
                "epoch": self.epoch, "isr": members, "error": repr(exc)}})
            return False
        if not recorded:
            self._fence("the controller refused an ISR change of this epoch")
            return False
        self._isr_recorded = set(members)
        return True

    # --- figures ------------------------------------------------------------------------------

    def statistics(self) -> ReplicationStatistics:
        """Role, epoch, confirm offset, each follower's held offset, lag and ISR membership, and the role loop's
        counts: the leader's ``StoreStatistics.replication`` and its replica's ``/metrics``."""
        log = self.log.log
        written = log.written_offset
        now = trio.current_time()
        role = self.role
        return ReplicationStatistics(
            role="leader", group=role.group, name=self.name, epoch=self.epoch,
            confirm_offset=log.confirm_offset, written_offset=written, leader_end=written, isr=sorted(self._isr),
            followers=[FollowerStatistics(name, f.held, written - f.held, name in self._isr,
                                          round(now - f.fetched_at, 3) if f.fetched_at >= 0 else None)
                       for name, f in sorted(self._followers.items())],
            shrinks=self.shrinks, expands=self.expands, acks=self.acks, fenced=self._fenced is not None,
            elections=role.elections, truncations=role.truncations, leader_changes=role.leader_changes)

    def figures(self) -> dict[str, Any]:
        """``statistics()`` as the store's periodic statistics log line shows it."""
        stats = self.statistics()
        return {"role": stats.role, "epoch": stats.epoch, "acks": stats.acks, "fenced": stats.fenced,
                "written": stats.written_offset, "confirm": stats.confirm_offset, "isr_size": len(stats.isr),
                "isr": stats.isr, "shrinks": stats.shrinks, "expands": stats.expands,
                "followers": {f.name: {"held": f.held, "lag_bytes": f.lag_bytes, "in_isr": f.in_isr,
                                       "since_fetch_s": f.since_fetch_s} for f in stats.followers}}
