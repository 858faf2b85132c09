"""The publish path of a node: its connections' ``Append`` actions, and its own messages, to the store.

Two ways, in trio's pairing (store/api.py): an append the store can take without waiting (embedded, async flush,
dispatch not lagging) is done in the step that read its PUBLISH, no worker task: read in a poller round
(``ReadRound``, gateway/node/poller.py; a stream's read, or a polled socket's backlog after a pause, is a round of
its own: ``Poller.alone``) it joins the round's appends, which go to the store in one
``append_nowait`` call when the poller ends the round, before any other task runs; if the store would block, each
connection's appends go back to the head of its worker queue and take the other way: the connection's worker
hands them to ``perform``, which awaits ``append`` (one batch per worker step). Either way every append with a
``ref`` is answered (``Appended``): never a false acknowledgement.

Order: an append read while a subscription to a filter matching its topic read before it (on any connection) is not
applied yet never takes the fast way; it waits behind an ``AfterReads`` mark (gateway/node/order.py), for every
activation read before it. The node's own appends (wills,
``$SYS``, HTTP publish) wait for the fences open when they are made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, final

import trio

from gateway.mqtt.actions import Append, Appended, Event
from gateway.mqtt.reasons import ReasonCode
from gateway.node.order import ReadOrder
from gateway.node.poller import ReadRound
from store.api import (DelayedCapExceeded, LeaseLost, LogFullError, MessageChain, NewMessage, PayloadRun, Position,
                       Positions, RecordTooLarge, StoreApi, batch_groups)

if TYPE_CHECKING:
    from gateway.node.connection import Connection

__all__ = ["Appends", "NOWAIT_RETRY_S"]

LOGGER = logging.getLogger(__name__)

NOWAIT_RETRY_S = 0.1
"""After the store said an append would block (a remote store always does; the sync flush policy; dispatch
lagging), appends take the awaited way for this long before the fast way is tried again: a read round does not
gather appends only to hand each back to its connection."""


@final
class Appends:
    """The publish path (see the module docstring).

    Args:
        store: where messages go.
        order: the read order of activations and appends.
    """

    def __init__(self, store: StoreApi, order: ReadOrder) -> None:
        self._store = store
        self._order = order
        self._blocked_until = 0.0  # the store would block: the fast way waits until then
        self._round: list[tuple[Connection, Append]] = []  # the poller's round's, for one write when it ends
        self.refused_by_qos = [0, 0, 0]  # messages the store did not take (a full disk...), index = QoS

    # --- the fast way -----------------------------------------------------------------------

    def now(self, connection: Connection, action: Append, in_round: bool) -> bool:
        """Append in this step, or in the store call that ends the poller's round (``in_round``: read in one);
        False leaves it, and any error, to :meth:`perform`. The round's first append asks the store for all of
        them (per message, that was 3% of a fan-in's CPU). The channel asked the ACL already."""
        order = self._order  # an activation of a filter matching it read before it is not applied yet: ``perform``
        if order.fenced and any([order.fences(m.topic) for m in action.messages]):  # waits for it
            return False
        if action.messages[0].deliver_at_ms:  # a delayed message waits for its client's cap: ``perform`` stores it
            return False
        if in_round and self._round:
            self._round.append((connection, action))
            return True
        if time.monotonic() < self._blocked_until:
            return False
        if in_round:
            self._round.append((connection, action))
            return True
        return self._append_now([(connection, action)])

    def round_end(self, _: ReadRound) -> bool:
        """The poller ended a round (its ``round_done``): its appends in one store call, or, if the store would
        block, each connection's back to the head of its queue of node actions (``perform`` answers them).
        Returns whether the round appended in this step."""
        appends = self._round
        if not appends:
            return False
        self._round = []
        if self._append_now(appends):
            return True
        grouped: dict[Connection, list[Append]] = {}
        for connection, append in appends:
            grouped.setdefault(connection, []).append(append)
        for connection, actions in grouped.items():
            connection.requeue(actions)
        return False

    def _append_now(self, appends: list[tuple[Connection, Append]]) -> bool:
        """Append now and acknowledge, one write per connection; False: nothing was appended."""
        try:
            parts = [append.messages for _, append in appends]
            # A read's QoS 0 run (a ``PayloadRun``) stays one part of a chain, no message made each; without one
            # (a QoS 1 round: an append per message) the flat list costs the store less per message.
            positions = self._store.append_nowait(MessageChain(parts) if any([type(p) is PayloadRun for p in parts])
                                                  else [m for part in parts for m in part])
        except trio.WouldBlock:
            self._blocked_until = time.monotonic() + NOWAIT_RETRY_S
            return False
        except (OSError, ValueError):
            return False  # nothing was appended: ``perform`` tries again and answers with the reason
        acknowledged: dict[Connection, list[Event]] = {}  # QoS 0 appends (no ref) wait for no answer
        index = 0
        for connection, append in appends:
            if append.ref is not None:
                acknowledged.setdefault(connection, []).append(
                    Appended(append.ref, True, ReasonCode.SUCCESS, positions[index]))
            index += len(append.messages)
        for connection, events in acknowledged.items():
            connection.feed_all(events)
        return True

    def mark(self) -> int | None:
        """The read-order mark for an append read now and left to ``perform``; None when nothing waits."""
        return self._order.mark() if self._order.fenced else None

    # --- the awaited way ----------------------------------------------------------------------

    async def perform(self, connection: Connection, appends: list[Append]) -> None:
        """Append a connection's consecutive appends as one batch; answer each in order."""
        positions, unknown = await self._stored([m for append in appends for m in append.messages])
        if isinstance(positions, ReasonCode) and not unknown and positions is not ReasonCode.SESSION_TAKEN_OVER \
                and (len(appends) > 1 or _run(appends[0])):
            # One bad message must not fail its neighbours: retry one by one so each gets its own answer (a QoS 0
            # run's messages too: they are one append, not one message). Not when the store went away with the
            # call in flight: the messages may be stored, and a retry would store them twice (a QoS 2 duplicate,
            # [MQTT-4.3.3]); each is refused, and its publisher sends it again. Nor when the client is another
            # node's now (``LeaseLost``): that refusal is the connection's, not a message's, and a retry that
            # meets the client after it left that node (present nowhere) would store again what its publisher
            # resent and completed there (the QoS 2 duplicates of bench failover).
            for append in appends:
                for one in ([Append(None, (m,)) for m in append.messages] if _run(append) else [append]):
                    await self.perform(connection, [one])
            return
        connection.feed_all(_answers(appends, positions))

    async def store(self, messages: Sequence[NewMessage], *, count: bool = True) -> Positions | ReasonCode:
        """The messages' positions once appended, or why the append failed.

        A failure counts the messages in ``refused_by_qos`` (unless ``count`` is False: a retry). A full disk is
        QUOTA_EXCEEDED and not logged here: the store logs the episode once (store/space.py), not once per
        publish. Messages of a client of an ended store lease are SESSION_TAKEN_OVER (the client is another
        node's now).
        """
        return (await self._stored(messages, count=count))[0]

    async def _stored(self, messages: Sequence[NewMessage], *,
                      count: bool = True) -> tuple[Positions | ReasonCode, bool]:
        """:meth:`store`, and whether a failure leaves the outcome unknown (the store became unreachable with the
        call sent: the messages may be stored) rather than nothing appended."""
        try:
            return await self._store.append(messages), False
        except (OSError, ValueError) as exc:
            return self._refused(exc, messages if count else ())

    def _refused(self, exc: Exception, messages: Sequence[NewMessage]) -> tuple[ReasonCode, bool]:
        """Why an append failed, and whether its outcome is unknown (:meth:`_stored`); ``messages`` are counted
        in ``refused_by_qos``."""
        unknown = False
        if isinstance(exc, RecordTooLarge):
            LOGGER.warning("append refused: %s", exc)
            reason = ReasonCode.PACKET_TOO_LARGE
        elif isinstance(exc, (LogFullError, DelayedCapExceeded)):
            reason = ReasonCode.QUOTA_EXCEEDED
        elif isinstance(exc, LeaseLost):
            reason = ReasonCode.SESSION_TAKEN_OVER
        elif isinstance(exc, ConnectionError):  # the store is unreachable: its client logs that once
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            unknown = True
        else:
            LOGGER.error("append failed: %r", exc)
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        for message in messages:
            self.refused_by_qos[message.qos] += 1
        return reason, unknown

    async def own(self, messages: Sequence[NewMessage], *, count: bool = True) -> ReasonCode | None:
        """Append the node's own messages (wills, ``$SYS``, HTTP publish), durable under the sync flush policy,
        after the activations read before this call; None, or why it failed."""
        positions = await self.own_stored(messages, count=count)
        return positions if isinstance(positions, ReasonCode) else None

    async def own_stored(self, messages: Sequence[NewMessage], *, count: bool = True) -> Positions | ReasonCode:
        """:meth:`own`, answering where the messages were stored (an HTTP publish of a delayed message: its id)."""
        await self._order.wait(self._order.mark())
        return await self.store(messages, count=count)

    async def own_each(self, messages: Sequence[NewMessage]) -> list[Position | ReasonCode]:
        """:meth:`own` of messages that fail alone (an HTTP bulk publish's): one append (one CommitLog write, one
        flush under the sync policy) for all, its same-topic runs as batch records, in groups that the store
        refuses alone (``store.api.batch_groups``: one message too large, a delayed one over its cap, fails by
        itself). Per message: where it was stored (a delayed message's id), or why not."""
        await self._order.wait(self._order.mark())
        indexes, batched = batch_groups(messages, self._store.max_record_bytes)
        try:
            results = await self._store.append_groups([[messages[i] for i in group] for group in indexes],
                                                      batched=batched)
        except (OSError, ValueError) as exc:  # the store went away with the call in flight: maybe stored, refused
            return [self._refused(exc, messages)[0]] * len(messages)
        outcomes: dict[int, Position | ReasonCode] = {}
        for group, result in zip(indexes, results):
            if isinstance(result, Exception):
                reason = self._refused(result, [messages[i] for i in group])[0]
                outcomes.update((i, reason) for i in group)
            else:
                outcomes.update(zip(group, result))
        return [outcomes[i] for i in range(len(messages))]


def _run(append: Append) -> bool:
    """Whether ``append`` is several QoS 0 messages (a read's run: ``Channel.handle_repeats``), answered by nothing."""
    return append.ref is None and len(append.messages) > 1


def _answers(appends: Sequence[Append], positions: Positions | ReasonCode) -> list[Event]:
    """``Appended`` for each append with a ref: where the store put it, or why it did not."""
    answers: list[Event] = []
    index = 0
    for append in appends:
        if append.ref is not None:
            if isinstance(positions, ReasonCode):
                answers.append(Appended(append.ref, False, positions))
            else:
                answers.append(Appended(append.ref, True, ReasonCode.SUCCESS, positions[index]))
        index += len(append.messages)
    return answers
