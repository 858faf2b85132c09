"""Back-end consumers: a service reads a topic filter as a consumer group, at least once, from committed offsets.

::

    async with Consumer.connect("store-host", 7883, group="billing", filter="tele/#",
                                start="earliest", username="billing", password="...") as consumer:
        async for batch in consumer:      # the previous batch is acknowledged when the next is asked for
            for message in batch:
                handle(message.topic, message.payload)

or, acknowledging explicitly (``auto_commit=False``)::

        async for batch in consumer:
            await process(batch)
            await consumer.commit(batch)  # stored on return, as the store's flush policy promises

The group lives in the store node (store/groups.py): every consumer of a group
is a member; members share the queue's messages (each message is handed to one
member at a time, a fair share of the backlog each); a member's messages not
acknowledged when it goes (it leaves, its process dies, its connection breaks
or falls silent for the store's lease) go to the other members; the group's
committed offset (the lowest one not acknowledged) survives restarts. A new
group starts at ``start``: ``"earliest"`` (the oldest message the store still
keeps), ``"latest"`` (messages appended after the join), a queue offset
(``int``) or a ``datetime`` (the first message stored at or after it); once the
group has an offset, ``start`` is ignored.

Guarantee: at least once. A message is delivered again when its consumer went
before acknowledging it, and, after every member left and the group is loaded
again, everything from the committed offset is (messages acknowledged out of
order above it included): handle duplicates (or make the handling idempotent).

Waiting: a claim long-polls the store (``wait_s``), which answers as soon as
the queue gets messages (the store's notify wakes it) or offsets are handed back.
A commit sends a batch's offsets as ``(base, count)`` runs (a batch record's
messages: one); iterating with auto-commit, a batch's acknowledgement travels
while the loop claims the next batch, so a loop step costs one round trip, not two.

Reconnecting: if the connection to the store breaks, the consumer waits for
the client to reconnect, joins again and goes on; what it had not acknowledged
went back to the group and is delivered again (to it or another member).

Properties: ``message.properties`` is the MQTT 5 properties decoded
(store/clients/properties.py: content type, user properties, response topic,
correlation data, message expiry), ``message.raw_properties`` the stored block.

Blocking code and asyncio: store/clients/blocking.py and store/clients/aio.py
run this very consumer on a trio thread of their own.

Resource handling: ``connect`` owns the connection and the auto-commit in flight;
leaving the block waits for that, leaves the group (the unacknowledged messages go
to the other members) and closes it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import final, overload

import trio

from store.clients.producer import unique_client_name
from store.clients.properties import MessageProperties, decode_properties
from store.api import Record, StoreUnavailable, group_owner
from store.offsetranges import ranges_of
from store.rpc.client import RemoteStore
from store.rpc.connection import Call
from store.tasks import background

__all__ = ["Batch", "Consumer", "ConsumerMessage", "queue_of", "start_position"]

LOGGER = logging.getLogger(__name__)

MAX_COUNT = 16_384
"""Default messages per claim: more than a 1 MiB batch record of small messages (about 11,000 of 64 B), so that a
claim is bounded by ``max_bytes`` and takes batch records whole: a consumer behind a ``send_batch`` producer at
40-50k messages/s over a loaded store's round trips of 100-300 ms needs that many per round trip (with 1,024 it
took 5k/s, docs/benchmarks.md); a member's share of the backlog caps it when there are several, and a claim
takes what there is, not 16,384, once the member is caught up."""

MAX_BYTES = 4 * 1024 * 1024
"""Default byte budget of a claim (a claim always gets at least one message when there is one)."""

WAIT_S = 5.0
"""How long one claim waits at the store for messages: the long poll's length (the consumer then asks again)."""

Start = str | int | datetime


@dataclass(frozen=True, slots=True)
class ConsumerMessage:
    """One message of the group's queue: its queue offset (what a commit acknowledges) and the stored record."""

    offset: int
    record: Record

    @property
    def topic(self) -> str:
        return self.record.topic

    @property
    def payload(self) -> bytes:
        return self.record.payload

    @property
    def properties(self) -> MessageProperties:
        """The MQTT 5 properties the publisher set (content type, user properties, response topic, correlation
        data, message expiry...), decoded; ``NO_PROPERTIES`` if none.

        Raises:
            ValueError: the record's property block does not decode (a producer stored raw bytes that are not one);
                ``raw_properties`` has them.
        """
        return decode_properties(self.record.properties)

    @property
    def raw_properties(self) -> bytes:
        """The MQTT 5 PUBLISH property block as stored (without its length prefix), ``b""`` if none."""
        return self.record.properties

    @property
    def store_ms(self) -> int:
        """When the store appended the message (ms since the epoch)."""
        return self.record.store_ms

    @property
    def expires_ms(self) -> int | None:
        """When the message expires (its message expiry interval after ``store_ms``), None if it does not.

        The store keeps an expired message and a consumer group still gets it: MQTT subscribers are not sent it
        [MQTT-3.3.2-5]; a service decides what an expired command means to it.
        """
        interval = self.properties.message_expiry_interval
        return None if interval is None else self.record.store_ms + interval * 1000


@dataclass(frozen=True, slots=True)
class Batch(Sequence[ConsumerMessage]):
    """Messages claimed together, in queue order (handed-back ones first).

    A read-only sequence, as a list of them would be: ``batch[0]``, ``batch[-1]``,
    ``batch[1:]`` (a list), ``len``, iteration, ``in``.
    """

    messages: list[ConsumerMessage]

    @overload
    def __getitem__(self, index: int) -> ConsumerMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[ConsumerMessage]: ...

    def __getitem__(self, index: int | slice) -> ConsumerMessage | list[ConsumerMessage]:
        return self.messages[index]

    def __iter__(self) -> Iterator[ConsumerMessage]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def offsets(self) -> list[int]:
        return [m.offset for m in self.messages]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The batch's offsets as ``(base, count)`` runs: what a commit sends (a batch record's messages: one)."""
        return ranges_of(m.offset for m in self.messages)


def queue_of(filter: str) -> str:
    """The queue a consumer reads for ``filter``: a first-level topic ``tele`` is read as ``tele/#``, as
    server-side consumers read it."""
    return filter if "/" in filter or "+" in filter or filter == "#" else filter + "/#"


def start_position(start: Start) -> tuple[str, int]:
    """``start`` as the RPC's ``(kind, at)``: ``earliest``/``latest``, an offset, or a time in ms since the epoch.

    Raises:
        ValueError: an unknown start word or a negative offset.
    """
    if isinstance(start, datetime):
        return "time", int(start.timestamp() * 1000)
    if isinstance(start, bool) or not isinstance(start, (str, int)):
        raise ValueError(f"start must be 'earliest', 'latest', an offset or a datetime, not {start!r}")
    if isinstance(start, int):
        if start < 0:
            raise ValueError(f"a start offset must not be negative, not {start}")
        return "offset", start
    if start not in ("earliest", "latest"):
        raise ValueError(f"start must be 'earliest', 'latest', an offset or a datetime, not {start!r}")
    return start, 0


@final
class Consumer:
    """One member of a consumer group; create it with :meth:`connect`, then iterate over batches."""

    def __init__(self, client: RemoteStore, group: str, filter: str, start: tuple[str, int], *,
                 max_count: int, max_bytes: int, wait_s: float, auto_commit: bool,
                 nursery: trio.Nursery | None = None) -> None:
        self._nursery = nursery  # where an auto-commit travels (none: the loop waits for each)
        self._committing: Call | None = None  # the auto-commit in flight (of the batch before the loop's)
        self.client = client
        self.group = group
        self.filter = filter
        self._owner = group_owner(group)  # the group's name at the store: back-end groups are ``$group/<name>``
        self._start = start
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._wait_s = wait_s
        self._auto_commit = auto_commit
        self._joined_at = -1  # the client's connection count when this member joined: another means rejoin
        self.committed = 0  # the group's committed offset, as the store last said

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int | None = None,
        *,
        group: str,
        filter: str,
        start: Start = "earliest",
        username: str | None = None,
        password: str | bytes | None = None,
        client_id: str | None = None,
        max_count: int = MAX_COUNT,
        max_bytes: int = MAX_BYTES,
        wait_s: float = WAIT_S,
        auto_commit: bool = True,
        timeout_s: float | None = 30.0,
    ) -> AsyncIterator[Consumer]:
        """Connect to the store node at ``host:port`` and join ``group`` on ``filter``'s queue.

        Without ``port``, ``host`` is the comma-separated ``HOST:PORT`` list of a replicated store's replicas (as
        :meth:`store.clients.producer.Producer.connect`).

        Args:
            filter: a topic filter (``tele/#``, ``tele/+/temp``) or a topic; a
                first-level topic ``tele`` is read as ``tele/#``.
            start: where a group with no committed offset starts (see the module docstring).
            client_id: this member's name at the store (``%c`` in ACL rules); default
                ``consumer-<host>-<pid>-<n>``. Unique among the store's connections.
            max_count, max_bytes, wait_s: one claim's size and long-poll time.
            auto_commit: acknowledge a batch when the next one is asked for.
            timeout_s: give up if the first connection takes longer (None: retry forever).

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the connection (bad credentials, another protocol version).
            AccessDenied: the ACL does not allow this user to subscribe to ``filter``.
            TopicError, ValueError: a bad filter, group name or start.
        """
        filter = queue_of(filter)
        position = start_position(start)  # a bad start fails before connecting
        async with RemoteStore.connect(host, port, node=client_id or unique_client_name("consumer"),
                                             timeout_s=timeout_s, username=username, password=password) as client, \
                background() as nursery:  # the auto-commit in flight's
            consumer = cls(client, group, filter, position, max_count=max_count, max_bytes=max_bytes,
                           wait_s=wait_s, auto_commit=auto_commit, nursery=nursery)
            await consumer._join()
            try:
                yield consumer
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                    try:
                        await consumer._committed_all()  # the last auto-commit in flight lands before the leave
                        await client.leave(group_owner(group), filter, "")
                    except OSError:  # the connection is gone: the store hands the messages back anyway
                        pass

    async def _join(self) -> None:
        await self.client.wait_connected()
        self._joined_at = self.client.client_statistics().connects
        kind, at = self._start
        self.committed = await self.client.join(self._owner, self.filter, "", start=kind, at=at)

    async def poll(self, max_count: int | None = None, wait_s: float | None = None) -> Batch:
        """Claim the next batch (empty if nothing came within ``wait_s``); it is this member's until acknowledged.

        Rejoins the group first if the connection was re-established since the last join.
        """
        while True:
            try:
                if self.client.client_statistics().connects != self._joined_at:
                    await self._join()
                found = await self.client.claim(self._owner, self.filter, "", max_count or self._max_count,
                                                max_bytes=self._max_bytes,
                                                wait_s=self._wait_s if wait_s is None else wait_s)
            except StoreUnavailable as exc:
                LOGGER.warning("consumer lost the store; rejoining when it is back: %s", exc,
                               extra={"ctx": {"group": self.group, "filter": self.filter}})
                await self.client.wait_reconnected(self._joined_at)
                continue
            return Batch([ConsumerMessage(offset, record) for offset, record in found.messages])

    async def commit(self, batch: Batch | list[int]) -> int:
        """Acknowledge a batch (or queue offsets); returns the group's committed offset, stored on return as
        the store's flush policy promises (a control record: on disk under ``sync``, in the page cache under ``async``).

        Offsets no longer this member's (handed to another after a reconnect) are ignored: they are delivered again.

        Raises:
            StoreUnavailable: the connection broke: not acknowledged (the messages will be delivered again).
        """
        ranges = batch.ranges if isinstance(batch, Batch) else ranges_of(batch)
        if ranges:
            self.committed = await self.client.ack(self._owner, self.filter, "", ranges=ranges)
        return self.committed

    async def __aiter__(self) -> AsyncIterator[Batch]:
        """Batches as they come (empty polls are not yielded); with ``auto_commit`` each is acknowledged when the
        loop asks for the next one, so a batch whose handling raised is not: the acknowledgement travels while the
        loop gets the next batch (one in flight; ``committed`` follows when it is answered, and leaving waits for
        it)."""
        while True:
            batch = await self.poll()
            if not batch:
                continue
            yield batch
            if not self._auto_commit:
                continue
            if self._committing is not None:
                await self._committing.wait()  # one acknowledgement in flight: they are stored in order
            self._committing = committing = Call()
            if self._nursery is not None:  # it travels while the loop takes the next batch
                self._nursery.start_soon(self._auto_commit_of, batch, committing)
            else:
                await self._auto_commit_of(batch, committing)

    async def _committed_all(self) -> None:
        """Return once the auto-commit in flight, if any, is answered (its error is the loop's, not the leave's)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            try:
                await committing.wait()
            except Exception:  # a commit that failed: its messages are delivered again
                pass

    async def _auto_commit_of(self, batch: Batch, call: Call) -> None:
        try:
            await self.commit(batch)
        except StoreUnavailable as exc:
            LOGGER.warning("batch not acknowledged (it will be delivered again): %s", exc,
                           extra={"ctx": {"group": self.group, "filter": self.filter}})
        except Exception as exc:  # the loop's to raise, when it acknowledges the next batch
            call.fail(exc)
            return
        call.set(None)
