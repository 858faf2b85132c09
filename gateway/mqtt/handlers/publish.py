"""Inbound PUBLISH at QoS 0, 1 and 2, its topic alias, the store's answer (PUBACK / PUBREC) and PUBREL.

Checks run cheapest first, as Mosquitto's ``handle__publish``: the header
(QoS, retain), the in-flight window, QoS 2 resends, the topic alias, the topic
name and its limits, the Receive Maximum, the publish rate; then the message's
one shape (``NewMessage``) goes to the node as an ``Append``. A QoS 1/2 message
is acknowledged only when the node reports it stored (``Appended``); a QoS 2
one's PUBCOMP only once its release is on disk (``InboundReleased``). A PUBLISH
to ``$delayed/<seconds>/<topic>`` (gateway/mqtt/delayed.py) becomes a delayed
message to ``<topic>``; even at QoS 0 it waits for the store's answer, which
may refuse it (the client's cap of pending delayed messages). An MQTT 5 client gets the delayed message's id
(``Position.id`` of its record, which the admin API lists and cancels by) in its PUBACK / PUBREC, as the User
Property ``delayed-id``; left out when the client's Maximum Packet Size has no room for it ([MQTT-3.4.2-3],
[MQTT-3.5.2-3]: ``Channel._fit``). QoS 0 (no acknowledgement) and MQTT 3.1.1 (no properties) get no id.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NoReturn

from gateway.mqtt.actions import Action, Append, Appended, Denied, InboundReleased, ReleaseInbound, Send
from gateway.mqtt.delayed import DELAYED_PREFIX, parse_delayed
from gateway.mqtt.errors import error_packet
from gateway.mqtt.handlers.view import ChannelView
from gateway.mqtt.limits import SYNTAX_ONLY, Limit
from gateway.mqtt.packets import MQTT_5, Puback, Pubcomp, Publish, Pubrec, Pubrel
from gateway.mqtt.properties import EMPTY_PROPERTIES, PacketType, Properties, encode_properties
from gateway.mqtt.reasons import PUBACK_REASONS, LocalProtocolError, ReasonCode, RemoteProtocolError
from gateway.mqtt.session import NOT_IN_LOG, Session
from gateway.mqtt.state import State
from lightqueue.topics import TopicError, validate_topic
from store.api import NewMessage, PayloadRun, Position


DELAYED_ID_PROPERTY = "delayed-id"
"""The User Property of the PUBACK / PUBREC of an MQTT 5 delayed publish: the message's id."""

RATE_DEBT_S = 10.0
"""A client whose publish-rate bucket owes more than this many seconds of refill is disconnected: it kept sending
through its refusals (or, QoS 0, its drops) for that long, so it is broken or abusive, not bursty."""

def property_block(properties: Properties) -> bytes:
    """A PUBLISH's (or a will's) properties as the record keeps them: the MQTT 5 property block, so a subscriber
    receives exactly what its publisher sent (one encoding at append, one decoding per queue read)."""
    return encode_properties(properties, PacketType.PUBLISH)


def _rate_refusal(channel: ChannelView, packet: Publish) -> list[Action] | None:
    """Charge the publish-rate buckets for ``packet``; None when it may go on, else the answer to it.

    Over a rate an MQTT 5 QoS 1/2 message gets PUBACK / PUBREC 0x97 (quota exceeded) and a 3.1.1 one closes
    the connection (it cannot be refused, and acknowledging it would lose it unseen); QoS 0 ones are dropped.
    A client ``RATE_DEBT_S`` seconds in debt is disconnected (0x96, message rate too high).
    """
    now = channel.now()
    refused: Limit | None = None
    for bucket, limit in channel.conn.buckets:
        cost = 1 if limit is Limit.PUBLISH_RATE else len(packet.payload)
        if not bucket.take(cost, now) and refused is None:
            refused = limit
    if refused is None:
        return None
    debt = max(bucket.debt_s(now) for bucket, _ in channel.conn.buckets)
    what = "messages/s" if refused is Limit.PUBLISH_RATE else "payload bytes/s"
    rate = channel.config.publish_rate if refused is Limit.PUBLISH_RATE else channel.config.publish_bytes_rate
    if debt > RATE_DEBT_S or (packet.qos and channel.conn.level != MQTT_5):
        reason = ReasonCode.MESSAGE_RATE_TOO_HIGH
        why = f"publishing over {rate:g} {what}" + (f" for {debt:.0f} s" if debt > RATE_DEBT_S else "")
        packet_out = channel.explained(error_packet(channel.conn.level, False, reason), channel.conn.level, why)
        return [channel.limit_hit(refused, 1, f"{why}: disconnected"),
                *channel.close(reason, why, packet=packet_out, will=True)]
    hit = channel.limit_hit(refused, 1, f"QoS {packet.qos} message over {rate:g} {what}: "
                                        + ("refused (0x97)" if packet.qos else "dropped"))
    if not packet.qos:
        return [hit]
    ack = Puback if packet.qos == 1 else Pubrec
    return [hit, Send((ack(packet.packet_id, ReasonCode.QUOTA_EXCEEDED),))]  # type: ignore[arg-type]


def _topic_refusal(channel: ChannelView, packet: Publish, limit: Limit, why: str) -> list[Action]:
    """A PUBLISH whose topic is over a limit: MQTT 5 QoS 1/2 get PUBACK / PUBREC 0x90 (topic name invalid:
    not malformed, "not accepted by this Server"); QoS 0 (no acknowledgement to say it in) and 3.1.1 close."""
    if packet.qos and channel.conn.level == MQTT_5:
        ack = Puback if packet.qos == 1 else Pubrec
        return [channel.limit_hit(limit, 1, f"QoS {packet.qos} message refused (0x90): {why}"),
                Send((ack(packet.packet_id, ReasonCode.TOPIC_NAME_INVALID),))]  # type: ignore[arg-type]
    reason = ReasonCode.TOPIC_NAME_INVALID
    packet_out = channel.explained(error_packet(channel.conn.level, False, reason), channel.conn.level, why)
    return [channel.limit_hit(limit, 1, f"{why}: disconnected"),
            *channel.close(reason, f"PUBLISH over a topic limit: {why}", packet=packet_out, will=True)]


def process_publish(channel: ChannelView, packet: Publish) -> list[Action]:
    """A PUBLISH from the client: its checks, cheapest first, then its ``Append`` (acknowledged on ``Appended``).

    Each check is a step named for its rule, run only when the rule can apply (a QoS 1/2 message, an alias, a
    topic name new on this connection, a topic long enough to be over a limit, a rate configured): a valid QoS 0
    message on the topic its client used before, most of what a node reads, calls none of them.
    """
    config = channel.config
    conn = channel.conn
    session = conn.session
    assert session is not None
    qos = packet.qos
    pid = packet.packet_id
    if qos > config.max_qos:
        _qos_not_supported(qos)
    if packet.retain and not config.retain_available:
        _retain_not_supported()
    if qos and conn.level != MQTT_5 and len(conn.pending) >= config.receive_maximum:
        return _wait_for_room(channel, packet)
    if qos == 2:
        resent = _qos2_resend(channel, session, pid)
        if resent is not None:
            return resent
    topic = packet.topic
    props = packet.properties
    alias = props.topic_alias
    if alias is not None:
        topic = _check_topic_alias(channel, alias, topic)
        props = replace(props, topic_alias=None)
    if topic != conn.valid_topic:
        _check_topic_name(channel, topic)
    if len(topic) >= conn.topic_check_from:
        over = channel.topic_over(topic, "topic name")
        if over is not None:
            return _topic_refusal(channel, packet, *over)
    if qos and conn.level == MQTT_5:
        _check_receive_maximum(channel, session)
    if conn.buckets:
        refusal = _rate_refusal(channel, packet)
        if refusal is not None:
            return refusal
    born_ms = int(conn.last_rx * 1000)  # the clock read when this packet came in (handle_in)
    deliver_at_ms = 0
    if topic.startswith(DELAYED_PREFIX):
        try:
            topic, delay_s = parse_delayed(topic, config.max_delay_s)
        except ValueError as exc:
            return _topic_refusal(channel, packet, Limit.DELAYED, str(exc))
        deliver_at_ms = born_ms + delay_s * 1000
    if conn.authorizer is not None and not conn.authorizer.may_publish(topic):
        return _not_authorized(channel, qos, pid, topic)
    message = NewMessage(topic, packet.payload, conn.client_id, qos, packet.retain,
                         b"" if props is EMPTY_PROPERTIES else property_block(props), born_ms,
                         pid if qos == 2 else 0, deliver_at_ms)
    if not qos and not deliver_at_ms:
        return [Append(None, (message,))]
    conn.next_ref += 1
    conn.pending[conn.next_ref] = (qos, pid, bool(deliver_at_ms))  # type: ignore[assignment]
    if qos == 2:
        conn.storing_qos2[pid] = None  # type: ignore[index]
    return [Append(conn.next_ref, (message,))]


def repeated(channel: ChannelView, actions: list[Action], payloads: list[bytes]) -> list[Action] | None:
    """The one ``Append`` of a QoS 0 message and of ``payloads``, PUBLISHes that repeat it but for their payloads,
    or None when they must be handled one by one: ``actions``, what the first answered, is not a plain QoS 0
    ``Append`` (it was refused, delayed, or closed the connection), or a publish rate charges each message.
    Every other check of :func:`process_publish` depends only on what they share (header, topic, the read's
    clock, the ACL's answer for the topic), so it answers for all of them."""
    if len(actions) != 1 or channel.conn.buckets:
        return None
    append = actions[0]
    if type(append) is not Append or append.ref is not None:
        return None
    like = append.messages[0]
    return [Append(None, PayloadRun(like, [like.payload, *payloads]))]


def _qos_not_supported(qos: int) -> NoReturn:
    """A PUBLISH above the Maximum QoS the CONNACK said [MQTT-3.2.2-11]: a protocol error, DISCONNECT 0x9B."""
    raise RemoteProtocolError(ReasonCode.QOS_NOT_SUPPORTED, f"PUBLISH QoS {qos} exceeds maximum QoS")


def _retain_not_supported() -> NoReturn:
    """A retained PUBLISH though the CONNACK said Retain Available 0 [MQTT-3.2.2-14]: DISCONNECT 0x9A."""
    raise RemoteProtocolError(ReasonCode.RETAIN_NOT_SUPPORTED, "PUBLISH with RETAIN set")


def _wait_for_room(channel: ChannelView, packet: Publish) -> list[Action]:
    """A 3.1.1 QoS 1/2 message over the in-flight limit: 3.1.1 has no Receive Maximum to tell the client, so it
    waits (the connection stops reading meanwhile: ``Channel.input_paused``)."""
    held = channel.hold(packet)
    return [channel.limit_hit(Limit.INFLIGHT, 1, f"{len(channel.conn.pending)} QoS 1/2 messages being stored: "
                                                 "input paused"), *held]


def _qos2_resend(channel: ChannelView, session: Session, pid: int) -> list[Action] | None:
    """The answer to a QoS 2 message whose packet id is already held ([MQTT-4.3.3-2]: until its PUBREL, PUBREC
    again and store nothing), or None for a new one."""
    if pid in session.awaiting_rel:
        return [Send((Pubrec(pid),))]  # a resend of a stored message: acknowledge, do not store again
    if pid in channel.conn.storing_qos2:
        return []  # a resend while the first copy is being stored: its PUBREC follows
    return None


def _check_topic_alias(channel: ChannelView, alias: int, topic: str) -> str:
    """The topic name of a PUBLISH with a Topic Alias: the alias is mapped to ``topic``, or ``topic`` is empty and
    the alias's mapping is used (section 3.3.2.3.4).

    Raises:
        RemoteProtocolError: TOPIC_ALIAS_INVALID, the alias is above the server's Topic Alias Maximum
            [MQTT-3.3.2-12]; PROTOCOL_ERROR, an empty topic name with an alias never mapped.
    """
    if alias > channel.config.topic_alias_maximum:
        raise RemoteProtocolError(ReasonCode.TOPIC_ALIAS_INVALID, f"topic alias {alias} exceeds the maximum")
    if topic:
        channel.conn.aliases_in[alias] = topic
        return topic
    if alias in channel.conn.aliases_in:
        return channel.conn.aliases_in[alias]
    raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"topic alias {alias} is not mapped")


def _check_topic_name(channel: ChannelView, topic: str) -> None:
    """Validate a topic name new on this connection and remember it (devices repeat theirs).

    Raises:
        RemoteProtocolError: PROTOCOL_ERROR, a wildcard in a topic name [MQTT-3.3.2-2] (or another malformed
            name); 0x90 is for names correctly formed but refused, as the topic limits answer.
    """
    try:
        channel.conn.valid_topic = validate_topic(topic, SYNTAX_ONLY)
    except TopicError as exc:
        raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, str(exc)) from None


def _check_receive_maximum(channel: ChannelView, session: Session) -> None:
    """An MQTT 5 client may not have more QoS 1/2 messages unacknowledged than the server's Receive Maximum
    [MQTT-3.3.4-7]; the server closes with 0x93 (section 3.3.4).

    Raises:
        RemoteProtocolError: RECEIVE_MAXIMUM_EXCEEDED.
    """
    maximum = channel.config.receive_maximum
    if len(channel.conn.pending) + len(session.awaiting_rel) >= maximum:
        raise RemoteProtocolError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                                  f"more than {maximum} unacknowledged QoS 1/2 PUBLISHes")


def _not_authorized(channel: ChannelView, qos: int, pid: int, topic: str) -> list[Action]:
    """A message the ACL does not let this client publish: dropped, and a QoS 1/2 one answered NOT_AUTHORIZED
    (3.1.1, which cannot refuse: acknowledged) in its turn, after the messages read before it are answered
    [MQTT-4.6.0-2]: it waits in ``pending`` as they do."""
    denied = Denied("publish", topic, f"QoS {qos} message dropped")
    if not qos:
        return [denied]
    channel.conn.next_ref += 1
    channel.conn.pending[channel.conn.next_ref] = (qos, pid, False)
    channel.conn.refused[channel.conn.next_ref] = None
    if qos == 2:
        channel.conn.storing_qos2[pid] = None
    return [denied, *_answer_refused(channel)]


def _answer_refused(channel: ChannelView) -> list[Action]:
    """Answer the refused messages whose turn has come: those with no message read before them still owed."""
    actions: list[Action] = []
    refused = channel.conn.refused
    while refused and (ref := next(iter(channel.conn.pending))) in refused:
        del refused[ref]
        actions += _appended(channel, Appended(ref, False, ReasonCode.NOT_AUTHORIZED))
    return actions


def process_pubrel(channel: ChannelView, packet: Pubrel) -> list[Action]:
    session = channel.conn.session
    assert session is not None
    pid = packet.packet_id
    position = session.awaiting_rel.get(pid)
    if position is not None:
        if pid in channel.conn.releasing.values():
            return []  # the release is being written: its PUBCOMP follows
        if position == NOT_IN_LOG:
            del session.awaiting_rel[pid]
            return [Send((Pubcomp(pid),))]
        channel.conn.next_ref += 1
        channel.conn.releasing[channel.conn.next_ref] = pid
        return [ReleaseInbound(channel.conn.next_ref, channel.conn.client_id, pid, position)]
    if channel.conn.level == MQTT_5:
        return [Send((Pubcomp(pid, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),))]
    return [Send((Pubcomp(pid),))]  # 3.1.1 has no reason: complete the flow anyway


def on_appended(channel: ChannelView, event: Appended) -> list[Action]:
    actions = _appended(channel, event)
    if channel.conn.refused:
        actions += _answer_refused(channel)
    if channel.conn.held and channel.state is State.CONNECTED:
        actions += channel.release_held()
    return actions


def _appended(channel: ChannelView, event: Appended) -> list[Action]:
    try:
        qos, pid, delayed = channel.conn.pending.pop(event.ref)
    except KeyError:
        raise LocalProtocolError(f"Appended for unknown ref {event.ref}") from None
    session = channel.conn.session
    assert session is not None
    closing = channel.state is not State.CONNECTED
    if not qos:  # a delayed QoS 0 message: the store may refuse it (its client's cap), which must not go unseen
        if closing or event.ok:
            return channel.settle() if closing else []
        return channel.close(event.reason, f"delayed QoS 0 message not stored ({event.reason.name})")
    if qos == 2:
        channel.conn.storing_qos2.pop(pid, None)
    if event.ok:
        if closing:
            if qos == 2:
                session.awaiting_rel[pid] = event.position  # the record says so too: the store knows it after a crash
            return channel.settle()
        props = _delayed_id(event.position) if delayed and channel.conn.level == MQTT_5 else EMPTY_PROPERTIES
        if qos == 2:
            session.awaiting_rel[pid] = event.position
            return [Send((Pubrec(pid, properties=props),))]
        return [Send((Puback(pid, properties=props),))]
    if closing:
        return channel.settle()
    if channel.conn.level == MQTT_5:
        reason = event.reason if event.reason.is_failure and event.reason in PUBACK_REASONS else \
            ReasonCode.UNSPECIFIED_ERROR
        return [Send(((Puback if qos == 1 else Pubrec)(pid, reason),))]
    if event.reason is ReasonCode.NOT_AUTHORIZED:
        # 3.1.1 has no negative acknowledgement: acknowledge the dropped message (the node logged it), or the
        # client would resend it forever (Mosquitto does the same). A PUBREL for it gets its PUBCOMP anyway.
        return [Send(((Puback if qos == 1 else Pubrec)(pid),))]
    return channel.close(event.reason, f"message not stored ({event.reason.name}); 3.1.1 cannot refuse it")


def _delayed_id(position: Position) -> Properties:
    """The properties of the acknowledgement of a delayed message stored at ``position``: its id."""
    return Properties(user_properties=((DELAYED_ID_PROPERTY, position.id),))


def on_inbound_released(channel: ChannelView, event: InboundReleased) -> list[Action]:
    try:
        pid = channel.conn.releasing.pop(event.ref)
    except KeyError:
        raise LocalProtocolError(f"InboundReleased for unknown ref {event.ref}") from None
    if event.ok:
        channel.conn.session.awaiting_rel.pop(pid, None)  # type: ignore[union-attr]
    if channel.state is not State.CONNECTED:
        return channel.settle()
    return [Send((Pubcomp(pid),))] if event.ok else []  # not recorded: the node closes the connection
