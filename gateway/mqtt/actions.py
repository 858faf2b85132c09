"""What a channel asks of its node (actions) and what the node tells the channel (events), as plain data.

The channel (``gateway/mqtt/channel.py``) is sans-IO: it never touches a socket, a timer or the store. Every
effect it wants is an *action* returned from its ``handle_*`` methods, executed in order by the node
(``gateway/node/``); every result the node obtains comes back as an *event* through ``Channel.handle_event``.
Requests that need an answer carry a ``ref`` that the answering event repeats.

All of them are frozen msgspec structs (cheaper to build than slotted dataclasses; the ones made per message
are untracked by the garbage collector: ``gc=False``, nothing they hold refers back to them). Don't subclass
these: the channel and the node dispatch on exact type through tables. Mapping fields (``dict``) are read-only
by convention. ``SessionState``, the session as data that ``SaveSession`` and ``SessionOpened`` carry, is a
slotted dataclass that gateway/mqtt/session.py builds and restores.

An inbound message is the store's ``NewMessage`` from the channel on (store/api.py): the one shape a message
has from the PUBLISH to the record. ``Message`` is the outbound one: a record as the queue cache keeps it for
delivery, its MQTT 5 properties decoded once for every local session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeAlias

import msgspec

from gateway.mqtt.limits import Limit
from gateway.mqtt.packets import Packet, SubscriptionOptions
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.template import PublishTemplate
from store.api import NewMessage, Position

NOT_IN_LOG = Position(-1, -1)
"""The position of an inbound QoS 2 message's record the store does not know (a blob saved before records kept
packet ids): its PUBREL is answered without a store write."""


class Message(msgspec.Struct, gc=False):
    """One message read from a light queue (or a retained one), as the channel delivers it.

    Untracked by the cyclic garbage collector, like ``store.log.record.Record``
    (nothing it refers to refers back): the queue cache holds thousands.

    ``client_id`` is the publisher's (for No Local). ``store_ms`` is set by the
    store; message expiry counts from it. ``queue``/``offset`` locate a message
    read from a light queue (None for a retained message). ``template``: the
    PUBLISH every session that delivers the message writes from (gateway/mqtt/session.py).
    """

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = EMPTY_PROPERTIES
    client_id: str = ""
    born_ms: int = 0
    store_ms: int = 0
    queue: str | None = None
    offset: int | None = None
    template: PublishTemplate | None = None  # its PUBLISH, encoded by the first session that delivers it


class Subscription(msgspec.Struct, frozen=True, gc=False):
    """One subscription of a session (untracked by the garbage collector: strings, numbers, options, no cycle; a node
    holding 50,000 of them walks them in every full collection otherwise, issue 31).

    ``filter`` is the filter as the client sent it (``$share/g/a/+`` included)
    and the key of everything per subscription; ``queue`` is the light queue it
    reads (the filter itself, or the inner filter of a shared subscription);
    ``group`` is the share name of a shared subscription.
    """

    filter: str
    queue: str
    options: SubscriptionOptions = SubscriptionOptions()
    subscription_id: int | None = None
    group: str | None = None


class Phase(Enum):
    """Where an outbound QoS 1/2 message is in its flow."""

    PUBLISHED = "published"  # PUBLISH sent; waiting for PUBACK (QoS 1) or PUBREC (QoS 2)
    RELEASED = "released"  # PUBREC received, PUBREL sent; waiting for PUBCOMP


class InFlight(msgspec.Struct, gc=False):
    """An outbound QoS 1/2 message not yet acknowledged, by reference into its queue (no body). Not frozen:
    its phase moves on. ``handle``: a shared subscription's message's POP receipt handle until its PUBACK or
    PUBREC acknowledges it to the group (never saved: a restarted gateway's handles are stale)."""

    packet_id: int
    filter: str
    offset: int
    qos: int
    phase: Phase = Phase.PUBLISHED
    handle: str | None = None


@dataclass(frozen=True, slots=True)
class SessionState:
    """A session as data. ``offsets`` are committed (contiguously acknowledged) queue offsets per
    subscription filter; ``cursors`` where delivery resumes (above it nothing was delivered; below
    it everything not ``inflight`` was acknowledged). Dicts are read-only by convention.

    ``lanes`` gives each non-shared QoS 1/2 subscription of a persistent session its lane of packet ids.
    ``detached`` says the state was saved with no connection attached (a disconnect or a handover): its
    ``cursors`` and ``inflight`` are exact; a state saved while connected is what a crash leaves, and is
    resumed from the committed offsets by lanes (module docstring). ``awaiting`` (inbound QoS 2 packet id
    -> position of its record) is taken from the store at resume (``StoreApi.awaiting_release``), never from a
    saved blob; ``awaiting_rel`` lists the ids the store does not know (blobs of earlier versions).
    """

    client_id: str
    expiry_s: int = 0
    subscriptions: tuple[Subscription, ...] = ()
    offsets: dict[str, int] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)
    awaiting_rel: frozenset[int] = frozenset()
    inflight: tuple[InFlight, ...] = ()
    next_packet_id: int = 1
    awaiting: dict[int, Position] = field(default_factory=dict)
    lanes: dict[str, int] = field(default_factory=dict)
    detached: bool = False


class SavedSubscription(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One subscription of a session as a part of its stored state (``PatchSession``): the subscription, its lane
    of packet ids, its committed ``offset`` and the ``cursor`` delivery resumes at."""

    sub: Subscription
    lane: int
    offset: int
    cursor: int


# --- actions: channel -> node ---------------------------------------------------------------


class Send(msgspec.Struct, frozen=True, gc=False):
    """Encode these packets at the channel's protocol level and write them, in order."""

    packets: tuple[Packet, ...]


class Deliver(msgspec.Struct, frozen=True, gc=False):
    """Write these pre-encoded PUBLISH packets (``count`` of them); after the write completes, feed ``SocketWritten(seq)``.

    ``by_qos`` counts the packets per QoS and ``oldest_ms`` is the earliest
    store time of the queue messages among them (0: none), for the metrics.
    """

    data: bytes
    seq: int
    count: int = 1
    by_qos: tuple[int, int, int] = (0, 0, 0)
    oldest_ms: int = 0


class Close(msgspec.Struct, frozen=True):
    """Close the network connection (after writing what was sent before); log ``log`` with the reason."""

    reason: ReasonCode
    log: str


class ArmTimer(msgspec.Struct, frozen=True):
    """(Re)start the timer ``name``; when it fires call ``Channel.handle_timeout(name)``."""

    name: str
    delay_s: float


class CancelTimer(msgspec.Struct, frozen=True):
    """Stop the timer ``name`` if it is running."""

    name: str


class OpenSession(msgspec.Struct, frozen=True):
    """Accept (auth) and find the session of ``client_id``; answer ``SessionOpened``.

    Credentials are checked first; then any other connection with this client
    id is taken over (feed it ``TakenOver`` and run its actions, which hand its
    session state over). With ``clean_start`` the old session is discarded.
    ``will_topic`` is checked against the client's publish rights, so a will it
    may not publish refuses the CONNECT. ``will`` and ``will_delay_s`` are the
    will itself, which the store holds while the client is connected (store/leases.py).
    """

    client_id: str
    clean_start: bool
    expiry_s: int
    username: str | None = None
    password: bytes | None = None
    will_topic: str | None = None
    will: NewMessage | None = None
    will_delay_s: int = 0


class Append(msgspec.Struct, frozen=True, gc=False):
    """Append messages to the CommitLog (durable under the sync flush policy).

    ``ref`` None: fire and forget (QoS 0). Otherwise answer ``Appended(ref, ...)``.
    """

    ref: int | None
    messages: Sequence[NewMessage]  # a tuple, or a ``PayloadRun``: a read's QoS 0 messages that repeat one another


class Activate(msgspec.Struct, frozen=True):
    """Make this session hold the queues of ``subscriptions``; answer ``Activated``.

    ``retained`` lists the filters that want retained messages now (the channel
    has applied retain handling; shared subscriptions never do).
    """

    ref: int
    client_id: str
    subscriptions: tuple[Subscription, ...]
    retained: tuple[str, ...] = ()


class AfterReads(msgspec.Struct, frozen=True):
    """Queued by the connection, not the channel, before an append read while subscriptions read on other
    connections wait to be applied: the actions after it wait until those are (``mark``, gateway/node/order.py)."""

    mark: int


class Release(msgspec.Struct, frozen=True):
    """This session stops holding these subscriptions (filters as sent); their offsets go too."""

    client_id: str
    filters: tuple[str, ...]


class CommitOffsets(msgspec.Struct, frozen=True):
    """Store the session's consumer offsets: filter -> next queue offset not yet fully acknowledged. Its shared
    subscriptions' messages have no offset here: ``acks`` are the POP receipt handles of those done (delivered at
    QoS 0, PUBACK, PUBREC, or skipped), ``releases`` of those it will not deliver (unsubscribed): visible to the
    other members at once."""

    client_id: str
    offsets: dict[str, int]
    acks: tuple[str, ...] = ()
    releases: tuple[str, ...] = ()


class Pull(msgspec.Struct, frozen=True, gc=False):
    """Read up to ``max_count`` messages of ``queue`` from ``from_offset``; answer ``Pulled(filter, ...)``.

    For a shared subscription (``group`` set) POP them from the group (any offsets, each with its receipt
    handle); ``from_offset`` places a group that has no offset yet (its first member's subscription start).
    """

    filter: str
    queue: str
    from_offset: int
    max_count: int
    group: str | None = None


class PublishWill(msgspec.Struct, frozen=True):
    """Publish the will now (a will with a delay is the store's: ``CloseSession``)."""

    client_id: str
    message: NewMessage


class SaveSession(msgspec.Struct, frozen=True):
    """Keep this session state: write it (WAL) if ``state.expiry_s > 0``; hand it to a taking-over connection.

    ``ref`` set: answer ``SessionSaved(ref)`` once it is written (what it records may then be relied on:
    PUBRELs sent, packet ids used, gateway/mqtt/session.py).
    """

    state: SessionState
    ref: int | None = None


class PatchSession(msgspec.Struct, frozen=True):
    """Keep these subscriptions of a persistent session (by filter; None: unsubscribed) beside its saved state,
    without writing the whole state again (``StoreApi.patch_session``): a SUBSCRIBE costs its own filters.
    """

    client_id: str
    parts: dict[str, SavedSubscription | None]
    subscriptions: int  # the session's subscriptions with these ($SYS)
    ref: int | None = None  # answered ``SessionSaved(ref)`` once written, as a ``SaveSession``


class ReleaseInbound(msgspec.Struct, frozen=True):
    """The client released inbound QoS 2 message ``packet_id`` (PUBREL): record that durably in the store
    (``StoreApi.release_awaiting``), then answer ``InboundReleased(ref)``: only then may PUBCOMP go out."""

    ref: int
    client_id: str
    packet_id: int
    position: Position  # the message's record


class CloseSession(msgspec.Struct, frozen=True):
    """The connection's session is settled: tell the store it closed. The session expires ``expiry_s`` from
    now (0: it ends now: state, offsets and filters go); the will the store holds is published ``will_delay_s``
    from now unless the session resumes first (None: it is dropped)."""

    client_id: str
    expiry_s: int
    will_delay_s: int | None = None


class Denied(msgspec.Struct, frozen=True):
    """The ACL refused the client ``access`` ("publish", "subscribe") to ``topic``; the channel already answered
    (dropped, PUBACK/PUBREC or SUBACK 0x87): this only feeds the node's count and its log line (``why``)."""

    access: str
    topic: str
    why: str


class LimitHit(msgspec.Struct, frozen=True):
    """The client ran into ``limit`` ``count`` times: count it; log ``log`` (with the client id) unless None.

    The channel already answered the client; this only feeds the node's
    counters and log (``None``: a line about this limit went out recently).
    """

    limit: Limit
    count: int = 1
    log: str | None = None


class Authorizer(Protocol):
    """The ACL as a connection's channel asks it: pure checks of one client's rights, injected by the node with
    ``SessionOpened`` (the sans-IO protocol knows no ACL file, user or rule)."""

    def may_publish(self, topic: str) -> bool:
        """May the client publish to ``topic``?"""
        ...

    def may_subscribe(self, filter: str) -> bool:
        """May the client subscribe to ``filter`` (as sent: a shared subscription's with its ``$share/...``)?"""
        ...

    def may_read(self, topic: str) -> bool:
        """May a message on ``topic`` be delivered to the client (a wildcard may cover a topic it may not read)?"""
        ...


# --- events: node -> channel ----------------------------------------------------------------


class SessionOpened(msgspec.Struct, frozen=True):
    """Answer to ``OpenSession``. ``reason`` other than SUCCESS refuses the connection (CONNACK reason).

    ``authorizer`` is the ACL for this client (``gateway.auth.acl.ClientAcl``), None when it may publish,
    subscribe and receive anything.
    """

    present: bool
    state: SessionState | None = None
    reason: ReasonCode = ReasonCode.SUCCESS
    authorizer: Authorizer | None = None


class Appended(msgspec.Struct, frozen=True, gc=False):
    """Answer to ``Append``: stored (``ok``, its record at ``position``), or refused with a PUBACK/PUBREC reason."""

    ref: int
    ok: bool = True
    reason: ReasonCode = ReasonCode.UNSPECIFIED_ERROR
    position: Position = NOT_IN_LOG


class SessionSaved(msgspec.Struct, frozen=True):
    """Answer to ``SaveSession`` with a ``ref``: the state is written."""

    ref: int


class InboundReleased(msgspec.Struct, frozen=True):
    """Answer to ``ReleaseInbound``: the release is durable (``ok``), or it could not be recorded (the store is
    unreachable: no PUBCOMP; the flow still awaits its PUBREL, which the client sends again after reconnecting)."""

    ref: int
    ok: bool = True


class Activated(msgspec.Struct, frozen=True):
    """Answer to ``Activate``: each new subscription's start offset, and retained messages per filter.

    ``reasons`` may refuse individual filters (e.g. NOT_AUTHORIZED); they get
    that code in the SUBACK and are not subscribed. ``at_head``: filters whose start was their queue's head once
    the node watched the queue, so its news will say when there is more to read: no first pull.
    """

    ref: int
    starts: dict[str, int]
    retained: tuple[tuple[str, Message], ...] = ()
    reasons: dict[str, ReasonCode] | None = None
    at_head: frozenset[str] = frozenset()


class Pulled(msgspec.Struct, frozen=True, gc=False):
    """Answer to ``Pull``: messages (with ``offset`` set) in queue order, and where the next pull starts; for a
    shared subscription, the POP receipt ``handles`` of the messages, one each."""

    filter: str
    messages: tuple[Message, ...]
    next_offset: int
    handles: tuple[str, ...] = ()


class QueueAdvanced(msgspec.Struct, frozen=True, gc=False):
    """Notify: ``queue`` has messages up to (not including) ``max_offset`` (or a POP group's messages came back:
    shared subscriptions' streams pull on any news)."""

    queue: str
    max_offset: int


class SocketWritten(msgspec.Struct, frozen=True, gc=False):
    """Every ``Deliver`` with ``seq <= up_to`` has been written to the socket."""

    up_to: int


class ConnectionLost(msgspec.Struct, frozen=True):
    """The socket failed or the peer closed it."""

    error: str


class TakenOver(msgspec.Struct, frozen=True):
    """Another connection with this client id has connected; this one must go.

    ``elsewhere``: on another gateway node, which has loaded the session already (or this node's store lease
    ended): no delayed will here (the session resumed there), and no save of this node's copy over that node's.
    """

    elsewhere: bool = False


class AdminDisconnect(msgspec.Struct, frozen=True):
    """An operator disconnected this client (admin API): close with Administrative action (0x98), will included."""


class ServerShutdown(msgspec.Struct, frozen=True):
    """The node is stopping (SIGTERM): close with Server shutting down (0x8B). The will is left to the store, as
    for a node that dies (a cluster store publishes it when the node's lease lapses)."""


class Timeout(msgspec.Struct, frozen=True):
    """A timer fired (``Channel.handle_timeout`` builds this).

    ``input_waiting``: the client's bytes wait in the kernel, unread by a busy
    node; the keep-alive counts them as received (MQTT 3.1.1 3.1.2.10: it
    measures the client's sending, not the server's reading).
    """

    name: str
    input_waiting: bool = False


Action: TypeAlias = (
    Send | Deliver | Close | ArmTimer | CancelTimer | OpenSession | Append | Activate | AfterReads | Release
    | CommitOffsets | Pull | PublishWill | SaveSession | PatchSession | ReleaseInbound | CloseSession | LimitHit
    | Denied
)
Event: TypeAlias = (
    SessionOpened | Appended | Activated | Pulled | QueueAdvanced | SocketWritten | ConnectionLost | TakenOver
    | Timeout | AdminDisconnect | ServerShutdown | SessionSaved | InboundReleased
)
