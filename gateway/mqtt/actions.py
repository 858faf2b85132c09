"""What a channel asks of its node (actions) and what the node tells the channel (events), as plain data.

The channel (``gateway/mqtt/channel.py``) is sans-IO: it never touches a socket, a
timer or the store. Every effect it wants is an *action* returned from its
``handle_*`` methods, executed in order by the node (``gateway/node/connection.py``);
every result the node obtains comes back as an *event* through
``Channel.handle_event``. Requests that need an answer carry a ``ref`` that the
answering event repeats.

All classes are slotted dataclasses (frozen unless made per message), or for
``Message`` a msgspec struct. Don't subclass these: the channel
dispatches on exact type. Mapping fields (``dict``) are read-only by convention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, TypeAlias

import msgspec

from gateway.mqtt.limits import Limit
from gateway.mqtt.packets import Packet, SubscriptionOptions
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from gateway.mqtt.reasons import ReasonCode

if TYPE_CHECKING:  # the session module builds on these classes, so only the type checker imports it here
    from gateway.mqtt.session import SessionState


class Message(msgspec.Struct, gc=False):
    """One application message as the channel needs it, inbound (to store) or outbound (from a queue).

    Untracked by the cyclic garbage collector, like ``store.log.record.Record``
    (nothing it refers to refers back): the queue cache holds thousands.

    ``client_id`` is the publisher's (for No Local). ``store_ms`` is set by the
    store; message expiry counts from it. ``queue``/``offset`` locate a message
    read from a light queue (None for messages not read from a queue: inbound
    messages, wills, retained messages). ``packet_id`` is an inbound QoS 2
    message's: its record keeps it, so the store knows the flow awaits PUBREL.
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
    packet_id: int = 0


@dataclass(frozen=True, slots=True)
class Subscription:
    """One subscription of a session.

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


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class InFlight:
    """An outbound QoS 1/2 message not yet acknowledged, by reference into its queue (no body)."""

    packet_id: int
    filter: str
    offset: int
    qos: int
    phase: Phase = Phase.PUBLISHED


# --- actions: channel -> node ---------------------------------------------------------------


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Send:
    """Encode these packets at the channel's protocol level and write them, in order."""

    packets: tuple[Packet, ...]


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Deliver:
    """Write these pre-encoded PUBLISH packets (``count`` of them); after the write completes, feed ``SocketWritten(seq)``.

    ``by_qos`` counts the packets per QoS and ``oldest_ms`` is the earliest
    store time of the queue messages among them (0: none), for the metrics.
    """

    data: bytes
    seq: int
    count: int = 1
    by_qos: tuple[int, int, int] = (0, 0, 0)
    oldest_ms: int = 0


@dataclass(frozen=True, slots=True)
class Close:
    """Close the network connection (after writing what was sent before); log ``log`` with the reason."""

    reason: ReasonCode
    log: str


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """(Re)start the timer ``name``; when it fires call ``Channel.handle_timeout(name)``."""

    name: str
    delay_s: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    """Stop the timer ``name`` if it is running."""

    name: str


@dataclass(frozen=True, slots=True)
class OpenSession:
    """Accept (auth) and find the session of ``client_id``; answer ``SessionOpened``.

    Credentials are checked first; then any other connection with this client
    id is taken over (feed it ``TakenOver`` and run its actions, which hand its
    session state over). With ``clean_start`` the old session is discarded
    (filters released). ``will_topic`` is checked against the client's
    publish rights, so a will it may not publish refuses the CONNECT.
    ``will`` and ``will_delay_s`` are the will itself, which a cluster node
    has the store hold while the client is connected (store/leases.py).
    """

    client_id: str
    clean_start: bool
    expiry_s: int
    username: str | None = None
    password: bytes | None = None
    will_topic: str | None = None
    will: Message | None = None
    will_delay_s: int = 0


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Append:
    """Append messages to the CommitLog (durable under the sync flush policy).

    ``ref`` None: fire and forget (QoS 0). Otherwise answer ``Appended(ref, ...)``.
    """

    ref: int | None
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class Activate:
    """Make this session hold the queues of ``subscriptions``; answer ``Activated``.

    ``retained`` lists the filters that want retained messages now (the channel
    has applied retain handling; shared subscriptions never do).
    """

    ref: int
    client_id: str
    subscriptions: tuple[Subscription, ...]
    retained: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AfterReads:
    """Queued by the connection, not the channel, before an append read while subscriptions read on other
    connections wait to be applied: the actions after it wait until those are (``mark``, gateway/node/order.py)."""

    mark: int


@dataclass(frozen=True, slots=True)
class Release:
    """This session stops holding these subscriptions (filters as sent); their offsets go too."""

    client_id: str
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CommitOffsets:
    """Store the session's consumer offsets: filter -> next queue offset not yet fully acknowledged."""

    client_id: str
    offsets: dict[str, int]


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Pull:
    """Read up to ``max_count`` messages of ``queue`` from ``from_offset``; answer ``Pulled(filter, ...)``.

    For a shared subscription (``group`` set) answer only with the messages the
    group assigns to this member (offsets may skip).
    """

    filter: str
    queue: str
    from_offset: int
    max_count: int
    group: str | None = None


@dataclass(frozen=True, slots=True)
class PublishWill:
    """Publish the will after ``delay_s`` unless a connection resumes the session first."""

    client_id: str
    message: Message
    delay_s: int


@dataclass(frozen=True, slots=True)
class SaveSession:
    """Keep this session state: write it (WAL) if ``state.expiry_s > 0``; hand it to a taking-over connection.

    ``ref`` set: answer ``SessionSaved(ref)`` once it is written (what it records may then be relied on:
    PUBRELs sent, packet ids used, gateway/mqtt/session.py).
    """

    state: SessionState
    ref: int | None = None


@dataclass(frozen=True, slots=True)
class ReleaseInbound:
    """The client released inbound QoS 2 message ``packet_id`` (PUBREL): record that durably in the store
    (``StoreClient.release_awaiting``), then answer ``InboundReleased(ref)``: only then may PUBCOMP go out."""

    ref: int
    client_id: str
    packet_id: int
    offset: int  # the CommitLog offset of the message's record


@dataclass(frozen=True, slots=True)
class DropSession:
    """The session has ended: delete its stored state and offsets."""

    client_id: str


@dataclass(frozen=True, slots=True)
class LimitHit:
    """The client ran into ``limit`` ``count`` times: count it; log ``log`` (with the client id) unless None.

    The channel already answered the client; this only feeds the node's
    counters and log (``None``: a line about this limit went out recently).
    """

    limit: Limit
    count: int = 1
    log: str | None = None


# --- events: node -> channel ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """Answer to ``OpenSession``. ``reason`` other than SUCCESS refuses the connection (CONNACK reason).

    ``may_read`` is the delivery side of the ACL for this client (``gateway.auth.acl.ReadCheck``): a pure check of a
    topic, None when every topic may be delivered.
    """

    present: bool
    state: SessionState | None = None
    reason: ReasonCode = ReasonCode.SUCCESS
    may_read: Callable[[str], bool] | None = None


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Appended:
    """Answer to ``Append``: stored (``ok``, at CommitLog ``offset``), or refused with a PUBACK/PUBREC reason."""

    ref: int
    ok: bool = True
    reason: ReasonCode = ReasonCode.UNSPECIFIED_ERROR
    offset: int = -1


@dataclass(frozen=True, slots=True)
class SessionSaved:
    """Answer to ``SaveSession`` with a ``ref``: the state is written."""

    ref: int


@dataclass(frozen=True, slots=True)
class InboundReleased:
    """Answer to ``ReleaseInbound``: the release is durable."""

    ref: int


@dataclass(frozen=True, slots=True)
class Activated:
    """Answer to ``Activate``: each new subscription's start offset, and retained messages per filter.

    ``reasons`` may refuse individual filters (e.g. NOT_AUTHORIZED); they get
    that code in the SUBACK and are not subscribed.
    """

    ref: int
    starts: dict[str, int]
    retained: tuple[tuple[str, Message], ...] = ()
    reasons: dict[str, ReasonCode] | None = None


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class Pulled:
    """Answer to ``Pull``: messages (with ``offset`` set) in queue order, and where the next pull starts."""

    filter: str
    messages: tuple[Message, ...]
    next_offset: int


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class QueueAdvanced:
    """Notify: ``queue`` has messages up to (not including) ``max_offset``."""

    queue: str
    max_offset: int


@dataclass(slots=True)  # not frozen: made per message, and frozen costs 6x to build
class SocketWritten:
    """Every ``Deliver`` with ``seq <= up_to`` has been written to the socket."""

    up_to: int


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The socket failed or the peer closed it."""

    error: str


@dataclass(frozen=True, slots=True)
class TakenOver:
    """Another connection with this client id has connected; this one must go.

    ``elsewhere``: on another gateway node, which has loaded the session already: no delayed will here
    (the session resumed), and no save of this node's copy over that node's.
    """

    elsewhere: bool = False


@dataclass(frozen=True, slots=True)
class AdminDisconnect:
    """An operator disconnected this client (admin API): close with Administrative action (0x98), will included."""


@dataclass(frozen=True, slots=True)
class ServerShutdown:
    """The node is stopping (SIGTERM): close with Server shutting down (0x8B). The will is left to the store, as
    for a node that dies (a cluster store publishes it when the node's lease lapses)."""


@dataclass(frozen=True, slots=True)
class Timeout:
    """A timer fired (``Channel.handle_timeout`` builds this).

    ``input_waiting``: the client's bytes wait in the kernel, unread by a busy
    node; the keep-alive counts them as received (MQTT 3.1.1 3.1.2.10: it
    measures the client's sending, not the server's reading).
    """

    name: str
    input_waiting: bool = False


Action: TypeAlias = (
    Send | Deliver | Close | ArmTimer | CancelTimer | OpenSession | Append | Activate | Release
    | CommitOffsets | Pull | PublishWill | SaveSession | ReleaseInbound | DropSession | LimitHit
)
Event: TypeAlias = (
    SessionOpened | Appended | Activated | Pulled | QueueAdvanced | SocketWritten | ConnectionLost | TakenOver
    | Timeout | AdminDisconnect | ServerShutdown | SessionSaved | InboundReleased
)
