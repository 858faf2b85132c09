"""The store's one interface: ``StoreApi``, what a gateway node (or any client of the store) may ask of it.

Two implementations, both complete: ``store.local.LocalStore`` calls a store node in this process (the
embedded gateway, and the RPC server on behalf of each connection), ``store.rpc.client.RemoteStore`` sends
the same calls to a store node process (a cluster gateway, back-end producers and consumers). Code above the
store is written against this protocol only: it never asks which one it has.

Calls come in trio's pairs where waiting is optional: ``append_nowait`` / ``pull_nowait`` do the work before
returning or raise ``trio.WouldBlock`` (a remote store always does: every call is a round trip), and
``append`` / ``pull`` await. Everything else awaits.

The types of the seam live here too, and the RPC carries them as they are (msgspec structs, encoded as
arrays): ``NewMessage`` (a message to append: the one shape a message has from the MQTT channel to the
record), ``PullRequest``, ``PullResult``, ``LogSpan``, ``StoreStatistics``, ``Position``, ``Positions``, ``Flow``.
So do the errors its calls raise and the engine types its answers carry (``Record``, ``LogFullError``,
``RecordTooLarge``, ``OffsetExpired``, ``TopicError``...): re-exported from the modules that raise them, so code
above the store imports only this module (an import-linter contract in pyproject.toml checks it).

Positions, not offsets: a record's place is a ``Position``, the log it is in and its CommitLog offset there. A
store has one log today (``MAIN_LOG``); a sharded store will have several, and the protocol core, which only
carries positions (QoS 2 flows, the session blob), will not change for it.

Leases (store/leases.py): every node holds a lease, and a client's connection belongs to the lease its node
held when the client connected. A remote store carries the epoch of each client's lease and names it in every
write made for the client (appends of its messages, its offsets, its session, its QoS 2 releases); once that
lease has ended (the node was cut off or frozen longer than the lease) the store refuses them
(``LeaseLost``), and ``moved`` reports the client as gone. The embedded store holds one lease for the life of
the process. So the interface has no epoch parameter: the remote side carries it.

This module imports no trio, socket or store engine beyond the definitions it re-exports (store.log.errors,
store.log.record, store.space: no IO at import): the sans-IO protocol code (gateway/mqtt/) builds ``NewMessage``
values from it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, final, overload

import msgspec

from lightqueue.results import PullResult
from lightqueue.topics import SHARE_PREFIX as TOPIC_SHARE_PREFIX
from store.usage import ProcessUsage

# --- the engine's errors and types that cross the seam --------------------------------------
# Defined where they are raised or made (the CommitLog, the record format, the topic grammar, the disk watch),
# which sit below this module: re-exported here, so code above the store (gateway, back-end clients) names
# them from the seam and never imports the engine. Not the other way round: store.log is the bottom layer,
# usable on its own (repair, benchmarks), and must not depend on the interface built over it.
from lightqueue.topics import TopicError
from store.log.errors import InvalidOffset, LogFullError, OffsetExpired, StartupError
from store.log.record import FLAG_RETAIN, HEADER_SIZE, QOS_MASK, Record, RecordTooLarge
from store.space import FULL_RETRY_S

__all__ = [
    "DLQ_PREFIX", "GROUP_PREFIX", "MAIN_LOG", "MAX_ATTEMPTS", "POP_PREFIX", "SHARE_PREFIX", "AdminOp",
    "DelayedCapExceeded", "DelayedMessage", "DelayedPage", "Flow", "FollowerStatistics", "LeaderFenced", "LeaseLost",
    "LogSpan", "MessageChain", "NewMessage", "NotLeader", "PayloadRun", "Popped", "Position", "Positions",
    "PullRequest", "PullResult", "PopStatistics", "ReplicationStatistics", "SESSION_IMAGE", "StoreApi",
    "StoreStatistics", "StoreUnavailable", "TimerStatistics", "any_delayed", "batch_groups", "batch_room", "batchable",
    "by_topic", "dlq_topic", "group_owner", "pop_owner",
    "session_image", "session_parts",
    # the engine's, re-exported (above)
    "FLAG_RETAIN", "FULL_RETRY_S", "QOS_MASK", "InvalidOffset", "LogFullError", "OffsetExpired", "Record",
    "RecordTooLarge", "StartupError", "TopicError",
]

GROUP_PREFIX = "$group/"
"""Group names (offsets owner, filter holder) of back-end consumer groups: ``$group/<name>``, apart from sessions
(client ids) and shared subscriptions."""


def group_owner(group: str) -> str:
    """The owner name (offsets) and holder name (filter activation) of consumer group ``group``: a back-end
    consumer names its group so at the store."""
    return GROUP_PREFIX + group

POP_PREFIX = "$pop/"
"""The owner name (offsets) and holder name (filter activation) of POP group ``g`` is ``$pop/<g>``: apart from the
claim/ack groups (``$group/``), so one name may be used both ways without sharing an offset."""

DLQ_PREFIX = "$dlq/"
"""The dead-letter queue of POP group ``g`` is the topic ``$dlq/<g>``: a real topic, read like any other."""

MAX_ATTEMPTS = 16
"""Default deliveries of a POP message (RocketMQ's default): after this many without an ack it is dead-lettered."""


def pop_owner(group: str) -> str:
    """The owner and holder name of POP group ``group`` at the store."""
    return POP_PREFIX + group


def dlq_topic(group: str) -> str:
    """The dead-letter topic of POP group ``group``."""
    return DLQ_PREFIX + group


SESSION_IMAGE = b"\xc1"
"""The first byte of a session stored with parts (``session_image``): a byte no msgpack document starts with, so
an image is never taken for a blob (the gateway's are msgpack)."""

_IMAGE = msgspec.msgpack.Decoder(tuple[bytes, dict[str, bytes]])


def session_image(blob: bytes, parts: Mapping[str, bytes]) -> bytes:
    """A stored session as ``StoreApi.load_session`` returns it: the blob alone when no part was patched since it
    was saved, else ``SESSION_IMAGE`` and msgpack ``[blob, {key: part}]``."""
    if not parts:
        return blob
    return SESSION_IMAGE + msgspec.msgpack.encode((blob, dict(parts)))


def session_parts(stored: bytes) -> tuple[bytes, dict[str, bytes]]:
    """The blob and the parts of a stored session (``session_image``).

    Raises:
        msgspec.DecodeError: an image that does not decode.
    """
    if not stored.startswith(SESSION_IMAGE):
        return stored, {}
    return _IMAGE.decode(memoryview(stored)[1:])


SHARE_PREFIX = TOPIC_SHARE_PREFIX
"""Group names of MQTT shared subscriptions: ``$share/<group>``, as in the filters that make them. Client ids are
opaque, so the prefix keeps groups apart from sessions in practice, as EMQX does."""


class AdminOp(enum.StrEnum):
    """What a gateway's admin API asks of the node a client is connected to (``StoreApi.admin_call``,
    docs/operations.md)."""

    CLIENT = "client"  # the connection's details (``GET /api/v1/clients/{id}``)
    SESSION = "session"  # the live session and its lags (``GET /api/v1/sessions/{id}``)
    DISCONNECT = "disconnect"  # close it as an administrative action (``DELETE /api/v1/clients/{id}``)
    DELETE_SESSION = "delete_session"  # disconnect it and end its session (``DELETE /api/v1/sessions/{id}``)
    CLIENTS = "clients"  # a page of the node's clients (``GET /api/v1/clients``; the query in the ask)
    SESSIONS = "sessions"  # the node's sessions (``GET /api/v1/sessions``)
    QUEUES = "queues"  # the queues its sessions read (``GET /api/v1/queues``)
    NODE = "node"  # the node itself: its process's CPU and memory, its clients (``GET /api/v1/nodes``)


MAIN_LOG = 0
"""The id of a store's one CommitLog (a sharded store will number its logs from it)."""


class Position(msgspec.Struct, frozen=True, array_like=True, gc=False, order=True):
    """Where a record is: ``offset`` in CommitLog ``log``. Ordered as (log, offset), which means something only
    within one log: offsets of different logs say nothing of which record came first."""

    log: int
    offset: int

    @property
    def id(self) -> str:
        """This position as a short opaque string: a delayed message's id (its ``Delayed`` record's position), which
        its publisher gets (the MQTT 5 PUBACK / PUBREC, the HTTP publish answer, a producer's send) and which
        lists and cancels it (:meth:`StoreApi.delayed_cancel`)."""
        return f"{self.log:x}-{self.offset:x}"

    @classmethod
    def parse(cls, text: str) -> Position:
        """The position :attr:`id` made ``text`` from.

        Raises:
            ValueError: ``text`` is no such id.
        """
        log, dash, offset = text.partition("-")
        if not dash or not _ID_PART.fullmatch(log) or not _ID_PART.fullmatch(offset):
            raise ValueError(f"{text!r} is not a delayed message id")
        return cls(int(log, 16), int(offset, 16))


_ID_PART = re.compile("[0-9a-f]{1,16}")
"""One hex field of a ``Position.id``: at most 64 bits, so a parsed id always fits the wire's integers."""


class Positions(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where an append put its messages: one log (an append is one write) and their offsets in it, in order.

    ``positions[i]`` is the i-th message's ``Position``, made when asked for: an append returns one of these per
    batch rather than a struct per message (a QoS 0 flood asks for none).
    """

    log: int
    offsets: list[int]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> Position:
        return Position(self.log, self.offsets[index])


class NewMessage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One message to append, as the channel makes it, the RPC carries it and the store encodes it.

    ``properties`` is the MQTT 5 PUBLISH property block (wire encoding, no length prefix); ``born_ms`` when the
    publisher made it (0: when the store takes it); ``packet_id`` a QoS 2 message's id, which its record keeps
    so that the store knows the flow awaits PUBREL (store/awaiting.py); ``deliver_at_ms`` (epoch ms, 0: now)
    makes it a delayed message, which the timer keeps until then (store/timer/). Untracked by the garbage collector: a
    flood makes one per PUBLISH and nothing it holds refers back.
    """

    topic: str
    payload: bytes
    client_id: str = ""
    qos: int = 0
    retain: bool = False
    properties: bytes = b""
    born_ms: int = 0
    packet_id: int = 0
    deliver_at_ms: int = 0


@final
class PayloadRun(Sequence[NewMessage]):
    """Messages of one topic alike but for their payloads, kept as ``like`` (its payload unused) and the payloads:
    a back-end producer's ``send_batch(payloads, topic=...)``.

    A store appends it as batch records without a ``NewMessage`` per message (``StoreNode._batch``): the Python
    per message was most of a batched send's cost. It is a sequence of ``NewMessage`` too, each made when asked
    for, so whatever does not know the form (the RPC's encoding, a run that does not fit one record) takes it as
    such.
    """

    __slots__ = ("like", "payloads", "borns")

    def __init__(self, like: NewMessage, payloads: list[bytes], borns: list[int] | None = None) -> None:
        self.like = like
        self.payloads = payloads
        self.borns = borns  # each message's born_ms, when they differ (None: like's)

    def __len__(self) -> int:
        return len(self.payloads)

    @overload
    def __getitem__(self, index: int) -> NewMessage: ...

    @overload
    def __getitem__(self, index: slice) -> PayloadRun: ...

    def __getitem__(self, index: int | slice) -> NewMessage | PayloadRun:
        borns = self.borns
        if isinstance(index, slice):
            return PayloadRun(self.like, self.payloads[index], None if borns is None else borns[index])
        if borns is None:
            return msgspec.structs.replace(self.like, payload=self.payloads[index])
        return msgspec.structs.replace(self.like, payload=self.payloads[index], born_ms=borns[index])

    def batchable(self, max_record_bytes: int) -> bool:
        """Whether every message of the run may share batch records (:func:`batchable`): its largest does."""
        return batchable(msgspec.structs.replace(self.like, payload=max(self.payloads, key=len)),
                         batch_room(self.like.topic, max_record_bytes))

    @classmethod
    def of(cls, messages: Sequence[NewMessage]) -> PayloadRun | None:
        """``messages`` as a run when there are two or more, alike but for their payloads and born times (none
        delayed or with a packet id): AutoBatch's sends, a publisher's QoS 0 flood. Their fields are compared in one
        pass in C, a tenth of what packing them one by one costs."""
        if len(messages) < 2 or isinstance(messages, PayloadRun):
            return None
        first = messages[0]
        if first.deliver_at_ms or first.packet_id or type(first.properties) is not bytes:  # kept as they are
            return None
        count = len(messages)
        columns = list(zip(*map(msgspec.structs.astuple, messages)))  # every message's fields, in C: no getattr each
        if not all(columns[field].count(columns[field][0]) == count for field in _ALIKE):
            return None
        payloads = list(columns[_PAYLOAD_AT])
        if type(payloads[0]) is not bytes or not _same(type, payloads):  # a codec's memoryview: kept as a copy
            payloads = [bytes(p) for p in payloads]
        return cls(first, payloads, list(columns[_BORN_AT]))


@final
class MessageChain(Sequence[NewMessage]):
    """Several callers' messages in one append, kept as their parts (sequences of ``NewMessage``, a
    ``PayloadRun`` among them): a gateway's read round. A store that knows the form encodes a ``PayloadRun`` part
    as batch records without a ``NewMessage`` per message (``StoreNode._encode_runs``); whatever does not takes
    it as the flat sequence it also is."""

    __slots__ = ("parts", "_count")

    def __init__(self, parts: list[Sequence[NewMessage]]) -> None:
        self.parts = parts
        self._count = sum(map(len, parts))

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> NewMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[NewMessage]: ...

    def __getitem__(self, index: int | slice) -> NewMessage | list[NewMessage]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._count
        for part in self.parts:
            if 0 <= index < len(part):
                return part[index]
            index -= len(part)
        raise IndexError("message index out of range")

    def __iter__(self) -> Iterator[NewMessage]:
        for part in self.parts:
            yield from part


_TOPIC, _CLIENT_ID, _PROPERTIES, _DELIVER_AT, _PACKET_ID, _PAYLOAD = map(attrgetter, (
    "topic", "client_id", "properties", "deliver_at_ms", "packet_id", "payload"))
_FIELDS = {name: index for index, name in enumerate(NewMessage.__struct_fields__)}
_ALIKE = tuple(_FIELDS[name] for name in ("topic", "client_id", "qos", "retain", "properties", "deliver_at_ms",
                                          "packet_id"))
"""The fields messages of a run share, by place in a message's ``astuple``: read as columns (one C call per
message), each compared by ``count`` (equal objects, mostly the same ones); a set per field, or one of
attribute tuples, cost a QoS 0 flood's read round more than twice as much per message (callgrind)."""
_PAYLOAD_AT, _BORN_AT = _FIELDS["payload"], _FIELDS["born_ms"]


def any_delayed(messages: Sequence[NewMessage]) -> bool:
    """Whether one of ``messages`` is delayed, without a ``NewMessage`` made per message of a ``PayloadRun`` (its
    messages are all like its ``like``) or of a ``MessageChain``'s."""
    if isinstance(messages, MessageChain):
        return any(map(any_delayed, messages.parts))
    if isinstance(messages, PayloadRun):
        return bool(messages.like.deliver_at_ms)
    return any(map(_DELIVER_AT, messages))


def _same(field: Callable[[Any], object], messages: Sequence[Any]) -> bool:
    """Whether every message has the same ``field`` (one pass in C; a set, the cheapest such pass, measured;
    a field that is not hashable, a writable memoryview, is taken as different)."""
    try:
        return len(set(map(field, messages))) == 1
    except (TypeError, ValueError):  # ValueError: a writable memoryview
        return False


def _delayed_or_flow(messages: Sequence[NewMessage]) -> bool:
    """Whether a message is delayed or has a QoS 2 packet id: never in a batch record."""
    return any(map(_DELIVER_AT, messages)) or any(map(_PACKET_ID, messages))


def _all_batchable(messages: Sequence[NewMessage], max_record_bytes: int) -> bool:
    """Whether ``messages``, two or more, may all share batch records (:func:`batchable`): one topic, and the
    largest payload, properties and client id together fit (one pass per field in C, not a check per message)."""
    if isinstance(messages, PayloadRun):
        return messages.batchable(max_record_bytes)
    if not _same(_TOPIC, messages) or _delayed_or_flow(messages):
        return False
    largest = max(map(len, map(_PAYLOAD, messages))) + max(map(len, map(_PROPERTIES, messages))) + \
        max(map(len, map(str.encode, map(_CLIENT_ID, messages))))
    return largest <= batch_room(messages[0].topic, max_record_bytes)


def by_topic(messages: Sequence[NewMessage]) -> list[list[int]]:
    """The indexes of ``messages`` in runs of one topic each: topics in the order of their first message, each
    run in the order sent.

    How a batch of many messages goes to one append (a back-end producer's, an HTTP bulk publish): a same-topic
    run is what the store can write as one batch record, and per topic the order of the messages, the one MQTT
    promises, is kept; messages of different topics in one batch may be stored in another order than sent.
    """
    runs: dict[str, list[int]] = {}
    for index, message in enumerate(messages):
        runs.setdefault(message.topic, []).append(index)
    return list(runs.values())


BATCH_RECORD_MARGIN = 4096
"""Bytes a message's single record must stay below the store's record limit to go in a batch record (a quarter of
the limit, if less): the batch record's message count and message header, and its target-queue section (4 bytes per
wildcard filter the topic matches: room for about a thousand)."""


def batch_room(topic: str, max_record_bytes: int) -> int:
    """The bytes a message of ``topic`` may hold (payload, properties, client id) to go in a batch record
    (``BATCH_RECORD_MARGIN``): one that fits fails only for what fails every message of its topic, not for size."""
    return max_record_bytes - HEADER_SIZE - min(BATCH_RECORD_MARGIN, max_record_bytes // 4) - len(topic.encode())


def batchable(message: NewMessage, room: int) -> bool:
    """Whether ``message`` may share a batch record of its topic (``room``: :func:`batch_room`): not delayed, no
    QoS 2 packet id, small enough."""
    return not (message.deliver_at_ms or message.packet_id) and \
        len(message.payload) + len(message.properties) + len(message.client_id.encode()) <= room


def batch_groups(messages: Sequence[NewMessage], max_record_bytes: int) -> tuple[list[list[int]], list[bool]]:
    """The groups of an ``append_groups`` that writes same-topic runs as batch records and lets each message fail
    alone: the indexes of ``messages`` per group, and whether each group is batched.

    Per topic (:func:`by_topic`), each stretch of two or more messages that can share a batch record is a batched
    group (the store writes it as batch records that fit its limit, all or nothing); every other message is a
    group of its own: a delayed one, one with a packet id, one whose single record is not ``BATCH_RECORD_MARGIN``
    below ``max_record_bytes`` (0: unknown, nothing is batched). Groups keep each topic's order. So a batched
    group fails only for what fails every message of its topic alike (the ACL, a full disk), not for size. What
    remains: a topic matching so many wildcard filters that its target-queue section outgrows the margin fails
    its batched group whole with ``RecordTooLarge``. Messages of one topic that all fit (a ``PayloadRun``, an
    AutoBatch of one topic) are one batched group, found in a few passes in C (``_all_batchable``).
    """
    if len(messages) > 1 and _all_batchable(messages, max_record_bytes):
        return [list(range(len(messages)))], [True]
    groups: list[list[int]] = []
    batched: list[bool] = []
    for run in by_topic(messages):
        room = batch_room(messages[run[0]].topic, max_record_bytes)
        stretch: list[int] = []
        for i in run:
            if batchable(messages[i], room):
                stretch.append(i)
                continue
            if stretch:
                groups.append(stretch)
                batched.append(len(stretch) > 1)
                stretch = []
            groups.append([i])
            batched.append(False)
        if stretch:
            groups.append(stretch)
            batched.append(len(stretch) > 1)
    return groups, batched


class PullRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Read up to ``max_count`` messages (and about ``max_bytes``) of ``queue`` from queue offset ``from_offset``."""

    queue: str
    from_offset: int
    max_count: int = 32
    max_bytes: int = 1 << 20


class LogSpan(msgspec.Struct, frozen=True, array_like=True):
    """The answer of ``read_log``: log ``log``'s bytes from offset ``start`` to at most ``data_end`` (see
    ``CommitLog.read_span``), and that log's current flushed and minimum offsets (all offsets of ``log``)."""

    log: int
    start: int
    data: bytes
    data_end: int
    flushed: int
    min_offset: int


class TimerStatistics(msgspec.Struct, frozen=True, array_like=True):
    """The delayed messages of the store (store/timer/): pending now, and since the store started: scheduled
    (enqueued by their Delayed record), fired (delivered to their topic), rolled (due beyond the wheel's window),
    cancelled (never to be delivered), and how late each fired one went out (``lateness_counts[i]`` below
    ``lateness_bounds[i]``, the last above all)."""

    pending: int
    scheduled: int
    fired: int
    rolled: int
    lateness_bounds: tuple[float, ...]
    lateness_counts: list[int]
    lateness_sum_s: float
    cancelled: int = 0


class PopStatistics(msgspec.Struct, frozen=True, array_like=True):
    """The POP groups of the store (store/pop/): groups known and messages in flight (invisible) or waiting for a
    retry now, and by the records applied since the store started: messages popped (first deliveries and retries,
    not invisible-time changes), acknowledged, revived for another attempt, dead-lettered."""

    groups: int
    inflight: int
    waiting: int
    popped: int
    acked: int
    revived: int
    dead: int


class DelayedMessage(msgspec.Struct, frozen=True, array_like=True):
    """A pending delayed message as an operator sees it (``StoreApi.delayed_list``): where its ``Delayed`` record
    is (``position.id`` is its id), its real topic, its publisher's client id, when it is due (epoch ms), its QoS,
    retain flag and payload size."""

    position: Position
    topic: str
    client_id: str
    due_ms: int
    qos: int
    retain: bool
    payload_bytes: int


class DelayedPage(msgspec.Struct, frozen=True, array_like=True):
    """One page of ``StoreApi.delayed_list``: its messages, and where the next page starts (``after``; 0: this was
    the last). A page may hold fewer than asked for (a bounded walk) and still have a next one."""

    messages: list[DelayedMessage]
    next: int


class FollowerStatistics(msgspec.Struct, frozen=True, array_like=True):
    """A follower as its leader sees it from its fetches (store/replica/leader.py)."""

    name: str
    held: int  # what it holds: written, or fsynced under its sync flush policy
    lag_bytes: int  # the leader's written end minus ``held``
    in_isr: bool  # counted in the confirm offset (the in-sync set)
    since_fetch_s: float | None  # seconds since its last fetch (None: it never fetched in this epoch)


class ReplicationStatistics(msgspec.Struct, frozen=True, array_like=True):
    """One replica of a replicated store group: its role and position, the leader's view of its followers, and
    what its role loop counted since the process started (docs/operations.md, "Metrics")."""

    role: str  # leader | follower
    group: str
    name: str
    epoch: int  # the epoch it leads or follows
    confirm_offset: int  # what dispatch, pulls and readers may see
    written_offset: int  # its log's end
    leader_end: int  # the leader's written end: a follower's as its last Frames said (-1: none yet)
    isr: list[str] = []  # leader: the in-sync set, itself included
    followers: list[FollowerStatistics] = []  # leader: each other configured replica
    shrinks: int = 0  # leader: followers that left the in-sync set in this epoch
    expands: int = 0  # leader: followers that joined it in this epoch
    acks: str = ""  # leader: its acks mode
    fenced: bool = False  # leader: it acknowledges nothing any more (lease gone, or a newer leader)
    elections: int = 0  # elections this replica won
    truncations: int = 0  # times its log was cut back to agree with a new leader's
    leader_changes: int = 0  # times it saw another leader or epoch after the first it saw

    @property
    def lag_bytes(self) -> int:
        """How far this replica's log is behind the leader's end (0 for the leader)."""
        return max(0, self.leader_end - self.written_offset)


class StoreStatistics(msgspec.Struct, frozen=True, array_like=True):
    """The store's figures an operator watches (metrics, ``$SYS``, the admin API)."""

    written_offset: int  # CommitLog end: bytes appended since the log began
    flushed_offset: int  # everything below is on disk
    dispatched_offset: int  # everything below is indexed
    log_bytes: int  # bytes of records the CommitLog still holds (retention keeps it bounded)
    queue_ids: int  # light-queue ids allocated so far
    active_filters: int  # wildcard filters being indexed
    retained: int  # retained messages
    notify_sent: int  # events routed to gateway nodes
    notify_suppressed: int  # node-events not sent because the node had no session on the queue
    notify_by_node: dict[str, int] = {}  # attached node -> events routed to it
    corrupt_records: int = 0  # corrupt CommitLog records found and skipped since the store started (each once)
    disk_full: bool = False  # the data disk is full: new messages are refused until space frees
    process: ProcessUsage | None = None  # the store node's process: pid, CPU seconds, RSS (the cluster view)
    timers: TimerStatistics | None = None  # delayed messages (store/timer/)
    replication: ReplicationStatistics | None = None  # the leader of a replicated group: its view (None: unreplicated)
    log_writes: int = 0  # CommitLog writes since the store started: each appends one or more records (a batch)
    pops: PopStatistics | None = None  # POP groups (store/pop/)

    @property
    def dispatch_lag(self) -> int:
        """Bytes appended and not indexed yet."""
        return self.written_offset - self.dispatched_offset


class Flow(NamedTuple):
    """An inbound QoS 2 flow: the client, the packet id, and the position of the message's record."""

    client_id: str
    packet_id: int
    position: Position


class Popped(NamedTuple):
    """One message a POP handed out: its receipt ``handle`` (opaque: ``pop_ack``, ``change_invisible``), which
    delivery this is (``attempt``, 1 the first), its queue ``offset`` and the stored record."""

    handle: str
    attempt: int
    offset: int
    record: Record


class StoreUnavailable(ConnectionError):
    """The store cannot be reached now (a remote store not connected, or the connection broke during the call).

    The call may or may not have taken effect; nothing that depends on it is acknowledged to a device.
    """


class LeaderFenced(StoreUnavailable):
    """A replicated store's leader could not acknowledge a write it had appended: its leader lease is gone, or the
    controller fenced it (store/replica/leader.py). The write may reach the next leader or not: unlike
    :class:`NotLeader` (nothing done), its outcome is unknown, as a broken connection's is; nothing is
    acknowledged, and the caller must not write it again on its own (its client resends)."""


class NotLeader(StoreUnavailable):
    """The store replica reached does not lead its group now: it serves nothing and names the leader it knows
    (``leader``, ``host:port``; empty when no leader is known now, during an election). The client tries there
    next: nothing was done."""

    def __init__(self, leader: str) -> None:
        super().__init__(f"this store replica does not lead: the leader is {leader or 'not known now'}")
        self.leader = leader


class LeaseLost(ConnectionError):
    """A write for a client of a lease that has ended: the client is no longer this node's (it may have connected
    to another node since), so the store refused it. Nothing is acknowledged for it."""





class DelayedCapExceeded(ValueError):
    """A delayed message refused: its client has as many delayed messages pending as the store allows
    (``open_store(timer_max_pending=...)``, setting ``delayed.max_pending_per_client``). Nothing of its append was
    stored; MQTT answers 0x97 (quota exceeded), or closes a 3.1.1 connection."""


class StoreApi(Protocol):
    """What a gateway node, a producer or a consumer needs from the store (see the module docstring).

    ``node`` is the caller's name at the store: the store routes events, client notices and admin calls to it.
    """

    node: str

    # --- messages -------------------------------------------------------------------------

    def append_nowait(self, messages: Sequence[NewMessage]) -> Positions:
        """:meth:`append` (not durable) done before returning: the messages' positions.

        Raises:
            trio.WouldBlock: the store cannot append without waiting (a remote store never can; the sync flush
                policy; dispatch lagging); nothing was appended.
            others: as :meth:`append`.
        """
        ...

    async def append(self, messages: Sequence[NewMessage], *, durable: bool | None = None,
                     batch: bool = False) -> Positions:
        """Append messages in one write, their target queues fixed now; returns their positions.

        Returns once they are appended, and on disk when ``durable`` (or when the flush policy is sync and
        ``durable`` is None). ``batch``: the messages, all of one topic, none delayed nor with a packet id, go in
        one batch record (one record, one CRC, one index entry per queue; docs/storage.md, "Batch records"): each
        still has a position and a queue offset of its own, and readers cannot tell.

        Raises:
            RecordTooLarge: a message exceeds the record size limit, or a batch's record does (nothing is
                appended: the caller splits the batch).
            ValueError: a batch of more than one topic, or with a delayed message or a packet id.
            OSError: the write failed (``LogFullError`` when the disk is full); nothing is acknowledged.
            ConnectionError: ``StoreUnavailable``, or ``LeaseLost`` for messages of a client of an ended lease.
        """
        ...

    async def append_groups(self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None,
                            batched: Sequence[bool] = ()) -> Sequence[Positions | Exception]:
        """:meth:`append` of several groups in one write (one request): per group its positions, or the exception
        that kept that group (only) out (``RecordTooLarge``, ``ValueError``, ``DelayedCapExceeded``, and over
        the RPC ``AccessDenied``); ``batched[i]``: group i goes in batch records (:func:`batch_groups` makes
        groups that fail only whole).

        Raises:
            OSError, ConnectionError: as :meth:`append`, for every group.
        """
        ...

    @property
    def max_record_bytes(self) -> int:
        """The store's ``commitlog.max_record_bytes`` (0: unknown: a store that did not say)."""
        ...

    def pull_nowait(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """:meth:`pull` done before returning, when the reads are small or in memory.

        Raises:
            trio.WouldBlock: the reads would block the event loop (a remote store's always would).
        """
        ...

    async def pull(self, requests: Sequence[PullRequest]) -> list[PullResult[Record]]:
        """The results of several queue reads, in request order."""
        ...

    async def max_offsets(self, queues: Sequence[str]) -> list[int]:
        """The next queue offset of each queue (0 for a queue never written)."""
        ...

    def max_offsets_nowait(self, queues: Sequence[str]) -> list[int]:
        """:meth:`max_offsets` done before returning, as dispatch has them now: with the queues watched first
        (:meth:`watch`), any later message on them comes as news, so a queue read up to this offset needs no read
        until then.

        Raises:
            trio.WouldBlock: the store is not in this process (a remote store's answer is a round trip).
        """
        ...

    async def retained(self, filter: str) -> list[Record]:
        """The retained messages whose topics match ``filter``."""
        ...

    async def retained_all(self, filters: Sequence[str]) -> list[list[Record]]:
        """:meth:`retained` of each of ``filters``, in order (an embedded store looks them up in one worker-thread
        hop: a SUBSCRIBE's filters, or a connection's SUBSCRIBEs read together)."""
        ...

    async def read_log(self, start: Position, max_bytes: int) -> LogSpan:
        """Log ``start.log``'s raw bytes from the record boundary ``start.offset`` (``CommitLog.read_span``), up
        to its flushed offset, for readers that frame records themselves; ``max_bytes`` 0 returns only the log's
        bounds.

        Raises:
            OffsetExpired: the offset is below the log's minimum (retention).
            InvalidOffset: the offset is beyond the flushed offset, or the store has no such log.
        """
        ...

    async def statistics(self) -> StoreStatistics:
        """The store's current figures."""
        ...

    # --- delayed messages (store/timer/) ---------------------------------------------------

    async def delayed_list(self, *, topic: str = "", client_id: str = "", after: int = 0,
                           limit: int = 100) -> DelayedPage:
        """A page of the pending delayed messages, of real topic ``topic`` and publisher ``client_id`` when given
        (empty: any), in the order the timer holds them, from where the previous page's ``next`` said (``after``;
        0: the start). Bounded: at most ``limit`` messages, and a bounded walk of the timer per page.

        Raises:
            ValueError: ``limit`` is not positive, or ``after`` is negative.
        """
        ...

    async def delayed_cancel(self, position: Position) -> bool:
        """Cancel the pending delayed message whose ``Delayed`` record is at ``position`` (its id): a
        ``TimerCancelled`` record, stored as the flush policy promises and applied on return; it is never delivered.
        False (nothing done) when no such message is pending: an unknown id, or one already fired or cancelled."""
        ...

    # --- subscriptions and offsets --------------------------------------------------------

    async def activate(self, queue: str, holder: str) -> int:
        """Hold the queue's filter for ``holder``; returns the queue offset the subscription starts at.

        Raises:
            TopicError: not a valid topic filter.
            ValueError: the queue id space is exhausted.
        """
        ...

    async def activate_all(self, queues: Sequence[str], holder: str) -> list[int | ValueError]:
        """:meth:`activate` of each of ``queues`` for one holder: each one's start, or the ``TopicError`` or
        ``ValueError`` that refused it alone (an embedded store writes them in one CommitLog write).

        Raises:
            LogFullError: the disk is full; none of them is held.
        """
        ...

    async def release(self, queue: str, holder: str) -> bool:
        """Stop holding the queue's filter (the holder's offset on it goes too); True if ``holder`` held it."""
        ...

    async def get_offsets(self, owner: str) -> dict[str, int]:
        """``{queue: next offset}`` committed by ``owner`` (a client id or a group)."""
        ...

    async def commit_offsets(self, commits: Mapping[str, Mapping[str, int]]) -> None:
        """Store ``{owner: {queue: next offset}}`` durably, in one write. An offset never moves back: a commit
        below the stored one (a late commit of a connection taken over) leaves it."""
        ...

    def watch(self, queue: str) -> None:
        """One more local session reads ``queue``: route its events here (reference counted)."""
        ...

    def unwatch(self, queue: str) -> None:
        """One local session fewer reads ``queue``."""
        ...

    async def events(self) -> dict[str, int]:
        """Wait for and take the merged ``{queue: max offset}`` events routed to this node.

        Raises:
            trio.EndOfChannel: this store client is closed.
        """
        ...

    def events_nowait(self) -> dict[str, int]:
        """:meth:`events` without waiting: what is routed to this node already (the news of an ``append_nowait``
        made in this step, dispatched in it when the store is in this process).

        Raises:
            trio.WouldBlock: none are.
            trio.EndOfChannel: none are and this store client is closed.
        """
        ...

    # --- consumer groups and shared subscriptions (store/groups.py) -------------------------

    async def join(self, group: str, queue: str, member: str, *, start: str = "latest", at: int = 0) -> int:
        """``member`` of this node joins ``group`` on ``queue`` (the group holds the queue's filter); returns the
        group's committed offset. ``start``/``at`` place a group without one (``store.groups.START_KINDS``).

        Raises:
            TopicError, ValueError: a bad filter, group name or start.
        """
        ...

    async def claim(self, group: str, queue: str, member: str, max_count: int, *, max_bytes: int = 1 << 20,
                    wait_s: float = 0.0) -> PullResult[Record]:
        """Messages the group hands ``member`` (theirs until acknowledged), waiting up to ``wait_s`` for some;
        ``next_offset`` is the group's cursor (its next offset never handed out)."""
        ...

    async def ack(self, group: str, queue: str, member: str, offsets: Sequence[int] = (), *, below: int = 0,
                  ranges: Sequence[tuple[int, int]] = ()) -> int:
        """``member`` processed ``offsets``, the ``(base, count)`` ``ranges`` (a claim's runs of offsets: one
        per batch record) and every offset it holds below ``below``; returns the group's committed offset,
        durable on return."""
        ...

    async def leave(self, group: str, queue: str, member: str) -> None:
        """``member`` leaves: what it holds goes to the other members."""
        ...

    # --- POP consumption (store/pop/) -----------------------------------------------------

    async def pop(self, group: str, queue: str, member: str, max_count: int, *, invisible_s: float,
                  wait_s: float = 0.0, max_attempts: int = MAX_ATTEMPTS, max_bytes: int = 1 << 20,
                  start: str = "latest", at: int = 0) -> list[Popped]:
        """Up to ``max_count`` messages of POP group ``group`` on ``queue`` for ``member`` (any number of members
        pop one queue at once), waiting up to ``wait_s`` for some: retries first, then new ones. Each is invisible
        to the group for ``invisible_s``; not acknowledged by then it is handed out again (attempt + 1), and after
        ``max_attempts`` appended to ``dlq_topic(group)`` instead. ``start``/``at`` place a group without an offset
        (``store.groups.START_KINDS``). Durable on return as the flush policy promises (a checkpoint record).

        Raises:
            TopicError, ValueError: a bad filter, group name, start, count or time.
        """
        ...

    async def pop_ack(self, handles: Sequence[str]) -> list[bool]:
        """Acknowledge popped messages (in one record per group); per handle, whether it was acknowledged now:
        False for a stale handle (the message was handed out again, its invisible time changed, or it was
        acknowledged or dead-lettered already). Durable on return as the flush policy promises.

        Raises:
            ValueError: a text that is not a receipt handle.
        """
        ...

    async def change_invisible(self, handle: str, invisible_s: float) -> str | None:
        """The message is invisible ``invisible_s`` from now instead (0: visible again at once, for its next
        attempt: a nack); returns its new handle (the old one is stale), None when ``handle`` is stale.

        Raises:
            ValueError: not a receipt handle, or a negative time.
        """
        ...

    # --- sessions: presence, expiry, wills (store/leases.py) -------------------------------

    async def open_session(self, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None = None, will_delay_s: int = 0) -> bytes | None:
        """Client ``client_id`` connected to this node; returns its stored session (as :meth:`load_session`; None: new).

        The store places the client here (a connection of it on another node is closed there: that node's
        :meth:`moved`), cancels its session's expiry and a will waiting for its delay (with ``clean_start`` the
        old session ends first: that will goes now, its state, offsets, held filters and QoS 2 flows go), and
        holds this connection's will: it is published if this node's lease ends while the client is here.

        Raises:
            LogFullError: a clean start meets a full data disk: nothing was deleted.
        """
        ...

    async def close_session(self, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        """The client's connection here closed: its session expires ``expiry_s`` from now (0: it ends now, or on
        a full data disk once there is room: it cannot resume meanwhile), and the will held for it is published
        ``will_delay_s`` from now unless the session resumes first (None: it is dropped: a normal DISCONNECT, or
        the node published it). Ignored once the client has connected to another node. Never waits for room: a
        close is heard at once, even while writes of the session are owed."""
        ...

    async def save_session(self, client_id: str, blob: bytes) -> None:
        """Keep the session blob of ``client_id`` durably (WAL; fsynced under the sync flush policy)."""
        ...

    async def patch_session(self, client_id: str, parts: Mapping[str, bytes]) -> None:
        """Keep ``parts`` of the stored session of ``client_id`` beside its blob (an empty part removes its key),
        durably as :meth:`save_session`, until the next save replaces them all; nothing is kept when no blob is.
        What :meth:`open_session` and :meth:`load_session` return holds them (``session_image``)."""
        ...

    async def load_session(self, client_id: str) -> bytes | None:
        """The session stored for ``client_id`` (its blob, or ``session_image`` when parts were patched since), or
        None."""
        ...

    async def end_session(self, client_id: str) -> bool:
        """End the session now (an operator's delete): its pending will goes now, its state, offsets, held
        filters and QoS 2 flows go; False when there was none."""
        ...

    async def sessions(self) -> list[str]:
        """The client ids of the stored sessions (connected or not)."""
        ...

    async def awaiting_release(self, client_id: str) -> dict[int, Position]:
        """``{packet id: position of its record}`` of the client's inbound QoS 2 messages stored and awaiting PUBREL:
        derived from the records, complete for everything appended before the call."""
        ...

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """Mark inbound QoS 2 flows released; returns once that is on disk (fsynced), so PUBCOMP may go out."""
        ...

    async def moved(self) -> list[str]:
        """The next clients of this node that are not this node's any more: they connected to another node, or
        this node's lease ended (it was away longer than the lease). Close them without writing for them.

        Raises:
            trio.EndOfChannel: this store client is closed.
        """
        ...

    async def wait_available(self) -> None:
        """Return once calls can reach the store (at once when they can)."""
        ...

    # --- administration across nodes -------------------------------------------------------

    async def admin_call(self, client_id: str, op: AdminOp) -> bytes | None:
        """Have the node ``client_id`` is connected to run admin ``op``; its answer as JSON bytes, or None when
        the client is connected to no other node.

        Raises:
            OSError: that node did not answer in time, or went away.
        """
        ...

    async def admin_call_all(self, op: AdminOp, query: bytes) -> tuple[dict[str, bytes], list[str]]:
        """Have every other node that has clients run list ``op`` with ``query`` (JSON bytes, handed on as they
        are): (their JSON answers by node name, the nodes that did not answer in time or went away)."""
        ...

    async def admin_asks(self) -> tuple[int, str, AdminOp, bytes]:
        """The next admin call of another node about a client of this one, or a list call (client id empty):
        ``(ask id, client id, op, query)``.

        Raises:
            trio.EndOfChannel: this store client is closed.
        """
        ...

    def admin_answer(self, ask_id: int, value: bytes | None) -> None:
        """Answer an admin ask with JSON bytes, or None when the client is not connected here."""
        ...
