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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from store.control import RetainedKept, encode_control
from store.log.commitlog import CommitLog
from store.log.record import RecordTooLarge, now_ms

if TYPE_CHECKING:
    from store.dispatch import Dispatcher

__all__ = ["ATTEMPTS", "restate"]

LOGGER = logging.getLogger(__name__)

ATTEMPTS = 20
"""Tries at appending the restatement with nothing between it and the state it restates, without stopping
appends; each retry first dispatches what was appended meanwhile. Then appends are held while it is made."""


def restate(log: CommitLog, dispatcher: Dispatcher, new_min_offset: int) -> int:
    """Append, durably, the live state of every applier of ``dispatcher`` (a retention prelude: retention is about
    to delete the records below ``new_min_offset``). Returns the number of records appended.

    Raises:
        RecordTooLarge: a restated record exceeds the log's maximum record size (retention waits, and says why).
        OSError: the log refused the append (a full disk) or the flush.
    """
    for _ in range(ATTEMPTS):
        end, records = _restated(log, dispatcher)
        if not records:
            return 0
        if log.append_computed(lambda at, end=end, records=records: records if at == end else None) is not None:
            break
    else:
        made: list[bytes] = []

        def under_the_lock(at: int) -> list[bytes]:
            end, records = _restated(log, dispatcher)
            if end != at:  # nothing appends without the lock: a bug, not a race
                raise RuntimeError(f"the CommitLog's end moved from {at} to {end} under its append lock")
            made.extend(records)
            return records

        log.append_computed(under_the_lock)
        records = made
        if not records:
            return 0
    log.flush()
    LOGGER.info("live state restated before retention", extra={"ctx": {
        "records": len(records), "retention_min_offset": new_min_offset}})
    return len(records)


def _restated(log: CommitLog, dispatcher: Dispatcher) -> tuple[int, list[bytes]]:
    """The log's end, and the records restating every part's state as of it (dispatch caught up to it)."""
    with dispatcher.caught_up() as end:
        controls = dispatcher.restated()
    now, limit = now_ms(), log.config.max_record_bytes
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
