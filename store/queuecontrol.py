"""The light queues' control records: activations, releases, offset commits and session ends, applied in log order.

Whatever the light queues hold besides their entries (a filter's queue id and the offset it is active since, who
holds which filter, consumer offsets) is made by control records (store/control.py) that dispatch applies here, in
log order between the messages it indexes: a replica copying the log, or a rebuild after the index was deleted,
derives the same state, queue ids included (``ActivatedRun``, and ``Activated`` of logs written before, carry the
ids their writer chose). The writes skip the WAL; the dispatcher's flush persists them after the CommitLog's (so
they are never ahead of what the log keeps), and :attr:`QueueControls.checkpoint` says where re-dispatch resumes.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence, final

from lightqueue.queues import LightQueues
from store.control import (ACTIVATIONS, Activated, ActivatedRun, Committed, Control, Released, SessionEnded,
                           activated_runs)
from store.log.record import Record

__all__ = ["QueueControls"]

LOGGER = logging.getLogger(__name__)

RESTATE_BYTES = 32 << 10
"""Filters per restated ``ActivatedRun`` record, in bytes: far below any record size limit in use."""


@final
class QueueControls:
    """The ``ControlApplier`` (store/dispatch.py) of the light queues."""

    def __init__(self, queues: LightQueues) -> None:
        self._queues = queues

    @property
    def checkpoint(self) -> int:
        """Every control record below this CommitLog offset is applied (an index from before control records: its
        dispatch checkpoint, as no record below it is one)."""
        queues = self._queues
        return queues.applied if queues.applied is not None else queues.checkpoint

    @property
    def restated(self) -> bool:
        """Whether this state lives in the log: False for an index written before control records, holding
        holders or offsets that no record made (``open_store`` appends :meth:`restate` once for them)."""
        queues = self._queues
        return queues.applied is not None or not (any(queues.holdings()) or any(queues.owners()))

    def apply(self, record: Record, control: Control) -> None:
        """Apply one control record; the control checkpoint moves past it in the same write."""
        queues = self._queues
        applied = record.offset + record.size
        if isinstance(control, ACTIVATIONS):
            self.apply_activations([(record, control)])
        elif isinstance(control, Released):
            queues.release(control.filter, control.holder, applied=applied)
        elif isinstance(control, Committed):
            try:
                queues.commit_offsets(control.owner, control.offsets, applied=applied)
            except ValueError as exc:
                LOGGER.error("offsets not applied: %s", exc, extra={"ctx": {"offset": record.offset}})
                queues.mark_applied(applied)
        elif isinstance(control, SessionEnded):
            queues.delete_owner(control.client, applied=applied)
        else:
            queues.mark_applied(applied)

    def apply_activations(self, run: Sequence[tuple[Record, Activated | ActivatedRun]]) -> None:
        """Apply a run of activation records in one write, each filter from its record's offset; the control
        checkpoint moves past the last."""
        activations: list[tuple[str, str, int, int | None]] = []
        offsets: list[int] = []  # each activation's record
        for record, control in run:
            if isinstance(control, Activated):
                activations.append((control.filter, control.holder, record.offset, control.qid or None))
            else:
                holder, offset = control.holder, record.offset
                activations += [(f, holder, offset, qid or None) for f, qid in zip(control.filters, control.qids)]
            offsets += [record.offset] * (len(activations) - len(offsets))
        last = run[-1][0]
        errors = self._queues.activate_all(activations, applied=last.offset + last.size)
        for offset, error in zip(offsets, errors):
            if error is not None:  # a filter or id its writer would not have written: never stall on it
                LOGGER.error("activation not applied: %s", error, extra={"ctx": {"offset": offset}})

    def flush(self, offset: int) -> None:
        """Move the checkpoint to ``offset``; the light queues' flush (after this) persists it with the rest."""
        if offset > self.checkpoint:
            self._queues.mark_applied(offset)

    def settle(self) -> None:
        """Nothing of its own to wait for: the light queues' memtable holds the checkpoint (the dispatcher waits)."""

    def restate(self) -> Iterable[Control]:
        """An ``ActivatedRun`` of every holder's filters (with their queue ids; in records of about
        ``RESTATE_BYTES``), a ``Committed`` per owner of offsets."""
        queues = self._queues
        held: dict[str, list[tuple[str, int]]] = {}
        for filter, holder, qid in list(queues.holdings()):
            held.setdefault(holder, []).append((filter, qid))
        for holder, activations in held.items():
            yield from activated_runs(holder, activations, RESTATE_BYTES)
        for owner in list(queues.owners()):
            offsets = queues.get_offsets(owner)
            if offsets:
                yield Committed(owner, offsets)

    def rewind(self, log_end: int) -> None:
        """The log ends at ``log_end``: when control records at or past it were applied (the memtable was
        flushed before the log, and the log lost its tail), forget what every control record made, so that
        dispatch applies them again from the log's start (the index entries stay: messages are not re-indexed)."""
        if self.checkpoint > log_end:
            LOGGER.warning("control records past the end of the CommitLog were applied: their state is derived "
                           "again from the log's start", extra={"ctx": {"checkpoint": self.checkpoint,
                                                                        "log_end": log_end}})
            self._queues.forget_controls(log_end)
