"""POP consumers: any number of members take messages of one group one by one, each invisible to the others until
acknowledged or its invisible time passes (store/pop/; docs/consumer-groups.md).

::

    async with PopConsumer.connect("store-host", 7883, group="billing", filter="tele/#", invisible_s=30,
                                   max_attempts=5, username="billing", password="...") as consumer:
        while True:
            for message in await consumer.pop(max_count=16):
                try:
                    await handle(message.topic, message.payload)
                except Exception:
                    await consumer.nack(message, delay_s=10)  # again in 10 s, as attempt + 1
                else:
                    await consumer.ack(message)

Unlike the claim/ack consumer (consumer.py), the balancing is per message and nothing is held per member: a member
that hangs or dies delays only the messages it popped, for at most their invisible time, after which the store
hands them to any member again (``message.attempt`` + 1). After ``max_attempts`` deliveries without an ack a
message goes to the group's dead-letter topic ``$dlq/<group>``, which the ordinary consumer reads (user properties
``dlq-topic``, ``dlq-client``, ``dlq-attempts``... say where it came from).

Guarantee: at least once; the order of the queue is not kept across retries. An ack answers whether it counted:
False when the message was handed out again meanwhile (its invisible time passed: another member may process it
too) or was acknowledged already.

Reconnecting: if the connection to the store breaks, a pop waits for the client to reconnect and goes on; an ack
that could not be sent raises ``StoreUnavailable`` (the message comes back after its invisible time).

Blocking code and asyncio: ``BlockingPopConsumer`` (blocking.py) and ``AsyncioPopConsumer`` (aio.py) run this
consumer on a trio thread of their own.

Resource handling: ``connect`` owns the connection; leaving the block closes it (popped messages not acknowledged
come back after their invisible time).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import final

from store.api import MAX_ATTEMPTS, Popped, StoreUnavailable
from store.clients.consumer import MAX_BYTES, WAIT_S, ConsumerMessage, Start, queue_of, start_position
from store.clients.producer import unique_client_name
from store.rpc.client import RemoteStore

__all__ = ["PopConsumer", "PopMessage"]

LOGGER = logging.getLogger(__name__)

MAX_COUNT = 32
"""Default messages per pop: each is invisible to the other members until handled, so fewer than a claim's."""

INVISIBLE_S = 30.0
"""Default invisible time: how long a popped message is this member's before it is handed out again."""


@dataclass(frozen=True, slots=True)
class PopMessage(ConsumerMessage):
    """A popped message: its receipt ``handle`` (what ``ack``, ``nack`` and ``change_invisible_time`` take) and its
    delivery ``attempt`` (1 the first), besides the queue offset and the stored record."""

    handle: str = ""
    attempt: int = 1


Receipt = PopMessage | str


def _handle(receipt: Receipt) -> str:
    return receipt.handle if isinstance(receipt, PopMessage) else receipt


@final
class PopConsumer:
    """One member of a POP group; create it with :meth:`connect`."""

    def __init__(self, client: RemoteStore, group: str, filter: str, start: tuple[str, int], *, invisible_s: float,
                 max_attempts: int, max_count: int, max_bytes: int, wait_s: float) -> None:
        self.client = client
        self.group = group
        self.filter = filter
        self.invisible_s = invisible_s
        self.max_attempts = max_attempts
        self._start = start
        self._max_count = max_count
        self._max_bytes = max_bytes
        self._wait_s = wait_s

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
        invisible_s: float = INVISIBLE_S,
        max_attempts: int = MAX_ATTEMPTS,
        username: str | None = None,
        password: str | bytes | None = None,
        client_id: str | None = None,
        max_count: int = MAX_COUNT,
        max_bytes: int = MAX_BYTES,
        wait_s: float = WAIT_S,
        timeout_s: float | None = 30.0,
    ) -> AsyncIterator[PopConsumer]:
        """Connect to the store node at ``host:port`` (or a replica list, as ``Consumer.connect``) to pop ``group``
        on ``filter``'s queue.

        Args:
            start: where a group with no committed offset starts (``Consumer.connect``'s).
            invisible_s: how long a popped message stays this member's (per pop: :meth:`pop`'s argument).
            max_attempts: deliveries before a message goes to ``$dlq/<group>`` (the group's setting: the latest
                pop's applies).
            max_count, max_bytes, wait_s: one pop's size and long-poll time.

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the connection (bad credentials, another protocol version).
            ValueError: a bad start, invisible time or number of attempts.
        """
        if invisible_s <= 0 or max_attempts < 1:
            raise ValueError(f"invisible_s and max_attempts must be positive, not {invisible_s} and {max_attempts}")
        position = start_position(start)
        async with RemoteStore.connect(host, port, node=client_id or unique_client_name("pop"),
                                       timeout_s=timeout_s, username=username, password=password) as client:
            yield cls(client, group, queue_of(filter), position, invisible_s=invisible_s,
                      max_attempts=max_attempts, max_count=max_count, max_bytes=max_bytes, wait_s=wait_s)

    async def pop(self, max_count: int | None = None, invisible_s: float | None = None,
                  wait_s: float | None = None) -> list[PopMessage]:
        """The next messages (retries first), each this member's for ``invisible_s``; empty when nothing came
        within ``wait_s``. Waits for the store to come back if the connection broke.

        Raises:
            AccessDenied: the ACL does not allow this user to subscribe to the filter.
            TopicError, ValueError: a bad filter, group name, count or time.
        """
        kind, at = self._start
        while True:
            connects = self.client.client_statistics().connects
            try:
                found = await self.client.pop(self.group, self.filter, "", max_count or self._max_count,
                                              invisible_s=self.invisible_s if invisible_s is None else invisible_s,
                                              wait_s=self._wait_s if wait_s is None else wait_s,
                                              max_attempts=self.max_attempts, max_bytes=self._max_bytes,
                                              start=kind, at=at)
            except StoreUnavailable as exc:
                LOGGER.warning("POP consumer lost the store; going on when it is back: %s", exc,
                               extra={"ctx": {"group": self.group, "filter": self.filter}})
                await self.client.wait_reconnected(connects)
                continue
            return [_message(popped) for popped in found]

    async def ack(self, receipt: Receipt) -> bool:
        """Acknowledge a message (or its handle): True when it counted, False when stale (handed out again meanwhile,
        or acknowledged already). Stored on return as the store's flush policy promises.

        Raises:
            StoreUnavailable: the connection broke: not acknowledged (the message comes back).
        """
        (done,) = await self.client.pop_ack([_handle(receipt)])
        return done

    async def ack_all(self, receipts: Sequence[Receipt]) -> list[bool]:
        """:meth:`ack` of several messages in one call (one record per group at the store)."""
        return await self.client.pop_ack([_handle(receipt) for receipt in receipts]) if receipts else []

    async def change_invisible_time(self, receipt: Receipt, invisible_s: float) -> str | None:
        """The message stays this member's for ``invisible_s`` from now (more time to process it); returns its new
        handle (the old one is stale), None when the handle was stale already."""
        return await self.client.change_invisible(_handle(receipt), invisible_s)

    async def nack(self, receipt: Receipt, delay_s: float = 0.0) -> str | None:
        """Give the message back: visible again ``delay_s`` from now, for its next attempt (or the dead-letter
        topic after the last). None when the handle was stale."""
        return await self.change_invisible_time(receipt, delay_s)

    async def __aiter__(self) -> AsyncIterator[PopMessage]:
        """Messages one by one as they come; each must be acknowledged (or nacked) by the caller."""
        while True:
            for message in await self.pop():
                yield message


def _message(popped: Popped) -> PopMessage:
    return PopMessage(popped.offset, popped.record, popped.handle, popped.attempt)
