"""The sans-IO MQTT 3.1.1 / 5.0 server side of one connection: packets and node events in, actions out.

``Channel`` is EMQX's ``emqx_channel`` in the h11 style: it holds protocol
logic only. Decoded packets go in through ``handle_in``, store and timer
results through ``handle_event`` / ``handle_timeout``, decoder errors through
``handle_protocol_error``; each returns the actions (``gateway/mqtt/actions.py``)
the node must execute, in order. There is no socket, timer or store here, and
timers are actions, so the channel is fully testable with plain calls.

Structure:

- the connection state moves only through ``gateway/mqtt/state.py``'s table;
- one handler per packet type in ``_PROCESS``, each in its packet family's
  module (``gateway/mqtt/handlers/``: connect, publish, acks, subscribe, ping),
  one ``_on_<event>`` per node event in ``_EVENTS`` (an event answering a
  packet family's action, as ``Appended`` or ``Activated``, is that family's);
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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, final

from gateway.mqtt.state import Closing, ConnectionState, Settled, State, next_state
from gateway.mqtt.actions import (
    Action,
    Activated,
    AdminDisconnect,
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
    PublishWill,
    Pulled,
    QueueAdvanced,
    SaveSession,
    Send,
    ServerShutdown,
    SessionOpened,
    SessionSaved,
    SocketWritten,
    TakenOver,
    Timeout,
)
from gateway.mqtt.codec import encode, fit
from gateway.mqtt.config import ChannelConfig
from gateway.mqtt.errors import error_packet
from gateway.mqtt.handlers import acks, connect, ping, publish, subscribe
from gateway.mqtt.handlers.publish import RATE_DEBT_S, process_publish
from gateway.mqtt.limits import HitLog, Limit
from gateway.mqtt.lazy import appended, made_on_first_use
from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
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
from gateway.mqtt.properties import RepeatLimitExceeded
from gateway.mqtt.reasons import (
    LocalProtocolError,
    ReasonCode,
    RemoteProtocolError,
)
from gateway.mqtt.ratelimit import TokenBucket
from gateway.mqtt.session import Session

__all__ = ["KEEPALIVE_TIMER", "RATE_DEBT_S", "Channel", "ChannelConfig", "error_packet"]

KEEPALIVE_TIMER = "keepalive"
"""Fires 1.5 x keep alive after the last packet received ([MQTT-3.1.2-24]); re-armed for the remainder if traffic came
(or waits unread: a node resuming 10,000 sessions can take tens of seconds to read a socket again)."""

COMMIT_TIMER = "commit"
"""Commits acknowledged offsets at most once per ``commit_interval_s``: offsets are written in batches, not per ack."""

MAX_REASON_STRING = 256
"""Reason Strings are diagnostics for people: the error's first characters say enough, and keep the packet small."""

BYTES_BURST_S = 1.0
"""The byte-rate bucket banks this many seconds of ``publish_bytes_rate``: a burst of a second's worth is normal."""


@final
class Channel:
    """The protocol state of one client connection (server side).

    Args:
        config: what the server offers.
        now: wall-clock seconds (``time.time``); keep alive, born timestamps and message expiry use it.

    Error handling: a peer's protocol error never raises out of ``handle_in``;
    it becomes the actions that close the connection. ``LocalProtocolError``
    means the node fed an event the channel did not ask for.

    Resource handling: owns nothing; the node owns the socket and timers and
    must execute every returned action in order.
    """

    __slots__ = (  # one channel per device: slots save a dict of about 1.5 KiB each
        "config", "now", "conn", "_state", "_will_due", "_timers", "_handover", "_moved", "_hits",
    )

    _timers: dict[str, None]  # names of the armed timers: made at the first (gateway/mqtt/lazy.py)
    __getattr__ = made_on_first_use({"_timers": dict})

    def __init__(
        self,
        config: ChannelConfig = ChannelConfig(),
        now: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.now = now
        self._state = State.AWAIT_CONNECT
        self._will_due: int | None = None  # the delay of a will left to the store at the close (None: none is due)
        self._handover = False
        self._moved = False  # taken over from another node: that node saves the session
        self._hits: HitLog | None = None  # made at the first limit hit: most connections never hit one
        start = now()
        self.conn = ConnectionState(
            start,
            min(config.max_topic_levels, config.max_topic_length // 4 + 1),
            tuple((TokenBucket(rate, burst, start), limit) for rate, burst, limit in (
                (config.publish_rate, config.publish_burst or config.publish_rate, Limit.PUBLISH_RATE),
                (config.publish_bytes_rate, config.publish_bytes_rate * BYTES_BURST_S, Limit.PUBLISH_BYTES_RATE),
            ) if rate > 0))
        """The protocol state the packet handlers read and change (``gateway/mqtt/state.py``)."""

    # --- introspection ------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def protocol_level(self) -> int:
        """The level to encode ``Send`` packets at: the client's, or 3.1.1 before a CONNECT was read."""
        return self.conn.level or MQTT_311

    @property
    def client_id(self) -> str:
        """The client identifier (assigned one included); empty before CONNECT."""
        return self.conn.client_id

    @property
    def session(self) -> Session | None:
        return self.conn.session

    @property
    def keep_alive(self) -> int:
        """The keep alive in force, in seconds (0: none)."""
        return self.conn.keepalive

    @property
    def input_paused(self) -> bool:
        """True while packets wait for room under the in-flight limit (3.1.1), or the session is being opened:
        stop reading (and decoding) until it is False again (it changes when an ``Appended`` or the
        ``SessionOpened`` is handled). Packets handed in meanwhile are kept, up to ``max_queued_packets``."""
        return bool(self.conn.held) or self.conn.awaiting_session

    # --- entry points -------------------------------------------------------------------

    def handle_in(self, packet: Packet) -> list[Action]:
        """Process one decoded packet from the client. Packets after the close are dropped."""
        conn = self.conn
        if type(packet) is Publish and self._state is State.CONNECTED and not conn.held:
            # A device's PUBLISH on an open connection, most of what a node reads: the state stays CONNECTED
            # (TRANSITIONS), and a PUBLISH acknowledges no delivery, so no commit can be due (``_after``).
            conn.last_rx = self.now()
            try:
                actions = process_publish(self, packet)
            except RemoteProtocolError as err:
                actions = self._protocol_error(err)
            return actions if conn.peer_max_packet is None else self._fit(actions)
        if type(packet) is Puback and self._state is State.CONNECTED and not conn.held:
            # A subscriber's PUBACK, one per QoS 1 message it gets: the state stays CONNECTED (TRANSITIONS), so
            # the state step is skipped as for a PUBLISH (a third of the channel's cost of a PUBACK, issue 31).
            conn.last_rx = self.now()
            try:
                actions = self._after(acks.process_puback(self, packet))
            except RemoteProtocolError as err:
                actions = self._protocol_error(err)
            return actions if conn.peer_max_packet is None else self._fit(actions)
        if self._state in (State.DISCONNECTING, State.CLOSED):
            return []
        try:
            self._state = next_state(self._state, type(packet))
            self.conn.last_rx = self.now()
            if self._state is State.CONNECTING and type(packet) is not Connect:
                if len(self.conn.queued) >= self.config.max_queued_packets:
                    raise RemoteProtocolError(ReasonCode.QUOTA_EXCEEDED, "too many packets before CONNACK")
                self.conn.queued = appended(self.conn.queued, packet)
                return []
            if self.conn.held:
                return self.hold(packet)
            actions = self._after(_PROCESS[type(packet)](self, packet))
        except RemoteProtocolError as err:
            actions = self._protocol_error(err)
        return actions if self.conn.peer_max_packet is None else self._fit(actions)

    def handle_repeats(self, packet: Publish, payloads: list[bytes]) -> list[Action]:
        """:meth:`handle_in` of a QoS 0 ``packet`` and of the PUBLISHes read right after it that repeat it but
        for their payloads (``MqttDecoder.repeats``): when ``packet`` passes its checks as a plain QoS 0 message
        and no publish rate is counted, they pass the same ones (same topic, header, clock and ACL answer), so
        they are one ``Append`` of a ``PayloadRun``; otherwise each is handled as a packet of its own, in order."""
        actions = self.handle_in(packet)
        run = publish.repeated(self, actions, payloads)
        if run is not None:
            return run
        for payload in payloads:
            actions += self.handle_in(Publish(packet.topic, payload))
        return actions

    def handle_pubacks(self, packet: Puback, packet_ids: list[int]) -> list[Action]:
        """:meth:`handle_in` of ``packet`` and of the shortest-form PUBACKs read right after it, given by their
        packet ids (``MqttDecoder.pubacks``): on an open connection they are one ``Session.puback_run``, then one
        offset-commit check (``_after``); otherwise each is handled as a packet of its own, in order. Their reason
        codes need no look: a PUBACK's reason code changes nothing the session does (``packet``'s, whatever it is,
        was checked by the decoder), and the run's have none."""
        conn = self.conn
        if self._state is not State.CONNECTED or conn.held:
            actions = self.handle_in(packet)
            for packet_id in packet_ids:
                actions += self.handle_in(Puback(packet_id))
            return actions
        conn.last_rx = self.now()
        try:
            actions = self._after(conn.session.puback_run((packet.packet_id, *packet_ids)))  # type: ignore[union-attr]
        except RemoteProtocolError as err:
            actions = self._protocol_error(err)
        return actions if conn.peer_max_packet is None else self._fit(actions)

    def handle_subscribes(self, packets: Sequence[Subscribe]) -> list[Action]:
        """:meth:`handle_in` of SUBSCRIBEs read one after another (``MqttDecoder.next_is_subscribe``), answered as
        one run on an open connection (``subscribe.SubscribeRun``: each checked as if alone, one ``Activate`` for
        their accepted filters, their SUBACKs in order in one ``Send``); otherwise each is handled alone. A
        protocol error in one closes the connection after the ones before it, as if each had come alone."""
        conn = self.conn
        if len(packets) == 1 or self._state is not State.CONNECTED or conn.held:
            return [action for packet in packets for action in self.handle_in(packet)]
        conn.last_rx = self.now()
        run = subscribe.SubscribeRun(self)
        actions: list[Action] = []
        try:
            for packet in packets:
                actions += run.add(packet)
        except RemoteProtocolError as err:
            actions += run.end() + self._protocol_error(err)
        else:
            actions = self._after(actions + run.end())
        return actions if conn.peer_max_packet is None else self._fit(actions)

    def input_done(self) -> list[Action]:
        """Everything the client sent so far is processed: deliver what its acknowledgements made room for
        (the session defers that while most of its window is in flight; call this after each read)."""
        session = self.conn.session
        if session is None or self._state is not State.CONNECTED:
            return []
        return session.pump_due()

    def handle_event(self, event: Event) -> list[Action]:
        """Process a result or notification from the node.

        Raises:
            LocalProtocolError: the event does not fit the channel's state (a node bug).
        """
        actions = self._after(self._event(event))
        return actions if self.conn.peer_max_packet is None else self._fit(actions)

    def handle_events(self, events: Sequence[Event]) -> list[Action]:
        """:meth:`handle_event` of each event in order, their actions in one list: the acknowledgements of a
        connection's messages appended in one read round come as one list, and the offset-commit check (``_after``)
        then runs once for them, not once a message (a QoS 1 fan-in's PUBACKs). With a client's Maximum Packet Size
        each event's packets are fitted as its own (``_fit``: what does not fit closes at that event).

        Raises:
            LocalProtocolError: an event does not fit the channel's state (a node bug).
        """
        if self.conn.peer_max_packet is not None:
            return [action for event in events for action in self.handle_event(event)]
        actions: list[Action] = []
        for event in events:
            actions += self._event(event)
        return self._after(actions)

    def _event(self, event: Event) -> list[Action]:
        """The handler's answer to ``event`` in the state it moves the channel to (a closing channel answers only
        the events that settle it), or the close a protocol error found in it calls for."""
        closing = self._state in (State.DISCONNECTING, State.CLOSED)
        self._state = next_state(self._state, type(event))
        if closing and type(event) not in (Appended, SessionOpened, InboundReleased):
            return []
        try:
            return _EVENTS[type(event)](self, event)
        except RemoteProtocolError as err:
            return self._protocol_error(err)

    def handle_timeout(self, name: str, input_waiting: bool = False) -> list[Action]:
        """A timer armed with ``ArmTimer(name, ...)`` fired; ``input_waiting`` as in ``Timeout``."""
        return self.handle_event(Timeout(name, input_waiting))

    def handle_protocol_error(self, err: RemoteProtocolError, protocol_level: int | None = None) -> list[Action]:
        """The decoder (or a check here) found the peer breaking the protocol: answer and close.

        Args:
            protocol_level: the decoder's level, for errors inside a CONNECT (the channel has not seen it).
        """
        actions = self._protocol_error(err, protocol_level)
        return actions if self.conn.peer_max_packet is None else self._fit(actions)

    def _protocol_error(self, err: RemoteProtocolError, protocol_level: int | None = None) -> list[Action]:
        if self._state in (State.DISCONNECTING, State.CLOSED):
            return []
        if self.conn.level is None:  # inside the CONNECT: answer at its level, which the client reads [MQTT-3.1.4-1]
            self.conn.level = protocol_level
        level = self.conn.level
        before_connack = self._state in (State.AWAIT_CONNECT, State.CONNECTING)
        packet = self.explained(error_packet(level, before_connack, err.reason), level, err.message)
        limit = Limit.USER_PROPERTIES if isinstance(err, RepeatLimitExceeded) else _LIMIT_ERRORS.get(err.reason)
        hit = [LimitHit(limit, 1)] if limit is not None else []  # counted; the close is the one log line
        return hit + self.close(err.reason, f"protocol error: {err.message}", packet=packet, will=True)

    def explained(self, packet: Packet | None, level: int | None, text: str) -> Packet | None:
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
        limit: int = self.conn.peer_max_packet  # type: ignore[assignment]
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
               f"exceeds the client's Maximum Packet Size of {self.conn.peer_max_packet} [MQTT-3.1.2-24]")
        return kept + self.close(ReasonCode.PACKET_TOO_LARGE, f"not sent: {why}", will=True)

    # --- closing ------------------------------------------------------------------------

    def close(
        self, reason: ReasonCode, log: str, *, packet: Packet | None = None, will: bool = False, handover: bool = False
    ) -> list[Action]:
        """Leave the connection: send ``packet``, stop timers, publish the will if due, close, settle the session."""
        actions: list[Action] = [Send((packet,))] if packet is not None else []
        actions += [CancelTimer(name) for name in sorted(self._timers)]
        self._timers.clear()
        if will and self._state is State.CONNECTED and self.conn.will is not None:
            delay = self.will_delay_s()
            if delay:  # the store publishes it then, unless the session resumes first
                self._will_due = delay
            else:
                actions.append(PublishWill(self.conn.client_id, self.conn.will))
        self.conn.will = None
        self._handover = handover
        self.conn.held = ()  # unacknowledged: a QoS 1/2 client sends them again
        self._state = next_state(self._state, Closing)
        actions.append(Close(reason, f"client {self.conn.client_id or '?'}: {log}"))
        return actions + self.settle()

    def will_delay_s(self) -> int:
        # The will goes when its delay passes or the session ends, whichever is first (section 3.1.3.2.2).
        return min(self.conn.will_delay, self.conn.expiry)

    def settle(self) -> list[Action]:
        """Once no store result the session depends on is outstanding: hand over, save or end the session."""
        conn = self.conn
        if self._state is not State.DISCONNECTING or conn.pending or conn.releasing or conn.awaiting_session:
            return []
        self._state = next_state(self._state, Settled)
        self.conn.link = None  # it refers back to this channel (its owner): no cycle outlives the connection
        session = self.conn.session
        if session is None:
            return []
        session.detach()
        closed = CloseSession(self.conn.client_id, self.conn.expiry if session.persistent else 0, self._will_due)
        if self._handover and self._moved:
            return [*session.commit(), closed]  # the store ignores it: the client is another node's now
        if self._handover and session.persistent:  # a session that ends with its connection is never handed over
            return [*session.commit(), SaveSession(session.state()), closed]  # [MQTT-3.1.2-6]
        if session.persistent:
            return [*session.commit(), *session.save(), closed]
        return [closed]  # the store ends the session: its offsets and filters go

    def _after(self, actions: list[Action]) -> list[Action]:
        """Batch offset commits: at ``commit_every`` acks, else on the commit timer."""
        session = self.conn.session
        if self._state is State.CONNECTED and session is not None and session.commit_pending:
            if session.commit_due():
                actions += session.commit()
            elif COMMIT_TIMER not in self._timers:
                self._timers[COMMIT_TIMER] = None
                actions.append(ArmTimer(COMMIT_TIMER, self.config.commit_interval_s))
        return actions

    def arm_keepalive(self, delay_s: float) -> ArmTimer:
        """(Re)arm the keep alive timer: the channel keeps the names of its armed timers (``close`` stops them)."""
        self._timers[KEEPALIVE_TIMER] = None
        return ArmTimer(KEEPALIVE_TIMER, delay_s)

    def save(self) -> list[Action]:
        assert self.conn.session is not None
        return self.conn.session.save()

    def now_ms(self) -> int:
        return int(self.now() * 1000)

    # --- limits -------------------------------------------------------------------------

    def limit_hit(self, limit: Limit, count: int, detail: str | None) -> LimitHit:
        """The action reporting ``count`` hits of ``limit``, with a log line if this connection's ``HitLog`` says."""
        if self._hits is None:
            self._hits = HitLog()
        due = self._hits.due(limit, count, self.now())
        if due is None or detail is None:
            return LimitHit(limit, count)
        if due > count:
            detail += f" ({due} hits of this limit since the last line)"
        return LimitHit(limit, count, detail)

    def topic_over(self, text: str, what: str) -> tuple[Limit, str] | None:
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

    def hold(self, packet: Packet) -> list[Action]:
        """Keep a packet for later, behind the QoS 1/2 message waiting for room under the in-flight limit."""
        if len(self.conn.held) >= self.config.max_queued_packets:
            raise RemoteProtocolError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                                      f"more than {self.config.max_queued_packets} packets wait behind "
                                      f"{self.config.receive_maximum} QoS 1/2 messages being stored")
        self.conn.held = appended(self.conn.held, packet)
        return []

    def release_held(self) -> list[Action]:
        """Process held packets until one has to wait again (or the connection closes)."""
        held, self.conn.held = self.conn.held, ()
        actions: list[Action] = []
        for index, packet in enumerate(held):
            if self._state is not State.CONNECTED:
                break
            actions += self.handle_in(packet)
            if self.conn.held:
                self.conn.held = appended(self.conn.held, *held[index + 1:])
                break
        return actions + self.input_done()

    # --- node events (those of a packet family are its handler module's) -----------------

    def _on_session_saved(self, event: SessionSaved) -> list[Action]:
        return self.conn.session.saved(event.ref)  # type: ignore[union-attr]

    def _on_pulled(self, event: Pulled) -> list[Action]:
        return self.conn.session.pulled(  # type: ignore[union-attr]
            event.filter, event.messages, event.next_offset, event.handles)

    def _on_queue_advanced(self, event: QueueAdvanced) -> list[Action]:
        if self.conn.session is None:
            return []  # not connected yet: the session pulls from its cursor once attached
        return self.conn.session.queue_advanced(event.queue, event.max_offset)

    def _on_socket_written(self, event: SocketWritten) -> list[Action]:
        return self.conn.session.written(event.up_to)  # type: ignore[union-attr]

    def _on_connection_lost(self, event: ConnectionLost) -> list[Action]:
        return self.close(ReasonCode.UNSPECIFIED_ERROR, f"connection lost: {event.error}", will=True)

    def _server_disconnect(self, reason: ReasonCode) -> Disconnect | None:
        """The DISCONNECT the server ends a connection with: MQTT 5 only, and never before the CONNACK, which must
        be the first packet the server sends [MQTT-3.2.0-1]."""
        return Disconnect(reason) if self.conn.level == MQTT_5 and self._state is State.CONNECTED else None

    def _on_taken_over(self, event: TakenOver) -> list[Action]:
        packet = self._server_disconnect(ReasonCode.SESSION_TAKEN_OVER)
        if event.elsewhere:
            # Resumed on another node: a delayed will must never fire (section 3.1.3.2.2), one without delay goes
            # now, as for a local takeover; that node owns the stored session, so this one only commits.
            self._moved = True
            return self.close(ReasonCode.SESSION_TAKEN_OVER, "session taken over by a connection to another node",
                              packet=packet, will=self.will_delay_s() == 0, handover=True)
        return self.close(ReasonCode.SESSION_TAKEN_OVER, "session taken over by a new connection", packet=packet,
                          will=True, handover=True)

    def _on_admin_disconnect(self, event: AdminDisconnect) -> list[Action]:
        packet = self._server_disconnect(ReasonCode.ADMINISTRATIVE_ACTION)
        return self.close(ReasonCode.ADMINISTRATIVE_ACTION, "disconnected by an operator (admin API)",
                          packet=packet, will=True)

    def _on_server_shutdown(self, event: ServerShutdown) -> list[Action]:
        # Before the CONNACK it says so: 0x88 Server unavailable (3.1.1: return code 3); after, DISCONNECT 0x8B.
        before_connack = self._state is State.CONNECTING
        reason = ReasonCode.SERVER_UNAVAILABLE if before_connack else ReasonCode.SERVER_SHUTTING_DOWN
        why = "the server is shutting down"
        packet = self.explained(error_packet(self.conn.level, before_connack, reason), self.conn.level, why)
        return self.close(reason, why, packet=packet)

    def _on_timeout(self, event: Timeout) -> list[Action]:
        if event.name not in self._timers:
            return []  # cancelled while the timer was firing
        del self._timers[event.name]
        if event.name == COMMIT_TIMER:
            return self.conn.session.commit() if self.conn.session is not None else []
        if event.name == KEEPALIVE_TIMER:
            limit = self.conn.keepalive * 1.5
            if event.input_waiting:
                self.conn.last_rx = self.now()
            idle = self.now() - self.conn.last_rx
            if idle >= limit:
                packet = self._server_disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
                return self.close(ReasonCode.KEEP_ALIVE_TIMEOUT,
                                  f"nothing received for {idle:.1f} s (keep alive {self.conn.keepalive} s)",
                                  packet=packet, will=True)
            return [self.arm_keepalive(limit - idle)]
        raise LocalProtocolError(f"unknown timer {event.name!r}")


_LIMIT_ERRORS = {
    ReasonCode.PACKET_TOO_LARGE: Limit.PACKET_SIZE,
    ReasonCode.RECEIVE_MAXIMUM_EXCEEDED: Limit.INFLIGHT,
}
"""Protocol errors that are limit hits (the decoder's packet size, the MQTT 5 Receive Maximum): counted as such."""

_PROCESS: dict[type, Callable[[Channel, Any], list[Action]]] = {
    Connect: connect.process_connect,
    Publish: publish.process_publish,
    Puback: acks.process_puback,
    Pubrec: acks.process_pubrec,
    Pubrel: publish.process_pubrel,
    Pubcomp: acks.process_pubcomp,
    Subscribe: subscribe.process_subscribe,
    Unsubscribe: subscribe.process_unsubscribe,
    Pingreq: ping.process_pingreq,
    Disconnect: ping.process_disconnect,
}
"""One handler per packet type the state table lets through (AUTH never is: enhanced auth is not offered)."""

_EVENTS: dict[type, Callable[[Channel, Any], list[Action]]] = {
    SessionOpened: connect.on_session_opened,
    Appended: publish.on_appended,
    InboundReleased: publish.on_inbound_released,
    SessionSaved: Channel._on_session_saved,
    Activated: subscribe.on_activated,
    Pulled: Channel._on_pulled,
    QueueAdvanced: Channel._on_queue_advanced,
    SocketWritten: Channel._on_socket_written,
    ConnectionLost: Channel._on_connection_lost,
    TakenOver: Channel._on_taken_over,
    AdminDisconnect: Channel._on_admin_disconnect,
    ServerShutdown: Channel._on_server_shutdown,
    Timeout: Channel._on_timeout,
}
