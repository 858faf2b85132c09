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
  releases, presence, wills) carries the epoch the client was accepted under,
  and the store refuses a write of an ended lease (``ErrorKind.FENCED``, or
  ignored for one-way messages);
- requests carry an id chosen by the client (never 0); the store answers each
  with a response carrying the same id, or ``Error(id, kind, message)``; many
  requests may be in flight, answers come in any order (appends in order);
- one-way messages have no id and no answer: ``Heartbeat`` (both ways, every
  lease / ``HEARTBEATS_PER_LEASE``), ``Watch`` (reference-count deltas of the queues the node's
  sessions read), ``HoldWill`` / ``DropWill`` (the node lease's wills),
  ``Present`` / ``Absent`` (which node has a client: cross-node takeover);
- the store pushes ``Events`` (``{queue: max offset}``, merged) and ``ClientMoved`` (a client of this node
  connected to another) at any time;
- cluster administration: a gateway asks about a client connected to another
  node with ``AdminCall``; the store forwards it to that node as ``AdminAsk``,
  whose ``AdminAnswer`` it relays as ``Value``; the lists (``AdminCallAll``) go to
  every other node that has clients, and the answers come back as ``NodeAnswers``.
- back-end producers and consumers (store/clients/producer.py, store/clients/consumer.py) log
  in with the Hello's credentials (store/rpc/access.py) and use appends and the
  consumer-group calls ``Join``, ``Claim``, ``Ack``, ``Leave`` (store/groups.py).

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

__all__ = [
    "CLIENT_MESSAGES",
    "HEARTBEATS_PER_LEASE",
    "LEASE_S",
    "MAX_FRAME_BYTES",
    "MAX_HELLO_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "SERVER_MESSAGES",
    "Absent",
    "Ack",
    "Activate",
    "AdminAnswer",
    "AdminAsk",
    "AdminCall",
    "AdminCallAll",
    "AdminOp",
    "AppendRequest",
    "Appended",
    "Awaiting",
    "Claim",
    "Claimed",
    "ClientMessage",
    "ClientMoved",
    "CommitOffsets",
    "DeleteOwner",
    "Done",
    "DropSession",
    "DropWill",
    "Error",
    "ErrorKind",
    "Events",
    "FrameDecoder",
    "GetAwaiting",
    "GetOffsets",
    "GetRetained",
    "GetStatistics",
    "GroupRequest",
    "Heartbeat",
    "Hello",
    "HoldWill",
    "Join",
    "Leave",
    "LoadSession",
    "LogBytes",
    "MaxOffsets",
    "NodeAnswers",
    "OffsetMap",
    "Offsets",
    "OpRequest",
    "Present",
    "PullRequest",
    "Pulled",
    "QueueRead",
    "RawRecords",
    "ReadLog",
    "RecordList",
    "Release",
    "ReleaseAwaiting",
    "RpcProtocolError",
    "SaveSession",
    "ServerMessage",
    "Statistics",
    "Value",
    "Watch",
    "Welcome",
    "WireMessage",
    "WireStatistics",
    "encode",
    "parse_address",
]

PROTOCOL_VERSION: Final = 4
"""Bumped on any change to the messages below; a store refuses a gateway of another version at the handshake.
(4: cluster-wide admin lists: ``AdminCallAll``, ``NodeAnswers``, ``AdminAsk.query``. 3: lease epochs on the
Hello, the Welcome and every write; re-registration flags; cluster administration; inbound QoS 2 flows:
``GetAwaiting``, ``ReleaseAwaiting``; ``ReadLog``.)"""

MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""Largest frame either side accepts: room for an append batch of dozens of maximum-size (1 MiB) records and a
pull batch the client keeps under half of it; a larger length prefix is a broken or hostile peer, not data."""

LEASE_S: Final = 5.0
"""A gateway node's lease on the wills it holds lasts this long after the last frame the store got from it:
then the store appends them. The client also gives up on a store silent this long. (The store's default; it tells
each client its own in the Welcome.)"""

MAX_HELLO_BYTES: Final = 4096
"""Largest frame a store accepts before the peer is authenticated: a Hello (node name, token, user name, password)
takes a few hundred bytes; a connection that has proven nothing must not make the store buffer more."""

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
    LOG_FULL = "log_full"  # store.log.errors.LogFullError: the disk is full
    OS = "os"  # any other OSError of the store (the write failed)
    INTERNAL = "internal"  # a bug in the store: logged there with its traceback
    DENIED = "denied"  # store.rpc.access.AccessDenied: bad credentials, or a call or topic the ACL does not allow
    FENCED = "fenced"  # the write names a lease of this node that has ended (store.log.errors.LeaseLost)
    EXPIRED = "expired"  # store.log.errors.OffsetExpired: retention deleted the offset asked for


class _Message(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of every wire message: frozen, encoded as ``[tag, field, ...]``."""


class WireMessage(_Message, tag="m"):
    """One message to append (``store.local.NewMessage`` on the wire)."""

    topic: str
    payload: bytes
    client_id: str = ""
    qos: int = 0
    retain: bool = False
    properties: bytes = b""
    born_ms: int | None = None
    packet_id: int = 0  # a QoS 2 message's packet id (gateway nodes only: store/awaiting.py)


class QueueRead(_Message, tag="q"):
    """One queue read of a ``PullRequest`` (``store.local.PullRequest`` on the wire)."""

    queue: str
    from_offset: int
    max_count: int
    max_bytes: int


OffsetMap: TypeAlias = dict[str, int]


# --- client -> store ----------------------------------------------------------------------


class Hello(_Message, tag="hello"):
    """The first frame of a connection: the client's protocol version and its gateway node name.

    Credentials (store/rpc/access.py), when the store asks for them: a gateway node
    presents the shared ``store.token``; a back-end producer or consumer
    (store/clients/producer.py, store/clients/consumer.py) a user name and password of the
    store's password file.

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
    """``{queue: delta}`` of the node's session count per queue (``StoreClient.watch`` / ``unwatch``)."""

    deltas: OffsetMap


class HoldWill(_Message, tag="will"):
    """Keep ``message`` for ``client_id``: append it ``delay_s`` after this node's lease ends.

    ``epoch``: the lease the client was accepted under (0: the connection's own); a will of an ended lease is
    ignored. ``again``: sent again after a reconnect; ignored if the client is now placed on another node.
    """

    client_id: str
    message: WireMessage
    delay_s: float
    epoch: int = 0
    again: bool = False


class DropWill(_Message, tag="nowill"):
    """The will of ``client_id`` held by this node must not fire (ignored for an ended lease ``epoch``)."""

    client_id: str
    epoch: int = 0


class Present(_Message, tag="here"):
    """``client_id`` is connected to this node now: the node it was connected to before is sent ``ClientMoved``.

    ``again``: not a new connection but one this node re-registers after a reconnect: it never displaces a
    client placed on another node meanwhile (that connection is newer): this node is sent ``ClientMoved`` instead.
    Ignored for an ended lease ``epoch``.
    """

    client_id: str
    epoch: int = 0
    again: bool = False


class Absent(_Message, tag="away"):
    """``client_id`` is gone from this node: no connection, no will waiting here (ignored for an ended lease)."""

    client_id: str
    epoch: int = 0


class AppendRequest(_Message, tag="append"):
    """Append each group in one CommitLog write; a group that does not encode fails alone.

    ``epoch``: the lease its senders were accepted under (0: the connection's own); refused if it has ended.
    """

    id: int
    groups: list[list[WireMessage]]
    durable: bool | None = None
    epoch: int = 0


class PullRequest(_Message, tag="pull"):
    """Read several queues."""

    id: int
    reads: list[QueueRead]


class Activate(_Message, tag="activate"):
    """``StoreClient.activate``: answered with ``Value(start offset)``."""

    id: int
    queue: str
    holder: str


class Release(_Message, tag="release"):
    """``StoreClient.release``: answered with ``Value(held: bool)`` (refused for an ended lease ``epoch``)."""

    id: int
    queue: str
    holder: str
    epoch: int = 0


class MaxOffsets(_Message, tag="maxoffs"):
    """``StoreClient.max_offsets``: answered with ``Offsets``."""

    id: int
    queues: list[str]


class GetOffsets(_Message, tag="getoffs"):
    """``StoreClient.get_offsets``: answered with ``Value({queue: offset})``."""

    id: int
    owner: str


class CommitOffsets(_Message, tag="commit"):
    """``StoreClient.commit_offsets`` (``{owner: {queue: offset}}``, one write): answered with ``Done``
    (refused for an ended lease ``epoch``)."""

    id: int
    commits: dict[str, OffsetMap]
    epoch: int = 0


class DeleteOwner(_Message, tag="delowner"):
    """``StoreClient.delete_owner``: answered with ``Done`` (refused for an ended lease ``epoch``)."""

    id: int
    owner: str
    epoch: int = 0


class GetRetained(_Message, tag="retained"):
    """``StoreClient.retained``: answered with ``RecordList``."""

    id: int
    filter: str


class SaveSession(_Message, tag="savesess"):
    """``StoreClient.save_session``: answered with ``Done`` once the blob is durable (refused for an ended lease
    ``epoch``)."""

    id: int
    client_id: str
    blob: bytes
    epoch: int = 0


class LoadSession(_Message, tag="loadsess"):
    """``StoreClient.load_session``: answered with ``Value(blob or None)``."""

    id: int
    client_id: str


class DropSession(_Message, tag="dropsess"):
    """``StoreClient.drop_session``: answered with ``Done`` (refused for an ended lease ``epoch``)."""

    id: int
    client_id: str
    epoch: int = 0


class GetAwaiting(_Message, tag="awaiting?"):
    """``StoreClient.awaiting_release``: answered with ``Awaiting``."""

    id: int
    client_id: str


class ReleaseAwaiting(_Message, tag="relflows"):
    """``StoreClient.release_awaiting`` (``(client id, packet id, log offset)`` per flow): ``Done`` once fsynced."""

    id: int
    flows: list[tuple[str, int, int]]


class GetStatistics(_Message, tag="stats?"):
    """``StoreClient.statistics``: answered with ``Statistics``."""

    id: int


class ReadLog(_Message, tag="readlog"):
    """``StoreClient.read_log``: the log's raw bytes from a record boundary, answered with ``LogBytes``
    (readers that frame records themselves: Spark executors without the segment files)."""

    id: int
    offset: int
    max_bytes: int


OpRequest: TypeAlias = (
    Activate | Release | MaxOffsets | GetOffsets | CommitOffsets | DeleteOwner | GetRetained
    | SaveSession | LoadSession | DropSession | GetAwaiting | ReleaseAwaiting | GetStatistics | ReadLog
)
"""The calls answered by one value; each names its ``StoreClient`` method."""


class Join(_Message, tag="join"):
    """Join consumer group ``group`` on the queue of ``filter`` (store/groups.py): answered with ``Value(offset)``.

    ``start`` (``earliest``, ``latest``, ``offset``, ``time``) and ``at`` (the
    offset, or ms since the epoch) apply when the group has no committed offset yet.
    """

    id: int
    group: str
    filter: str
    start: str = "earliest"
    at: int = 0


class Claim(_Message, tag="claim"):
    """Take up to ``max_count`` messages of the group, waiting up to ``wait_ms`` for some: answered with ``Claimed``."""

    id: int
    group: str
    filter: str
    max_count: int
    max_bytes: int
    wait_ms: int


class Ack(_Message, tag="ack"):
    """The claimed ``offsets`` are processed: answered with ``Value(the group's committed offset)``."""

    id: int
    group: str
    filter: str
    offsets: list[int]


class Leave(_Message, tag="leave"):
    """Leave the group (what this connection holds goes back to it): answered with ``Done``."""

    id: int
    group: str
    filter: str


GroupRequest: TypeAlias = Join | Claim | Ack | Leave
"""The consumer-group calls of back-end consumers (store/clients/consumer.py)."""


class AdminOp(enum.StrEnum):
    """What a gateway's admin API asks of the node a client is connected to (docs/operations.md)."""

    CLIENT = "client"  # the connection's details (``GET /api/v1/clients/{id}``)
    SESSION = "session"  # the live session and its lags (``GET /api/v1/sessions/{id}``)
    DISCONNECT = "disconnect"  # close it as an administrative action (``DELETE /api/v1/clients/{id}``)
    DELETE_SESSION = "delete_session"  # disconnect it and end its session (``DELETE /api/v1/sessions/{id}``)
    CLIENTS = "clients"  # a page of the node's clients (``GET /api/v1/clients``; the query in ``AdminAsk.query``)
    SESSIONS = "sessions"  # the node's sessions (``GET /api/v1/sessions``)
    QUEUES = "queues"  # the queues its sessions read (``GET /api/v1/queues``)


class AdminCall(_Message, tag="admin"):
    """Run ``op`` on the node ``client_id`` is connected to: answered with ``Value(its answer, JSON bytes)``, or
    ``Value(None)`` when the client is connected to no other node."""

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


ClientMessage: TypeAlias = (
    Hello | Heartbeat | Watch | HoldWill | DropWill | Present | Absent | AppendRequest | PullRequest | OpRequest
    | GroupRequest | AdminCall | AdminCallAll | AdminAnswer
)
CLIENT_MESSAGES: Final = ClientMessage


# --- store -> client ----------------------------------------------------------------------


class Welcome(_Message, tag="welcome"):
    """The store accepted the handshake.

    ``store_id`` (one per store process) and ``epoch`` name the node's lease; ``resumed`` is False when the Hello
    named a lease of this store that has ended: the node's clients are no longer its own (its wills were
    published), so it closes their connections and sends nothing for them.
    """

    version: int
    node: str  # the node name, as the store routes events to it (back-end clients: in their own namespace)
    heartbeat_s: float
    lease_s: float
    store_id: str = ""
    epoch: int = 0
    resumed: bool = True


class Error(_Message, tag="err"):
    """Request ``id`` failed (id 0: the connection failed and is being closed)."""

    id: int
    kind: ErrorKind
    message: str


class Events(_Message, tag="ev"):
    """Merged topic events routed to this node: ``{queue: max offset}``."""

    events: OffsetMap


class ClientMoved(_Message, tag="moved"):
    """``client_id`` connected to another node: close this node's connection of it (a takeover), and let none
    of its delayed wills fire here (the session resumed there)."""

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
    """Per group of the request: its CommitLog offsets, or (index -> error) when it did not encode."""

    id: int
    offsets: list[list[int]]
    errors: dict[int, Error] = {}


class RawRecords(_Message, tag="recs"):
    """One queue's read: ``(queue offset, CommitLog offset, record bytes)`` per message, as stored.

    The store sends the record bytes as they are on disk and the client decodes
    them (store.log.record.decode_record): the store's CPU is the cluster's shared one.
    """

    entries: list[tuple[int, int, bytes]]
    next_offset: int
    expired: bool


class Pulled(_Message, tag="pulled"):
    """The reads of a ``PullRequest``, in request order."""

    id: int
    results: list[RawRecords]


class Offsets(_Message, tag="offs"):
    """``max_offsets``: one int per queue, in request order."""

    id: int
    offsets: list[int]


class Value(_Message, tag="val"):
    """The answer of an op with a value: a bool, an int, bytes, a mapping of offsets, or None."""

    id: int
    value: bool | int | bytes | OffsetMap | None = None


class Awaiting(_Message, tag="awaiting"):
    """A client's inbound QoS 2 flows awaiting PUBREL: ``{packet id: log offset}``."""

    id: int
    flows: dict[int, int]


class Done(_Message, tag="done"):
    """An op without a value (commits, deletes, session writes) completed."""

    id: int


class WireStatistics(_Message, tag="stats"):
    """``store.local.StoreStatistics`` on the wire (field for field)."""

    written_offset: int
    flushed_offset: int
    dispatched_offset: int
    log_bytes: int
    queue_ids: int
    active_filters: int
    retained: int
    notify_sent: int
    notify_suppressed: int
    notify_by_node: OffsetMap
    corrupt_records: int = 0
    disk_full: bool = False


class Statistics(_Message, tag="statsr"):
    """The answer to the ``statistics`` op."""

    id: int
    stats: WireStatistics


class RecordList(_Message, tag="reclist"):
    """The answer to the ``retained`` op: ``(CommitLog offset, record bytes)`` per retained message."""

    id: int
    records: list[tuple[int, bytes]]


class Claimed(_Message, tag="claimed"):
    """The answer to ``Claim``: ``(queue offset, CommitLog offset, record bytes)`` per message, as stored."""

    id: int
    entries: list[tuple[int, int, bytes]]


class LogBytes(_Message, tag="logbytes"):
    """The answer to ``ReadLog`` (``store.log.commitlog.CommitLog.read_span``): ``data`` is the log from ``start``
    (the request's offset, or the next segment's base at the end of a segment's data), ending at most at
    ``data_end`` (that segment's readable end), perhaps inside a record; ``flushed`` and ``min_offset`` bound
    the whole log now."""

    id: int
    start: int
    data: bytes
    data_end: int
    flushed: int
    min_offset: int


ServerMessage: TypeAlias = (
    Welcome | Heartbeat | Error | Events | ClientMoved | Appended | Pulled | Offsets | Value | Awaiting | Done
    | Statistics | RecordList | Claimed | AdminAsk | NodeAnswers | LogBytes
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
