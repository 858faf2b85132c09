"""SUBSCRIBE and UNSUBSCRIBE: filters checked, shared subscriptions, quotas, and the retained messages they bring.

A SUBSCRIBE's accepted filters go to the node as one ``Activate`` (those of SUBSCRIBEs read together as one:
``SubscribeRun``); the SUBACK and the retained messages (per Retain Handling) follow its ``Activated``.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.mqtt.actions import Action, Activate, Activated, Denied, Release, Send, Subscription
from gateway.mqtt.handlers.view import ChannelView
from gateway.mqtt.limits import SYNTAX_ONLY, Limit
from gateway.mqtt.packets import MQTT_5, Suback, Subscribe, SubscriptionOptions, Unsuback, Unsubscribe
from gateway.mqtt.properties import EMPTY_PROPERTIES
from gateway.mqtt.reasons import LocalProtocolError, ReasonCode, RemoteProtocolError
from lightqueue.topics import SHARE_PREFIX, TopicError, is_wildcard, parse_shared, validate_filter


_GRANTED = (ReasonCode.GRANTED_QOS_0, ReasonCode.GRANTED_QOS_1, ReasonCode.GRANTED_QOS_2)
"""A SUBACK's reason code by the QoS granted (an enum's call by value is a lookup in Python)."""


def _parsed_filter(filter: str) -> tuple[str, str] | None:
    """(group, filter) of a shared subscription, None for a plain filter.

    Raises:
        RemoteProtocolError: PROTOCOL_ERROR, the filter is malformed (wildcards [MQTT-4.7.1-2/3], empty
            [MQTT-4.7.3-1], share name [MQTT-4.8.2-1/2]): a protocol violation the connection is closed for
            (3.1.1 [MQTT-4.8.0-1], 5.0 section 4.13.1), not a refusal (SUBACK/UNSUBACK 0x8F is for filters
            correctly formed but not allowed, as the topic limits answer).
    """
    try:
        if filter.startswith(SHARE_PREFIX):
            return parse_shared(filter, SYNTAX_ONLY)
        validate_filter(filter, SYNTAX_ONLY)
    except TopicError as exc:
        raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"malformed topic filter: {exc}") from None
    return None


def _check_subscription(
    channel: ChannelView, filter: str, options: SubscriptionOptions, sub_id: int | None
) -> Subscription | ReasonCode:
    """The subscription a SUBSCRIBE entry asks for, or the SUBACK reason refusing it: shared subscriptions and
    wildcards only if available (0x9E, 0xA2), No Local never on a shared one [MQTT-3.8.3-4], the QoS granted at
    most the Maximum QoS ([MQTT-3.2.2-10]: a request above it is accepted, downgraded)."""
    config = channel.config
    shared = _parsed_filter(filter)
    group, queue = shared if shared is not None else (None, filter)
    if group is not None:
        if not config.shared_available:
            return ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
        if options.no_local and channel.conn.level == MQTT_5:
            raise RemoteProtocolError(ReasonCode.PROTOCOL_ERROR,
                                      f"No Local on shared subscription {filter!r} [MQTT-3.8.3-4]")
    if not config.wildcard_available and is_wildcard(queue):
        return ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
    if options.qos > config.max_qos:
        options = replace(options, qos=config.max_qos)
    return Subscription(filter, queue, options, sub_id, group)


def _check_subscription_identifier(channel: ChannelView, packet: Subscribe) -> int | None:
    """The SUBSCRIBE's Subscription Identifier, or None.

    Raises:
        RemoteProtocolError: SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, the CONNACK said they are not available
            (section 3.2.2.3.12: DISCONNECT 0xA1).
    """
    ids = packet.properties.subscription_identifiers
    if ids and not channel.config.subscription_ids_available:
        raise RemoteProtocolError(ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
                                  "SUBSCRIBE with a subscription identifier")
    return ids[0] if ids else None


def process_subscribe(channel: ChannelView, packet: Subscribe) -> list[Action]:
    """A SUBSCRIBE alone: :class:`SubscribeRun` of one packet."""
    run = SubscribeRun(channel)
    return [*run.add(packet), *run.end()]


class SubscribeRun:
    """SUBSCRIBEs read together, answered as one: each checked as if alone (``_check_subscription``, a topic
    limit, the ACL, the session's quota; a refusal in its SUBACK), and the accepted filters of consecutive ones
    go to the node as one ``Activate``, whose ``Activated`` answers them all: one fence, one store write and one
    session patch for the run, their SUBACKs in their order in one ``Send`` once the patch is written (a client
    pipelining one filter per SUBSCRIBE paid each of these per packet, issue 31). An ``Activate`` keys its
    answers by filter, so a packet asking for a filter already in the run ends it and starts the next."""

    __slots__ = ("_channel", "_conn", "_session", "_quota", "_held", "_entries", "_subs", "_retained", "_filters")

    def __init__(self, channel: ChannelView) -> None:
        self._channel = channel
        self._conn = channel.conn
        session = channel.conn.session
        assert session is not None
        self._session = session
        self._quota = channel.config.max_subscriptions
        # What the session holds stays the same while the run is checked (its Activated adds to it).
        self._held = session.subscription_count if self._quota else 0
        self._entries: list[tuple[int, list[ReasonCode], list[tuple[int, Subscription]]]] = []
        self._subs: list[Subscription] = []
        self._retained: list[str] = []
        self._filters: set[str] = set()

    def add(self, packet: Subscribe) -> list[Action]:
        """Check ``packet``'s filters into the run; what goes out now (limit hits, an ``Activate`` the run ended
        before it, or its SUBACK when it activates nothing and no earlier SUBSCRIBE waits for its activation:
        else the SUBACK follows theirs).

        Raises:
            RemoteProtocolError: as ``_check_subscription`` and ``_check_subscription_identifier``; the packets
                added before it are still the run's (:meth:`end`).
        """
        channel = self._channel
        conn = self._conn
        session = self._session
        sub_id = None if packet.properties is EMPTY_PROPERTIES else _check_subscription_identifier(channel, packet)
        quota = self._quota
        # New filters being activated count with those held: a SUBSCRIBE answered later must not let an earlier
        # one overshoot. (Counted, not collected: a SUBSCRIBE costs the same with 4,000 filters held as with 4, and
        # with 64 SUBSCRIBEs in flight as with one.) The filters in flight are collected only when they could reach
        # the quota, not on every SUBSCRIBE of a client that pipelines them.
        held = self._held
        if quota and held + conn.activating + len(packet.subscriptions) <= quota:
            quota = 0  # every filter of this packet fits
        if quota:
            activating = {sub.filter for entries in conn.activations.values() for _, _, w in entries for _, sub in w
                          if not session.holds(sub.filter)}
            held += len(activating)
        codes: list[ReasonCode] = []
        wanted: list[tuple[int, Subscription]] = []
        hits: list[Action] = []
        over_quota = 0
        for index, (filter, options) in enumerate(packet.subscriptions):
            checked = _check_subscription(channel, filter, options, sub_id)
            if isinstance(checked, ReasonCode):
                codes.append(checked)
                continue
            over = channel.topic_over(checked.queue, "topic filter") \
                if len(checked.queue) >= conn.topic_check_from else None  # shorter ones cannot be over a limit
            if over is not None:
                codes.append(ReasonCode.TOPIC_FILTER_INVALID)
                hits.append(channel.limit_hit(over[0], 1, f"filter refused: {over[1]}"))
                continue
            if conn.authorizer is not None and not conn.authorizer.may_subscribe(filter):
                codes.append(ReasonCode.NOT_AUTHORIZED)  # 3.1.1: 0x80, as every refusal
                hits.append(Denied("subscribe", filter, "filter refused"))
                continue
            if quota and filter not in activating and not session.holds(filter):
                if held >= quota:
                    codes.append(ReasonCode.QUOTA_EXCEEDED)
                    over_quota += 1
                    continue
                activating.add(filter)
                held += 1
            codes.append(_GRANTED[checked.options.qos])
            wanted.append((index, checked))
        if over_quota:
            hits.append(channel.limit_hit(Limit.SUBSCRIPTIONS, over_quota,
                                          f"{over_quota} filter(s) refused: the session holds {held} "
                                          f"subscriptions, the limit is {quota}"))
        if not wanted and not self._entries:
            if not conn.activations:
                return [*hits, Send((Suback(packet.packet_id, tuple(codes)),))]
            # Its SUBACK goes after those of the SUBSCRIBEs before it, which wait for their activation.
            next(reversed(conn.activations.values())).append((packet.packet_id, codes, wanted))
            return hits
        ended: list[Action] = []
        for _, sub in wanted:
            if sub.filter in self._filters:
                ended = self.end()
                break
        if not self._entries:
            conn.next_ref += 1
            conn.activations[conn.next_ref] = self._entries
        self._entries.append((packet.packet_id, codes, wanted))
        conn.activating += len(wanted)
        for _, sub in wanted:
            self._subs.append(sub)
            self._filters.add(sub.filter)
            handling = sub.options.retain_handling
            if sub.group is None and (handling == 0 or (handling == 1 and not session.holds(sub.filter))):
                self._retained.append(sub.filter)
        return [*hits, *ended]

    def end(self) -> list[Action]:
        """The run's ``Activate`` (none if it is empty); the run starts empty again."""
        if not self._entries:
            return []
        conn = self._conn
        activate = Activate(conn.next_ref, conn.client_id, tuple(self._subs), tuple(self._retained))
        self._entries = []
        self._subs = []
        self._retained = []
        self._filters = set()
        return [activate]


def process_unsubscribe(channel: ChannelView, packet: Unsubscribe) -> list[Action]:
    session = channel.conn.session
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
    reasons = tuple(codes) if channel.conn.level == MQTT_5 else ()
    # The UNSUBACK goes at once: the unsubscription takes effect for the client now, and on a full disk the store's
    # release and the session's patch wait for room (docs/operations.md). A SUBSCRIBE's patch comes after it.
    actions: list[Action] = [Release(channel.conn.client_id, tuple(released)), *session.patch(released)] \
        if released else []
    return [*actions, Send((Unsuback(packet.packet_id, reasons),))]


def on_activated(channel: ChannelView, event: Activated) -> list[Action]:
    try:
        entries = channel.conn.activations.pop(event.ref)
    except KeyError:
        raise LocalProtocolError(f"Activated for unknown ref {event.ref}") from None
    conn = channel.conn
    session = conn.session
    assert session is not None
    refused = event.reasons or {}
    starts, at_head = event.starts, event.at_head
    subscribed: dict[str, None] = {}  # in order
    subacks: list[Suback] = []
    for packet_id, codes, wanted in entries:
        conn.activating -= len(wanted)
        for index, sub in wanted:
            filter = sub.filter
            if refused:
                reason = refused.get(filter)
                if reason is not None:
                    codes[index] = reason
                    continue
            start = starts.get(filter)
            if start is None and not session.holds(filter):
                raise LocalProtocolError(f"Activated without a start offset for {filter!r}")
            session.subscribe(sub, start or 0, at_head=filter in at_head)
            subscribed[filter] = None
        subacks.append(Suback(packet_id, tuple(codes)))
    retained = tuple(pair for pair in event.retained if pair[0] in subscribed)
    return session.patch(subscribed, Send(tuple(subacks)), retained)
