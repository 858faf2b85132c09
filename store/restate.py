"""Restating the live state before retention deletes the records that made it, so the log alone keeps holding it.

A session saved once and never again, a filter held for months, a group's commit: their control records age out
of the CommitLog with the segments that hold them, while the state they made is still live. Before retention
deletes segments (``CommitLog.add_retention_prelude``), every ``ControlApplier``'s :meth:`restate` is appended
at the log's end, in one batch, and flushed; only then are the segments deleted. A rebuild from the remaining
log (a replica, an index deleted or repaired) derives the same state.

Crash safety. A crash before the restatement is durable deletes nothing (the deletion waits for the prelude; a
prelude that fails defers retention to its next run). A crash after it and before the deletion leaves both the old
records and the restatement: applying is idempotent and the restatement says the same as the state they made.

No gap. The restatement is the state as of one log offset: dispatch has applied every record below the log's end
(its lock held, so no step runs meanwhile) and the batch is appended only if the log still ends there
(``CommitLog.append_computed``); otherwise a control record appended meanwhile (a session ended) could be
applied before a restatement that predates it, and a rebuild would bring back what it ended. Under appends the
attempt is repeated after dispatching what came; after ``ATTEMPTS`` tries (a log appended to without pause) the
state is read and appended with the log's append lock held, so appends wait for it (a pause as long as reading
the state: retention must not wait for a quiet moment that may never come).

A replicated leader. Dispatch never passes the confirm offset, which the leader holds below the written end until
the followers confirm (``CommitLog.hold_confirm``): the state can only be read as of a *confirmed* end, so each
attempt first waits (``CommitLog.wait_confirmed``, no lock held, no spinning) for the end it saw to be confirmed,
and appends only if the log still ends at the confirm offset dispatch reached. The last resort cannot take the
append lock and wait there: followers confirm through that lock, so waiting under it would deadlock. Under the
lock it restates only if the end is confirmed at that moment (then nothing can move it), else the run is deferred
with one log line (``RetentionDeferred``), as it is when the followers do not confirm within ``CONFIRM_WAIT_S``
(a follower that stopped leaves the in-sync set after ``replication.max_lag_s``, and the next run succeeds).
Retention is deferred, never done with a restatement a rebuild could misread. The deletion also waits for the
followers to confirm the restatement itself (``Replication``'s own prelude, store/replica/leader.py).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Protocol

from store.control import Control, RetainedKept, encode_control
from store.log.commitlog import CommitLog
from store.log.errors import RetentionDeferred
from store.log.record import RecordTooLarge, now_ms

__all__ = ["ATTEMPTS", "CONFIRM_WAIT_S", "Restatable", "restate"]

LOGGER = logging.getLogger(__name__)

ATTEMPTS = 20
"""Tries at appending the restatement with nothing between it and the state it restates, without stopping
appends; each retry first dispatches what was appended meanwhile. Then appends are held while it is made."""

CONFIRM_WAIT_S = 5.0
"""How long one attempt waits for the replicas to confirm the log's end before retention is deferred to its next
run: longer than a healthy follower's round trip, short enough not to hold the retention thread."""


class Restatable(Protocol):
    """What a restatement reads the state from: ``store.dispatch.Dispatcher``, which adds :func:`restate` to its
    log's retention preludes (so this module names the two calls it makes, and does not import it back)."""

    def caught_up(self) -> AbstractContextManager[int]:
        """Dispatch held still, caught up to the log's confirm offset, which it yields."""

    def restated(self, cut: int, chunk_bytes: int) -> list[Control]:
        """The live state of every part, as control records."""


def restate(log: CommitLog, dispatcher: Restatable, new_min_offset: int) -> int:
    """Append, durably, the live state of every applier of ``dispatcher`` (a retention prelude: retention is about
    to delete the records below ``new_min_offset``). Returns the number of records appended.

    Raises:
        RecordTooLarge: a restated record exceeds the log's maximum record size (retention waits, and says why).
        OSError: the log refused the append (a full disk) or the flush.
    """
    for _ in range(ATTEMPTS):
        if not log.wait_confirmed(log.written_offset, CONFIRM_WAIT_S):
            raise RetentionDeferred(f"the replicas did not confirm the log's end within {CONFIRM_WAIT_S} s")
        end, records = _restated(log, dispatcher, new_min_offset)
        if not records:
            return 0
        if log.append_computed(lambda at, end=end, records=records: records if at == end else None) is not None:
            break
    else:
        made: list[bytes] = []
        confirmed: list[bool] = []

        def under_the_lock(at: int) -> list[bytes] | None:
            confirmed.append(log.confirm_offset == at)
            if not confirmed[0]:  # replicas confirm through this lock: waiting here would deadlock
                return None
            end, records = _restated(log, dispatcher, new_min_offset)
            if end != at:  # nothing appends or confirms without the lock: a bug, not a race
                raise RuntimeError(f"the CommitLog's end moved from {at} to {end} under its append lock")
            made.extend(records)
            return records

        log.append_computed(under_the_lock)
        if not confirmed[0]:
            raise RetentionDeferred(f"the replicated log's end was not confirmed with nothing appended after it"
                                    f" in {ATTEMPTS} attempts")
        if not made:
            return 0
        records = made
    log.flush()
    LOGGER.info("live state restated before retention", extra={"ctx": {
        "records": len(records), "retention_min_offset": new_min_offset}})
    return len(records)


def _restated(log: CommitLog, dispatcher: Restatable, cut: int) -> tuple[int, list[bytes]]:
    """The log's confirmed end, and the records restating every part's state as of it (dispatch caught up to it)
    and the queues' numbering at ``cut``."""
    now, limit = now_ms(), log.config.max_record_bytes
    with dispatcher.caught_up() as end:
        controls = dispatcher.restated(cut, limit // 2)
    records = []
    for control in controls:
        try:
            records.append(encode_control(control, now, limit)[0])
        except RecordTooLarge:
            if not isinstance(control, RetainedKept):
                raise
            # A retained message within a few bytes of the record limit does not fit a record with its topic
            # around it: it stays retained, but a rebuild from a log without its record would not bring it back.
            LOGGER.error("retained message too large to restate before retention deletes its record",
                         extra={"ctx": {"topic": control.topic, "offset": control.offset}})
    return end, records
