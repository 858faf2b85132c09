"""The sans-IO MQTT 3.1.1 / 5.0 server side of one connection: packets and node events in, actions out.

``Channel`` is EMQX's ``emqx_channel`` in the h11 style: it holds protocol
logic only. Decoded packets go in through ``handle_in``, store and timer
results through ``handle_event`` / ``handle_timeout``, decoder errors through
``handle_protocol_error``; each returns the actions (``gateway/mqtt/actions.py``)
the node must execute, in order. There is no socket, timer or store here, and
timers are actions, so the channel is fully testable with plain calls.

Structure:

- the connection state moves only through ``gateway/mqtt/state.py``'s table;
- one ``_process_<packet>`` per packet type in ``_PROCESS``, one ``_on_<event>``
  per node event in ``_EVENTS``;
- checks run cheapest first (Mosquitto's ``handle__publish`` order) and raise
  ``RemoteProtocolError``; ``error_packet`` is the one place that turns an
  error into a CONNACK or DISCONNECT (MQTT 5) or into a bare close (3.1.1,
  except CONNACK return codes for CONNECT refusals 3.1.1 has codes for);
- the session (``gateway/mqtt/session.py``) owns delivery, packet ids and QoS state.

Acknowledgements of inbound QoS 1/2 messages (PUBACK / PUBREC) are sent only
when the node reports them stored (``Appended``), which under the sync flush
policy means durable. A QoS 2 message's record carries its packet id, so the
store derives "awaiting PUBREL" from it (store/awaiting.py); a PUBCOMP goes out
only once the release is on disk (``ReleaseInbound`` -> ``InboundReleased``).

Per-client limits (topic length and levels, subscriptions, in-flight messages,
publish rate; docs/security.md, "Limits") are checked here too: each hit is
answered as the client's protocol version allows and reported as a
``LimitHit`` action for the node to count and log.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, final

from gateway.mqtt.state import Closing, Settled, State, next_state
from gateway.mqtt.actions import (
    Action,
    Activate,
    Activated,
    AdminDisconnect,
    Append,
    Appended,
    ArmTimer,
    CancelTimer,
    Close,
    ConnectionLost,
    Deliver,
    CloseSession,
    Event,
    InboundReleased,
    LimitHit,
    OpenSession,
    PublishWill,
    Pulled,
    QueueAdvanced,
    Release,
    ReleaseInbound,
    SaveSession,
    Send,
    ServerShutdown,
    SessionOpened,
    SessionSaved,
    SocketWritten,
    Subscription,
    TakenOver,
    Timeout,
)
from gateway.mqtt.codec import encode, encode_publish_template, fit
from gateway.mqtt.limits import HitLog, Limit
from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from gateway.mqtt.properties import (EMPTY_PROPERTIES, MAX_UINT16, MAX_VARINT, PacketType, Properties, RepeatLimit,
                                     RepeatLimitExceeded, encode_properties)
from gateway.mqtt.reasons import (
    CONNACK_REASONS,
    DISCONNECT_REASONS,
    PUBACK_REASONS,
    LocalProtocolError,
    ReasonCode,
    RemoteProtocolError,
)
from gateway.mqtt.ratelimit import TokenBucket
from gateway.mqtt.session import NOT_IN_LOG, Encoder, Link, Session
from lightqueue.topics import (
    DEFAULT_LIMITS,
    MAX_TOPIC_BYTES,
    TopicError,
    TopicLimits,
    is_wildcard,
    parse_shared,
    validate_filter,
    validate_topic,
)
from store.api import NewMessage

__all__ = ["KEEPALIVE_TIMER", "Channel", "ChannelConfig", "error_packet"]

KEEPALIVE_TIMER = "keepalive"
"""Fires 1.5 x keep alive after the last packet received ([MQTT-3.1.2-24]); re-armed for the remainder if traffic came
(or waits unread: a node resuming 10,000 sessions can take tens of seconds to read a socket again)."""

COMMIT_TIMER = "commit"
"""Commits acknowledged offsets at most once per ``commit_interval_s``: offsets are written in batches, not per ack."""

MAX_REASON_STRING = 256
"""Reason Strings are diagnostics for people: the error's first characters say enough, and keep the packet small."""

RATE_DEBT_S = 10.0
"""A client whose publish-rate bucket owes more than this many seconds of refill is disconnected: it kept sending
through its refusals (or, QoS 0, its drops) for that long, so it is broken or abusive, not bursty."""

BYTES_BURST_S = 1.0
"""The byte-rate bucket banks this many seconds of ``publish_bytes_rate``: a burst of a second's worth is normal."""

SYNTAX_ONLY = TopicLimits(MAX_TOPIC_BYTES, MAX_TOPIC_BYTES + 1)
"""Topic validation with the protocol's bounds only: the configured length and level limits are checked apart, so
a topic over them is a counted limit hit answered per message, not a malformed packet."""

_MAX_EXPIRY = 0xFFFF_FFFF  # Session Expiry Interval 0xFFFFFFFF means "never expires" (section 3.1.2.11.2)

_CONNACK_REFUSALS_311 = frozenset({
    ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
    ReasonCode.BAD_USER_NAME_OR_PASSWORD, ReasonCode.BAD_AUTHENTICATION_METHOD, ReasonCode.NOT_AUTHORIZED,
    ReasonCode.BANNED, ReasonCode.SERVER_UNAVAILABLE, ReasonCode.SERVER_BUSY,
})
"""CONNECT refusals a 3.1.1 CONNACK return code expresses (section 3.2.2.3); any other error closes without a packet."""


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """What the server offers its clients (advertised in the MQTT 5 CONNACK) and the channel's memory bounds.

    ``max_packet_size`` must equal the decoder's limit (the server enforces it
    on input), as must ``max_connect_size`` (the largest CONNECT) and the
    User Property bounds (``max_user_properties``, ``max_user_property_bytes``
    per property block; 0 = none: ``repeat_limit``). ``receive_maximum`` bounds inbound QoS 1/2 messages awaiting
    acknowledgement; ``default_receive_maximum`` is the outbound window of
    3.1.1 clients (which cannot say), ``max_inflight`` caps any client's.
    ``max_keepalive`` None honours any keep alive; otherwise an MQTT 5 client
    asking for more (or for none, 0) is told this value as Server Keep Alive.
    ``reason_strings`` adds the error's text as Reason String to the CONNACKs
    and DISCONNECTs that refuse or close an MQTT 5 client.

    Per-client limits (docs/security.md, "Limits"): ``max_topic_length`` (UTF-8
    bytes) and ``max_topic_levels`` bound topic names and filters (at most the
    protocol's 65535 bytes and the store's 128 levels); ``max_subscriptions``
    per session, ``publish_rate`` (messages/s, banking ``publish_burst``, 0 =
    one second's worth), ``publish_bytes_rate`` (payload bytes/s) and
    ``qos0_queue_bytes`` (QoS 0 delivery bytes waiting for the socket) are
    off at 0. ``receive_maximum`` is also the in-flight limit of 3.1.1
    clients, as the number of their QoS 1/2 messages stored at once.
    ``pull_batch`` messages per pull bounds a slow stream's buffer; it is the
    deliveries of one step (four turns of ``gateway.mqtt.session.DELIVER_BUDGET``),
    so a subscriber draining a backlog pulls once per step.
    """

    max_packet_size: int = 1024 * 1024 + 1024
    max_connect_size: int = 128 * 1024
    receive_maximum: int = 128
    default_receive_maximum: int = 256
    max_inflight: int = 1024
    topic_alias_maximum: int = 64
    max_keepalive: int | None = None
    max_session_expiry_s: int = 7 * 24 * 3600
    session_expiry_311_s: int = 7 * 24 * 3600
    max_qos: int = 2
    retain_available: bool = True
    wildcard_available: bool = True
    shared_available: bool = True
    subscription_ids_available: bool = True
    assigned_id_prefix: str = "lightgate-"
    pull_batch: int = 1024
    max_unwritten: int = 1024
    commit_interval_s: float = 1.0
    commit_every: int = 256
    max_queued_packets: int = 256
    reason_strings: bool = False
    max_topic_length: int = MAX_TOPIC_BYTES
    max_topic_levels: int = DEFAULT_LIMITS.max_levels
    max_subscriptions: int = 0
    max_user_properties: int = 0
    max_user_property_bytes: int = 0
    publish_rate: float = 0.0
    publish_burst: float = 0.0
    publish_bytes_rate: float = 0.0
    qos0_queue_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("receive_maximum", "default_receive_maximum", "max_inflight"):
            if not 1 <= getattr(self, name) <= MAX_UINT16:
                raise ValueError(f"{name} must be 1..{MAX_UINT16}, not {getattr(self, name)}")
        if not 0 <= self.topic_alias_maximum <= MAX_UINT16:
            raise ValueError(f"topic_alias_maximum must be 0..{MAX_UINT16}, not {self.topic_alias_maximum}")
        if self.max_qos not in (0, 1, 2):
            raise ValueError(f"max_qos must be 0, 1 or 2, not {self.max_qos}")
        if self.max_keepalive is not None and not 1 <= self.max_keepalive <= MAX_UINT16:
            raise ValueError(f"max_keepalive must be 1..{MAX_UINT16}, not {self.max_keepalive}")
        for name in ("pull_batch", "max_unwritten", "commit_every", "max_queued_packets", "max_packet_size",
                     "max_connect_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.commit_interval_s <= 0:
            raise ValueError(f"commit_interval_s must be positive, not {self.commit_interval_s}")
        if not 1 <= self.max_topic_length <= MAX_TOPIC_BYTES:
            raise ValueError(f"max_topic_length must be 1..{MAX_TOPIC_BYTES}, not {self.max_topic_length}")
        if not 1 <= self.max_topic_levels <= DEFAULT_LIMITS.max_levels:
            raise ValueError(f"max_topic_levels must be 1..{DEFAULT_LIMITS.max_levels} (the store's limit), "
                             f"not {self.max_topic_levels}")
        for name in ("max_subscriptions", "publish_rate", "publish_burst", "publish_bytes_rate", "qos0_queue_bytes",
                     "max_user_properties", "max_user_property_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")

    @property
    def repeat_limit(self) -> RepeatLimit:
        """The decoder's bounds of the repeated properties of one property block (0: none)."""
        return RepeatLimit(self.max_user_properties or MAX_VARINT, self.max_user_property_bytes or MAX_VARINT)


def error_packet(protocol_level: int | None, before_connack: bool, reason: ReasonCode) -> Packet | None:
    """The packet that tells the client why the server closes, or None to close silently.

    MQTT 5 answers in the CONNACK before the connection is accepted and in a
    DISCONNECT after; a reason a packet cannot carry becomes UNSPECIFIED_ERROR.
    MQTT 3.1.1 (and an unknown level, answered in 3.1.1 form as Mosquitto does
    for unknown protocol versions) only has CONNACK return codes for refusals.
    """
    if before_connack:
        if protocol_level == MQTT_5:
            return Connack(reason_code=reason if reason in CONNACK_REASONS else ReasonCode.UNSPECIFIED_ERROR)
        return Connack(reason_code=reason) if reason in _CONNACK_REFUSALS_311 else None
    if protocol_level == MQTT_5:
        return Disconnect(reason if reason in DISCONNECT_REASONS else ReasonCode.UNSPECIFIED_ERROR)
    return None


def _parsed_filter(filter: str) -> tuple[str, str] | None:
    """(group, filter) of a shared subscription, None for a plain filter.

    Raises:
        RemoteProtocolError: PROTOCOL_ERROR, the filter is malformed (wildcards [MQTT-4.7.1-2/3], empty
            [MQTT-4.7.3-1], share name [MQTT-4.8.2-1/2]): a protocol violation the connection is closed for
            (3.1.1 [MQTT-4.8.0-1], 5.0 section 4.13.1), not a refusal (SUBACK/UNSUBACK 0x8F is for filters
            correctly formed but not allowed, as the topic limits answer).
    """
    try:
        shared = parse_shared(filter, SYNTAX_ONLY)
        if shared is None:
            validate_filter(filter, SYNTAX_ONLY)
    except TopicError as exc:
        raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"malformed topic filter: {exc}") from None
    return shared


@final
class Channel:
    """The protocol state of one client connection (server side).

    Args:
        config: what the server offers.
        now: wall-clock seconds (``time.time``); keep alive, born timestamps and message expiry use it.
        encoder: builds outbound PUBLISH templates; a node may share a caching one between channels.

    Error handling: a peer's protocol error never raises out of ``handle_in``;
    it becomes the actions that close the connection. ``LocalProtocolError``
    means the node fed an event the channel did not ask for.

    Resource handling: owns nothing; the node owns the socket and timers and
    must execute every returned action in order.
    """

    __slots__ = (  # one channel per device: slots save a dict of about 1.5 KiB each
        "config", "_now", "_encoder", "_state", "_level", "_client_id", "_assigned", "_clean_start", "_expiry",
        "_requested_expiry", "_keepalive", "_keepalive_override", "_peer_max_packet", "_will", "_will_delay",
        "_will_due",
        "_session", "_link", "_queued", "_pending", "_storing_qos2", "_releasing", "_activations", "_next_ref",
        "_aliases_in",
        "_last_rx", "_timers", "_awaiting_session", "_handover", "_moved", "_held", "_hits", "_topic_check_from",
        "_buckets", "_valid_topic",
    )

    def __init__(
        self,
        config: ChannelConfig = ChannelConfig(),
        now: Callable[[], float] = time.time,
        *,
        encoder: Encoder = encode_publish_template,
    ) -> None:
        self.config = config
        self._now = now
        self._encoder = encoder
        self._state = State.AWAIT_CONNECT
        self._level: int | None = None
        self._peer_max_packet: int | None = None  # the client's Maximum Packet Size, once its CONNECT is read
        self._client_id = ""
        self._assigned: str | None = None
        self._clean_start = True
        self._requested_expiry = 0
        self._expiry = 0
        self._keepalive = 0
        self._keepalive_override: int | None = None  # Server Keep Alive, when it differs from the client's
        self._will: NewMessage | None = None
        self._will_delay = 0
        self._will_due: int | None = None  # the delay of a will left to the store at the close (None: none is due)
        self._session: Session | None = None
        self._link: Link | None = None
        self._queued: list[Packet] = []
        self._pending: dict[int, tuple[int, int]] = {}  # Append ref -> (qos, packet id), acks owed
        # Dicts used as sets (keys only): an empty dict is 64 B, an empty set 216 B, on every idle connection.
        self._storing_qos2: dict[int, None] = {}  # inbound QoS 2 packet ids being appended
        self._releasing: dict[int, int] = {}  # ReleaseInbound ref -> inbound QoS 2 packet id whose PUBCOMP waits
        self._activations: dict[int, tuple[int, list[ReasonCode], list[tuple[int, Subscription]]]] = {}
        self._next_ref = 0
        self._aliases_in: dict[int, str] = {}
        self._last_rx = now()
        self._timers: dict[str, None] = {}  # names of the armed timers
        self._awaiting_session = False
        self._handover = False
        self._moved = False  # taken over from another node: that node saves the session
        self._held: list[Packet] = []  # 3.1.1 packets waiting for room under the in-flight limit (a list: 56 B idle)
        self._hits: HitLog | None = None  # made at the first limit hit: most connections never hit one
        # Shorter topics cannot be over a topic limit (a level takes a character, a character at most 4 bytes):
        # the publish path skips the check for them.
        self._topic_check_from = min(config.max_topic_levels, config.max_topic_length // 4 + 1)
        self._valid_topic = ""  # the topic name the last PUBLISH passed validation with: devices repeat theirs
        start = now()
        self._buckets: tuple[tuple[TokenBucket, Limit], ...] = tuple(
            (TokenBucket(rate, burst, start), limit) for rate, burst, limit in (
                (config.publish_rate, config.publish_burst or config.publish_rate, Limit.PUBLISH_RATE),
                (config.publish_bytes_rate, config.publish_bytes_rate * BYTES_BURST_S, Limit.PUBLISH_BYTES_RATE),
            ) if rate > 0)

    # --- introspection ------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def protocol_level(self) -> int:
        """The level to encode ``Send`` packets at: the client's, or 3.1.1 before a CONNECT was read."""
        return self._level or MQTT_311

    @property
    def client_id(self) -> str:
        """The client identifier (assigned one included); empty before CONNECT."""
        return self._client_id

    @property
    def session(self) -> Session | None:
        return self._session

    @property
    def keep_alive(self) -> int:
        """The keep alive in force, in seconds (0: none)."""
        return self._keepalive

    @property
    def input_paused(self) -> bool:
        """True while packets wait for room under the in-flight limit (3.1.1), or the session is being opened:
        stop reading (and decoding) until it is False again (it changes when an ``Appended`` or the
        ``SessionOpened`` is handled). Packets handed in meanwhile are kept, up to ``max_queued_packets``."""
        return bool(self._held) or self._awaiting_session

    # --- entry points -------------------------------------------------------------------

    def handle_in(self, packet: Packet) -> list[Action]:
        """Process one decoded packet from the client. Packets after the close are dropped."""
        if type(packet) is Publish and self._state is State.CONNECTED and not self._held:
            # A device's PUBLISH on an open connection, most of what a node reads: the state stays CONNECTED
            # (TRANSITIONS), and a PUBLISH acknowledges no delivery, so no commit can be due (``_after``).
            self._last_rx = self._now()
            try:
                actions = self._process_publish(packet)
            except RemoteProtocolError as err:
                actions = self._protocol_error(err)
            return actions if self._peer_max_packet is None else self._fit(actions)
        if self._state in (State.DISCONNECTING, State.CLOSED):
            return []
        try:
            self._state = next_state(self._state, type(packet))
            self._last_rx = self._now()
            if self._state is State.CONNECTING and type(packet) is not Connect:
                if len(self._queued) >= self.config.max_queued_packets:
                    raise RemoteProtocolError(ReasonCode.QUOTA_EXCEEDED, "too many packets before CONNACK")
                self._queued.append(packet)
                return []
            if self._held:
                return self._hold(packet)
            actions = self._after(_PROCESS[type(packet)](self, packet))
        except RemoteProtocolError as err:
            actions = self._protocol_error(err)
        return actions if self._peer_max_packet is None else self._fit(actions)

    def input_done(self) -> list[Action]:
        """Everything the client sent so far is processed: deliver what its acknowledgements made room for
        (the session defers that while most of its window is in flight; call this after each read)."""
        session = self._session
        if session is None or self._state is not State.CONNECTED:
            return []
        return session.pump_due()

    def handle_event(self, event: Event) -> list[Action]:
        """Process a result or notification from the node.

        Raises:
            LocalProtocolError: the event does not fit the channel's state (a node bug).
        """
        closing = self._state in (State.DISCONNECTING, State.CLOSED)
        self._state = next_state(self._state, type(event))
        if closing and type(event) not in (Appended, SessionOpened, InboundReleased):
            return []
        try:
            actions = self._after(_EVENTS[type(event)](self, event))
        except RemoteProtocolError as err:
            actions = self._protocol_error(err)
        return actions if self._peer_max_packet is None else self._fit(actions)

    def handle_timeout(self, name: str, input_waiting: bool = False) -> list[Action]:
        """A timer armed with ``ArmTimer(name, ...)`` fired; ``input_waiting`` as in ``Timeout``."""
        return self.handle_event(Timeout(name, input_waiting))

    def handle_protocol_error(self, err: RemoteProtocolError, protocol_level: int | None = None) -> list[Action]:
        """The decoder (or a check here) found the peer breaking the protocol: answer and close.

        Args:
            protocol_level: the decoder's level, for errors inside a CONNECT (the channel has not seen it).
        """
        actions = self._protocol_error(err, protocol_level)
        return actions if self._peer_max_packet is None else self._fit(actions)

    def _protocol_error(self, err: RemoteProtocolError, protocol_level: int | None = None) -> list[Action]:
        if self._state in (State.DISCONNECTING, State.CLOSED):
            return []
        if self._level is None:  # inside the CONNECT: answer at its level, which the client reads [MQTT-3.1.4-1]
            self._level = protocol_level
        level = self._level
        before_connack = self._state in (State.AWAIT_CONNECT, State.CONNECTING)
        packet = self._explained(error_packet(level, before_connack, err.reason), level, err.message)
        limit = Limit.USER_PROPERTIES if isinstance(err, RepeatLimitExceeded) else _LIMIT_ERRORS.get(err.reason)
        hit = [LimitHit(limit, 1)] if limit is not None else []  # counted; the close is the one log line
        return hit + self._close(err.reason, f"protocol error: {err.message}", packet=packet, will=True)

    def _explained(self, packet: Packet | None, level: int | None, text: str) -> Packet | None:
        """``packet`` (an error CONNACK or DISCONNECT) with ``text`` as its Reason String, if configured and
        MQTT 5 (``_fit`` leaves it out if the client's Maximum Packet Size has no room for it [MQTT-3.14.2-3])."""
        if packet is None or level != MQTT_5 or not self.config.reason_strings:
            return packet
        return replace(packet, properties=replace(packet.properties,  # type: ignore[arg-type]
                                                  reason_string=text[:MAX_REASON_STRING]))

    def _fit(self, actions: list[Action]) -> list[Action]:
        """``actions`` with every packet within the client's Maximum Packet Size ([MQTT-3.1.2-24]): the one place
        that applies it to the packets the channel sends (``Session`` drops a PUBLISH over it, [MQTT-3.1.2-25]).

        A packet over the limit is sent without its Reason String and User Properties (``codec.fit``). One that
        does not fit even so is not sent, nor is anything after it, and the connection closes: a client that
        cannot receive an acknowledgement cannot go on. The node actions are kept (their results settle the
        session).
        """
        limit: int = self._peer_max_packet  # type: ignore[assignment]
        level = self.protocol_level
        for index, action in enumerate(actions):
            if not isinstance(action, Send):
                continue
            packets = []
            trimmed = False
            for packet in action.packets:
                fitted = fit(packet, level, limit)
                if fitted is None:
                    return self._unsendable(actions, index, packets, packet)
                packets.append(fitted)
                trimmed = trimmed or fitted is not packet
            if trimmed:
                actions[index] = Send(tuple(packets))
        return actions

    def _unsendable(self, actions: list[Action], index: int, sendable: list[Packet], packet: Packet) -> list[Action]:
        """``_fit``'s answer when ``packet``, in ``actions[index]`` after ``sendable``, cannot be sent."""
        kept = actions[:index] + ([Send(tuple(sendable))] if sendable else [])
        kept += [action for action in actions[index + 1:] if type(action) not in (Send, Deliver)]
        if self._state in (State.DISCONNECTING, State.CLOSED):
            return kept  # already closing (the packet said why): only that packet is not sent
        size = len(encode(packet, self.protocol_level))
        why = (f"a {packet.packet_type.name} of {size} bytes, even without its reason string and user properties, "
               f"exceeds the client's Maximum Packet Size of {self._peer_max_packet} [MQTT-3.1.2-24]")
        return kept + self._close(ReasonCode.PACKET_TOO_LARGE, f"not sent: {why}", will=True)

    # --- closing ------------------------------------------------------------------------

    def _close(
        self, reason: ReasonCode, log: str, *, packet: Packet | None = None, will: bool = False, handover: bool = False
    ) -> list[Action]:
        """Leave the connection: send ``packet``, stop timers, publish the will if due, close, settle the session."""
        actions: list[Action] = [Send((packet,))] if packet is not None else []
        actions += [CancelTimer(name) for name in sorted(self._timers)]
        self._timers.clear()
        if will and self._state is State.CONNECTED and self._will is not None:
            delay = self._will_delay_s()
            if delay:  # the store publishes it then, unless the session resumes first
                self._will_due = delay
            else:
                actions.append(PublishWill(self._client_id, self._will))
        self._will = None
        self._handover = handover
        self._held.clear()  # unacknowledged: a QoS 1/2 client sends them again
        self._state = next_state(self._state, Closing)
        actions.append(Close(reason, f"client {self._client_id or '?'}: {log}"))
        return actions + self._settle()

    def _will_delay_s(self) -> int:
        # The will goes when its delay passes or the session ends, whichever is first (section 3.1.3.2.2).
        return min(self._will_delay, self._expiry)

    def _settle(self) -> list[Action]:
        """Once no store result the session depends on is outstanding: hand over, save or end the session."""
        if self._state is not State.DISCONNECTING or self._pending or self._releasing or self._awaiting_session:
            return []
        self._state = next_state(self._state, Settled)
        self._link = None  # it refers back to this channel (now_ms, report): no cycle outlives the connection
        session = self._session
        if session is None:
            return []
        session.detach()
        closed = CloseSession(self._client_id, self._expiry if session.persistent else 0, self._will_due)
        if self._handover and self._moved:
            return [*session.commit(), closed]  # the store ignores it: the client is another node's now
        if self._handover and session.persistent:  # a session that ends with its connection is never handed over
            return [*session.commit(), SaveSession(session.state()), closed]  # [MQTT-3.1.2-6]
        if session.persistent:
            return [*session.commit(), *session.save(), closed]
        return [closed]  # the store ends the session: its offsets and filters go

    def _after(self, actions: list[Action]) -> list[Action]:
        """Batch offset commits: at ``commit_every`` acks, else on the commit timer."""
        session = self._session
        if self._state is State.CONNECTED and session is not None and session.commit_pending:
            if session.commit_due():
                actions += session.commit()
            elif COMMIT_TIMER not in self._timers:
                self._timers[COMMIT_TIMER] = None
                actions.append(ArmTimer(COMMIT_TIMER, self.config.commit_interval_s))
        return actions

    def _save(self) -> list[Action]:
        assert self._session is not None
        return self._session.save()

    def _now_ms(self) -> int:
        return int(self._now() * 1000)

    # --- limits -------------------------------------------------------------------------

    def _limit_hit(self, limit: Limit, count: int, detail: str | None) -> LimitHit:
        """The action reporting ``count`` hits of ``limit``, with a log line if this connection's ``HitLog`` says."""
        if self._hits is None:
            self._hits = HitLog()
        due = self._hits.due(limit, count, self._now())
        if due is None or detail is None:
            return LimitHit(limit, count)
        if due > count:
            detail += f" ({due} hits of this limit since the last line)"
        return LimitHit(limit, count, detail)

    def _topic_over(self, text: str, what: str) -> tuple[Limit, str] | None:
        """The limit a (valid) topic name or filter is over, and why, or None."""
        config = self.config
        levels = text.count("/") + 1
        if levels > config.max_topic_levels:
            return Limit.TOPIC_LEVELS, f"{what} has {levels} levels; the limit is {config.max_topic_levels}"
        if len(text) * 4 > config.max_topic_length:  # UTF-8 takes at most 4 bytes a character: shorter ones fit
            size = len(text.encode())
            if size > config.max_topic_length:
                return Limit.TOPIC_LENGTH, f"{what} is {size} bytes; the limit is {config.max_topic_length}"
        return None

    def _hold(self, packet: Packet) -> list[Action]:
        """Keep a packet for later, behind the QoS 1/2 message waiting for room under the in-flight limit."""
        if len(self._held) >= self.config.max_queued_packets:
            raise RemoteProtocolError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                                      f"more than {self.config.max_queued_packets} packets wait behind "
                                      f"{self.config.receive_maximum} QoS 1/2 messages being stored")
        self._held.append(packet)
        return []

    def _release_held(self) -> list[Action]:
        """Process held packets until one has to wait again (or the connection closes)."""
        held, self._held = self._held, []
        actions: list[Action] = []
        for index, packet in enumerate(held):
            if self._state is not State.CONNECTED:
                break
            actions += self.handle_in(packet)
            if self._held:
                self._held.extend(held[index + 1:])
                break
        return actions + self.input_done()

    def _rate_refusal(self, packet: Publish) -> list[Action] | None:
        """Charge the publish-rate buckets for ``packet``; None when it may go on, else the answer to it.

        Over a rate an MQTT 5 QoS 1/2 message gets PUBACK / PUBREC 0x97 (quota exceeded) and a 3.1.1 one closes
        the connection (it cannot be refused, and acknowledging it would lose it unseen); QoS 0 ones are dropped.
        A client ``RATE_DEBT_S`` seconds in debt is disconnected (0x96, message rate too high).
        """
        now = self._now()
        refused: Limit | None = None
        for bucket, limit in self._buckets:
            cost = 1 if limit is Limit.PUBLISH_RATE else len(packet.payload)
            if not bucket.take(cost, now) and refused is None:
                refused = limit
        if refused is None:
            return None
        debt = max(bucket.debt_s(now) for bucket, _ in self._buckets)
        what = "messages/s" if refused is Limit.PUBLISH_RATE else "payload bytes/s"
        rate = self.config.publish_rate if refused is Limit.PUBLISH_RATE else self.config.publish_bytes_rate
        if debt > RATE_DEBT_S or (packet.qos and self._level != MQTT_5):
            reason = ReasonCode.MESSAGE_RATE_TOO_HIGH
            why = f"publishing over {rate:g} {what}" + (f" for {debt:.0f} s" if debt > RATE_DEBT_S else "")
            packet_out = self._explained(error_packet(self._level, False, reason), self._level, why)
            return [self._limit_hit(refused, 1, f"{why}: disconnected"),
                    *self._close(reason, why, packet=packet_out, will=True)]
        hit = self._limit_hit(refused, 1, f"QoS {packet.qos} message over {rate:g} {what}: "
                                          + ("refused (0x97)" if packet.qos else "dropped"))
        if not packet.qos:
            return [hit]
        ack = Puback if packet.qos == 1 else Pubrec
        return [hit, Send((ack(packet.packet_id, ReasonCode.QUOTA_EXCEEDED),))]  # type: ignore[arg-type]

    def _topic_refusal(self, packet: Publish, limit: Limit, why: str) -> list[Action]:
        """A PUBLISH whose topic is over a limit: MQTT 5 QoS 1/2 get PUBACK / PUBREC 0x90 (topic name invalid:
        not malformed, "not accepted by this Server"); QoS 0 (no acknowledgement to say it in) and 3.1.1 close."""
        if packet.qos and self._level == MQTT_5:
            ack = Puback if packet.qos == 1 else Pubrec
            return [self._limit_hit(limit, 1, f"QoS {packet.qos} message refused (0x90): {why}"),
                    Send((ack(packet.packet_id, ReasonCode.TOPIC_NAME_INVALID),))]  # type: ignore[arg-type]
        reason = ReasonCode.TOPIC_NAME_INVALID
        packet_out = self._explained(error_packet(self._level, False, reason), self._level, why)
        return [self._limit_hit(limit, 1, f"{why}: disconnected"),
                *self._close(reason, f"PUBLISH over a topic limit: {why}", packet=packet_out, will=True)]

    # --- packets ------------------------------------------------------------------------

    def _refuse(self, reason: ReasonCode, log: str) -> list[Action]:
        packet = self._explained(error_packet(self._level, True, reason), self._level, log)
        return self._close(reason, f"connection refused: {log}", packet=packet)

    def _process_connect(self, packet: Connect) -> list[Action]:
        config = self.config
        self._level = level = packet.protocol_level
        props = packet.properties
        self._peer_max_packet = props.maximum_packet_size
        if props.authentication_method is not None:
            return self._refuse(ReasonCode.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not offered")
        client_id = packet.client_id
        if not client_id:
            if level == MQTT_311 and not packet.clean_start:
                return self._refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
                                    "empty client id with clean session 0 [MQTT-3.1.3-8]")
            client_id = config.assigned_id_prefix + uuid.uuid4().hex
            self._assigned = client_id if level == MQTT_5 else None
        self._client_id = client_id
        if packet.will_topic is not None:
            try:
                validate_topic(packet.will_topic, SYNTAX_ONLY)
            except TopicError as exc:
                return self._refuse(ReasonCode.TOPIC_NAME_INVALID, f"will topic: {exc}")
            over = self._topic_over(packet.will_topic, "will topic")
            if over is not None:
                return [self._limit_hit(over[0], 1, over[1]), *self._refuse(ReasonCode.TOPIC_NAME_INVALID, over[1])]
            if packet.will_qos > config.max_qos:
                return self._refuse(ReasonCode.QOS_NOT_SUPPORTED, f"will QoS {packet.will_qos}")
            if packet.will_retain and not config.retain_available:
                return self._refuse(ReasonCode.RETAIN_NOT_SUPPORTED, "will retain")
            will_props = packet.will_properties
            self._will_delay = will_props.will_delay_interval or 0
            if will_props.will_delay_interval is not None:
                will_props = replace(will_props, will_delay_interval=None)
            self._will = NewMessage(packet.will_topic, packet.will_payload, client_id, packet.will_qos,
                                    packet.will_retain, _property_block(will_props), self._now_ms())
        if level == MQTT_5:
            self._requested_expiry = props.session_expiry_interval or 0
            self._expiry = min(self._requested_expiry, config.max_session_expiry_s)
            keepalive = packet.keep_alive
            if config.max_keepalive is not None and not 0 < keepalive <= config.max_keepalive:
                keepalive = config.max_keepalive
            receive_maximum = props.receive_maximum or MAX_UINT16
        else:
            self._expiry = self._requested_expiry = 0 if packet.clean_start else config.session_expiry_311_s
            keepalive = packet.keep_alive
            receive_maximum = config.default_receive_maximum
        self._keepalive = keepalive
        self._keepalive_override = keepalive if keepalive != packet.keep_alive else None
        self._clean_start = packet.clean_start
        limit = props.maximum_packet_size
        if limit is not None:  # before the session is opened (or taken over): the client could never be told
            connack = Connack(False, ReasonCode.SUCCESS, self._connack_properties())
            if fit(connack, level, limit) is None:
                return self._refuse(ReasonCode.PACKET_TOO_LARGE,
                                    f"the CONNACK takes {len(encode(connack, level))} bytes, over the client's "
                                    f"Maximum Packet Size of {limit} [MQTT-3.1.2-24]")
        self._link = Link(
            protocol_level=level,
            receive_maximum=min(receive_maximum, config.max_inflight),
            max_packet_size=props.maximum_packet_size,
            topic_alias_maximum=props.topic_alias_maximum or 0,
            pull_batch=config.pull_batch,
            max_unwritten=config.max_unwritten,
            commit_every=config.commit_every,
            encoder=self._encoder,
            now_ms=self._now_ms,
            qos0_queue_bytes=config.qos0_queue_bytes,
            report=self._limit_hit,
        )
        self._awaiting_session = True
        return [OpenSession(client_id, packet.clean_start, self._expiry, packet.username, packet.password,
                            packet.will_topic, self._will, self._will_delay_s())]

    def _connack_properties(self) -> Properties:
        config = self.config
        if self._level != MQTT_5:
            return EMPTY_PROPERTIES
        fields: dict[str, object] = {
            "receive_maximum": config.receive_maximum,
            "maximum_packet_size": config.max_packet_size,
            "topic_alias_maximum": config.topic_alias_maximum,
        }
        if self._assigned is not None:
            fields["assigned_client_identifier"] = self._assigned
        if self._expiry != self._requested_expiry:
            fields["session_expiry_interval"] = self._expiry
        if self._keepalive_override is not None:
            fields["server_keep_alive"] = self._keepalive_override
        if config.max_qos < 2:
            fields["maximum_qos"] = config.max_qos
        for name, available in (
            ("retain_available", config.retain_available),
            ("wildcard_subscription_available", config.wildcard_available),
            ("subscription_identifier_available", config.subscription_ids_available),
            ("shared_subscription_available", config.shared_available),
        ):
            if not available:
                fields[name] = False
        return Properties(**fields)  # type: ignore[arg-type]

    def _process_publish(self, packet: Publish) -> list[Action]:
        config = self.config
        session = self._session
        assert session is not None
        qos = packet.qos
        pid = packet.packet_id
        if qos > config.max_qos:
            raise RemoteProtocolError(ReasonCode.QOS_NOT_SUPPORTED, f"PUBLISH QoS {qos} exceeds maximum QoS")
        if packet.retain and not config.retain_available:
            raise RemoteProtocolError(ReasonCode.RETAIN_NOT_SUPPORTED, "PUBLISH with RETAIN set")
        if qos and self._level != MQTT_5 and len(self._pending) >= config.receive_maximum:
            # 3.1.1 has no Receive Maximum to tell the client: wait (the connection stops reading meanwhile).
            held = self._hold(packet)
            return [self._limit_hit(Limit.INFLIGHT, 1, f"{len(self._pending)} QoS 1/2 messages being stored: "
                                                      "input paused"), *held]
        if qos == 2:
            if pid in session.awaiting_rel:
                return [Send((Pubrec(pid),))]  # a resend of a stored message: acknowledge, do not store again
            if pid in self._storing_qos2:
                return []  # a resend while the first copy is being stored: its PUBREC follows
        topic = packet.topic
        props = packet.properties
        alias = props.topic_alias
        if alias is not None:
            if alias > config.topic_alias_maximum:
                raise RemoteProtocolError(ReasonCode.TOPIC_ALIAS_INVALID, f"topic alias {alias} exceeds the maximum")
            if topic:
                self._aliases_in[alias] = topic
            elif alias in self._aliases_in:
                topic = self._aliases_in[alias]
            else:
                raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"topic alias {alias} is not mapped")
            props = replace(props, topic_alias=None)
        if topic != self._valid_topic:
            try:
                self._valid_topic = validate_topic(topic, SYNTAX_ONLY)
            except TopicError as exc:  # a wildcard [MQTT-3.3.2-2]; 0x90 is for names correctly formed but refused
                raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, str(exc)) from None
        if len(topic) >= self._topic_check_from:
            over = self._topic_over(topic, "topic name")
            if over is not None:
                return self._topic_refusal(packet, *over)
        if qos and self._level == MQTT_5 and len(self._pending) + len(session.awaiting_rel) >= config.receive_maximum:
            raise RemoteProtocolError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                                      f"more than {config.receive_maximum} unacknowledged QoS 1/2 PUBLISHes")
        if self._buckets:
            refusal = self._rate_refusal(packet)
            if refusal is not None:
                return refusal
        born_ms = int(self._last_rx * 1000)  # the clock read when this packet came in (handle_in)
        message = NewMessage(topic, packet.payload, self._client_id, qos, packet.retain,
                             b"" if props is EMPTY_PROPERTIES else _property_block(props), born_ms,
                             pid if qos == 2 else 0)
        if not qos:
            return [Append(None, (message,))]
        self._next_ref += 1
        self._pending[self._next_ref] = (qos, pid)  # type: ignore[assignment]
        if qos == 2:
            self._storing_qos2[pid] = None  # type: ignore[index]
        return [Append(self._next_ref, (message,))]

    def _process_puback(self, packet: Puback) -> list[Action]:
        return self._session.puback(packet.packet_id)  # type: ignore[union-attr]

    def _process_pubrec(self, packet: Pubrec) -> list[Action]:
        return self._session.pubrec(packet.packet_id, packet.reason_code)  # type: ignore[union-attr]

    def _process_pubcomp(self, packet: Pubcomp) -> list[Action]:
        return self._session.pubcomp(packet.packet_id)  # type: ignore[union-attr]

    def _process_pubrel(self, packet: Pubrel) -> list[Action]:
        session = self._session
        assert session is not None
        pid = packet.packet_id
        offset = session.awaiting_rel.get(pid)
        if offset is not None:
            if pid in self._releasing.values():
                return []  # the release is being written: its PUBCOMP follows
            if offset == NOT_IN_LOG:
                del session.awaiting_rel[pid]
                return [Send((Pubcomp(pid),))]
            self._next_ref += 1
            self._releasing[self._next_ref] = pid
            return [ReleaseInbound(self._next_ref, self._client_id, pid, offset)]
        if self._level == MQTT_5:
            return [Send((Pubcomp(pid, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),))]
        return [Send((Pubcomp(pid),))]  # 3.1.1 has no reason: complete the flow anyway

    def _check_subscription(
        self, filter: str, options: SubscriptionOptions, sub_id: int | None
    ) -> Subscription | ReasonCode:
        """The subscription a SUBSCRIBE entry asks for, or the SUBACK reason refusing it."""
        config = self.config
        shared = _parsed_filter(filter)
        group, queue = shared if shared is not None else (None, filter)
        if group is not None:
            if not config.shared_available:
                return ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
            if options.no_local and self._level == MQTT_5:
                raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR,
                                          f"No Local on shared subscription {filter!r} [MQTT-3.8.3-4]")
        if is_wildcard(queue) and not config.wildcard_available:
            return ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
        if options.qos > config.max_qos:
            options = replace(options, qos=config.max_qos)
        return Subscription(filter, queue, options, sub_id, group)

    def _process_subscribe(self, packet: Subscribe) -> list[Action]:
        session = self._session
        assert session is not None
        ids = packet.properties.subscription_identifiers
        if ids and not self.config.subscription_ids_available:
            raise RemoteProtocolError(ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
                                      "SUBSCRIBE with a subscription identifier")
        sub_id = ids[0] if ids else None
        quota = self.config.max_subscriptions
        # New filters being activated count with those held: a SUBSCRIBE answered later must not let an earlier
        # one overshoot. (Counted, not collected: a SUBSCRIBE costs the same with 4,000 filters held as with 4.)
        activating = {sub.filter for _, _, w in self._activations.values() for _, sub in w
                      if not session.holds(sub.filter)} if quota else set()
        held = session.subscription_count + len(activating)
        codes: list[ReasonCode] = []
        wanted: list[tuple[int, Subscription]] = []
        retained: list[str] = []
        hits: list[Action] = []
        over_quota = 0
        for index, (filter, options) in enumerate(packet.subscriptions):
            checked = self._check_subscription(filter, options, sub_id)
            if isinstance(checked, ReasonCode):
                codes.append(checked)
                continue
            over = self._topic_over(checked.queue, "topic filter")
            if over is not None:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                hits.append(self._limit_hit(over[0], 1, f"filter refused: {over[1]}"))
                continue
            if quota and filter not in activating and not session.holds(filter):
                if held >= quota:
                    codes.append(ReasonCode.QUOTA_EXCEEDED)
                    over_quota += 1
                    continue
                activating.add(filter)
                held += 1
            codes.append(ReasonCode(checked.options.qos))
            wanted.append((index, checked))
            handling = checked.options.retain_handling
            if checked.group is None and (handling == 0 or (handling == 1 and not session.holds(filter))):
                retained.append(filter)
        if over_quota:
            hits.append(self._limit_hit(Limit.SUBSCRIPTIONS, over_quota,
                                        f"{over_quota} filter(s) refused: the session holds {held} "
                                        f"subscriptions, the limit is {quota}"))
        if not wanted:
            return [*hits, Send((Suback(packet.packet_id, tuple(codes)),))]
        self._next_ref += 1
        self._activations[self._next_ref] = (packet.packet_id, codes, wanted)
        subs = tuple(sub for _, sub in wanted)
        return [*hits, Activate(self._next_ref, self._client_id, subs, tuple(retained))]

    def _process_unsubscribe(self, packet: Unsubscribe) -> list[Action]:
        session = self._session
        assert session is not None
        codes: list[ReasonCode] = []
        released: list[str] = []
        for filter in packet.topic_filters:
            _parsed_filter(filter)
            if session.unsubscribe(filter):
                codes.append(ReasonCode.SUCCESS)
                released.append(filter)
            else:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
        actions: list[Action] = [Release(self._client_id, tuple(released)), *self._save()] if released else []
        reasons = tuple(codes) if self._level == MQTT_5 else ()
        return [*actions, Send((Unsuback(packet.packet_id, reasons),))]

    def _process_pingreq(self, packet: Pingreq) -> list[Action]:
        return [Send((Pingresp(),))]

    def _process_disconnect(self, packet: Disconnect) -> list[Action]:
        expiry = packet.properties.session_expiry_interval
        if expiry is not None:
            if self._requested_expiry == 0 and expiry > 0:
                raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR,
                                          "session expiry set at DISCONNECT after 0 at CONNECT [MQTT-3.14.2-2]")
            self._expiry = min(expiry, self.config.max_session_expiry_s)
            self._session.expiry_s = self._expiry  # type: ignore[union-attr]
        with_will = packet.reason_code is ReasonCode.DISCONNECT_WITH_WILL_MESSAGE
        return self._close(packet.reason_code, f"client disconnected ({packet.reason_code.name})", will=with_will)

    # --- node events --------------------------------------------------------------------

    def _on_session_opened(self, event: SessionOpened) -> list[Action]:
        if not self._awaiting_session:
            raise LocalProtocolError("SessionOpened without an OpenSession")
        self._awaiting_session = False
        closing = self._state is State.DISCONNECTING
        if event.reason.is_failure:
            if closing:
                return self._settle()
            # The node refuses for its own state (a full data disk...), not for what the client sent: a 3.1.1
            # client gets the nearest return code (3, Server unavailable) rather than a silent close.
            reason = event.reason if self._level == MQTT_5 or event.reason in _CONNACK_REFUSALS_311 \
                else ReasonCode.SERVER_UNAVAILABLE
            return self._refuse(reason, f"by the node ({event.reason.name})")
        state = event.state if event.present and not self._clean_start else None
        self._session = session = Session(self._client_id, self._expiry, state)
        if closing:
            return self._settle()
        assert self._link is not None
        self._link.may_read = event.may_read
        actions: list[Action] = [Send((Connack(state is not None, ReasonCode.SUCCESS, self._connack_properties()),))]
        if self._keepalive:
            self._timers[KEEPALIVE_TIMER] = None
            actions.append(ArmTimer(KEEPALIVE_TIMER, self._keepalive * 1.5))
        actions += session.attach(self._link)
        queued, self._queued = self._queued, []
        for packet in queued:
            actions += self.handle_in(packet)
        return actions + self.input_done()

    def _on_appended(self, event: Appended) -> list[Action]:
        actions = self._appended(event)
        if self._held and self._state is State.CONNECTED:
            actions += self._release_held()
        return actions

    def _appended(self, event: Appended) -> list[Action]:
        try:
            qos, pid = self._pending.pop(event.ref)
        except KeyError:
            raise LocalProtocolError(f"Appended for unknown ref {event.ref}") from None
        session = self._session
        assert session is not None
        closing = self._state is not State.CONNECTED
        if qos == 2:
            self._storing_qos2.pop(pid, None)
        if event.ok:
            if qos == 2:
                session.awaiting_rel[pid] = event.offset  # the record says so too: the store knows it after a crash
                return self._settle() if closing else [Send((Pubrec(pid),))]
            return self._settle() if closing else [Send((Puback(pid),))]
        if closing:
            return self._settle()
        if self._level == MQTT_5:
            reason = event.reason if event.reason.is_failure and event.reason in PUBACK_REASONS else \
                ReasonCode.UNSPECIFIED_ERROR
            return [Send(((Puback if qos == 1 else Pubrec)(pid, reason),))]
        if event.reason is ReasonCode.NOT_AUTHORIZED:
            # 3.1.1 has no negative acknowledgement: acknowledge the dropped message (the node logged it), or the
            # client would resend it forever (Mosquitto does the same). A PUBREL for it gets its PUBCOMP anyway.
            return [Send(((Puback if qos == 1 else Pubrec)(pid),))]
        return self._close(event.reason, f"message not stored ({event.reason.name}); 3.1.1 cannot refuse it")

    def _on_inbound_released(self, event: InboundReleased) -> list[Action]:
        try:
            pid = self._releasing.pop(event.ref)
        except KeyError:
            raise LocalProtocolError(f"InboundReleased for unknown ref {event.ref}") from None
        self._session.awaiting_rel.pop(pid, None)  # type: ignore[union-attr]
        if self._state is not State.CONNECTED:
            return self._settle()
        return [Send((Pubcomp(pid),))]

    def _on_session_saved(self, event: SessionSaved) -> list[Action]:
        return self._session.saved(event.ref)  # type: ignore[union-attr]

    def _on_activated(self, event: Activated) -> list[Action]:
        try:
            packet_id, codes, wanted = self._activations.pop(event.ref)
        except KeyError:
            raise LocalProtocolError(f"Activated for unknown ref {event.ref}") from None
        session = self._session
        assert session is not None
        refused = event.reasons or {}
        subscribed = set()
        for index, sub in wanted:
            reason = refused.get(sub.filter)
            if reason is not None:
                codes[index] = reason
                continue
            if not session.holds(sub.filter) and sub.filter not in event.starts:
                raise LocalProtocolError(f"Activated without a start offset for {sub.filter!r}")
            session.subscribe(sub, event.starts.get(sub.filter, 0))
            subscribed.add(sub.filter)
        actions: list[Action] = [*self._save(), Send((Suback(packet_id, tuple(codes)),))]
        retained = tuple(pair for pair in event.retained if pair[0] in subscribed)
        return actions + session.retained(retained)

    def _on_pulled(self, event: Pulled) -> list[Action]:
        return self._session.pulled(event.filter, event.messages, event.next_offset)  # type: ignore[union-attr]

    def _on_queue_advanced(self, event: QueueAdvanced) -> list[Action]:
        if self._session is None:
            return []  # not connected yet: the session pulls from its cursor once attached
        return self._session.queue_advanced(event.queue, event.max_offset)

    def _on_socket_written(self, event: SocketWritten) -> list[Action]:
        return self._session.written(event.up_to)  # type: ignore[union-attr]

    def _on_connection_lost(self, event: ConnectionLost) -> list[Action]:
        return self._close(ReasonCode.UNSPECIFIED_ERROR, f"connection lost: {event.error}", will=True)

    def _server_disconnect(self, reason: ReasonCode) -> Disconnect | None:
        """The DISCONNECT the server ends a connection with: MQTT 5 only, and never before the CONNACK, which must
        be the first packet the server sends [MQTT-3.2.0-1]."""
        return Disconnect(reason) if self._level == MQTT_5 and self._state is State.CONNECTED else None

    def _on_taken_over(self, event: TakenOver) -> list[Action]:
        packet = self._server_disconnect(ReasonCode.SESSION_TAKEN_OVER)
        if event.elsewhere:
            # Resumed on another node: a delayed will must never fire (section 3.1.3.2.2), one without delay goes
            # now, as for a local takeover; that node owns the stored session, so this one only commits.
            self._moved = True
            return self._close(ReasonCode.SESSION_TAKEN_OVER, "session taken over by a connection to another node",
                               packet=packet, will=self._will_delay_s() == 0, handover=True)
        return self._close(ReasonCode.SESSION_TAKEN_OVER, "session taken over by a new connection", packet=packet,
                           will=True, handover=True)

    def _on_admin_disconnect(self, event: AdminDisconnect) -> list[Action]:
        packet = self._server_disconnect(ReasonCode.ADMINISTRATIVE_ACTION)
        return self._close(ReasonCode.ADMINISTRATIVE_ACTION, "disconnected by an operator (admin API)",
                           packet=packet, will=True)

    def _on_server_shutdown(self, event: ServerShutdown) -> list[Action]:
        # Before the CONNACK it says so: 0x88 Server unavailable (3.1.1: return code 3); after, DISCONNECT 0x8B.
        before_connack = self._state is State.CONNECTING
        reason = ReasonCode.SERVER_UNAVAILABLE if before_connack else ReasonCode.SERVER_SHUTTING_DOWN
        why = "the server is shutting down"
        packet = self._explained(error_packet(self._level, before_connack, reason), self._level, why)
        return self._close(reason, why, packet=packet)

    def _on_timeout(self, event: Timeout) -> list[Action]:
        if event.name not in self._timers:
            return []  # cancelled while the timer was firing
        del self._timers[event.name]
        if event.name == COMMIT_TIMER:
            return self._session.commit() if self._session is not None else []
        if event.name == KEEPALIVE_TIMER:
            limit = self._keepalive * 1.5
            if event.input_waiting:
                self._last_rx = self._now()
            idle = self._now() - self._last_rx
            if idle >= limit:
                packet = self._server_disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
                return self._close(ReasonCode.KEEP_ALIVE_TIMEOUT,
                                   f"nothing received for {idle:.1f} s (keep alive {self._keepalive} s)",
                                   packet=packet, will=True)
            self._timers[KEEPALIVE_TIMER] = None
            return [ArmTimer(KEEPALIVE_TIMER, limit - idle)]
        raise LocalProtocolError(f"unknown timer {event.name!r}")


def _property_block(properties: Properties) -> bytes:
    """A PUBLISH's (or a will's) properties as the record keeps them: the MQTT 5 property block, so a subscriber
    receives exactly what its publisher sent (one encoding at append, one decoding per queue read)."""
    return encode_properties(properties, PacketType.PUBLISH)


_LIMIT_ERRORS = {
    ReasonCode.PACKET_TOO_LARGE: Limit.PACKET_SIZE,
    ReasonCode.RECEIVE_MAXIMUM_EXCEEDED: Limit.INFLIGHT,
}
"""Protocol errors that are limit hits (the decoder's packet size, the MQTT 5 Receive Maximum): counted as such."""

_PROCESS: dict[type, Callable[[Channel, Any], list[Action]]] = {
    Connect: Channel._process_connect,
    Publish: Channel._process_publish,
    Puback: Channel._process_puback,
    Pubrec: Channel._process_pubrec,
    Pubrel: Channel._process_pubrel,
    Pubcomp: Channel._process_pubcomp,
    Subscribe: Channel._process_subscribe,
    Unsubscribe: Channel._process_unsubscribe,
    Pingreq: Channel._process_pingreq,
    Disconnect: Channel._process_disconnect,
}
"""One handler per packet type the state table lets through (AUTH never is: enhanced auth is not offered)."""

_EVENTS: dict[type, Callable[[Channel, Any], list[Action]]] = {
    SessionOpened: Channel._on_session_opened,
    Appended: Channel._on_appended,
    InboundReleased: Channel._on_inbound_released,
    SessionSaved: Channel._on_session_saved,
    Activated: Channel._on_activated,
    Pulled: Channel._on_pulled,
    QueueAdvanced: Channel._on_queue_advanced,
    SocketWritten: Channel._on_socket_written,
    ConnectionLost: Channel._on_connection_lost,
    TakenOver: Channel._on_taken_over,
    AdminDisconnect: Channel._on_admin_disconnect,
    ServerShutdown: Channel._on_server_shutdown,
    Timeout: Channel._on_timeout,
}
