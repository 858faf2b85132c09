"""The states of one MQTT connection and the one table that moves between them.

Rule 1 (after h11's ``_state.py``): every state change of a connection is an
entry of ``TRANSITIONS`` and happens in ``next_state``; nothing else assigns a
state. A missing entry means the event is not allowed in that state: from the
peer (a packet) that is a protocol error, from the node (an event) it is a bug
in the node.

States:

- AWAIT_CONNECT: the socket is open, nothing received yet.
- CONNECTING: CONNECT received; waiting for the node to accept it and open the
  session (auth, takeover, session load). Packets the client sends meanwhile
  are queued (clients may send before CONNACK).
- CONNECTED: CONNACK sent.
- DISCONNECTING: the channel has decided to close (the socket is closed or
  closing) but is still waiting for store results that change the session
  (appends and releases of inbound QoS 2 messages, the session a late
  ``SessionOpened`` brings), so that the saved session is exact.
- CLOSED: nothing more to do.

``ConnectionState`` (h11's object of the same name) holds the rest of a
connection's protocol state: what the packet handlers read and change.
"""

from __future__ import annotations

from enum import Enum
from typing import final

from gateway.mqtt.actions import (
    Activated,
    AdminDisconnect,
    Appended,
    Authorizer,
    ConnectionLost,
    InboundReleased,
    Pulled,
    QueueAdvanced,
    ServerShutdown,
    SessionOpened,
    SessionSaved,
    SocketWritten,
    Subscription,
    TakenOver,
    Timeout,
)
from gateway.mqtt.lazy import Queued, made_on_first_use
from gateway.mqtt.limits import Limit
from gateway.mqtt.packets import (
    Auth,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from gateway.mqtt.ratelimit import TokenBucket
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode, RemoteProtocolError
from gateway.mqtt.session import Link, Session
from store.api import NewMessage


class State(Enum):
    AWAIT_CONNECT = "await_connect"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    DISCONNECTING = "disconnecting"
    CLOSED = "closed"

    # Members are singletons compared by identity: the identity hash is right, and it is C, where Enum's
    # hashes the name in Python. Every packet and node event looks its state up in TRANSITIONS.
    __hash__ = object.__hash__


@final
class Closing:
    """Pseudo-event: the channel decided to close the connection."""


@final
class Settled:
    """Pseudo-event: no store result the session depends on is outstanding any more."""


CLIENT_PACKETS = (Connect, Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Unsubscribe, Pingreq, Disconnect, Auth)
"""Every packet a client may send (codec.py's ``_SENT_BY``); the ones a state does not list are protocol errors."""

_AFTER_CONNECT = (Publish, Puback, Pubrec, Pubrel, Pubcomp, Subscribe, Unsubscribe, Pingreq, Disconnect)
# What the node may still report after the channel decided to close: the channel ignores it
# (or, for Appended, InboundReleased and SessionOpened, folds it into the session before saving it).
_LATE_EVENTS = (Appended, Activated, Pulled, QueueAdvanced, SocketWritten, ConnectionLost, TakenOver, Timeout,
                SessionOpened, AdminDisconnect, ServerShutdown, SessionSaved, InboundReleased)

_S = State
TRANSITIONS: dict[State, dict[type, State]] = {
    _S.AWAIT_CONNECT: {
        Connect: _S.CONNECTING,
        ConnectionLost: _S.AWAIT_CONNECT,
        Timeout: _S.AWAIT_CONNECT,
        Closing: _S.DISCONNECTING,
    },
    _S.CONNECTING: {
        # AUTH (enhanced authentication) is not offered, so it is an error here too.
        **{packet: _S.CONNECTING for packet in _AFTER_CONNECT},
        SessionOpened: _S.CONNECTED,
        ConnectionLost: _S.CONNECTING,
        TakenOver: _S.CONNECTING,
        AdminDisconnect: _S.CONNECTING,
        ServerShutdown: _S.CONNECTING,
        Timeout: _S.CONNECTING,
        Closing: _S.DISCONNECTING,
    },
    _S.CONNECTED: {
        **{packet: _S.CONNECTED for packet in _AFTER_CONNECT},
        Appended: _S.CONNECTED,
        InboundReleased: _S.CONNECTED,
        SessionSaved: _S.CONNECTED,
        Activated: _S.CONNECTED,
        Pulled: _S.CONNECTED,
        QueueAdvanced: _S.CONNECTED,
        SocketWritten: _S.CONNECTED,
        ConnectionLost: _S.CONNECTED,
        TakenOver: _S.CONNECTED,
        AdminDisconnect: _S.CONNECTED,
        ServerShutdown: _S.CONNECTED,
        Timeout: _S.CONNECTED,
        Closing: _S.DISCONNECTING,
    },
    _S.DISCONNECTING: {
        **{event: _S.DISCONNECTING for event in _LATE_EVENTS},
        Settled: _S.CLOSED,
    },
    _S.CLOSED: {event: _S.CLOSED for event in _LATE_EVENTS},
}


def next_state(state: State, event_type: type) -> State:
    """The state after ``event_type`` happens in ``state``.

    Raises:
        RemoteProtocolError: PROTOCOL_ERROR, a client packet the state does not allow.
        LocalProtocolError: a node event or pseudo-event the state does not allow.
    """
    try:
        return TRANSITIONS[state][event_type]
    except KeyError:
        if event_type in CLIENT_PACKETS:
            raise RemoteProtocolError(
                ReasonCode.PROTOCOL_ERROR, f"{event_type.__name__} is not allowed in state {state.name}"
            ) from None
        raise LocalProtocolError(f"{event_type.__name__} is not allowed in state {state.name}") from None


@final
class ConnectionState:
    """What one connection has agreed and has in progress: the protocol state the packet handlers read and change.

    h11's ``ConnectionState`` and EMQX's channel record: the client's terms (level, identifier, expiry, keep
    alive, will), its session, and the store requests whose answers it waits for. The channel
    (``gateway/mqtt/channel.py``) owns one and keeps what is its own apart: the ``State`` (moved through
    ``TRANSITIONS`` only), the dispatch, the timers and the closing. The handlers (``gateway/mqtt/handlers/``)
    use these attributes, never the channel's private ones (tests/gateway/mqtt/test_structure.py).
    """

    __slots__ = (  # one per device: slots save a dict of about 1.5 KiB each
        "level", "peer_max_packet", "client_id", "assigned", "clean_start", "requested_expiry", "expiry",
        "keepalive", "keepalive_override", "will", "will_delay", "session", "link", "queued", "pending", "refused",
        "authorizer", "storing_qos2", "releasing", "activations", "activating", "next_ref", "aliases_in", "last_rx",
        "awaiting_session", "held", "topic_check_from", "valid_topic", "buckets",
    )

    # Made at their first use (gateway/mqtt/lazy.py): an idle device's stay empty (an empty dict is 64 B).
    pending: dict[int, tuple[int, int, bool]]  # Append ref -> (qos, packet id, delayed), acks owed
    refused: dict[int, None]  # refs in pending the ACL refused: answered in their turn
    # Dicts used as sets (keys only): an empty set is 216 B.
    storing_qos2: dict[int, None]  # inbound QoS 2 packet ids being appended
    releasing: dict[int, int]  # ReleaseInbound ref -> inbound QoS 2 packet id whose PUBCOMP waits
    # Activate ref -> its SUBSCRIBEs: (packet id, SUBACK codes, (index, subscription) of each accepted filter)
    activations: dict[int, list[tuple[int, list[ReasonCode], list[tuple[int, Subscription]]]]]
    aliases_in: dict[int, str]
    __getattr__ = made_on_first_use({"pending": dict, "refused": dict, "storing_qos2": dict, "releasing": dict,
                                     "activations": dict, "aliases_in": dict})

    def __init__(self, last_rx: float, topic_check_from: int, buckets: tuple[tuple[TokenBucket, Limit], ...]) -> None:
        self.level: int | None = None
        self.peer_max_packet: int | None = None  # the client's Maximum Packet Size, once its CONNECT is read
        self.client_id = ""
        self.assigned: str | None = None
        self.clean_start = True
        self.requested_expiry = 0
        self.expiry = 0
        self.keepalive = 0
        self.keepalive_override: int | None = None  # Server Keep Alive, when it differs from the client's
        self.will: NewMessage | None = None
        self.will_delay = 0
        self.session: Session | None = None
        self.link: Link | None = None
        self.queued: Queued[Packet] = ()  # packets read before the CONNACK
        self.authorizer: Authorizer | None = None  # the ACL's checks of this client (None: it may do anything)
        self.next_ref = 0
        self.activating = 0  # filters in ``activations``: counted as they come and go, not summed per SUBSCRIBE
        self.last_rx = last_rx
        self.awaiting_session = False
        self.held: Queued[Packet] = ()  # 3.1.1 packets waiting for room under the in-flight limit
        # Shorter topics cannot be over a topic limit (a level takes a character, a character at most 4 bytes):
        # the publish and subscribe paths skip the check for them.
        self.topic_check_from = topic_check_from
        self.valid_topic = ""  # the topic name the last PUBLISH passed validation with: devices repeat theirs
        self.buckets = buckets
