"""Control records: what the store knows besides messages, written to the CommitLog as records of their own.

The log is the only truth (docs/storage.md, "Control records"): a filter's activation with the queue id it gets,
its release, a consumer's offset commit, a QoS 2 release, a session's save and end, a client's lifecycle (where
it is connected, its will, its expiry) are each a record, appended like a message (same frame, same CRC, same
flush policy, so its acknowledgement means what a message's means) with ``FLAG_CONTROL`` set, its kind in the
topic field and its body, msgpack, in the payload. Dispatch applies them in log order, between the messages it
indexes (store/dispatch.py, ``ControlApplier``), so whatever RocksDB holds is derived from the log and a copy of
the log (a replica, a rebuild after the index was deleted) derives the same.

This module is the one definition of the kinds and their bodies; it knows nothing of RocksDB or trio.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Union

import msgspec

from store.api import NewMessage
from store.log.record import Record, new_control

__all__ = [
    "ACTIVATIONS", "KIND_PREFIX", "Activated", "ActivatedRun", "ClientClosed", "ClientConnected", "ClientForgotten",
    "Committed", "Control", "ControlError", "Delayed", "FlowsAwaiting", "FlowsReleased", "PopAcked", "PopCheckpoint",
    "PopRestated", "PopRevived", "QueueBases", "Released", "RetainedKept", "SessionEnded", "SessionPatched",
    "SessionSaved", "TimerCancelled", "TimersFired", "TimersRolled", "WillPublished", "activated_runs",
    "decode_control", "encode_all", "encode_control",
]

KIND_PREFIX = "$store/"
"""A control record's topic field is ``$store/<kind>``: readable in a dump, and no MQTT wildcard filter matches a
``$`` topic ([MQTT-4.7.2-1]). Control-ness is the flag, never the topic: a client may publish to ``$store/x``."""


class ControlError(ValueError):
    """A control record whose body does not decode (it passed its CRC: a writer of another version, or a bug)."""


# -- light queues ----------------------------------------------------------------------------------------------


class Activated(msgspec.Struct, frozen=True, array_like=True, tag="activated"):
    """``holder`` holds ``filter``; a wildcard filter's first holder starts its indexing at this record's offset,
    under queue id ``qid`` (chosen by the writer, so every replica gets the same id). Written no more (see
    ``ActivatedRun``), applied in the logs written before."""

    filter: str
    holder: str
    qid: int


class ActivatedRun(msgspec.Struct, frozen=True, array_like=True, tag="activated_run"):
    """``holder`` holds each of ``filters``, in order, as an ``Activated`` record of each would say (``qids[i]`` is
    ``filters[i]``'s id), every one from this record's offset: a SUBSCRIBE run's filters cost one record, not one
    each (a record, a header, a CRC, a decode and a dispatch step per filter made 50 x 1,000 filters CPU-bound,
    issue 31)."""

    holder: str
    filters: list[str]
    qids: list[int]

    def __post_init__(self) -> None:
        if len(self.filters) != len(self.qids):  # decoding fails: a ControlError, the record skipped and logged
            raise ValueError(f"{len(self.filters)} filters with {len(self.qids)} queue ids")


ACTIVATIONS = (Activated, ActivatedRun)
"""The activation record kinds (``isinstance`` of either): ``ActivatedRun`` is written, ``Activated`` still read."""


def activated_runs(holder: str, activations: Sequence[tuple[str, int]], max_bytes: int) -> list[ActivatedRun]:
    """``activations`` (``(filter, qid)``, in order) as ``ActivatedRun`` records of at most about ``max_bytes`` of
    filters each (a record stays under the record size limit; a filter larger than that goes alone)."""
    filters = [filter for filter, _ in activations]
    if sum(map(len, filters)) * 4 + len(filters) * 12 <= max_bytes:  # one record, the usual case (costs below)
        return [ActivatedRun(holder, filters, [qid for _, qid in activations])]
    runs: list[ActivatedRun] = []
    filters = []
    qids: list[int] = []
    size = 0
    for filter, qid in activations:
        cost = len(filter) * 4 + 12  # UTF-8 at most 4 bytes a character, msgpack headers, the id
        if filters and size + cost > max_bytes:
            runs.append(ActivatedRun(holder, filters, qids))
            filters, qids, size = [], [], 0
        filters.append(filter)
        qids.append(qid)
        size += cost
    if filters:
        runs.append(ActivatedRun(holder, filters, qids))
    return runs


class Released(msgspec.Struct, frozen=True, array_like=True, tag="released"):
    """``holder`` no longer holds ``filter`` (its offset on the filter's queue goes; the last holder's release of a
    wildcard filter ends its indexing and deletes its queue)."""

    filter: str
    holder: str


class Committed(msgspec.Struct, frozen=True, array_like=True, tag="committed"):
    """``owner`` (a session or a consumer group) consumed ``{queue: next offset}``; offsets never move back."""

    owner: str
    offsets: dict[str, int]


class QueueBases(msgspec.Struct, frozen=True, array_like=True, tag="queue_bases"):
    """The numbering of the topic queues where retention cut the log at ``cut`` (restated before it deletes the
    records below): ``queues`` ``(name, queue id, queue offset of its first entry at or after cut)`` (its max
    offset when it has none there), and ``next_id``, the next topic queue id. A dispatch that starts an empty
    index at a log cut there (a new replica, a repair) takes it first, so it numbers as the original did; one
    restatement may span several records in a row (all with the same ``cut``; ``more``: another follows)."""

    cut: int
    next_id: int
    queues: list[tuple[str, int, int]]
    more: bool = False


# -- sessions and clients --------------------------------------------------------------------------------------


class SessionSaved(msgspec.Struct, frozen=True, array_like=True, tag="session_saved"):
    """The gateway's session blob of ``client`` (opaque to the store). ``only_existing``: it replaces a blob kept
    when it is applied, and is dropped when there is none (the late save of a client connected nowhere must not
    bring back a session that ended before it in the log)."""

    client: str
    blob: bytes
    only_existing: bool = False


class SessionPatched(msgspec.Struct, frozen=True, array_like=True, tag="session_patched"):
    """Parts of ``client``'s session changed since its last ``SessionSaved`` (the gateway's: a subscription made or
    replaced, by its filter), each kept beside the blob under its key until the next save restates them whole; an
    empty part removes its key (an unsubscription). Dropped when no blob is kept (its session ended before it):
    a SUBSCRIBE costs a record of its own filters, not the whole blob (issue 31)."""

    client: str
    parts: dict[str, bytes]


class SessionEnded(msgspec.Struct, frozen=True, array_like=True, tag="session_ended"):
    """The session of ``client`` ended (expiry, clean start, a clean session's close, an operator's delete): its
    blob, its offsets and held filters, its QoS 2 flows go."""

    client: str


class FlowsReleased(msgspec.Struct, frozen=True, array_like=True, tag="flows_released"):
    """Inbound QoS 2 flows released by PUBREL: ``(client id, packet id, CommitLog offset of the record)``."""

    flows: list[tuple[str, int, int]]


class FlowsAwaiting(msgspec.Struct, frozen=True, array_like=True, tag="flows_awaiting"):
    """The inbound QoS 2 flows as the store knows them (restated: before retention deletes the records that made
    them, and over data of a version without control records): every flow whose record lies below
    ``settled_below`` is released, then ``flows`` (``(client id, packet id, CommitLog offset of the record)``)
    await PUBREL."""

    flows: list[tuple[str, int, int]]
    settled_below: int = 0


class ClientConnected(msgspec.Struct, frozen=True, array_like=True, tag="client_connected"):
    """``client`` connected to gateway node ``node`` with this expiry and will (stored before its CONNACK): after a
    restart the store places it on a restored lease of its node (store/leases.py)."""

    client: str
    node: str
    expiry_s: int
    will: NewMessage | None = None
    will_delay_s: int = 0


class ClientClosed(msgspec.Struct, frozen=True, array_like=True, tag="client_closed"):
    """The connection of ``client`` closed at wall-clock ``closed_ms``: its session expires ``expiry_s`` later
    (0: it ended already, only its will waits), its will (None: none pending) is due ``will_delay_s`` later."""

    client: str
    node: str
    expiry_s: int
    will: NewMessage | None
    will_delay_s: int
    closed_ms: int


class WillPublished(msgspec.Struct, frozen=True, array_like=True, tag="will_published"):
    """The pending will of closed ``client`` was appended: a restart must not publish it again."""

    client: str


class ClientForgotten(msgspec.Struct, frozen=True, array_like=True, tag="client_forgotten"):
    """Nothing is pending for ``client`` any more (its session ended and no will waits)."""

    client: str


# -- retained messages -----------------------------------------------------------------------------------------


class RetainedKept(msgspec.Struct, frozen=True, array_like=True, tag="retained_kept"):
    """``topic``'s retained message is the record ``record`` (its bytes as stored) at CommitLog offset ``offset``:
    restated before retention deletes that record (retained messages outlive the log's retention). Applied in log
    order with the retained messages of the records around it, the latest original offset winning."""

    topic: str
    offset: int
    record: bytes


# -- delayed delivery (store/timer/) ---------------------------------------------------------------------------


class Delayed(msgspec.Struct, frozen=True, array_like=True, tag="delayed"):
    """A message to deliver to ``topic`` at ``due_ms`` (epoch ms): written once, here, under the timer's system
    queue; the timer (store/timer/) points at this record until it fires. ``client`` is the publisher's client
    id, ``properties`` the MQTT 5 property block (wire encoding), ``born_ms`` when the publisher made it."""

    client: str
    topic: str
    due_ms: int
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: bytes = b""
    born_ms: int = 0


class TimersFired(msgspec.Struct, frozen=True, array_like=True, tag="timers_fired"):
    """The messages appended just before this record, in the same write, deliver these timer entries:
    ``(CommitLog offset of the Delayed record, TimerLog position when fired, due ms)``; they never fire again."""

    entries: list[tuple[int, int, int]]


class TimersRolled(msgspec.Struct, frozen=True, array_like=True, tag="timers_rolled"):
    """These timer entries (as in :class:`TimersFired`) are due beyond the wheel's window: each is enqueued again
    (a new TimerLog entry, in a slot the window reaches) and the old entry ends."""

    entries: list[tuple[int, int, int]]


class TimerCancelled(msgspec.Struct, frozen=True, array_like=True, tag="timer_cancelled"):
    """An operator (or the publisher) cancelled these pending timer entries (as in :class:`TimersFired`): each ends
    and its message is never delivered. Written only while the dequeue step cannot fire them
    (store/timer/pending.py)."""

    entries: list[tuple[int, int, int]]


# -- POP consumption (store/pop/) -------------------------------------------------------------------------------


class PopCheckpoint(msgspec.Struct, frozen=True, array_like=True, tag="pop_ck"):
    """A POP of ``group`` on ``queue`` handed ``offsets`` (queue offsets, each with its delivery ``attempts``, 1 the
    first) to ``member`` at ``pop_ms``, invisible to the other members until ``pop_ms + invisible_ms``; the record's
    CommitLog offset is the checkpoint's identity (what receipt handles name). ``cursor``: the group's next queue
    offset never handed out, after this pop; ``gone``: handed-back offsets retention deleted (done: they are lost);
    ``max_attempts``: the group's setting, after which a message not acknowledged goes to the dead-letter queue.
    Written again for one offset, it changes that message's invisible time (its older handles go stale)."""

    group: str
    queue: str
    member: str
    offsets: list[int]
    attempts: list[int]
    pop_ms: int
    invisible_ms: int
    cursor: int
    max_attempts: int
    gone: list[int] = []


class PopAcked(msgspec.Struct, frozen=True, array_like=True, tag="pop_acked"):
    """Members of ``group`` processed ``acks``: ``(queue offset, CommitLog offset of its checkpoint)``; an ack whose
    checkpoint is not the message's current one (it was revived, or its invisible time changed) does nothing."""

    group: str
    queue: str
    acks: list[tuple[int, int]]


class PopRevived(msgspec.Struct, frozen=True, array_like=True, tag="pop_revived"):
    """The revive step: the invisible time of ``retries`` (as in :class:`PopAcked`) passed without an ack, they are
    visible again for their next attempt; ``dead`` passed their last attempt and were appended to the group's
    dead-letter queue just before this record, in the same write (done)."""

    group: str
    queue: str
    retries: list[tuple[int, int]]
    dead: list[tuple[int, int]] = []


class PopRestated(msgspec.Struct, frozen=True, array_like=True, tag="pop_restated"):
    """One POP group's state as it is (restated before retention deletes the checkpoints that made it): its cursor
    and setting, ``inflight`` ``(queue offset, checkpoint offset, visible again at ms, attempt, member)`` and
    ``retry`` ``(queue offset, attempt it is handed out with next)``. Applying it replaces what was kept."""

    group: str
    queue: str
    cursor: int
    max_attempts: int
    inflight: list[tuple[int, int, int, int, str]]
    retry: list[tuple[int, int]]


Control = Union[Activated, ActivatedRun, Released, Committed, SessionSaved, SessionPatched, SessionEnded,
                FlowsReleased, FlowsAwaiting, ClientConnected, ClientClosed, WillPublished, ClientForgotten,
                RetainedKept, Delayed, TimersFired, TimersRolled, TimerCancelled, QueueBases, PopCheckpoint,
                PopAcked, PopRevived, PopRestated]
"""Every control record kind (a tagged union: the tag is the first element of the msgpack array)."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Control)


def encode_control(control: Control, store_ms: int, max_size: int, packet_id: int = 0) -> tuple[bytes, Record]:
    """The record of ``control`` (bytes to append, and the ``Record`` they decode to, offset 0); ``packet_id``: a
    ``Delayed`` record's QoS 2 publisher's (``new_control``).

    Raises:
        RecordTooLarge: the record would exceed ``max_size`` (a session blob over the record limit).
    """
    client = getattr(control, "client", "") or getattr(control, "holder", "") or getattr(control, "owner", "")
    return new_control(_kind(type(control)), _ENCODER.encode(control), store_ms, client, max_size, packet_id)


@functools.cache
def _kind(control_type: type) -> str:
    """The topic field of a kind's records: one string per kind, shared by the records the store keeps decoded
    (store/log/recent.py), as every connection's client-connected record (about 60 B each, issue 31)."""
    return KIND_PREFIX + str(control_type.__struct_config__.tag)  # type: ignore[attr-defined]


def decode_control(record: Record) -> Control:
    """The control a control record carries.

    Raises:
        ControlError: the body does not decode as a known kind.
    """
    try:
        return _DECODER.decode(record.payload)
    except msgspec.DecodeError as exc:
        raise ControlError(f"control record {record.topic!r} at offset {record.offset} does not decode: {exc}") \
            from None


def encode_all(controls: Sequence[Control], store_ms: int, max_size: int) -> list[tuple[bytes, Record]]:
    """:func:`encode_control` for each of ``controls``."""
    return [encode_control(control, store_ms, max_size) for control in controls]
