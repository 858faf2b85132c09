"""The store node's RPC wire format: length-prefixed msgpack frames, one msgspec Struct per message.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
Each message is an array whose first element is its tag (msgspec tagged
unions, ``array_like``): compact, and decoded straight into typed Structs, so
a frame that does not match its type is refused as a whole.

The conversation (docs/cluster.md):

- the gateway opens a TCP connection and sends ``Hello(version, node, ...)``
  (at most ``MAX_HELLO_BYTES``: nothing larger is buffered before the peer is
  authenticated); the store answers ``Welcome`` or an ``Error`` with id 0 and
  closes (wrong version, not a Hello, credentials);
- leases and fencing: the ``Welcome`` names the node's lease (``store_id``,
  ``epoch``) and says whether it is the lease the Hello named (``resumed``).
  A gateway whose lease ended meanwhile (frozen, partitioned) learns it there;
  every write it makes for a client (appends, offset commits, session writes,
  releases, disconnects) carries the epoch the client was accepted under,
  and the store refuses a write of an ended lease (``ErrorKind.FENCED``, or
  ignores it for a one-way message);
- requests carry an id chosen by the client (never 0); the store answers each
  with a response carrying the same id, or ``Error(id, kind, message)``; many
  requests may be in flight, answers come in any order (appends in order);
- one-way messages have no id and no answer: ``Heartbeat`` (both ways, every
  lease / ``HEARTBEATS_PER_LEASE``), ``Watch`` (reference-count deltas of the queues the node's
  sessions read), ``Reattach`` (after a reconnect: a client still connected here, with its will);
- the store pushes ``Events`` (``{queue: max offset}``, merged) and ``ClientMoved`` (a client of this node
  connected to another) at any time;
- cluster administration: a gateway asks about a client connected to another
  node with ``AdminCall``; the store forwards it to that node as ``AdminAsk``,
  whose ``AdminAnswer`` it relays as ``Value``; the lists (``AdminCallAll``) go to
  every other node that has clients, and the answers come back as ``NodeAnswers``.
- back-end producers and consumers (store/clients/producer.py, store/clients/consumer.py) log
  in with the Hello's credentials (store/rpc/access.py) and use appends and the
  consumer-group calls ``Join``, ``Claim``, ``Ack``, ``Leave`` (store/groups.py), and POP consumption's
  ``Pop``, ``PopAck``, ``ChangeInvisible`` (store/pop/).

The messages carry the store interface's own types as they are (``store.api``: ``NewMessage``,
``PullRequest``, ``LogSpan``, ``StoreStatistics``), so a call and its answer have one shape on both sides.

Sans-IO, in the manner of h11: ``FrameDecoder`` turns received bytes into
messages (``receive_data`` then ``next_message`` until ``NEED_DATA``) and
``encode`` turns a message into the bytes of one frame. Neither touches a
socket; store/rpc/server.py and store/rpc/client.py own the sockets.

Error handling: a frame longer than ``max_frame_bytes``, bytes that are not
msgpack, a message of an unknown tag or with fields of the wrong type, and a
connection that ends inside a frame raise ``RpcProtocolError``; the side that
sees it answers ``Error`` (id 0) if it can and closes the connection.
"""

from __future__ import annotations

import enum
from typing import Any, Final, TypeAlias

import msgspec

from store.api import (AdminOp, DelayedPage, Flow, LogSpan, NewMessage, Position, Positions, PullRequest,
                       StoreStatistics)

__all__ = [
    "CLIENT_MESSAGES",
    "ChangeInvisible",
    "HEARTBEATS_PER_LEASE",
    "MAX_FRAME_BYTES",
    "MAX_HELLO_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "SERVER_MESSAGES",
    "Ack",
    "Activate",
    "ActivateAll",
    "AdminAnswer",
    "AdminAsk",
    "AdminCall",
    "AdminCallAll",
    "AdminOp",
    "AppendRequest",
    "Appended",
    "CancelDelayed",
    "Awaiting",
    "Claim",
    "Claimed",
    "ClientMessage",
    "ClientMoved",
    "CloseSession",
    "CommitOffsets",
    "DelayedList",
    "Done",
    "EndSession",
    "Error",
    "ErrorKind",
    "Events",
    "Fetch",
    "Frames",
    "GetAwaiting",
    "GetOffsets",
    "GetRetained",
    "GetStatistics",
    "Heartbeat",
    "Hello",
    "Join",
    "Leave",
    "ListDelayed",
    "ListSessions",
    "LoadSession",
    "LogBytes",
    "MaxOffsets",
    "Names",
    "NewHandle",
    "NodeAnswers",
    "OffsetMap",
    "Offsets",
    "OpRequest",
    "OpenSession",
    "PatchSession",
    "Pop",
    "PopAck",
    "PopAcks",
    "PopResult",
    "Pull",
    "Pulled",
    "READER_PREFIX",
    "REPLICA_PREFIX",
    "RawRecords",
    "ReadLog",
    "Reattach",
    "RecordList",
    "Release",
    "ReleaseAwaiting",
    "RpcProtocolError",
    "SaveSession",
    "ServerMessage",
    "Starts",
    "Statistics",
    "Value",
    "Watch",
    "Welcome",
    "encode",
    "parse_address",
]

PROTOCOL_VERSION: Final = 11
"""Bumped on any change to the messages below; a store refuses a gateway of another version at the handshake.
(11: a run of activations is one request: ``ActivateAll``, answered by ``Starts`` (a store of 10 would not know it).
10: a group member acknowledges ranges of offsets: ``Ack.ranges`` (a store of 9 would ignore the field and
acknowledge nothing). 9: batch records whole in reads: ``RawRecords.batches``, POP answers too (``PopResult.result``, ``.handles``);
sessions patched: ``PatchSession``, and ``LoadSession``'s and ``OpenSession``'s answers may carry a session image (a
blob with its parts); a replica's ``Fetch`` waits for news: ``min_bytes``, ``max_wait_ms``. 8: delayed messages listed and cancelled: ``ListDelayed``, ``CancelDelayed``, ``DelayedList``,
``TimerStatistics.cancelled``; POP: ``Pop``, ``PopAck``, ``ChangeInvisible``, ``PopResult``, ``PopAcks``,
``NewHandle``; batch records: ``AppendRequest.batched``, ``Welcome.max_record_bytes``; ``StoreStatistics.log_writes``;
``Leave.unsubscribe`` gone (MQTT shared subscriptions are POP groups); ``StoreStatistics.pops``. 7: replication: ``Fetch`` and ``Frames`` between a replica (``$replica/<name>``) and its leader;
``ErrorKind.NOT_LEADER``. 6: positions, not offsets: ``Appended`` carries each group's ``Positions``, ``Awaiting``
and ``ReleaseAwaiting`` a ``Position`` per flow, ``ReadLog`` starts at one and ``LogSpan`` names its log;
``ErrorKind.INVALID_OFFSET``, so a remote ``read_log`` raises ``InvalidOffset`` as the local one does; ``NewMessage.deliver_at_ms`` and
``ErrorKind.DELAYED_CAP`` (delayed delivery). 5: the store's interface types
on the wire; sessions, presence, wills and expiry in the store: ``OpenSession``, ``CloseSession``, ``Reattach``,
``EndSession``, ``ListSessions``; group members named within a node. 4: cluster-wide
admin lists: ``AdminCallAll``, ``NodeAnswers``, ``AdminAsk.query``. 3: lease epochs on the Hello, the Welcome and
every write; inbound QoS 2 flows: ``GetAwaiting``, ``ReleaseAwaiting``; ``ReadLog``.)"""

MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""Largest frame either side accepts: room for an append batch of dozens of maximum-size (1 MiB) records and a
pull batch the client keeps under half of it; a larger length prefix is a broken or hostile peer, not data."""

MAX_HELLO_BYTES: Final = 4096
"""Largest frame a store accepts before the peer is authenticated: a Hello (node name, token, user name, password)
takes a few hundred bytes; a connection that has proven nothing must not make the store buffer more."""

REPLICA_PREFIX: Final = "$replica/"
"""The node names of replicas fetching the log (``$replica/<name>``, store/replica/follower.py): they present the
store token like a gateway node and send nothing but ``Fetch``; they take no lease and are no gateway node."""

READER_PREFIX: Final = "$reader/"
"""The node names of log readers (``$reader/<name>``, spark_analytics/live.py, store/rpc/reader.py): they present the
store token and send nothing but ``ReadLog``; a follower replica serves them from its own log as a leader does. Their
``Welcome.epoch`` is the epoch the replica leads (0: it follows, or the store is not replicated)."""

HEARTBEATS_PER_LEASE: Final = 5
"""Both sides send a heartbeat every lease / 5 (1 s by default), so silence for a lease is five missed heartbeats:
a dead peer, not an idle or briefly busy one."""

_LENGTH_BYTES = 4


class RpcProtocolError(Exception):
    """The peer broke the wire format; the connection must be closed (after an ``Error`` frame when possible)."""


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""``FrameDecoder.next_message`` has no complete frame: feed more bytes."""


class ErrorKind(enum.StrEnum):
    """Why a request failed, so the client raises the exception the local store would have raised."""

    PROTOCOL = "protocol"  # the connection is unusable (malformed, oversized, out of order): it is closed
    VERSION = "version"  # the handshake's protocol version is not the store's
    RECORD_TOO_LARGE = "record_too_large"  # store.log.record.RecordTooLarge
    TOPIC = "topic"  # lightqueue.topics.TopicError
    VALUE = "value"  # ValueError: a bad argument
    DELAYED_CAP = "delayed_cap"  # store.api.DelayedCapExceeded: the client's delayed messages pending are at the cap
    LOG_FULL = "log_full"  # store.log.errors.LogFullError: the disk is full
    OS = "os"  # any other OSError of the store (the write failed)
    INTERNAL = "internal"  # a bug in the store: logged there with its traceback
    DENIED = "denied"  # store.rpc.access.AccessDenied: bad credentials, or a call or topic the ACL does not allow
    FENCED = "fenced"  # the write names a lease of this node that has ended (store.api.LeaseLost)
    EXPIRED = "expired"  # store.log.errors.OffsetExpired: retention deleted the offset asked for
    INVALID_OFFSET = "invalid_offset"  # store.log.errors.InvalidOffset: no record starts there (read_log)
    LEADER_FENCED = "leader_fenced"  # store.api.LeaderFenced: a write appended by a leader that may no longer ack it
    NOT_LEADER = "not_leader"  # store.api.NotLeader: a replica that does not lead; the message is the leader's
    # address host:port (empty: no leader known now)


class _Message(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of every wire message: frozen, encoded as ``[tag, field, ...]``."""


OffsetMap: TypeAlias = dict[str, int]


# --- client -> store ----------------------------------------------------------------------


class Hello(_Message, tag="hello"):
    """The first frame of a connection: the client's protocol version and its gateway node name.

    Credentials (store/rpc/access.py), when the store asks for them: a gateway node
    presents the shared ``store.token``; a back-end producer or consumer
    (store/clients/) a user name and password of the store's password file.

    ``store_id`` and ``epoch`` name the lease the node held on its last
    connection (empty and 0 on its first): the store resumes that lease if it
    has not ended.
    """

    version: int
    node: str
    token: str = ""
    username: str | None = None
    password: bytes | None = None
    store_id: str = ""
    epoch: int = 0


class Heartbeat(_Message, tag="hb"):
    """Liveness, both ways; renews the node's lease."""


class Watch(_Message, tag="watch"):
    """``{queue: delta}`` of the node's session count per queue (``StoreApi.watch`` / ``unwatch``)."""

    deltas: OffsetMap


class Reattach(_Message, tag="again"):
    """After a reconnect: ``client_id`` is still connected to this node, with this will (the store may have
    restarted and forgotten). Ignored for an ended lease ``epoch``; a client present on another node meanwhile is
    that node's: this node is sent ``ClientMoved``."""

    client_id: str
    expiry_s: int
    will: NewMessage | None = None
    will_delay_s: int = 0
    epoch: int = 0


class AppendRequest(_Message, tag="append"):
    """Append each group in one CommitLog write; a group that does not encode fails alone.

    ``epoch``: the lease its senders were accepted under (0: the connection's own); refused if it has ended.
    ``batched``: the indexes of the groups that go in one batch record each (``StoreApi.append(batch=True)``).
    """

    id: int
    groups: list[list[NewMessage]]
    durable: bool | None = None
    epoch: int = 0
    batched: list[int] = []


class Pull(_Message, tag="pull"):
    """``StoreApi.pull``: read several queues; answered with ``Pulled``."""

    id: int
    reads: list[PullRequest]


class Activate(_Message, tag="activate"):
    """``StoreApi.activate``: answered with ``Value(start offset)``."""

    id: int
    queue: str
    holder: str


class ActivateAll(_Message, tag="activate_all"):
    """``StoreApi.activate_all``: answered with ``Starts`` (one request and one activation record for a run of
    SUBSCRIBEs, not one of each per filter, issue 31)."""

    id: int
    queues: list[str]
    holder: str


class Release(_Message, tag="release"):
    """``StoreApi.release``: answered with ``Value(held: bool)`` (refused for an ended lease ``epoch``)."""

    id: int
    queue: str
    holder: str
    epoch: int = 0


class MaxOffsets(_Message, tag="maxoffs"):
    """``StoreApi.max_offsets``: answered with ``Offsets``."""

    id: int
    queues: list[str]


class GetOffsets(_Message, tag="getoffs"):
    """``StoreApi.get_offsets``: answered with ``Value({queue: offset})``."""

    id: int
    owner: str


class CommitOffsets(_Message, tag="commit"):
    """``StoreApi.commit_offsets`` (``{owner: {queue: offset}}``, one write): answered with ``Done``
    (refused for an ended lease ``epoch``)."""

    id: int
    commits: dict[str, OffsetMap]
    epoch: int = 0


class GetRetained(_Message, tag="retained"):
    """``StoreApi.retained``: answered with ``RecordList``."""

    id: int
    filter: str


class OpenSession(_Message, tag="opensess"):
    """``StoreApi.open_session``: answered with ``Value(the stored session blob, or None)``."""

    id: int
    client_id: str
    clean_start: bool
    expiry_s: int
    will: NewMessage | None = None
    will_delay_s: int = 0


class CloseSession(_Message, tag="closesess"):
    """``StoreApi.close_session``: answered with ``Done`` (refused for an ended lease ``epoch``)."""

    id: int
    client_id: str
    expiry_s: int
    will_delay_s: int | None = None
    epoch: int = 0


class SaveSession(_Message, tag="savesess"):
    """``StoreApi.save_session``: answered with ``Done`` once the blob is durable (refused for an ended lease
    ``epoch``)."""

    id: int
    client_id: str
    blob: bytes
    epoch: int = 0


class PatchSession(_Message, tag="patchsess"):
    """``StoreApi.patch_session``: answered with ``Done`` once the parts are durable (refused for an ended lease
    ``epoch``)."""

    id: int
    client_id: str
    parts: dict[str, bytes]
    epoch: int = 0


class LoadSession(_Message, tag="loadsess"):
    """``StoreApi.load_session``: answered with ``Value(blob or None)``."""

    id: int
    client_id: str


class EndSession(_Message, tag="endsess"):
    """``StoreApi.end_session``: answered with ``Value(whether there was one)``."""

    id: int
    client_id: str


class ListSessions(_Message, tag="sessions?"):
    """``StoreApi.sessions``: answered with ``Names``."""

    id: int


class GetAwaiting(_Message, tag="awaiting?"):
    """``StoreApi.awaiting_release``: answered with ``Awaiting``."""

    id: int
    client_id: str


class ReleaseAwaiting(_Message, tag="relflows"):
    """``StoreApi.release_awaiting`` (a ``Flow`` each: client id, packet id, position): ``Done`` once fsynced
    (refused for an ended lease ``epoch``)."""

    id: int
    flows: list[Flow]
    epoch: int = 0


class GetStatistics(_Message, tag="stats?"):
    """``StoreApi.statistics``: answered with ``Statistics``."""

    id: int


class ListDelayed(_Message, tag="delayed?"):
    """``StoreApi.delayed_list``: a page of the pending delayed messages, answered with ``DelayedList``."""

    id: int
    topic: str
    client_id: str
    after: int
    limit: int


class CancelDelayed(_Message, tag="canceldelayed"):
    """``StoreApi.delayed_cancel``: answered with ``Value(whether it was pending)``, once the cancellation is
    stored and applied. A back-end client may cancel a message of a real topic its ACL lets it publish to."""

    id: int
    position: Position


class ReadLog(_Message, tag="readlog"):
    """``StoreApi.read_log``: the log's raw bytes from a record boundary, answered with ``LogBytes``
    (readers that frame records themselves: Spark executors without the segment files)."""

    id: int
    start: Position
    max_bytes: int


class Join(_Message, tag="join"):
    """``StoreApi.join``: ``member`` (of this node; "" for a back-end client, whose connection is the member)
    joins ``group`` on ``queue`` (store/groups.py): answered with ``Value(the group's committed offset)``.

    ``start`` (``earliest``, ``latest``, ``offset``, ``time``) and ``at`` (the offset, or ms since the epoch)
    apply when the group has no committed offset yet.
    """

    id: int
    group: str
    queue: str
    member: str = ""
    start: str = "earliest"
    at: int = 0


class Claim(_Message, tag="claim"):
    """``StoreApi.claim``: up to ``max_count`` messages of the group, waiting up to ``wait_ms`` for some:
    answered with ``Claimed``."""

    id: int
    group: str
    queue: str
    max_count: int
    max_bytes: int
    wait_ms: int
    member: str = ""


class Ack(_Message, tag="ack"):
    """``StoreApi.ack``: the member processed ``offsets``, the ``(base, count)`` ``ranges`` (a claim's runs: a
    batch record's messages are one) and what it holds below ``below``: answered with ``Value(the group's
    committed offset)``."""

    id: int
    group: str
    queue: str
    offsets: list[int]
    member: str = ""
    below: int = 0
    ranges: list[tuple[int, int]] = []


class Leave(_Message, tag="leave"):
    """``StoreApi.leave``: what the member holds goes back to the group: answered with ``Done``."""

    id: int
    group: str
    queue: str
    member: str = ""


class Pop(_Message, tag="pop"):
    """``StoreApi.pop``: up to ``max_count`` messages of POP group ``group``, invisible for ``invisible_ms``, waiting up
    to ``wait_ms`` for some: answered with ``PopResult``."""

    id: int
    group: str
    queue: str
    max_count: int
    invisible_ms: int
    wait_ms: int
    max_attempts: int
    max_bytes: int
    member: str = ""
    start: str = "latest"
    at: int = 0


class PopAck(_Message, tag="popack"):
    """``StoreApi.pop_ack``: answered with ``PopAcks`` (per handle, whether it was acknowledged now)."""

    id: int
    handles: list[str]


class ChangeInvisible(_Message, tag="invisible"):
    """``StoreApi.change_invisible``: answered with ``NewHandle`` (None: the handle was stale)."""

    id: int
    handle: str
    invisible_ms: int


class AdminCall(_Message, tag="admin"):
    """``StoreApi.admin_call``: run ``op`` on the node ``client_id`` is connected to: answered with
    ``Value(its answer, JSON bytes)``, or ``Value(None)`` when the client is connected to no other node."""

    id: int
    client_id: str
    op: AdminOp


class AdminCallAll(_Message, tag="adminall"):
    """Run list ``op`` on every other gateway node that has clients (the store's presence): answered with
    ``NodeAnswers``. ``query`` is the op's parameters (JSON bytes), handed to each node as they are."""

    id: int
    op: AdminOp
    query: bytes = b""


class AdminAnswer(_Message, tag="adminr"):
    """A node's answer to the store's ``AdminAsk`` ``id``: JSON bytes, or None (the client is not here)."""

    id: int
    value: bytes | None = None


class Fetch(_Message, tag="fetch"):
    """A replica asks its leader for the log from ``offset`` (its written end; a record boundary), answered with
    ``Frames`` (store/replica/). Only on a ``$replica/<name>`` connection. ``epoch``: the leader epoch the replica
    follows; ``last_epoch``: the epoch of its last record (-1: none), so the leader can tell where their logs part;
    ``held``: what the replica holds (written, or fsynced under the sync flush policy): the leader's confirm offset
    and acknowledgements count it. The leader answers once at least ``min_bytes`` are past ``offset``, or after
    ``max_wait_ms`` once there is anything new (records, or a confirm offset it did not send), or after its long
    poll (store/replica/leader.py); an acknowledgement waiting for replicas ends the wait."""

    id: int
    epoch: int
    last_epoch: int
    offset: int
    held: int
    max_bytes: int
    min_bytes: int = 1
    max_wait_ms: int = 0


OpRequest: TypeAlias = (
    Pull | Activate | ActivateAll | Release | MaxOffsets | GetOffsets | CommitOffsets | GetRetained | OpenSession
    | CloseSession | SaveSession | PatchSession | LoadSession | EndSession | ListSessions | GetAwaiting
    | ReleaseAwaiting | GetStatistics | ReadLog | Join | Claim | Ack | Leave | AdminCall | AdminCallAll | ListDelayed
    | CancelDelayed | Pop | PopAck | ChangeInvisible
)
"""The requests answered by one message each; each names its ``StoreApi`` method."""

ClientMessage: TypeAlias = Hello | Heartbeat | Watch | Reattach | AppendRequest | AdminAnswer | Fetch | OpRequest
CLIENT_MESSAGES: Final = ClientMessage


# --- store -> client ----------------------------------------------------------------------


class Welcome(_Message, tag="welcome"):
    """The store accepted the handshake.

    ``store_id`` (one per store process) and ``epoch`` name the node's lease; ``resumed`` is False when the Hello
    named a lease of this store that has ended: the node's clients are no longer its own (their wills went to
    their delays), so it closes their connections and sends nothing for them.
    """

    version: int
    node: str  # the node name, as the store routes events to it (back-end clients: in their own namespace)
    heartbeat_s: float
    lease_s: float
    store_id: str = ""
    epoch: int = 0
    resumed: bool = True
    max_record_bytes: int = 0  # the store's commitlog.max_record_bytes (0: an older store, unknown): producers
    # batch only messages that fit a record of their own (store/clients/producer.py)


class Error(_Message, tag="err"):
    """Request ``id`` failed (id 0: the connection failed and is being closed)."""

    id: int
    kind: ErrorKind
    message: str


class Events(_Message, tag="ev"):
    """Merged topic events routed to this node: ``{queue: max offset}``."""

    events: OffsetMap


class ClientMoved(_Message, tag="moved"):
    """``client_id`` connected to another node: close this node's connection of it (a takeover), and write
    nothing more for it."""

    client_id: str


class AdminAsk(_Message, tag="admina"):
    """Run ``op`` for ``client_id``, connected to this node (another node's ``AdminCall``), or list op ``op`` with
    ``query`` (``AdminCallAll``; ``client_id`` empty): answer ``AdminAnswer``."""

    id: int
    client_id: str
    op: AdminOp
    query: bytes = b""


class NodeAnswers(_Message, tag="adminallr"):
    """The answers to an ``AdminCallAll``: JSON bytes by node name, and the nodes that did not answer in time."""

    id: int
    answers: dict[str, bytes]
    missing: list[str] = []


class Appended(_Message, tag="appended"):
    """Per group of the request: its positions, or (index -> error) when it did not encode."""

    id: int
    positions: list[Positions]
    errors: dict[int, Error] = {}


class RawRecords(_Message, tag="recs"):
    """One queue's read: ``(queue offset, CommitLog offset, record bytes)`` per record, as stored.

    The store sends the record bytes as they are on disk and the client decodes
    them (store.log.record.decode_record): the store's CPU is the cluster's shared one.
    A batch record travels whole, once: ``batches`` maps its entry's index to
    ``(first, stop)``, the messages of it that are served (message i at queue
    offset entry's + i and position CommitLog offset + i, ``first <= i < stop``);
    an entry not in ``batches`` is one message.
    """

    entries: list[tuple[int, int, bytes]]
    next_offset: int
    expired: bool
    batches: dict[int, tuple[int, int]] = {}


class Pulled(_Message, tag="pulled"):
    """The reads of a ``Pull``, in request order."""

    id: int
    results: list[RawRecords]


class Claimed(_Message, tag="claimed"):
    """The answer to ``Claim``: the member's messages, as stored (a batch record whole); ``next_offset`` is the
    group's cursor."""

    id: int
    result: RawRecords


class PopResult(_Message, tag="popped"):
    """The answer to ``Pop``: the messages popped as a read carries them (``RawRecords``: a batch record whole, once,
    with the messages of it popped), and per message, in their order, its ``(receipt handle, attempt)``."""

    id: int
    result: RawRecords
    handles: list[tuple[str, int]]


class PopAcks(_Message, tag="popacks"):
    """The answer to ``PopAck``: per handle, in order, whether it was acknowledged now."""

    id: int
    acked: list[bool]


class NewHandle(_Message, tag="handle"):
    """The answer to ``ChangeInvisible``: the message's new receipt handle, None when the one given was stale."""

    id: int
    handle: str | None


class Offsets(_Message, tag="offs"):
    """``max_offsets``: one int per queue, in request order."""

    id: int
    offsets: list[int]


class Value(_Message, tag="val"):
    """The answer of an op with a value: a bool, an int, bytes, a mapping of offsets, or None."""

    id: int
    value: bool | int | bytes | OffsetMap | None = None


class Starts(_Message, tag="starts"):
    """The answer of ``ActivateAll``: each queue's start offset, in order, or the ``Error`` (with the request's id)
    that refused it alone."""

    id: int
    starts: list[int | Error]


class Names(_Message, tag="names"):
    """The answer of ``ListSessions``."""

    id: int
    names: list[str]


class Awaiting(_Message, tag="awaiting"):
    """A client's inbound QoS 2 flows awaiting PUBREL: ``{packet id: position of its record}``."""

    id: int
    flows: dict[int, Position]


class Done(_Message, tag="done"):
    """An op without a value (commits, session writes) completed."""

    id: int


class Statistics(_Message, tag="statsr"):
    """The answer to ``GetStatistics``."""

    id: int
    stats: StoreStatistics


class DelayedList(_Message, tag="delayedr"):
    """The answer to ``ListDelayed``."""

    id: int
    page: DelayedPage


class RecordList(_Message, tag="reclist"):
    """The answer to ``GetRetained``: ``(CommitLog offset, record bytes)`` per retained message."""

    id: int
    records: list[tuple[int, bytes]]


class LogBytes(_Message, tag="logbytes"):
    """The answer to ``ReadLog`` (``store.log.commitlog.CommitLog.read_span``): ``span.data`` is the log from
    ``span.start`` (the request's offset, or the next segment's base at the end of a segment's data), ending at
    most at ``span.data_end`` (that segment's readable end), perhaps inside a record; ``span.flushed`` and
    ``span.min_offset`` bound the whole log now."""

    id: int
    span: LogSpan


class Frames(_Message, tag="frames"):
    """The answer to ``Fetch``: the leader's log bytes from the fetch's offset (``CommitLog.read_frames``: whole
    frames, perhaps none), the leader's ``epoch`` and ``confirm`` offset, its epoch entries ``(epoch, start)`` that
    cover ``data``, ``truncate_to`` (-1: none): the replica's log parts from the leader's there; it cuts its log
    at that offset before it fetches again; ``end``: the leader's written end when it answered (the replica's lag,
    for its metrics; -1: not said); and ``min_offset``: where the leader's log starts (its retention deleted what
    is below): the replica deletes its sealed segments below it, and an empty replica starts its log there."""

    id: int
    epoch: int
    data: bytes
    confirm: int
    epochs: list[tuple[int, int]]
    truncate_to: int = -1
    end: int = -1
    min_offset: int = 0


ServerMessage: TypeAlias = (
    Welcome | Heartbeat | Error | Events | ClientMoved | Appended | Pulled | Claimed | Offsets | Value | Names
    | Awaiting | Done | Statistics | RecordList | AdminAsk | NodeAnswers | LogBytes | Frames | DelayedList | PopResult
    | PopAcks | NewHandle | Starts
)
SERVER_MESSAGES: Final = ServerMessage

_ENCODER = msgspec.msgpack.Encoder()


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6 address]:PORT`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not of that form, or the port is not 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def parse_addresses(text: str) -> list[tuple[str, int]]:
    """A comma-separated list of ``HOST:PORT`` (the replicas of a replicated store; one: a store) as ``(host, port)``s.

    Raises:
        ValueError: an item is not ``HOST:PORT``.
    """
    return [parse_address(item.strip()) for item in text.split(",")]


def encode(message: _Message) -> bytes:
    """The bytes of one frame carrying ``message``.

    Raises:
        RpcProtocolError: the message would exceed ``MAX_FRAME_BYTES`` (the caller must split it).
    """
    buffer = bytearray(_LENGTH_BYTES)
    _ENCODER.encode_into(message, buffer, _LENGTH_BYTES)
    size = len(buffer) - _LENGTH_BYTES
    if size > MAX_FRAME_BYTES:
        raise RpcProtocolError(f"a {type(message).__name__} of {size} bytes exceeds the frame limit "
                               f"of {MAX_FRAME_BYTES} bytes")
    buffer[:_LENGTH_BYTES] = size.to_bytes(_LENGTH_BYTES, "big")
    return bytes(buffer)


class FrameDecoder:
    """Bytes in, messages out, for one direction of one connection.

    Args:
        messages: the union of message types this side may receive
            (``CLIENT_MESSAGES`` on the store, ``SERVER_MESSAGES`` on a client).
        max_frame_bytes: a longer frame is a protocol error (nothing of it is buffered).
    """

    __slots__ = ("_buffer", "_decoder", "_eof", "_max", "_pos")

    def __init__(self, messages: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(messages)
        self._max = max_frame_bytes
        self._buffer = bytearray()
        self._pos = 0  # start of the first frame not returned yet
        self._eof = False

    def allow(self, max_frame_bytes: int) -> None:
        """Accept frames up to ``max_frame_bytes`` from now on (the store raises the limit once a peer is admitted)."""
        self._max = max_frame_bytes

    @property
    def buffered(self) -> int:
        """Bytes received and not returned as messages yet: what this connection costs in memory now."""
        return len(self._buffer) - self._pos

    def receive_data(self, data: bytes) -> None:
        """Add received bytes; ``b""`` means the peer closed its side."""
        if data:
            if self._pos:
                del self._buffer[: self._pos]
                self._pos = 0
            self._buffer += data
        else:
            self._eof = True

    @property
    def eof(self) -> bool:
        """The peer closed its side and every complete frame was returned."""
        return self._eof and self._pos == len(self._buffer)

    def next_message(self) -> Any:
        """The next complete message, or ``NEED_DATA``.

        Raises:
            RpcProtocolError: an oversized or undecodable frame, or the stream ended inside a frame.
        """
        buffer = self._buffer
        pos = self._pos
        available = len(buffer) - pos
        if available < _LENGTH_BYTES:
            if self._eof and available:
                raise RpcProtocolError(f"the connection ended inside a frame header ({available} bytes)")
            return NEED_DATA
        size = int.from_bytes(buffer[pos : pos + _LENGTH_BYTES], "big")
        if size > self._max:
            raise RpcProtocolError(f"a frame of {size} bytes exceeds the limit of {self._max} bytes")
        end = pos + _LENGTH_BYTES + size
        if len(buffer) < end:
            if self._eof:
                raise RpcProtocolError(f"the connection ended inside a frame ({available} of "
                                       f"{size + _LENGTH_BYTES} bytes)")
            return NEED_DATA
        self._pos = end
        try:
            with memoryview(buffer) as view:
                return self._decoder.decode(view[pos + _LENGTH_BYTES : end])
        except msgspec.DecodeError as exc:  # ValidationError included: the right msgpack, the wrong shape
            raise RpcProtocolError(f"malformed frame: {exc}") from None
