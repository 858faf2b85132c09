"""CONNECT: the client's identity, will, keep alive and session, and the CONNACK once the node opened the session.

Checks run before the session is asked for: enhanced authentication (not
offered), the client identifier ([MQTT-3.1.3-8]), the will's topic, QoS and
retain, and that the CONNACK fits the client's Maximum Packet Size; a refusal
is a CONNACK with its reason (or, 3.1.1 without a return code for it, a close).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from collections.abc import Callable

from gateway.mqtt.actions import Action, OpenSession, Send, SessionOpened
from gateway.mqtt.codec import encode, fit
from gateway.mqtt.errors import CONNACK_REFUSALS_311, error_packet
from gateway.mqtt.handlers.publish import property_block
from gateway.mqtt.handlers.view import ChannelView
from gateway.mqtt.limits import SYNTAX_ONLY
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connack, Connect
from gateway.mqtt.properties import EMPTY_PROPERTIES, MAX_UINT16, Properties
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode
from gateway.mqtt.session import Link, Session
from gateway.mqtt.state import State
from lightqueue.topics import TopicError, validate_topic
from store.api import NewMessage


def _refuse(channel: ChannelView, reason: ReasonCode, log: str) -> list[Action]:
    packet = channel.explained(error_packet(channel.conn.level, True, reason), channel.conn.level, log)
    return channel.close(reason, f"connection refused: {log}", packet=packet)


def process_connect(channel: ChannelView, packet: Connect) -> list[Action]:
    """A CONNECT: its checks (``CONNECT_CHECKS``, in order: the first refusal answers), the will, the terms of the
    connection, then the ``OpenSession`` whose answer (``on_session_opened``) the CONNACK waits for."""
    channel.conn.level = packet.protocol_level
    channel.conn.peer_max_packet = packet.properties.maximum_packet_size
    for check in CONNECT_CHECKS:
        refusal = check(channel, packet)
        if refusal is not None:
            return refusal
    if packet.will_topic is not None:
        _take_will(channel, packet)
    receive_maximum = _agree_terms(channel, packet)
    refusal = _check_connack_fits(channel, packet)
    if refusal is not None:
        return refusal
    config = channel.config
    props = packet.properties
    channel.conn.link = Link(
        protocol_level=channel.conn.level,
        receive_maximum=min(receive_maximum, config.max_inflight),
        max_packet_size=props.maximum_packet_size,
        topic_alias_maximum=props.topic_alias_maximum or 0,
        pull_batch=config.pull_batch,
        max_unwritten=config.max_unwritten,
        commit_every=config.commit_every,
        owner=channel,
        qos0_queue_bytes=config.qos0_queue_bytes,
        max_unwritten_bytes=config.max_unwritten_bytes,
        since_ms=channel.now_ms(),
    )
    channel.conn.awaiting_session = True
    return [OpenSession(channel.conn.client_id, packet.clean_start, channel.conn.expiry, packet.username,
                        packet.password, packet.will_topic, channel.conn.will, channel.will_delay_s())]


def _check_authentication_method(channel: ChannelView, packet: Connect) -> list[Action] | None:
    """Enhanced authentication is not offered: a CONNECT asking for it is refused with 0x8C (section 4.12)."""
    if packet.properties.authentication_method is not None:
        return _refuse(channel, ReasonCode.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not offered")
    return None


def _check_client_identifier(channel: ChannelView, packet: Connect) -> list[Action] | None:
    """The client's identifier, or one assigned for an empty one ([MQTT-3.1.3-6], told to an MQTT 5 client in
    the CONNACK [MQTT-3.2.2-16]); a 3.1.1 client must not leave it empty with clean session 0 [MQTT-3.1.3-8]."""
    client_id = packet.client_id
    if not client_id:
        level = channel.conn.level
        if level == MQTT_311 and not packet.clean_start:
            return _refuse(channel, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
                           "empty client id with clean session 0 [MQTT-3.1.3-8]")
        client_id = channel.config.assigned_id_prefix + uuid.uuid4().hex
        channel.conn.assigned = client_id if level == MQTT_5 else None
    channel.conn.client_id = client_id
    return None


def _check_will(channel: ChannelView, packet: Connect) -> list[Action] | None:
    """A will the server can publish: a valid topic name within the topic limits, at most the Maximum QoS
    [MQTT-3.2.2-12], retained only if retain is available [MQTT-3.2.2-13]."""
    topic = packet.will_topic
    if topic is None:
        return None
    config = channel.config
    try:
        validate_topic(topic, SYNTAX_ONLY)
    except TopicError as exc:
        return _refuse(channel, ReasonCode.TOPIC_NAME_INVALID, f"will topic: {exc}")
    over = channel.topic_over(topic, "will topic")
    if over is not None:
        return [channel.limit_hit(over[0], 1, over[1]), *_refuse(channel, ReasonCode.TOPIC_NAME_INVALID, over[1])]
    if packet.will_qos > config.max_qos:
        return _refuse(channel, ReasonCode.QOS_NOT_SUPPORTED, f"will QoS {packet.will_qos}")
    if packet.will_retain and not config.retain_available:
        return _refuse(channel, ReasonCode.RETAIN_NOT_SUPPORTED, "will retain")
    return None


CONNECT_CHECKS: tuple[Callable[[ChannelView, Connect], list[Action] | None], ...] = (
    _check_authentication_method, _check_client_identifier, _check_will)
"""The checks of a CONNECT, in order (EMQX's ``process_connect`` pipeline): each returns the refusal or None."""


def _take_will(channel: ChannelView, packet: Connect) -> None:
    """Keep the checked will as the message it will be; its delay is the channel's, not the record's."""
    topic = packet.will_topic
    assert topic is not None  # _check_will passed it
    will_props = packet.will_properties
    channel.conn.will_delay = will_props.will_delay_interval or 0
    if will_props.will_delay_interval is not None:
        will_props = replace(will_props, will_delay_interval=None)
    channel.conn.will = NewMessage(topic, packet.will_payload, channel.conn.client_id, packet.will_qos,
                                   packet.will_retain, property_block(will_props), channel.now_ms())


def _agree_terms(channel: ChannelView, packet: Connect) -> int:
    """Set the session expiry (MQTT 5: capped, the CONNACK then says so, section 3.2.2.3.2; 3.1.1: by clean
    session) and the keep alive (capped: Server Keep Alive [MQTT-3.2.2-21]); return the client's Receive Maximum
    (3.1.1: the configured default), the window of its outbound messages."""
    config = channel.config
    props = packet.properties
    if channel.conn.level == MQTT_5:
        channel.conn.requested_expiry = props.session_expiry_interval or 0
        channel.conn.expiry = min(channel.conn.requested_expiry, config.max_session_expiry_s)
        keepalive = packet.keep_alive
        if config.max_keepalive is not None and not 0 < keepalive <= config.max_keepalive:
            keepalive = config.max_keepalive
        receive_maximum = props.receive_maximum or MAX_UINT16
    else:
        channel.conn.expiry = channel.conn.requested_expiry = 0 if packet.clean_start else config.session_expiry_311_s
        keepalive = packet.keep_alive
        receive_maximum = config.default_receive_maximum
    channel.conn.keepalive = keepalive
    channel.conn.keepalive_override = keepalive if keepalive != packet.keep_alive else None
    channel.conn.clean_start = packet.clean_start
    return receive_maximum


def _check_connack_fits(channel: ChannelView, packet: Connect) -> list[Action] | None:
    """The CONNACK must fit the client's Maximum Packet Size [MQTT-3.1.2-24]; checked before the session is opened
    (or taken over), since the client could never be told."""
    limit = packet.properties.maximum_packet_size
    if limit is None:
        return None
    level = packet.protocol_level
    connack = Connack(False, ReasonCode.SUCCESS, _connack_properties(channel))
    if fit(connack, level, limit) is not None:
        return None
    return _refuse(channel, ReasonCode.PACKET_TOO_LARGE,
                   f"the CONNACK takes {len(encode(connack, level))} bytes, over the client's "
                   f"Maximum Packet Size of {limit} [MQTT-3.1.2-24]")


def _connack_properties(channel: ChannelView) -> Properties:
    config = channel.config
    if channel.conn.level != MQTT_5:
        return EMPTY_PROPERTIES
    fields: dict[str, object] = {
        "receive_maximum": config.receive_maximum,
        "maximum_packet_size": config.max_packet_size,
        "topic_alias_maximum": config.topic_alias_maximum,
    }
    if channel.conn.assigned is not None:
        fields["assigned_client_identifier"] = channel.conn.assigned
    if channel.conn.expiry != channel.conn.requested_expiry:
        fields["session_expiry_interval"] = channel.conn.expiry
    if channel.conn.keepalive_override is not None:
        fields["server_keep_alive"] = channel.conn.keepalive_override
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


def on_session_opened(channel: ChannelView, event: SessionOpened) -> list[Action]:
    if not channel.conn.awaiting_session:
        raise LocalProtocolError("SessionOpened without an OpenSession")
    channel.conn.awaiting_session = False
    closing = channel.state is State.DISCONNECTING
    if event.reason.is_failure:
        if closing:
            return channel.settle()
        # The node refuses for its own state (a full data disk...), not for what the client sent: a 3.1.1
        # client gets the nearest return code (3, Server unavailable) rather than a silent close.
        reason = event.reason if channel.conn.level == MQTT_5 or event.reason in CONNACK_REFUSALS_311 \
            else ReasonCode.SERVER_UNAVAILABLE
        return _refuse(channel, reason, f"by the node ({event.reason.name})")
    state = event.state if event.present and not channel.conn.clean_start else None
    channel.conn.session = session = Session(channel.conn.client_id, channel.conn.expiry, state)
    if closing:
        return channel.settle()
    assert channel.conn.link is not None
    channel.conn.authorizer = event.authorizer
    channel.conn.link.may_read = event.authorizer.may_read if event.authorizer is not None else None
    actions: list[Action] = [Send((Connack(state is not None, ReasonCode.SUCCESS, _connack_properties(channel)),))]
    if channel.conn.keepalive:
        actions.append(channel.arm_keepalive(channel.conn.keepalive * 1.5))
    actions += session.attach(channel.conn.link)
    queued, channel.conn.queued = channel.conn.queued, ()
    for packet in queued:
        actions += channel.handle_in(packet)
    return actions + channel.input_done()
