"""MQTT sessions: the state that outlives a connection, and the delivery engine that feeds a connected client.

``SessionState`` is the session as data: what a persistent session stores
(``SaveSession``) and what a resumed or taken-over session starts from.
``Session`` is the live, mutable session of one connected client. It does no
I/O: its methods return actions (``gateway/actions.py``).

Delivery (design.md, "Pull and push"): each subscription reads one light
queue through a *stream*: a cursor (the next queue offset to pull), a bounded
buffer of pulled messages, and the offsets delivered but not yet acknowledged.
A stream pulls only when its buffer is empty, at most ``pull_batch`` messages,
so a slow session holds at most one batch per subscription plus its in-flight
window. It keeps pulling until a pull comes back empty (it reached the head)
or a known head (``QueueAdvanced``) is reached, without waiting for news.
Only streams with work (buffered messages, or a pull to make) are *ready*;
``pump`` walks those, and news reaches a queue's streams through an index by
queue, so the cost of a packet or an event does not grow with the
subscriptions a session holds (SUBSCRIBE at 40,000 held cost 4.4 ms when every
pump walked every stream).

Offsets advance only on PUBACK / PUBCOMP (QoS 1/2) or socket write (QoS 0),
and only contiguously: the committed offset of a stream is its lowest
unacknowledged offset. Commits are batched (``commit``).

Resuming (reconnect with a present session): in-flight PUBLISHes are re-pulled
by offset and resent with DUP and their packet ids, PUBRELs are resent, and
nothing below the saved resume cursor that is not in flight is delivered again
(acknowledged out of order before the disconnect). After a crash (no clean
save) the store's committed offsets win and delivery is at-least-once from there.

Persistence is not a separate class: whether the session is persistent is
``expiry_s > 0``, which a DISCONNECT may change (>0 to 0) mid-session, so one
class decides per call whether ``SaveSession`` is emitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import final

import msgspec

from gateway.actions import (
    Action,
    CommitOffsets,
    Deliver,
    InFlight,
    LimitHit,
    Message,
    Phase,
    Pull,
    SaveSession,
    Send,
    Subscription,
)
from gateway.codec import PublishTemplate
from gateway.limits import Limit
from gateway.packets import MQTT_5, Pubrel
from gateway.properties import MAX_UINT16, PacketType, encode_properties
from gateway.reasons import ReasonCode

Encoder = Callable[[str, bytes, int, bool, bytes, int], PublishTemplate]
"""``codec.encode_publish_template``'s signature; a node may pass a caching one to share encodings."""

_NO_OFFSET = -1  # the "offset" of an in-flight retained message: not in a queue, never resent after a reconnect


@dataclass(frozen=True, slots=True)
class SessionState:
    """A session as data. ``offsets`` are committed (contiguously acknowledged) queue offsets per
    subscription filter; ``cursors`` where delivery resumes (above it nothing was delivered; below
    it everything not ``inflight`` was acknowledged). Dicts are read-only by convention."""

    client_id: str
    expiry_s: int = 0
    subscriptions: tuple[Subscription, ...] = ()
    offsets: dict[str, int] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)
    awaiting_rel: frozenset[int] = frozenset()
    inflight: tuple[InFlight, ...] = ()
    next_packet_id: int = 1
    will: Message | None = None
    will_delay_s: int = 0


DELIVER_BUDGET = 256
"""Messages one ``pump`` call delivers at most (the next call comes when they are written): the size of one
connection's turn on the node's event loop. A step writes up to four turns in a row (``SYNC_WRITES`` in
gateway/server.py), about one flooded read of small PUBLISHes (gateway/poller.py), so a fan-in subscriber keeps
up with its publishers (at 64, a QoS 0 fan-in subscriber fell seconds behind). Larger turns would lengthen every
other connection's wait while many sessions drain backlogs at once."""


ALIAS_BYTES = 64 * 1024
"""Bytes of topic names a connection's outbound topic aliases may hold: a client may accept 65,535 aliases, and
topics are up to limits.max_topic_length long. Beyond it topics go out by name (an alias is the server's choice)."""


@dataclass(slots=True)
class Link:
    """What delivery needs to know about the connection a session is attached to (set at CONNECT)."""

    protocol_level: int
    receive_maximum: int  # outbound in-flight window (client's Receive Maximum, or the 3.1.1 default)
    max_packet_size: int | None  # the client's Maximum Packet Size; None = no limit
    topic_alias_maximum: int  # outbound aliases the client accepts (0 = none)
    pull_batch: int  # messages per pull, and so the buffer bound per stream
    max_unwritten: int  # QoS 0 messages handed to the socket but not yet written
    commit_every: int  # commit offsets after this many acknowledgements even before the commit timer
    encoder: Encoder
    now_ms: Callable[[], int]
    aliases: dict[str, int] = field(default_factory=dict)  # outbound topic -> alias, for this connection
    alias_bytes: int = 0  # the length of the topics in ``aliases`` (at most ALIAS_BYTES)
    qos0_queue_bytes: int = 0  # QoS 0 bytes handed to the socket but not yet written before new ones drop (0: none)
    report: Callable[[Limit, int, str | None], LimitHit] = LimitHit  # builds the action for a limit hit


@final
class _Stream:
    """Delivery state of one subscription's queue."""

    __slots__ = ("sub", "cursor", "head", "pulling", "buffer", "unacked", "resend", "skip_below")

    def __init__(self, sub: Subscription, cursor: int) -> None:
        self.sub = sub
        self.cursor = cursor  # next offset to pull
        self.head: int | None = None  # queue max offset when known; None: pull to find out
        self.pulling = False
        self.buffer: deque[Message] = deque()
        self.unacked: set[int] = set()  # delivered, not yet acknowledged (or written, QoS 0)
        self.resend: dict[int, int] = {}  # resuming: offset -> packet id to resend with DUP
        # Resuming: offsets below this not in ``resend`` were acknowledged. A shared subscription's group
        # hands out offsets in any order (old ones handed back by other members), so it skips none.
        self.skip_below = cursor if sub.group is None else 0

    def committed(self) -> int:
        if self.unacked:
            return min(self.unacked)
        return max(self.skip_below, self.buffer[0].offset if self.buffer else self.cursor)  # type: ignore[type-var]

    def resume_cursor(self) -> int:
        return max(self.skip_below, self.buffer[0].offset if self.buffer else self.cursor)  # type: ignore[type-var]


@final
class Session:
    """The live session of one client: subscriptions, delivery, packet ids and QoS 2 state.

    Args:
        client_id: the session's client identifier.
        expiry_s: Session Expiry Interval; > 0 makes the session persistent.
        state: a present session to resume (None: a new, empty session).

    Resource handling: holds no resources; ``attach`` binds it to a connection's
    ``Link`` and ``detach`` unbinds it.
    """

    __slots__ = ("client_id", "expiry_s", "awaiting_rel", "_streams", "_inflight", "_next_pid", "_retained",
                 "_written", "_unwritten", "_unwritten_bytes", "_seq", "_link", "_committed", "_acks", "_pump_due",
                 "_by_queue", "_ready")

    def __init__(self, client_id: str, expiry_s: int, state: SessionState | None = None) -> None:
        self.client_id = client_id
        self.expiry_s = expiry_s
        self.awaiting_rel: dict[int, None] = dict.fromkeys(state.awaiting_rel) if state else {}  # a dict as a set: 64 B empty
        """Inbound QoS 2 packet ids stored and PUBREC'd, waiting for PUBREL: a resent PUBLISH is not stored again."""
        self._streams: dict[str, _Stream] = {}
        self._by_queue: dict[str, list[_Stream]] = {}  # the streams reading each queue (shared ones included)
        self._ready: dict[_Stream, None] = {}  # streams with buffered messages or a pull to make, oldest first
        self._inflight: dict[int, InFlight] = {}
        self._next_pid = state.next_packet_id if state else 1
        # Lists, not deques: an idle session keeps both empty, and an empty deque costs 760 B.
        self._retained: list[tuple[Subscription, Message]] = []
        self._written: list[tuple[int, list[tuple[_Stream, int]], int]] = []  # (seq, QoS 0 items, bytes)
        self._unwritten = 0
        self._unwritten_bytes = 0
        self._seq = 0
        self._link: Link | None = None
        self._committed: dict[str, int] = {}
        self._acks = 0
        self._pump_due = False
        if state is not None:
            self._restore(state)

    def _restore(self, state: SessionState) -> None:
        for sub in state.subscriptions:
            committed = state.offsets.get(sub.filter, 0)
            resume = max(state.cursors.get(sub.filter, committed), committed)
            self._add(_Stream(sub, resume))
            self._committed[sub.filter] = committed
        for entry in state.inflight:
            stream = self._streams.get(entry.filter)
            current = stream is not None and entry.offset >= self._committed[entry.filter]
            if entry.phase is Phase.PUBLISHED:
                if not current or stream.sub.group is not None:  # type: ignore[union-attr]
                    # Unsubscribed, acknowledged according to a later commit, or shared: the group took
                    # the message back when this member left and hands it to a connected member.
                    continue
                stream.resend[entry.offset] = entry.packet_id  # type: ignore[union-attr]
                stream.cursor = min(stream.cursor, entry.offset)  # type: ignore[union-attr]
            if current:
                stream.unacked.add(entry.offset)  # type: ignore[union-attr]
            # A PUBREL is owed to the client whatever the offsets say.
            self._inflight[entry.packet_id] = entry

    # --- introspection ------------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        """Does the session outlive the connection (Session Expiry Interval > 0, or 3.1.1 clean session 0)?"""
        return self.expiry_s > 0

    @property
    def subscriptions(self) -> dict[str, Subscription]:
        """Current subscriptions by filter (a copy)."""
        return {name: stream.sub for name, stream in self._streams.items()}

    @property
    def subscription_count(self) -> int:
        return len(self._streams)

    def holds(self, filter: str) -> bool:
        """Is ``filter`` subscribed (without copying the subscriptions)?"""
        return filter in self._streams

    @property
    def inflight(self) -> tuple[InFlight, ...]:
        """Outbound QoS 1/2 messages not yet acknowledged, oldest first."""
        return tuple(self._inflight.values())

    @property
    def commit_pending(self) -> bool:
        """True when acknowledgements arrived since the last ``commit``."""
        return self._acks > 0

    def committed_offsets(self) -> dict[str, int]:
        """The committed offset of every subscription as delivery stands now."""
        return {name: stream.committed() for name, stream in self._streams.items()}

    def state(self, will: Message | None = None, will_delay_s: int = 0) -> SessionState:
        """The session as data, for ``SaveSession`` (retained-message deliveries in flight are not kept).

        A persistent session saves it at every SUBSCRIBE, so this is one pass with ``committed`` and
        ``resume_cursor`` inlined: it costs per subscription held (limits.max_subscriptions bounds that).
        """
        offsets: dict[str, int] = {}
        cursors: dict[str, int] = {}
        for name, stream in self._streams.items():
            buffer = stream.buffer
            cursor = stream.cursor if not buffer else buffer[0].offset
            resume = cursors[name] = cursor if cursor > stream.skip_below else stream.skip_below  # type: ignore[operator]
            offsets[name] = min(stream.unacked) if stream.unacked else resume
        return SessionState(
            client_id=self.client_id,
            expiry_s=self.expiry_s,
            subscriptions=tuple(stream.sub for stream in self._streams.values()),
            offsets=offsets,
            cursors=cursors,
            awaiting_rel=frozenset(self.awaiting_rel),
            inflight=tuple(e for e in self._inflight.values() if e.offset != _NO_OFFSET and e.filter in self._streams),
            next_packet_id=self._next_pid,
            will=will,
            will_delay_s=will_delay_s,
        )

    def save(self, will: Message | None = None, will_delay_s: int = 0) -> list[Action]:
        """``SaveSession`` if the session is persistent, else nothing."""
        return [SaveSession(self.state(will, will_delay_s))] if self.persistent else []

    # --- connection ---------------------------------------------------------------------

    def attach(self, link: Link) -> list[Action]:
        """Bind to a connection: resend PUBRELs owed, then resend in-flight PUBLISHes and deliver."""
        self._link = link
        pubrels = tuple(Pubrel(e.packet_id) for e in self._inflight.values() if e.phase is Phase.RELEASED)
        actions: list[Action] = [Send(pubrels)] if pubrels else []
        return actions + self.pump()

    def detach(self) -> None:
        """Unbind from the connection. QoS 0 messages not yet written count as delivered (at most once)."""
        for _, items, _ in self._written:
            for stream, offset in items:
                stream.unacked.discard(offset)
        self._written.clear()
        self._unwritten = 0
        self._unwritten_bytes = 0
        self._retained.clear()
        self._link = None

    # --- subscriptions ------------------------------------------------------------------

    def subscribe(self, sub: Subscription, start: int) -> bool:
        """Add ``sub`` starting at queue offset ``start``, or replace the options of the same filter.

        Returns:
            True if the subscription is new (a replaced one keeps its position).
        """
        stream = self._streams.get(sub.filter)
        if stream is not None:
            stream.sub = sub
            return False
        self._add(_Stream(sub, start))
        self._committed[sub.filter] = start
        return True

    def unsubscribe(self, filter: str) -> bool:
        """Remove a subscription; its messages still in flight finish their flows. Returns whether it existed."""
        self._committed.pop(filter, None)
        stream = self._streams.pop(filter, None)
        if stream is None:
            return False
        self._ready.pop(stream, None)
        readers = self._by_queue[stream.sub.queue]
        readers.remove(stream)
        if not readers:
            del self._by_queue[stream.sub.queue]
        return True

    def _add(self, stream: _Stream) -> None:
        self._streams[stream.sub.filter] = stream
        self._by_queue.setdefault(stream.sub.queue, []).append(stream)
        self._ready[stream] = None  # its first pull finds where the queue's head is

    # --- delivery -----------------------------------------------------------------------

    def queue_advanced(self, queue: str, max_offset: int) -> list[Action]:
        """A queue has news up to ``max_offset``: streams on it that are idle pull.

        A shared subscription's stream cannot know which messages its group
        will assign it, so news always makes it pull (until an empty answer).
        """
        ready = self._ready
        for stream in self._by_queue.get(queue, ()):
            if stream.sub.group is not None:
                stream.head = None
            elif stream.head is None or stream.head < max_offset:
                stream.head = max_offset
            else:
                continue
            ready[stream] = None
        return self.pump()

    def pulled(self, filter: str, messages: tuple[Message, ...], next_offset: int) -> list[Action]:
        """Messages a ``Pull`` brought; an empty answer means the stream reached the head."""
        stream = self._streams.get(filter)
        if stream is None:
            return []
        stream.pulling = False
        self._ready[stream] = None
        if stream.sub.group is not None:
            # The group hands out messages, old ones a member left unacknowledged included: the cursor
            # follows the group's, no offset is filtered, and news during the pull (head None) pulls again.
            stream.buffer.extend(messages)
            stream.cursor = next_offset
            if messages:
                stream.head = None
            return self.pump()
        fresh = [m for m in messages if m.offset is not None and m.offset >= stream.cursor]
        stream.buffer.extend(fresh)
        if stream.resend:
            returned = {m.offset for m in fresh}
            for offset in [o for o in stream.resend if o < next_offset and o not in returned]:
                # Gone from the store (retention): the in-flight message can never be resent.
                self._inflight.pop(stream.resend.pop(offset), None)
                stream.unacked.discard(offset)
        stream.cursor = max(stream.cursor, next_offset)
        if not fresh:
            stream.head = max(stream.head or 0, stream.cursor)
        return self.pump()

    def retained(self, messages: tuple[tuple[str, Message], ...]) -> list[Action]:
        """Deliver retained messages for new subscriptions (RETAIN set), ahead of queue traffic."""
        for filter, message in messages:
            stream = self._streams.get(filter)
            if stream is not None:
                self._retained.append((stream.sub, message))
        return self.pump()

    def pump(self) -> list[Action]:
        """Deliver what the windows allow and pull for streams that ran dry.

        While the QoS 0 deliveries not yet written add up to ``qos0_queue_bytes``
        or more, further QoS 0 queue messages are dropped (their offsets advance:
        QoS 0 is at most once) and reported, so a slow reader costs bounded memory.

        At most ``DELIVER_BUDGET`` messages go out per call; the write of a
        ``Deliver`` comes back as ``written``, which pumps again. So 10,000
        sessions resuming at once take turns in small steps, and a CONNECT
        arriving meanwhile waits for one round of small steps, not of full windows.
        """
        link = self._link
        if link is None:
            return []
        self._pump_due = False
        chunks: list[bytes] = []
        written: list[tuple[_Stream, int]] = []
        actions: list[Action] = []
        inflight = self._inflight
        window = link.receive_maximum
        unwritten_room = link.max_unwritten - self._unwritten
        queue_limit = link.qos0_queue_bytes
        queued = self._unwritten_bytes
        dropped = 0
        oldest = 0  # the earliest store time of the queue messages delivered now (the latency metric's)
        retained = self._retained
        while retained:
            sub, message = retained[0]
            qos = min(sub.options.qos, message.qos)
            if (qos and len(inflight) >= window) or (not qos and len(written) >= unwritten_room) \
                    or len(chunks) >= DELIVER_BUDGET:
                break
            del retained[0]
            template = self._template(link, message, sub, qos, True)
            if template is not None:
                chunks.append(template.render(self._track(sub.filter, _NO_OFFSET, qos) if qos else None))
        idle: list[_Stream] = []
        for stream in self._ready:
            sub = stream.sub
            buffer = stream.buffer
            while buffer:
                message = buffer[0]
                offset: int = message.offset  # type: ignore[assignment]
                if offset < stream.skip_below:
                    buffer.popleft()
                    pid = stream.resend.pop(offset, None)
                    if pid is not None:
                        self._resend(link, stream, message, pid, chunks)
                    continue
                qos = min(sub.options.qos, message.qos)
                if (qos and len(inflight) >= window) or (not qos and len(written) >= unwritten_room) \
                        or len(chunks) >= DELIVER_BUDGET:
                    break
                buffer.popleft()
                if not qos and queue_limit and queued >= queue_limit:
                    dropped += 1
                    continue
                template = self._template(link, message, sub, qos, sub.options.retain_as_published and message.retain)
                if template is None:
                    continue  # expired, No Local, or too big for the client: skipped, its offset advances
                stream.unacked.add(offset)
                if not oldest or message.store_ms < oldest:
                    oldest = message.store_ms
                if qos:
                    chunks.append(template.render(self._track(sub.filter, offset, qos)))
                else:
                    chunks.append(template.render())
                    written.append((stream, offset))
                    queued += template.size
            if not buffer and not stream.pulling and (stream.head is None or stream.cursor < stream.head):
                stream.pulling = True
                if sub.group is not None:
                    stream.head = stream.cursor  # idle after an empty answer unless news comes meanwhile
                actions.append(Pull(sub.filter, sub.queue, stream.cursor, link.pull_batch, sub.group))
            if not buffer and (stream.pulling or stream.cursor >= stream.head):  # type: ignore[operator]
                idle.append(stream)  # nothing to deliver until a pull answers or news comes
        for stream in idle:
            del self._ready[stream]
        if dropped:
            actions.append(link.report(Limit.QOS0_QUEUE, dropped, f"{dropped} QoS 0 message(s) dropped: {queued} bytes"
                                       f" wait for the socket (limit {queue_limit})"))
        if not chunks:
            return actions
        self._seq += 1
        if written:
            self._written.append((self._seq, written, queued - self._unwritten_bytes))
            self._unwritten += len(written)
            self._unwritten_bytes = queued
        by_qos = [0, 0, 0]
        for chunk in chunks:
            by_qos[chunk[0] >> 1 & 3] += 1  # the QoS bits of the PUBLISH's first byte
        return [Deliver(b"".join(chunks), self._seq, len(chunks), (by_qos[0], by_qos[1], by_qos[2]), oldest),
                *actions]

    def _track(self, filter: str, offset: int, qos: int) -> int:
        pid = self._allocate()
        self._inflight[pid] = InFlight(pid, filter, offset, qos)
        return pid

    def _allocate(self) -> int:
        """The next packet id not in flight (the window guarantees one is free)."""
        pid = self._next_pid
        while pid in self._inflight:
            pid = pid % MAX_UINT16 + 1
        self._next_pid = pid % MAX_UINT16 + 1
        return pid

    def _resend(self, link: Link, stream: _Stream, message: Message, pid: int, chunks: list[bytes]) -> None:
        entry = self._inflight.get(pid)
        if entry is None:
            return
        # A resend is the same message: no expiry check, the QoS it was first sent with.
        template = self._template(link, message, stream.sub, entry.qos, stream.sub.options.retain_as_published
                                  and message.retain, resend=True)
        if template is None:
            del self._inflight[pid]
            stream.unacked.discard(entry.offset)
            return
        chunks.append(template.render(pid, dup=True))

    def _template(
        self, link: Link, message: Message, sub: Subscription, qos: int, retain: bool, *, resend: bool = False
    ) -> PublishTemplate | None:
        """Encode ``message`` for this subscriber, or None if it must not be sent to it."""
        if sub.options.no_local and message.client_id == self.client_id:
            return None
        topic = message.topic
        properties = b""
        new_alias = False
        if link.protocol_level == MQTT_5:
            props = message.properties
            changes: dict[str, object] = {}
            expiry = props.message_expiry_interval
            if expiry is not None:
                waited_ms = max(0, link.now_ms() - message.store_ms) if message.store_ms else 0
                if waited_ms >= expiry * 1000 and not resend:
                    return None
                changes["message_expiry_interval"] = max(1, expiry - waited_ms // 1000)
            wanted_ids = (sub.subscription_id,) if sub.subscription_id else ()
            if props.subscription_identifiers != wanted_ids:
                changes["subscription_identifiers"] = wanted_ids
            # Topic aliases are first come, first served until the client's maximum; a known topic is
            # sent as an empty name plus its alias. A new alias counts only once its packet is sent.
            alias = link.aliases.get(topic)
            new_alias = alias is None and len(link.aliases) < link.topic_alias_maximum \
                and link.alias_bytes + len(topic) <= ALIAS_BYTES
            if new_alias:
                alias = len(link.aliases) + 1
            elif alias is not None:
                topic = ""
            if alias != props.topic_alias:
                changes["topic_alias"] = alias
            if changes:
                props = replace(props, **changes)  # type: ignore[arg-type]
            properties = encode_properties(props, PacketType.PUBLISH)
        template = link.encoder(topic, message.payload, qos, retain, properties, link.protocol_level)
        if link.max_packet_size is not None and template.size > link.max_packet_size:
            return None
        if new_alias:
            link.aliases[message.topic] = alias  # type: ignore[assignment]
            link.alias_bytes += len(message.topic)
        return template

    # --- acknowledgements ---------------------------------------------------------------

    def puback(self, packet_id: int) -> list[Action]:
        """PUBACK from the client: a QoS 1 delivery is done. Unknown ids are ignored (as EMQX does)."""
        entry = self._inflight.get(packet_id)
        if entry is None or entry.qos != 1:
            return []
        del self._inflight[packet_id]
        self._acked(entry)
        return self._after_ack()

    def pubrec(self, packet_id: int, reason: ReasonCode) -> list[Action]:
        """PUBREC from the client: answer PUBREL (or end the flow on a failure reason)."""
        entry = self._inflight.get(packet_id)
        if entry is None or entry.qos != 2:
            if self._link is not None and self._link.protocol_level == MQTT_5:
                return [Send((Pubrel(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),))]
            return [Send((Pubrel(packet_id),))]
        if reason.is_failure:
            del self._inflight[packet_id]
            self._acked(entry)
            return self.pump()
        self._inflight[packet_id] = replace(entry, phase=Phase.RELEASED)
        return [Send((Pubrel(packet_id),))]

    def pubcomp(self, packet_id: int) -> list[Action]:
        """PUBCOMP from the client: a QoS 2 delivery is done."""
        entry = self._inflight.get(packet_id)
        if entry is None or entry.phase is not Phase.RELEASED:
            return []
        del self._inflight[packet_id]
        self._acked(entry)
        return self._after_ack()

    def _after_ack(self) -> list[Action]:
        """Pump now, or, while most of the window is still in flight, at ``pump_due``.

        A client acknowledges a window of messages in one burst. Pumping on each
        acknowledgement made one write of one message per ack; pumping once the
        burst is read (the connection calls ``pump_due`` after each read) makes
        one write for all the room it freed.
        """
        link = self._link
        if link is not None and len(self._inflight) > link.receive_maximum - max(1, link.receive_maximum // 4):
            self._pump_due = True
            return []
        return self.pump()

    def pump_due(self) -> list[Action]:
        """The pump acknowledgements deferred (``_after_ack``), if any."""
        return self.pump() if self._pump_due else []

    def written(self, up_to: int) -> list[Action]:
        """Deliveries up to ``seq`` reached the socket: their QoS 0 messages are done."""
        while self._written and self._written[0][0] <= up_to:
            _, items, size = self._written.pop(0)
            self._unwritten -= len(items)
            self._unwritten_bytes -= size
            for stream, offset in items:
                stream.unacked.discard(offset)
            self._acks += len(items)
        return self.pump()

    def _acked(self, entry: InFlight) -> None:
        stream = self._streams.get(entry.filter)
        if stream is not None:
            stream.unacked.discard(entry.offset)
        self._acks += 1

    def commit_due(self) -> bool:
        """Enough acknowledgements piled up to commit without waiting for the commit timer."""
        return self._link is not None and self._acks >= self._link.commit_every

    def commit(self) -> list[Action]:
        """``CommitOffsets`` for every subscription whose committed offset moved since the last commit."""
        self._acks = 0
        moved = {}
        for name, stream in self._streams.items():
            offset = stream.committed()
            if self._committed.get(name) != offset:
                moved[name] = self._committed[name] = offset
        return [CommitOffsets(self.client_id, moved)] if moved else []


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SessionState)


def encode_session(state: SessionState) -> bytes:
    """The session as the blob the store keeps (msgpack: no pickle, readable by any version that knows the fields)."""
    return _ENCODER.encode(state)


def decode_session(blob: bytes) -> SessionState:
    """Raises msgspec.DecodeError (a ValueError) on a blob that is not a session."""
    return _DECODER.decode(blob)


def merge_committed(state: SessionState, committed: Mapping[str, int]) -> SessionState:
    """The session with the queues' committed offsets (queue -> offset) where they are ahead of its own.

    A blob is saved on subscription changes and disconnects, offsets are
    committed on acknowledgements: after a crash the blob can be older than
    the commits, and replaying from it would resend acknowledged messages.
    Shared subscriptions are skipped: their group owns the offset.
    """
    offsets = dict(state.offsets)
    cursors = dict(state.cursors)
    for sub in state.subscriptions:
        offset = committed.get(sub.queue)
        if sub.group is None and offset is not None and offset > offsets.get(sub.filter, 0):
            offsets[sub.filter] = offset
            cursors[sub.filter] = max(cursors.get(sub.filter, offset), offset)
    if offsets == state.offsets:
        return state
    return replace(state, offsets=offsets, cursors=cursors)
