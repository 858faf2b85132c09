"""MQTT sessions: the state that outlives a connection, and the delivery engine that feeds a connected client.

``SessionState`` (``gateway/mqtt/actions.py``, which carries it) is the session
as data: what a persistent session stores (``SaveSession``) and what a resumed
or taken-over session starts from.
``Session`` is the live, mutable session of one connected client. It does no
I/O: its methods return actions (``gateway/mqtt/actions.py``).

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
(acknowledged out of order before the disconnect).

After a crash there is no clean save, and the store's committed offsets win.
Packet ids make that exact ([MQTT-4.4.0-1]): a persistent session gives each
non-shared QoS 1/2 subscription a *lane* of ``LANE_PIDS`` packet ids, and the
message at queue offset o always goes out with id ``lane * LANE_PIDS + o %
LANE_PIDS``. A stream sends offset o only while o < d + ``LANE_PIDS``, where d
is its committed offset as of the last session save known to be written
(``SaveSession`` with a ref, answered by ``saved``): so after a crash every
message that may have been sent lies in [c, c + ``LANE_PIDS``) (c, the
committed offset found, is at least d) and no two of them share an id. That
range is sent again with DUP=1 and the same ids; a QoS 2 message whose PUBREC
was recorded goes as PUBREL instead. The save that moves d comes every
``LANE_PIDS`` / 2 messages of a stream (not per message). A QoS 2 PUBREC costs
one save before its PUBREL goes out (saves in flight gather the PUBRECs that
arrive meanwhile), and a QoS 2 message completed above the committed offset is
kept in the saved state until the offset passes it, so a crash never makes it
be sent as a new PUBLISH. Retained messages and shared subscriptions take ids
from a pool (1..``LANE_PIDS`` - 1) and are resent after a crash only as at
least once, with new ids; so is a subscription beyond the ``LANES`` lanes.

A shared subscription (``$share/<group>/<filter>``) reads its group's queue by POP (docs/consumer-groups.md,
"MQTT shared subscriptions"): each message pulled comes with a receipt handle, kept with the buffered message and
then with its in-flight entry; the handle is acknowledged to the group when the message is done for this member
(QoS 0: handed to the socket; QoS 1: PUBACK; QoS 2: PUBREC, from which the client owns it and only its PUBREL
is resent) or skipped, with the offset commits (``CommitOffsets.acks``), which then come after each event, not
on the commit timer. What the session holds when its connection closes is given back to the group at once
(``receipts``); after a gateway crash the group hands it out again when its invisible time passes. A shared
stream pops at most what its window can send now, and ``SHARED_POP``.

Persistence is not a separate class: whether the session is persistent is
``expiry_s > 0``, which a DISCONNECT may change (>0 to 0) mid-session, so one
class decides per call whether ``SaveSession`` is emitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol, final

import msgspec
from msgspec.structs import replace as with_fields

from gateway.mqtt.actions import (
    NOT_IN_LOG,
    Action,
    CommitOffsets,
    Deliver,
    InFlight,
    LimitHit,
    Message,
    PatchSession,
    Phase,
    Pull,
    SavedSubscription,
    SaveSession,
    Send,
    SessionState,
    Subscription,
)
from gateway.mqtt.limits import Limit
from gateway.mqtt.lazy import made, made_on_first_use
from gateway.mqtt.packets import MQTT_5, Pubrel
from gateway.mqtt.properties import MAX_UINT16
from gateway.mqtt.reasons import ReasonCode, RemoteProtocolError
from gateway.mqtt.template import PublishTemplate
from store.api import MAIN_LOG, Position, session_parts


_NO_OFFSET = -1  # the "offset" of an in-flight retained message: not in a queue, never resent after a reconnect

LANE_PIDS = 512
"""Packet ids per lane (see the module docstring): also the most messages of one subscription in flight, and how
far delivery may run ahead of the last saved committed offset, whatever the client's window. 512 keeps a
subscription busy while a save made halfway through the lane is written, and leaves room for ``LANES`` lanes."""

LANES = MAX_UINT16 // LANE_PIDS
"""Lanes 1..127 use ids 512..65535; ids 1..511 are the pool of retained and shared deliveries."""

POOL_PIDS = LANE_PIDS - 1

SHARED_POP = 32
"""Messages a shared subscription pops at most at once: each is invisible to the group's other members until this
one delivers it, so a fast member takes a small share at a time and the others get the rest (store.clients.pop's
default, for the same reason)."""


DELIVER_BUDGET = 1024
"""Messages one ``pump`` call delivers at most (the next call comes when they are written): the size of one
connection's turn on the node's event loop. A step writes up to four turns in a row (``SYNC_WRITES`` in
gateway/node/connection.py). A turn is one pull's worth (``pull_batch``), so a session draining a backlog from
the store still writes one pull per step, as when a turn was 256 and a step four of them; what a turn of 1,024
adds is for messages already in memory: a QoS 1 fan-in subscriber's window, freed by a read of its PUBACKs or
filled by a read round's news (about 830 PUBLISHes), goes out in the step that freed or brought them. At 256,
such a step wrote 1,024 and left the rest to later steps (each one read round of the node later): a message
waited a median 138 ms between its read and its delivery, 77 ms at 1,024 (docs/benchmarks.md, "QoS 1 fan-in:
where a message's time goes"). At 64, a QoS 0 fan-in subscriber fell seconds behind."""


ALIAS_BYTES = 64 * 1024
"""Bytes of topic names a connection's outbound topic aliases may hold: a client may accept 65,535 aliases, and
topics are up to limits.max_topic_length long. Beyond it topics go out by name (an alias is the server's choice)."""


class LinkOwner(Protocol):
    """The connection a ``Link`` belongs to (its channel): its clock and its limit-hit actions, reached through one
    reference rather than two bound methods kept per connection (64 B each, issue 31)."""

    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch, as store times."""
        ...

    def limit_hit(self, limit: Limit, count: int, detail: str | None) -> LimitHit:
        """The action reporting ``count`` hits of ``limit`` (``detail``: the log line's text, if one is due)."""
        ...


NO_ALIASES: Mapping[str, int] = MappingProxyType({})
"""The outbound topic aliases of a link that has sent none (most: a 3.1.1 client can take none)."""


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
    owner: LinkOwner  # the channel: its clock and limit-hit actions
    aliases: dict[str, int] | None = None  # outbound topic -> alias, for this connection (made at the first)
    alias_bytes: int = 0  # the length of the topics in ``aliases`` (at most ALIAS_BYTES)
    qos0_queue_bytes: int = 0  # delivery bytes handed to the socket, unwritten, before new QoS 0 ones drop (0: none)
    max_unwritten_bytes: int = 0  # delivery bytes handed to the socket, unwritten, before delivery stops (0: none)
    may_read: Callable[[str], bool] | None = None  # the ACL's delivery check (topic -> readable); None: all are
    since_ms: int = 0  # when the connection's CONNECT came (ms since the epoch, as store times): interval 0's cut


@final
class _Stream:
    """Delivery state of one subscription's queue."""

    __slots__ = ("sub", "cursor", "head", "pulling", "buffer", "unacked", "resend", "skip_below", "lane", "durable",
                 "dup_below", "completed", "handles")

    def __init__(self, sub: Subscription, cursor: int, lane: int = 0, head: int | None = None) -> None:
        self.sub = sub
        self.cursor = cursor  # next offset to pull
        self.head = head  # queue max offset when known; None: pull to find out
        self.pulling = False
        # Pulled messages not yet delivered: a deque from the first pull that brings some (an empty one is 624 B, and
        # a session may hold thousands of subscriptions that never get a message: issue 31).
        self.buffer: deque[Message] | tuple[()] = ()
        # Delivered, not yet acknowledged (or written, QoS 0): a dict used as a set, as a dict of ints is never
        # tracked by the garbage collector (a set always is: 50,000 subscriptions, 50,000 more objects for every
        # full collection to walk; and an empty set is 216 B, an empty dict 64 B).
        self.unacked: dict[int, None] = {}
        # Resuming: offset -> packet id to resend with DUP; made by the resume that has some (None: none, as for
        # every new subscription: 64 B less each, issue 31).
        self.resend: dict[int, int] | None = None
        # Resuming: offsets below this not in ``resend`` were acknowledged. A shared subscription's group
        # hands out offsets in any order (old ones handed back by other members), so it skips none.
        self.skip_below = cursor if sub.group is None else 0
        self.lane = lane  # its lane of packet ids (0: ids from the pool)
        self.durable: int | None = None  # committed offset of the last save known written (None: none yet)
        self.dup_below = 0  # after a crash: offsets below may have been sent, they go again with DUP=1
        self.completed: set[int] | None = None  # QoS 2 offsets completed at or above the committed offset
        # A shared subscription's buffered messages' receipt handles by queue offset (None: not shared). A
        # buffered offset without one is a second copy (the group handed it out again): dropped.
        self.handles: dict[int, str] | None = {} if sub.group is not None else None

    def fill(self, messages: Sequence[Message]) -> None:
        """Buffer pulled ``messages``."""
        if isinstance(self.buffer, deque):
            self.buffer.extend(messages)
        elif messages:
            self.buffer = deque(messages)

    def pid(self, offset: int) -> int:
        """The packet id of the message at ``offset`` in this stream's lane."""
        return self.lane * LANE_PIDS + offset % LANE_PIDS

    def committed(self) -> int:
        if self.unacked:
            return min(self.unacked)
        return max(self.skip_below, self.buffer[0].offset if self.buffer else self.cursor)  # type: ignore[type-var]

    def resume_cursor(self) -> int:
        return max(self.skip_below, self.buffer[0].offset if self.buffer else self.cursor)  # type: ignore[type-var]


@final
class _Saving:
    """What the write of a save or patch settles (``Session.saved``): lanes' committed offsets, PUBRELs, and the
    SUBACKs and UNSUBACKs held for it with the retained messages that follow them."""

    __slots__ = ("durable", "pubrels", "held")

    def __init__(self, durable: list[tuple[_Stream, int]], pubrels: Sequence[int],
                 held: Sequence[tuple[Send, tuple[tuple[str, Message], ...]]]) -> None:
        self.durable = durable
        self.pubrels = pubrels
        self.held = held


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
                 "_saves", "_next_ref", "_pubrel_due", "_need_save", "_by_queue", "_ready", "_lanes", "_lane_floor",
                 "_pop_acks", "_pop_releases", "_patch_due", "_held", "_whole_due")

    awaiting_rel: dict[int, Position]
    """Inbound QoS 2 packet id -> position of its record (``NOT_IN_LOG``: unknown to the store), stored
    and PUBREC'd, waiting for PUBREL: a resent PUBLISH is not stored again."""
    # Made at their first use (gateway/mqtt/lazy.py), as awaiting_rel: an idle device's session keeps them empty.
    _streams: dict[str, _Stream]
    # The shared subscriptions' streams reading each queue. An unshared one is found in ``_streams`` by its queue
    # (its filter): a list per subscription was one more object for the garbage collector to walk (issue 31).
    _by_queue: dict[str, list[_Stream]]
    _written: list[tuple[int, list[tuple[_Stream, int]], int]]  # (seq, QoS 0 items, bytes); not a deque (760 B)
    _committed: dict[str, int]
    # Read by every delivery (pump): made by the first one, which a session without subscriptions never makes.
    _ready: dict[_Stream, None]  # streams with buffered messages or a pull to make, oldest first
    _inflight: dict[int, InFlight]
    _retained: list[tuple[Subscription, Message]]  # a list, not a deque: an empty deque costs 760 B
    __getattr__ = made_on_first_use({"awaiting_rel": dict, "_streams": dict, "_by_queue": dict, "_written": list,
                                     "_committed": dict, "_ready": dict, "_inflight": dict, "_retained": list})

    def __init__(self, client_id: str, expiry_s: int, state: SessionState | None = None) -> None:
        self.client_id = client_id
        self.expiry_s = expiry_s
        self._next_pid = state.next_packet_id if state else 1
        self._lanes: dict[int, int] | None = None  # lane -> streams holding it (made at the first lane)
        self._lane_floor = 1  # every lane below it is held (``_free_lane`` looks from here)
        self._unwritten = 0
        self._unwritten_bytes = 0
        self._seq = 0
        self._link: Link | None = None
        self._acks = 0
        self._pump_due = False
        # Made at the first save: most sessions never save while connected (an empty dict is 64 B each).
        self._saves: dict[int, _Saving] | None = None  # ref -> what its write settles
        self._held: list[tuple[Send, tuple[tuple[str, Message], ...]]] | None = None  # acks for the next write
        self._next_ref = 0
        self._pubrel_due: Sequence[int] = ()  # PUBRELs waiting for a save that records their PUBREC
        self._need_save = False  # a stream waits for (or will soon need) a save of its committed offset
        self._patch_due: dict[str, None] | None = None  # filters changed while a save was written, for the next patch
        # The next write is a whole save, not a patch: until one, the stored blob says the session is detached (a
        # new session's is saved so at its CONNECT, a resumed one's at its last close), and a restore after a crash
        # reads that flag to resend from the committed offsets with DUP [MQTT-4.4.0-1], not from a patch's cursor.
        self._whole_due = True
        # Shared subscriptions' receipt handles to acknowledge, and to give back, at the next commit (None: none).
        self._pop_acks: list[str] | None = None
        self._pop_releases: list[str] | None = None
        if state is not None:
            self._restore(state)

    def _restore(self, state: SessionState) -> None:
        self.awaiting_rel = dict.fromkeys(state.awaiting_rel, NOT_IN_LOG) | state.awaiting
        crashed = not state.detached
        for sub in state.subscriptions:
            committed = state.offsets.get(sub.filter, 0)
            lane = state.lanes.get(sub.filter, 0) if sub.group is None and sub.options.qos > 0 else 0
            resume = committed if crashed and lane else max(state.cursors.get(sub.filter, committed), committed)
            stream = _Stream(sub, resume, lane)
            self._add(stream)
            if lane:
                stream.durable = committed  # the store's, or a saved blob's: written
                stream.dup_below = committed + LANE_PIDS if crashed else 0
            self._committed[sub.filter] = committed
        for stream in self._streams.values():
            if not stream.lane and self._wants_lane(stream.sub):
                self._take_lane(stream)  # a blob without lanes: usable once a save records it
        for entry in state.inflight:
            stream = self._streams.get(entry.filter)
            current = stream is not None and entry.offset >= self._committed[entry.filter]
            if stream is not None and stream.lane and stream.durable is not None:
                # By lane: the ids follow the offsets. Below the committed offset a flow is complete (PUBCOMP
                # came before the commit); after a crash the PUBLISHes go again by offset, the PUBRELs here.
                if not current or (crashed and entry.phase is Phase.PUBLISHED):
                    continue
                entry = with_fields(entry, packet_id=stream.pid(entry.offset))
            if entry.phase is Phase.PUBLISHED:
                if not current or stream.sub.group is not None:  # type: ignore[union-attr]
                    # Unsubscribed, acknowledged according to a later commit, or shared: the group took
                    # the message back when this member left and hands it to a connected member.
                    continue
                if stream.resend is None:
                    stream.resend = {}
                stream.resend[entry.offset] = entry.packet_id
                stream.cursor = min(stream.cursor, entry.offset)  # type: ignore[union-attr]
            if current:
                stream.unacked[entry.offset] = None  # type: ignore[union-attr]
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
        return len(self._streams) if made(self, "_streams") else 0

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

    def receipts(self) -> tuple[list[str], list[str]]:
        """The shared subscriptions' receipt handles when the connection closes, then forgotten: those done and not
        committed yet (to acknowledge), and those still held (in flight or buffered: to give back to the group, so
        another member gets them now rather than after their invisible time; resuming, the session does not send
        them again)."""
        acks, held = self._pop_acks or [], self._pop_releases or []
        self._pop_acks = self._pop_releases = None
        for entry in self._inflight.values():
            if entry.handle is not None:
                held.append(entry.handle)
                entry.handle = None
        for stream in self._streams.values():
            if stream.handles:
                held += stream.handles.values()
                stream.handles.clear()
                stream.buffer = ()
        return acks, held

    def _pop_ack(self, handle: str) -> None:
        """A shared subscription's message is done for this member: acknowledged to its group at the next commit."""
        if self._pop_acks is None:
            self._pop_acks = []
        self._pop_acks.append(handle)
        self._acks += 1

    def state(self, *, resumable: bool = False) -> SessionState:
        """The session as data, for ``SaveSession`` (retained-message deliveries in flight are not kept).

        QoS 2 messages completed at or above a stream's committed offset are
        listed as released (their PUBREL goes again after a crash, never their
        PUBLISH); the ones below it are forgotten here. ``resumable``: only what
        a resume after a crash reads (a save while connected), without the
        PUBLISHes in flight by lane, which a crash resends by offset: a save
        every half lane then costs little more than the subscriptions.
        """
        offsets = self.committed_offsets()
        streams = self._streams
        inflight = [e for e in self._inflight.values() if e.offset != _NO_OFFSET and e.filter in streams and not (
            resumable and e.phase is Phase.PUBLISHED and streams[e.filter].lane)]
        for name, stream in self._streams.items():
            if stream.completed:
                stream.completed = {o for o in stream.completed if o >= offsets[name]}
                inflight += (InFlight(stream.pid(o), name, o, 2, Phase.RELEASED) for o in sorted(stream.completed))
        return SessionState(
            client_id=self.client_id,
            expiry_s=self.expiry_s,
            subscriptions=tuple(stream.sub for stream in self._streams.values()),
            offsets=offsets,
            cursors={name: stream.resume_cursor() for name, stream in self._streams.items()},
            awaiting_rel=frozenset(pid for pid, offset in self.awaiting_rel.items() if offset == NOT_IN_LOG),
            inflight=tuple(inflight),
            next_packet_id=self._next_pid,
            awaiting={pid: offset for pid, offset in self.awaiting_rel.items() if offset != NOT_IN_LOG},
            lanes={name: stream.lane for name, stream in self._streams.items() if stream.lane},
            detached=self._link is None,
        )

    def save(self) -> list[Action]:
        """``SaveSession`` if the session is persistent, else nothing; while attached, one to be answered
        (``saved``), so that what it records may be relied on once it is written."""
        if not self.persistent:
            return []
        if self._link is None:
            return [SaveSession(self.state())]
        if self._saves:  # one is being written: the next follows its answer (``saved``), with all changed meanwhile
            self._need_save = True
            return []
        return [self._save_action()]

    def patch(self, filters: Iterable[str], ack: Send | None = None,
              retained: tuple[tuple[str, Message], ...] = ()) -> list[Action]:
        """``PatchSession`` of ``filters`` (subscribed or replaced now, or unsubscribed) if the session is
        persistent: what a SUBSCRIBE changed, without the whole state (saved whole by the next ``save``). ``ack``
        (its SUBACK) and the ``retained`` messages of its new subscriptions go once that is written, so a session
        restored after a crash has every subscription acknowledged [MQTT-3.8.4-3]. While a save or patch is being
        written, the filters wait and go together in the next one (``saved``)."""
        due = self._patch_due if self._patch_due is not None else {}
        due.update(dict.fromkeys(filters))
        now = [ack] if ack is not None else []
        if not self.persistent or not due or self._link is None:
            self._patch_due = due or None
            save = [SaveSession(self.state())] if self.persistent and due and self._link is None else []
            return [*save, *now, *self.retained(retained)]
        if ack is not None:
            held = self._held if self._held is not None else []
            held.append((ack, retained))
            self._held = held
        if self._saves:
            self._patch_due = due
            return []
        return [self._patch_action(due)]

    def _patch_action(self, filters: Iterable[str]) -> PatchSession | SaveSession:
        if self._whole_due:
            return self._save_action()
        streams = self._streams
        parts: dict[str, SavedSubscription | None] = {}
        durable: list[tuple[_Stream, int]] = []
        for name in filters:
            stream = streams.get(name)
            if stream is None:
                parts[name] = None
                continue
            offset = stream.committed()
            parts[name] = SavedSubscription(stream.sub, stream.lane, offset, stream.resume_cursor())
            if stream.lane:
                durable.append((stream, offset))
        self._patch_due = None
        return PatchSession(self.client_id, parts, len(streams), self._written_ref(durable, ()))

    def _save_action(self) -> SaveSession:
        state = self.state(resumable=True)
        streams = self._streams
        ref = self._written_ref([(streams[name], offset) for name, offset in state.offsets.items()
                                 if streams[name].lane], self._pubrel_due)
        self._pubrel_due = ()
        self._need_save = False
        self._patch_due = None  # the state holds them
        self._whole_due = False
        return SaveSession(state, ref)

    def _written_ref(self, durable: list[tuple[_Stream, int]], pubrels: Sequence[int]) -> int:
        """The ref of a save or patch made now: what its answer (``saved``) settles, the acknowledgements held
        for it included (it holds every change made so far)."""
        self._next_ref += 1
        if self._saves is None:
            self._saves = {}
        self._saves[self._next_ref] = _Saving(durable, pubrels, self._held or ())
        self._held = None
        return self._next_ref

    def saved(self, ref: int) -> list[Action]:
        """A ``SaveSession`` or ``PatchSession`` of this session is written: its committed offsets bound the lanes,
        the PUBRELs its PUBRECs waited for and the SUBACKs and UNSUBACKs held for it go out (with the retained
        messages of their subscriptions), and delivery goes on."""
        saving = self._saves.pop(ref, None) if self._saves else None
        if saving is None or self._link is None:
            return []
        for stream, offset in saving.durable:
            if stream.durable is None or offset > stream.durable:
                stream.durable = offset
        inflight = self._inflight
        owed = tuple(Pubrel(pid) for pid in saving.pubrels
                     if pid in inflight and inflight[pid].phase is Phase.RELEASED)
        actions: list[Action] = [Send(owed)] if owed else []
        for ack, retained in saving.held:
            actions.append(ack)
            self._hold_retained(retained)
        if self._pubrel_due and not self._saves:
            actions.append(self._save_action())
        if self._patch_due and not self._saves and not self._need_save:
            actions.append(self._patch_action(self._patch_due))
        return actions + self.pump()

    # --- connection ---------------------------------------------------------------------

    def attach(self, link: Link) -> list[Action]:
        """Bind to a connection: resend PUBRELs owed, then resend in-flight PUBLISHes and deliver."""
        self._link = link
        if not (made(self, "_inflight") or made(self, "_streams") or made(self, "_retained")):
            return []  # a new session: nothing to resend or deliver (its containers stay unmade while it idles)
        pubrels = tuple(Pubrel(e.packet_id) for e in self._inflight.values() if e.phase is Phase.RELEASED)
        actions: list[Action] = [Send(pubrels)] if pubrels else []
        return actions + self.pump()

    def detach(self) -> None:
        """Unbind from the connection. QoS 0 messages not yet written count as delivered (at most once)."""
        for _, items, _ in self._written:
            for stream, offset in items:
                stream.unacked.pop(offset, None)
        self._written.clear()
        self._unwritten = 0
        self._unwritten_bytes = 0
        self._retained.clear()
        self._saves = None  # their answers are not awaited: the next connection resumes from the saved state
        self._pubrel_due = ()
        self._patch_due = self._held = None  # the save at the close holds them; no acknowledgement goes now
        self._whole_due = True  # that save says detached
        self._link = None

    # --- subscriptions ------------------------------------------------------------------

    def subscribe(self, sub: Subscription, start: int, *, at_head: bool = False) -> bool:
        """Add ``sub`` starting at queue offset ``start``, or replace the options of the same filter. ``at_head``:
        the queue has nothing from ``start`` on until news says so (``queue_advanced``): no first pull.

        Returns:
            True if the subscription is new (a replaced one keeps its position).
        """
        stream = self._streams.get(sub.filter)
        if stream is not None:
            stream.sub = sub
            if not stream.lane and self._wants_lane(sub):
                self._take_lane(stream)
            return False
        stream = _Stream(sub, start, self._free_lane() if self._wants_lane(sub) else 0,
                         start if at_head and sub.group is None else None)
        self._add(stream)
        self._committed[sub.filter] = start
        return True

    def unsubscribe(self, filter: str) -> bool:
        """Remove a subscription; its messages still in flight finish their flows. Returns whether it existed."""
        self._committed.pop(filter, None)
        stream = self._streams.pop(filter, None)
        if stream is None:
            return False
        if stream.handles:  # its buffered messages go back to the group (those in flight finish their flows)
            self._pop_releases = [*(self._pop_releases or ()), *stream.handles.values()]
            self._acks += 1
        self._ready.pop(stream, None)
        if stream.lane:
            self._hold_lane(stream.lane, -1)
        if stream.sub.group is not None:
            readers = self._by_queue[stream.sub.queue]
            readers.remove(stream)
            if not readers:
                del self._by_queue[stream.sub.queue]
        return True

    def _add(self, stream: _Stream) -> None:
        if stream.lane:
            self._hold_lane(stream.lane, 1)
        self._streams[stream.sub.filter] = stream
        if stream.sub.group is not None:
            self._by_queue.setdefault(stream.sub.queue, []).append(stream)
        if stream.head is None:
            self._ready[stream] = None  # its first pull finds where the queue's head is

    def _wants_lane(self, sub: Subscription) -> bool:
        """Does ``sub`` send by lane: a persistent session's non-shared QoS 1/2 subscription."""
        return self.persistent and sub.group is None and sub.options.qos > 0

    def _hold_lane(self, lane: int, streams: int) -> None:
        """``streams`` more (or fewer) streams hold ``lane``."""
        lanes = self._lanes
        if lanes is None:
            lanes = self._lanes = {}
        held = lanes.get(lane, 0) + streams
        if held > 0:
            lanes[lane] = held
        else:
            lanes.pop(lane, None)
            self._lane_floor = min(self._lane_floor, lane)

    def _take_lane(self, stream: _Stream) -> None:
        stream.lane = self._free_lane()
        if stream.lane:
            self._hold_lane(stream.lane, 1)

    def _free_lane(self) -> int:
        """The lowest lane no stream and no message in flight uses; 0 (the pool) when every lane is taken.

        The streams' lanes are counted as they change (``_hold_lane``), not collected: with every lane taken a
        SUBSCRIBE costs the same at 1,000 subscriptions held as at 200; nor are the lanes below the lowest one
        released (``_lane_floor``) looked at again: the 127th SUBSCRIBE costs what the first does."""
        held = self._lanes or {}
        if len(held) >= LANES:
            return 0
        lane = self._lane_floor
        while lane in held:
            lane += 1
        self._lane_floor = lane
        if not self._inflight:
            return lane
        used = {pid // LANE_PIDS for pid in self._inflight}
        return next((free for free in range(lane, LANES + 1) if free not in held and free not in used), 0)

    # --- delivery -----------------------------------------------------------------------

    def queue_advanced(self, queue: str, max_offset: int) -> list[Action]:
        """A queue has news up to ``max_offset``: streams on it that are idle pull.

        A shared subscription's stream cannot know which messages its group
        will assign it, so news always makes it pull (until an empty answer).
        """
        ready = self._ready
        streams: Sequence[_Stream] = self._by_queue.get(queue, ())
        own = self._streams.get(queue)  # the unshared subscription on the queue: its filter is the queue's name
        if own is not None and own.sub.group is None:
            streams = (own, *streams)
        for stream in streams:
            if stream.sub.group is not None:
                stream.head = None
            elif stream.head is None or stream.head < max_offset:
                stream.head = max_offset
            else:
                continue
            ready[stream] = None
        return self.pump()

    def pulled(self, filter: str, messages: tuple[Message, ...], next_offset: int,
               handles: tuple[str, ...] = ()) -> list[Action]:
        """Messages a ``Pull`` brought; an empty answer means the stream reached the head. A shared
        subscription's come with their receipt ``handles``."""
        stream = self._streams.get(filter)
        if stream is None:
            return []
        stream.pulling = False
        self._ready[stream] = None
        if stream.handles is not None:
            # The group hands out messages, old ones another member did not acknowledge included: no offset is
            # filtered, and news during the pull (head None) pulls again. The cursor stays the subscription's
            # start: it only places a group that has no offset yet.
            for message, handle in zip(messages, handles, strict=True):
                stream.handles[message.offset] = handle  # type: ignore[index]
            stream.fill(messages)
            if messages:
                stream.head = None
            return self.pump()
        # A queue's messages come in offset order: when the first is new, all are (no filtering list per pull).
        fresh: Sequence[Message] = messages if messages and messages[0].offset is not None \
            and messages[0].offset >= stream.cursor else [m for m in messages
                                                          if m.offset is not None and m.offset >= stream.cursor]
        stream.fill(fresh)
        resend = stream.resend
        if resend:
            returned = {m.offset for m in fresh}
            for offset in [o for o in resend if o < next_offset and o not in returned]:
                # Gone from the store (retention): the in-flight message can never be resent.
                self._inflight.pop(resend.pop(offset), None)
                stream.unacked.pop(offset, None)
        stream.cursor = max(stream.cursor, next_offset)
        if not fresh:
            stream.head = max(stream.head or 0, stream.cursor)
        return self.pump()

    def retained(self, messages: tuple[tuple[str, Message], ...]) -> list[Action]:
        """Deliver retained messages for new subscriptions (RETAIN set), ahead of queue traffic."""
        self._hold_retained(messages)
        return self.pump()

    def _hold_retained(self, messages: tuple[tuple[str, Message], ...]) -> None:
        for filter, message in messages:
            stream = self._streams.get(filter)
            if stream is not None:
                self._retained.append((stream.sub, message))

    def pump(self) -> list[Action]:
        """Deliver what the windows allow and pull for streams that ran dry.

        While the deliveries not yet written add up to ``max_unwritten_bytes`` or
        more, nothing more is delivered until the socket takes them (``written``):
        a client that does not read costs that buffer, its messages of any QoS
        wait in their queues. While they add up to ``qos0_queue_bytes`` or more,
        further QoS 0 queue messages are dropped (their offsets advance: QoS 0 is
        at most once) and reported.

        At most ``DELIVER_BUDGET`` messages go out per call; the write of a
        ``Deliver`` comes back as ``written``, which pumps again. So 10,000
        sessions resuming at once take turns in small steps, and a CONNECT
        arriving meanwhile waits for one round of small steps, not of full windows.
        """
        link = self._link
        if link is None:
            return []
        self._pump_due = False
        chunks: list[bytes] = []  # the parts of the packets written
        sent = 0
        by_qos = [0, 0, 0]
        written: list[tuple[_Stream, int]] = []
        actions: list[Action] = []
        inflight = self._inflight
        window = link.receive_maximum
        unwritten_room = link.max_unwritten - self._unwritten
        queue_limit = link.qos0_queue_bytes
        queued = self._unwritten_bytes
        byte_cap = link.max_unwritten_bytes or 1 << 62  # 0: no cap
        dropped = 0
        oldest = 0  # the earliest store time of the queue messages delivered now (the latency metric's)
        retained = self._retained
        while retained:
            sub, message = retained[0]
            qos = min(sub.options.qos, message.qos)
            if (qos and len(inflight) >= window) or (not qos and len(written) >= unwritten_room) \
                    or sent >= DELIVER_BUDGET or queued >= byte_cap:
                break
            pid = self._allocate() if qos else None
            if qos and pid is None:
                break  # every id of the pool is in flight
            del retained[0]
            size = self._write(link, message, sub, qos, True, chunks, pid, retained=True)
            if size:
                if pid is not None:
                    inflight[pid] = InFlight(pid, sub.filter, _NO_OFFSET, qos)
                sent += 1
                by_qos[qos] += 1
                queued += size
        idle: list[_Stream] = []
        level = link.protocol_level
        me = self.client_id
        for stream in self._ready:
            sub = stream.sub
            buffer = stream.buffer
            lane = stream.lane
            options = sub.options
            most = options.qos  # the delivered QoS is the lower of the message's and this [MQTT-3.8.4-8]
            # Hoisted per stream: does a message with no expiry go out with nothing of this subscriber's patched
            # in (``PublishTemplate.write_plain``): no ACL filter, size limit, identifier or alias to apply.
            plain = link.may_read is None and link.max_packet_size is None \
                and (level != MQTT_5 or not (sub.subscription_id or link.topic_alias_maximum))
            while buffer:
                message = buffer[0]
                offset: int = message.offset  # type: ignore[assignment]
                if offset < stream.skip_below:
                    buffer.popleft()
                    pid = stream.resend.pop(offset, None) if stream.resend else None
                    if pid is not None and self._resend(link, stream, message, pid, chunks):
                        sent += 1
                        by_qos[self._inflight[pid].qos] += 1
                    continue
                handles = stream.handles
                if handles is not None and offset not in handles:
                    buffer.popleft()  # a second copy: the group handed it out again before this one went
                    continue
                qos = message.qos
                if qos > most:  # not min(): a builtin call per message
                    qos = most
                if (qos and len(inflight) >= window) or (not qos and len(written) >= unwritten_room) \
                        or sent >= DELIVER_BUDGET or queued >= byte_cap:
                    break
                pid = None
                if qos:
                    if lane:
                        if not self._in_lane(stream, offset):
                            break
                        pid = stream.pid(offset)
                        if offset < stream.dup_below and self._released(stream, pid, offset):
                            buffer.popleft()  # its PUBREC was recorded: the PUBREL went out at attach
                            continue
                        if pid in inflight:
                            break  # the id is still in flight (ids a blob of an earlier version gave out)
                    else:
                        pid = self._allocate()
                        if pid is None:
                            break  # every id of the pool is in flight
                buffer.popleft()
                handle = handles.pop(offset) if handles is not None else None
                if offset < stream.dup_below:
                    # After a crash it may have gone out already, with this id: again, with DUP (at least once).
                    if not qos:
                        continue  # QoS 0 is at most once
                    if self._write(link, message, sub, qos, sub.options.retain_as_published and message.retain,
                                   chunks, pid, dup=True, resend=True):
                        stream.unacked[offset] = None
                        inflight[pid] = InFlight(pid, sub.filter, offset, qos)  # type: ignore[index,arg-type]
                        sent += 1
                        by_qos[qos] += 1
                    continue
                size = 0
                if not qos and queue_limit and queued >= queue_limit:
                    dropped += 1
                elif plain and message.properties.message_expiry_interval is None:
                    # The common delivery, what ``_write`` would do in one call: No Local [MQTT-3.8.3-3], then the
                    # shared packet with RETAIN as published or not [MQTT-3.3.1-12, 13] and this packet id.
                    if not (options.no_local and message.client_id == me):
                        size = (message.template or _template(message)).write_plain(
                            chunks, level, qos, options.retain_as_published and message.retain, pid)
                else:
                    size = self._write(link, message, sub, qos, options.retain_as_published and message.retain,
                                       chunks, pid)
                if not size or not qos:
                    if handle is not None:  # done for this member: QoS 0 goes at most once, a skip is final
                        self._pop_ack(handle)
                    if not size:
                        continue  # dropped, expired, not readable, too big for the client: skipped, offset advances
                stream.unacked[offset] = None
                sent += 1
                by_qos[qos] += 1
                if not oldest or message.store_ms < oldest:
                    oldest = message.store_ms
                if qos:
                    inflight[pid] = InFlight(pid, sub.filter, offset, qos,  # type: ignore[index,arg-type]
                                             handle=handle)
                else:
                    written.append((stream, offset))
                queued += size
            if not buffer and not stream.pulling and (stream.head is None or stream.cursor < stream.head):
                count = link.pull_batch
                if sub.group is not None:
                    count = min(count, SHARED_POP)
                    if sub.options.qos:  # a POP: what the window can send now (the rest stays with the group)
                        count = min(count, window - len(inflight))
                        if count < 1:
                            continue  # an acknowledgement pumps again
                    stream.head = stream.cursor  # idle after an empty answer unless news comes meanwhile
                stream.pulling = True
                actions.append(Pull(sub.filter, sub.queue, stream.cursor, count, sub.group))
            if not buffer and (stream.pulling or stream.cursor >= stream.head):  # type: ignore[operator]
                idle.append(stream)  # nothing to deliver until a pull answers or news comes
        for stream in idle:
            del self._ready[stream]
        if dropped:
            actions.append(link.owner.limit_hit(Limit.QOS0_QUEUE, dropped, f"{dropped} QoS 0 message(s) dropped: "
                                                f"{queued} bytes wait for the socket (limit {queue_limit})"))
        if self._need_save and not self._saves:
            actions.append(self._save_action())
        if not sent:
            return actions
        self._seq += 1
        self._written.append((self._seq, written, queued - self._unwritten_bytes))
        self._unwritten += len(written)
        self._unwritten_bytes = queued
        return [Deliver(b"".join(chunks), self._seq, sent, (by_qos[0], by_qos[1], by_qos[2]), oldest),
                *actions]

    def _in_lane(self, stream: _Stream, offset: int) -> bool:
        """May ``offset`` go out by the stream's lane now: is it below the saved committed offset + ``LANE_PIDS``?
        Asks for a save when the stream is there or halfway, and acknowledgements moved its committed offset."""
        if not self.persistent:
            return True  # nothing resumes it after a crash (a persistent session's lane resumed by one that is not)
        durable = stream.durable
        if durable is None or offset >= durable + LANE_PIDS:
            if not self._saves and (durable is None or stream.committed() > durable):
                self._need_save = True
            return False
        if offset >= durable + LANE_PIDS // 2 and not self._need_save and not self._saves \
                and stream.committed() > durable:
            self._need_save = True
        return True

    def _released(self, stream: _Stream, pid: int, offset: int) -> bool:
        """Is the QoS 2 message at ``offset`` past its PUBREC: PUBREL sent, or the flow complete?"""
        entry = self._inflight.get(pid)
        if entry is not None and entry.offset == offset and entry.phase is Phase.RELEASED:
            return True
        return stream.completed is not None and offset in stream.completed

    def _allocate(self) -> int | None:
        """The next packet id not in flight: of the pool in a persistent session (the lanes have the others),
        of them all otherwise (its window guarantees one is free); None when the pool is all in flight."""
        limit = POOL_PIDS if self.expiry_s > 0 else MAX_UINT16  # ``persistent``, without a property call
        pid = self._next_pid if self._next_pid <= limit else 1
        if pid not in self._inflight:  # acknowledged in order: the next id is free, no search
            self._next_pid = pid + 1 if pid < limit else 1
            return pid
        for _ in range(limit):
            if pid not in self._inflight:
                self._next_pid = pid % limit + 1
                return pid
            pid = pid % limit + 1
        return None

    def _resend(self, link: Link, stream: _Stream, message: Message, pid: int, chunks: list[bytes]) -> bool:
        """Write the message in flight with ``pid`` again, with DUP; False when it is no longer sent (forgotten)."""
        entry = self._inflight.get(pid)
        if entry is None:
            return False
        # A resend is the same message: no expiry check, the QoS it was first sent with.
        if self._write(link, message, stream.sub, entry.qos, stream.sub.options.retain_as_published
                       and message.retain, chunks, pid, dup=True, resend=True):
            return True
        del self._inflight[pid]
        stream.unacked.pop(entry.offset, None)
        return False

    def _write(
        self, link: Link, message: Message, sub: Subscription, qos: int, retain: bool, out: list[bytes],
        pid: int | None, *, dup: bool = False, resend: bool = False, retained: bool = False,
    ) -> int:
        """Write ``message`` for this subscriber to ``out`` (as parts of its packet) and return the packet's size;
        0 if it must not be sent to it.

        The message's template (``Message.template``) is made by the first session that delivers it and shared
        by every other: a subscriber adds its flags, packet id and own properties.

        Message expiry (MQTT 5.0 section 3.3.2.3.3): a message whose Message Expiry Interval has passed before its
        delivery to this subscriber started is not sent [MQTT-3.3.2-5], one that goes out carries the interval
        minus the whole seconds it waited [MQTT-3.3.2-6]. An interval of 0 is a lifetime of none: the message goes
        to the subscribers connected when it was stored (their delivery starts as it is stored; ``Link.since_ms``)
        with an interval of 0, and to no one later: not to a session that connects afterwards, nor as a retained
        message (``retained``: a retained-message delivery at subscribe time). A resend (``resend``) is the
        delivery that already started: never expired. The rule binds the server whatever the subscriber's
        protocol: a 3.1.1 subscriber is not sent what has expired either (without the property).
        """
        if sub.options.no_local and message.client_id == self.client_id:
            return 0
        if link.may_read is not None and not link.may_read(message.topic):
            return 0  # a wildcard overlapping an ACL deny rule: the denied topics are withheld
        template = _template(message)
        level = link.protocol_level
        expiry = message.properties.message_expiry_interval
        if expiry is not None:  # a 5.0 publisher's interval binds the server for every subscriber, 3.1.1 too
            waited_ms = max(0, link.owner.now_ms() - message.store_ms) if message.store_ms else 0
            if not resend and (waited_ms >= expiry * 1000 if expiry
                               else retained or message.store_ms < link.since_ms):
                return 0
            expiry = max(1, expiry - waited_ms // 1000) if expiry else 0
        block = None
        alias = None
        new_alias = by_alias = False
        if level == MQTT_5:
            # Topic aliases are first come, first served until the client's maximum; a known topic is
            # sent as an empty name plus its alias. A new alias counts only once its packet is sent.
            if link.topic_alias_maximum:
                topic = message.topic
                aliases = link.aliases or NO_ALIASES
                alias = aliases.get(topic)
                new_alias = alias is None and len(aliases) < link.topic_alias_maximum \
                    and link.alias_bytes + len(topic) <= ALIAS_BYTES
                if new_alias:
                    alias = len(aliases) + 1
                by_alias = alias is not None and not new_alias
            if expiry is not None or sub.subscription_id or alias is not None:
                block = template.patched(expiry, (sub.subscription_id,) if sub.subscription_id else (), alias)
        head = template.head(level, qos, retain, dup, block, by_alias)
        if link.max_packet_size is not None \
                and template.size(head, level, qos, block, by_alias) > link.max_packet_size:
            return 0
        if new_alias:
            if link.aliases is None:
                link.aliases = {}
            link.aliases[message.topic] = alias  # type: ignore[assignment]
            link.alias_bytes += len(message.topic)
        return template.write(out, head, level, pid, block, by_alias)

    # --- acknowledgements ---------------------------------------------------------------

    def puback(self, packet_id: int) -> list[Action]:
        """PUBACK from the client: a QoS 1 delivery is done (``puback_run`` of one)."""
        return self.puback_run((packet_id,))

    def puback_run(self, packet_ids: Iterable[int]) -> list[Action]:
        """PUBACKs from the client, in the order read: each QoS 1 delivery is done; unknown ids are ignored (as EMQX
        does). A subscriber's read holds tens of them: the pump and the commit check they call for come once for
        all (``_after_ack``), not once a PUBACK, and each costs its in-flight entry's removal only.

        Raises:
            RemoteProtocolError: an id is in flight in a QoS 2 flow (``_wrong_ack``); the ids before it are done.
        """
        inflight = self._inflight
        streams = self._streams
        name = None
        unacked: dict[int, None] = {}
        done = 0
        try:
            for packet_id in packet_ids:
                entry = inflight.get(packet_id)
                if entry is None:
                    continue
                if entry.qos != 1:
                    raise _wrong_ack("PUBACK", packet_id, entry)
                del inflight[packet_id]
                if entry.handle is not None:  # a failure reason too: not sent to another member [MQTT-4.8.2-6]
                    self._pop_ack(entry.handle)
                if entry.filter != name:  # a run is mostly one subscription's: its stream found once
                    name = entry.filter
                    stream = streams.get(name)
                    unacked = stream.unacked if stream is not None else {}
                unacked.pop(entry.offset, None)
                done += 1
        finally:
            self._acks += done
        return self._after_ack() if done else []

    def pubrec(self, packet_id: int, reason: ReasonCode) -> list[Action]:
        """PUBREC from the client: answer PUBREL (or end the flow on a failure reason).

        A persistent session records the PUBREC first (a save: after a crash
        the message is released, not published again), gathering the PUBRECs
        that arrive while a save is being written into the next one.
        """
        entry = self._inflight.get(packet_id)
        if entry is None:
            if self._link is not None and self._link.protocol_level == MQTT_5:
                return [Send((Pubrel(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),))]
            return [Send((Pubrel(packet_id),))]
        if entry.qos != 2:
            raise _wrong_ack("PUBREC", packet_id, entry)
        if entry.handle is not None:
            # The client has the message (or refused it: not sent to another member [MQTT-4.8.2-6]): from here
            # only its PUBREL is owed, which needs no message, so the group is done with it.
            self._pop_ack(entry.handle)
            entry.handle = None
        if reason.is_failure:
            del self._inflight[packet_id]
            self._acked(entry)
            return self.pump()
        if entry.phase is Phase.RELEASED:  # the PUBREC again: PUBREL again, unless a save is about to send it
            waiting = packet_id in self._pubrel_due or any(packet_id in saving.pubrels
                                                           for saving in (self._saves or {}).values())
            return [] if waiting else [Send((Pubrel(packet_id),))]
        self._inflight[packet_id] = with_fields(entry, phase=Phase.RELEASED)
        if not self.persistent or entry.offset == _NO_OFFSET:
            return [Send((Pubrel(packet_id),))]  # nothing a crash could resume
        due = self._pubrel_due if isinstance(self._pubrel_due, list) else []  # the empty tuple is shared: 0 B
        due.append(packet_id)
        self._pubrel_due = due
        return [] if self._saves else [self._save_action()]

    def pubcomp(self, packet_id: int) -> list[Action]:
        """PUBCOMP from the client: a QoS 2 delivery is done. Unknown ids are ignored.

        Raises:
            RemoteProtocolError: the id is in flight but no PUBREL was sent for it (``_wrong_ack``).
        """
        entry = self._inflight.get(packet_id)
        if entry is None:
            return []
        if entry.phase is not Phase.RELEASED:
            raise _wrong_ack("PUBCOMP", packet_id, entry)
        del self._inflight[packet_id]
        stream = self._streams.get(entry.filter)
        if stream is not None and stream.lane and entry.offset != _NO_OFFSET:
            if stream.completed is None:
                stream.completed = set()
            stream.completed.add(entry.offset)
        self._acked(entry)
        return self._after_ack()

    def _after_ack(self) -> list[Action]:
        """Pump now, or, while most of the window is still in flight, at ``pump_due``; not at all while nothing
        waits for the room (no stream ready, no retained message, no save due).

        A client acknowledges a window of messages in one burst. Pumping on each
        acknowledgement made one write of one message per ack; pumping once the
        burst is read (the connection calls ``pump_due`` after each read) makes
        one write for all the room it freed. A subscriber that keeps up has
        nothing waiting when its acknowledgements come (its news are delivered
        when they come): a pump per acknowledgement was work for nothing.
        """
        if not (self._ready or self._retained or self._need_save):
            return []
        link = self._link
        if link is not None and len(self._inflight) > link.receive_maximum - max(1, link.receive_maximum // 4):
            self._pump_due = True
            return []
        return self.pump()

    def pump_due(self) -> list[Action]:
        """The pump acknowledgements deferred (``_after_ack``), if any."""
        return self.pump() if self._pump_due else []

    def written(self, up_to: int) -> list[Action]:
        """Deliveries up to ``seq`` reached the socket: their QoS 0 messages are done, their bytes no longer wait."""
        while self._written and self._written[0][0] <= up_to:
            _, items, size = self._written.pop(0)
            self._unwritten -= len(items)
            self._unwritten_bytes -= size
            for stream, offset in items:
                stream.unacked.pop(offset, None)
            self._acks += len(items)
        return self.pump()

    def _acked(self, entry: InFlight) -> None:
        stream = self._streams.get(entry.filter)
        if stream is not None:
            stream.unacked.pop(entry.offset, None)
        self._acks += 1

    def commit_due(self) -> bool:
        """Enough acknowledgements piled up to commit without waiting for the commit timer, or a shared
        subscription's receipt handles wait: they go after the packet that made them (their invisible time runs,
        and the packets read at once go in one commit)."""
        return self._link is not None and (self._acks >= self._link.commit_every or bool(self._pop_acks)
                                           or bool(self._pop_releases))

    def commit(self) -> list[Action]:
        """``CommitOffsets`` for every subscription whose committed offset moved since the last commit."""
        self._acks = 0
        moved = {}
        for name, stream in self._streams.items():
            if stream.handles is not None:
                continue  # shared: its group keeps the offset, its messages are acknowledged by handle
            offset = stream.committed()
            if self._committed.get(name) != offset:
                moved[name] = self._committed[name] = offset
        acks, releases = self._pop_acks or (), self._pop_releases or ()
        self._pop_acks = self._pop_releases = None
        if not (moved or acks or releases):
            return []
        return [CommitOffsets(self.client_id, moved, tuple(acks), tuple(releases))]


def _template(message: Message) -> PublishTemplate:
    """The message's template (``Message.template``): made by the first session that delivers it, shared by every
    other."""
    template = message.template
    if template is None:
        template = message.template = PublishTemplate(message.topic, message.payload, message.properties)
    return template


def _wrong_ack(kind: str, packet_id: int, entry: InFlight) -> RemoteProtocolError:
    """A client acknowledgement that does not belong to the flow its packet id is in: the client answers a QoS 1
    PUBLISH with PUBACK, a QoS 2 one with PUBREC and its PUBREL with PUBCOMP (4.3.2, 4.3.3), so this is a
    protocol violation the connection is closed for (3.1.1 [MQTT-4.8.0-1]; 5.0 section 4.13: 0x82)."""
    flow = "a QoS 1 PUBLISH" if entry.qos == 1 else \
        "a QoS 2 PUBLISH after its PUBREL" if entry.phase is Phase.RELEASED else "a QoS 2 PUBLISH"
    return RemoteProtocolError(ReasonCode.PROTOCOL_ERROR, f"{kind} for packet id {packet_id}, which is {flow}")


BLOB_VERSION = 2
"""The session blob's format (``encode_session``). 2: each stream of a subscription is keyed by (filter, log),
since a wildcard filter's queue has offsets per log, and positions carry their log. A blob without a version is
1: ``SessionState``'s fields as they were, every offset in the store's one log."""


class SavedStream(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A saved subscription's stream over one log: the committed ``offset`` of ``filter``'s queue in ``log`` and
    the ``cursor`` delivery resumes at (None: not saved: the state had none for the filter)."""

    filter: str
    log: int
    offset: int | None = None
    cursor: int | None = None


class SavedInFlight(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An ``InFlight`` as saved: its queue offset with the log it is in."""

    packet_id: int
    filter: str
    log: int
    offset: int
    qos: int
    phase: Phase = Phase.PUBLISHED


class _Blob(msgspec.Struct, kw_only=True):
    """A session blob (version ``v``); a map, so a later version adds fields with defaults."""

    v: int = BLOB_VERSION
    client_id: str
    expiry_s: int = 0
    subscriptions: tuple[Subscription, ...] = ()
    streams: list[SavedStream] = []
    lanes: dict[str, int] = {}
    awaiting_rel: frozenset[int] = frozenset()
    inflight: tuple[SavedInFlight, ...] = ()
    next_packet_id: int = 1
    awaiting: dict[int, Position] = {}
    detached: bool = False


class _BlobV1(msgspec.Struct):
    """A blob of version 1 (no ``v``): ``SessionState`` as it was, offsets by filter, ``awaiting`` by offset."""

    client_id: str
    expiry_s: int = 0
    subscriptions: tuple[Subscription, ...] = ()
    offsets: dict[str, int] = {}
    cursors: dict[str, int] = {}
    awaiting_rel: frozenset[int] = frozenset()
    inflight: tuple[InFlight, ...] = ()
    next_packet_id: int = 1
    awaiting: dict[int, int] = {}
    lanes: dict[str, int] = {}
    detached: bool = False


class _Version(msgspec.Struct):
    """A blob's version alone (its other fields skipped): version 1 had no ``v``."""

    v: int = 1


_ENCODER = msgspec.msgpack.Encoder()
_VERSION = msgspec.msgpack.Decoder(_Version)
_DECODERS = {1: msgspec.msgpack.Decoder(_BlobV1), BLOB_VERSION: msgspec.msgpack.Decoder(_Blob)}


def encode_session(state: SessionState) -> bytes:
    """The session as the blob the store keeps: msgpack (no pickle), a map of named fields, ``BLOB_VERSION``.

    The state reads the store's one log (``MAIN_LOG``): its streams and in-flight offsets are saved as that log's.
    """
    offsets, cursors = state.offsets, state.cursors
    streams = [SavedStream(f, MAIN_LOG, offset, cursors.get(f)) for f, offset in offsets.items()]
    streams += [SavedStream(f, MAIN_LOG, None, cursor) for f, cursor in cursors.items() if f not in offsets]
    return _ENCODER.encode(_Blob(
        client_id=state.client_id, expiry_s=state.expiry_s, subscriptions=state.subscriptions, streams=streams,
        lanes=state.lanes, awaiting_rel=state.awaiting_rel,
        inflight=tuple(SavedInFlight(e.packet_id, e.filter, MAIN_LOG, e.offset, e.qos, e.phase)
                       for e in state.inflight),
        next_packet_id=state.next_packet_id, awaiting=state.awaiting, detached=state.detached))


_PART = msgspec.msgpack.Decoder(SavedSubscription)


def encode_parts(parts: Mapping[str, SavedSubscription | None]) -> dict[str, bytes]:
    """``PatchSession``'s parts as the store keeps them (``StoreApi.patch_session``): empty for an unsubscription."""
    return {name: b"" if part is None else _ENCODER.encode(part) for name, part in parts.items()}


def decode_session(stored: bytes) -> SessionState:
    """The session a stored blob of any version holds, with the parts patched since it was saved
    (``PatchSession``): each part replaces its subscription (options, lane, offset, cursor), or removes it.

    Raises:
        msgspec.DecodeError: (a ValueError) the blob is not a session, is of a version this code does not know,
            or has positions in a log other than ``MAIN_LOG`` (a store of several logs: a later version's).
    """
    blob, parts = session_parts(stored)
    state = _decode_blob(blob)
    return _patched(state, {name: _PART.decode(part) if part else None for name, part in parts.items()}) \
        if parts else state


def _patched(state: SessionState, parts: Mapping[str, SavedSubscription | None]) -> SessionState:
    """``state`` with ``parts`` (filter -> its subscription now, None: unsubscribed) over its subscriptions. The
    messages in flight of a filter stay (resuming reads them by offset), an unsubscribed one's go, as in a save."""
    subscriptions = {sub.filter: sub for sub in state.subscriptions}
    offsets, cursors, lanes = dict(state.offsets), dict(state.cursors), dict(state.lanes)
    for name, part in parts.items():
        if part is None:
            for kept in (subscriptions, offsets, cursors, lanes):
                kept.pop(name, None)
            continue
        subscriptions[name] = part.sub  # a replaced one keeps its place
        offsets[name], cursors[name] = part.offset, part.cursor
        if part.lane:
            lanes[name] = part.lane
        else:
            lanes.pop(name, None)
    inflight = tuple(e for e in state.inflight if e.filter in subscriptions)
    return replace(state, subscriptions=tuple(subscriptions.values()), offsets=offsets, cursors=cursors,
                   lanes=lanes, inflight=inflight)


def _decode_blob(blob: bytes) -> SessionState:
    version = _VERSION.decode(blob).v
    decoder = _DECODERS.get(version)
    if decoder is None:
        raise msgspec.DecodeError(f"session blob of version {version}: this version reads {sorted(_DECODERS)}")
    saved = decoder.decode(blob)
    if isinstance(saved, _BlobV1):
        return SessionState(
            saved.client_id, saved.expiry_s, saved.subscriptions, saved.offsets, saved.cursors, saved.awaiting_rel,
            saved.inflight, saved.next_packet_id, {pid: Position(MAIN_LOG, o) for pid, o in saved.awaiting.items()},
            saved.lanes, saved.detached)
    logs = {s.log for s in saved.streams} | {e.log for e in saved.inflight} | {p.log for p in saved.awaiting.values()}
    if logs - {MAIN_LOG}:
        raise msgspec.DecodeError(f"session blob with positions in logs {sorted(logs)}: this store has one log")
    return SessionState(
        saved.client_id, saved.expiry_s, saved.subscriptions,
        offsets={s.filter: s.offset for s in saved.streams if s.offset is not None},
        cursors={s.filter: s.cursor for s in saved.streams if s.cursor is not None},
        awaiting_rel=saved.awaiting_rel,
        inflight=tuple(InFlight(e.packet_id, e.filter, e.offset, e.qos, e.phase) for e in saved.inflight),
        next_packet_id=saved.next_packet_id, awaiting=saved.awaiting, lanes=saved.lanes, detached=saved.detached)


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


def clamp_to_heads(state: SessionState, heads: Mapping[str, int]) -> tuple[SessionState, dict[str, tuple[int, int]]]:
    """The session with every offset and cursor past its queue's head (queue -> max offset) pulled back to it,
    and what moved (filter -> (from, to)).

    Only after the store lost records it had acknowledged (a power loss under the async flush policy: the
    store pulls its own offsets back at start, docs/storage.md): the records appended next reuse those queue
    offsets, and a session resuming past them would skip them. In-flight PUBLISHes at or past the head were
    lost with the log and are dropped; a PUBREL owed stays. Shared subscriptions are skipped: their group
    owns the offset.
    """
    offsets = dict(state.offsets)
    cursors = dict(state.cursors)
    moved: dict[str, tuple[int, int]] = {}
    for sub in state.subscriptions:
        head = heads.get(sub.queue)
        if sub.group is not None or head is None:
            continue
        offset = offsets.get(sub.filter, 0)
        cursor = cursors.get(sub.filter, offset)
        if max(offset, cursor) > head:
            moved[sub.filter] = (max(offset, cursor), head)
            offsets[sub.filter] = min(offset, head)
            cursors[sub.filter] = min(cursor, head)
    if not moved:
        return state, moved
    inflight = tuple(e for e in state.inflight if not (e.filter in moved and e.phase is Phase.PUBLISHED
                                                        and e.offset >= moved[e.filter][1]))
    return replace(state, offsets=offsets, cursors=cursors, inflight=inflight), moved


def session_blob_expiry(blob: bytes) -> int:
    """The Session Expiry Interval the stored session ``blob`` was saved with (0 if it is unreadable): the store
    asks it of the blobs its client ledger has no entry for (``store.node.open_store``)."""
    try:
        return decode_session(blob).expiry_s
    except msgspec.DecodeError:
        return 0


def clamp_session_blob(blob: bytes, max_offset: Callable[[str], int]) -> bytes | None:
    """The stored session ``blob`` with its positions pulled back to its queues' heads (``max_offset(queue)``),
    or None if none is past them (or the blob is unreadable: resuming reports that). The store runs it over
    every blob after a power loss (``store.node.open_store``), when the heads are those of the recovered log:
    later, the records appended meanwhile would hide that a position had been past the end."""
    try:
        state = decode_session(blob)
    except msgspec.DecodeError:
        return None
    state, moved = clamp_to_heads(state, {sub.queue: max_offset(sub.queue) for sub in state.subscriptions})
    return encode_session(state) if moved else None
