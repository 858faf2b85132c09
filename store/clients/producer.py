"""Back-end producers: a service publishes to MQTT topics through the store, batched, with a durability handle.

A message a producer sends is appended to the CommitLog exactly like a device's
PUBLISH (the store fixes its target queues and notifies the gateway nodes), so
devices subscribed on any gateway node receive it through the normal path::

    async with Producer.connect("store-host", 7883, username="billing", password="...") as producer:
        handle = producer.send("cmd/dev-17/reboot", b"now", qos=1, content_type="text/plain")
        position = await handle        # appended (durable: on disk by default)
        await producer.flush()         # or: wait for everything sent so far

        later = await producer.send("cmd/dev-17/off", b"", delay_s=3600)   # a delayed message
        await producer.cancel_delayed(later.id)                          # its id: cancel it before it is due

Batching: :meth:`Producer.send` only queues; a batch leaves when it holds
``batch_bytes`` of payload or ``batch_count`` messages, or ``linger_ms`` after
its first message, whichever comes first. A batch is one RPC request and one
CommitLog write (one group commit when durable), and each message in it fails
alone (a topic the ACL denies, a record over the size limit). Up to
``IN_FLIGHT`` batches travel at once; the store appends them in the order sent.

Delivery guarantee: at most once per :meth:`send`. A handle that raises
``StoreUnavailable`` means the connection broke with the batch in flight: the
message may or may not be stored; a producer that needs at-least-once sends it
again (the consumer side tolerates duplicates; see store/clients/consumer.py).

MQTT 5 properties travel in the record as the MQTT 5 property block (the
PUBLISH form, without its length prefix), which the gateway decodes for MQTT 5
subscribers: pass it whole as ``properties=`` or use the keyword arguments for
the common ones (:func:`store.clients.properties.encode_properties`).

Blocking code and asyncio: store/clients/blocking.py and store/clients/aio.py
run this very producer on a trio thread of their own.

Resource handling: ``connect`` is an async context manager owning the
connection and the batching task; leaving it flushes what was sent (unless the
block raised), then closes the connection.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, final

import trio

from lightqueue.topics import validate_topic
from store.api import NewMessage, Position
from store.clients.properties import encode_properties
from store.rpc.client import RemoteStore, default_node_name

__all__ = ["Producer", "ProducerStatistics", "SendHandle", "encode_properties"]

LINGER_MS = 5
"""Default wait after a batch's first message for more to join it: a few ms cost a service little and turn
a burst of sends into one request and one CommitLog write."""

BATCH_BYTES = 1024 * 1024
"""Default payload bytes that close a batch at once: far below the RPC's append budget and frame limit."""

BATCH_COUNT = 2000
"""Default messages that close a batch at once: bounds the per-request decode work on the store."""

MAX_BUFFERED_BYTES = 64 * 1024 * 1024
"""Payload bytes waiting to be sent beyond which :meth:`Producer.send` refuses (``trio.WouldBlock``): a service
producing faster than the store accepts learns it instead of growing without bound."""

IN_FLIGHT = 4
"""Batches sent and not yet answered: enough to keep the store busy across a round trip."""

_names = itertools.count(1)


@final
class SendHandle:
    """The outcome of one :meth:`Producer.send`: ``await handle`` returns the message's ``Position`` (its log and
    CommitLog offset).

    Raises (on await): ``AccessDenied`` (the ACL does not allow the topic),
    ``RecordTooLarge``, ``StoreUnavailable`` (the connection broke: maybe stored),
    ``OSError`` (the store's write failed: not stored).
    """

    __slots__ = ("_done", "_position", "_error", "_callbacks")

    def __init__(self) -> None:
        self._done = trio.Event()
        self._position: Position | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[SendHandle], object]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, callback: Callable[[SendHandle], object]) -> None:
        """Call ``callback(handle)`` once the handle is done (at once if it is), on the trio thread: how the blocking
        and asyncio faces (store/clients/threaded.py) learn the outcome without a task per message."""
        if self.done():
            callback(self)
        else:
            self._callbacks.append(callback)

    def _set(self, outcome: Position | BaseException) -> None:
        if isinstance(outcome, BaseException):
            self._error = outcome
        else:
            self._position = outcome
        self._done.set()
        for callback in self._callbacks:
            callback(self)
        self._callbacks.clear()

    def result(self) -> Position:
        """The message's position, or the send's error raised, once :meth:`done`."""
        if not self.done():
            raise RuntimeError("the message is not stored yet: await the handle")
        if self._error is not None:
            raise self._error
        assert self._position is not None
        return self._position

    async def wait(self) -> Position:
        """The message's position, once the store appended it."""
        await self._done.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, Position]:
        return self.wait().__await__()


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    sent: int  # send() calls accepted
    stored: int  # messages the store appended
    failed: int  # messages whose handle raised
    batches: int  # requests sent
    buffered: int  # messages waiting for a batch


@final
class Producer:
    """Publishes to MQTT topics through a store node; create it with :meth:`connect`."""

    def __init__(self, client: RemoteStore, *, client_id: str, linger_ms: float, batch_bytes: int,
                 batch_count: int, durable: bool | None) -> None:
        self.client = client
        self.client_id = client_id
        self._linger_s = linger_ms / 1000
        self._batch_bytes = batch_bytes
        self._batch_count = batch_count
        self._durable = durable
        self._buffer: list[tuple[NewMessage, SendHandle]] = []
        self._buffered_bytes = 0
        self._wakeup = trio.Event()  # set when the buffer gets its first message or fills a batch, or on flush
        self._flushing = False  # a flush waits: send what is buffered without lingering
        self._slots = trio.Semaphore(IN_FLIGHT)
        self._idle = trio.Event()  # set while nothing is buffered or in flight
        self._idle.set()
        self._in_flight = 0
        self._sent = self._stored = self._failed = self._batches = 0

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int | None = None,
        *,
        username: str | None = None,
        password: str | bytes | None = None,
        client_id: str | None = None,
        linger_ms: float = LINGER_MS,
        batch_bytes: int = BATCH_BYTES,
        batch_count: int = BATCH_COUNT,
        durable: bool | None = True,
        timeout_s: float | None = 30.0,
    ) -> AsyncIterator[Producer]:
        """Connect to the store node at ``host:port`` (its ``store.listen``) and produce until the block exits.

        Without ``port``, ``host`` is the comma-separated ``HOST:PORT`` list of a replicated store's replicas: the
        producer finds the leader and follows it when it changes (docs/cluster.md, "Replicated store").

        Args:
            username, password: the service's credentials, when the store has a password file.
            client_id: the producer id recorded with each message (and ``%c`` in ACL rules);
                default ``producer-<host>-<pid>-<n>``. Unique among the store's connections.
            linger_ms, batch_bytes, batch_count: batching (see the module docstring).
            durable: True: a handle completes once the message is on disk; None: per
                the store's flush policy; False: once it is written (not flushed).
            timeout_s: give up if the first connection takes longer (None: retry forever).

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the connection (bad credentials, another protocol version).
        """
        name = client_id or unique_client_name("producer")
        async with RemoteStore.connect(host, port, node=name, timeout_s=timeout_s, username=username,
                                       password=password) as client:
            producer = cls(client, client_id=name, linger_ms=linger_ms, batch_bytes=batch_bytes,
                           batch_count=batch_count, durable=durable)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer._run, nursery)
                yield producer
                await producer.flush()
                nursery.cancel_scope.cancel()

    def send(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: bytes = b"",
        delay_s: float | None = None,
        deliver_at: int | None = None,
        **common: Any,
    ) -> SendHandle:
        """Queue a message for ``topic``; returns its handle at once (``await`` it for the offset).

        Args:
            qos: the QoS the message is stored with (0..2): devices receive it at
                the lower of this and their subscription's QoS.
            retain: also make it the topic's retained message (an empty payload deletes that).
            properties: an MQTT 5 PUBLISH property block, as encoded on the wire without its length.
            delay_s, deliver_at: deliver it this many seconds from now, or at this time (ms since the epoch), not
                now: a delayed message, which the store keeps until then (store/timer/; the handle's position is
                its Delayed record's, whose ``id`` is the message's id: :meth:`cancel_delayed`). A store with a
                cap of delayed messages per client fails the handle with ``DelayedCapExceeded`` when this
                producer's client id is at it.
            common: keyword arguments of :func:`encode_properties`, appended to ``properties``
                (do not set a property in both).

        Raises:
            TopicError: not a valid topic name (wildcards included).
            ValueError: a bad QoS or property value, a negative delay, or both delay_s and deliver_at.
            trio.WouldBlock: ``MAX_BUFFERED_BYTES`` are waiting to be sent: ``await flush()`` first.
        """
        validate_topic(topic)
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
        if self._buffered_bytes + len(payload) > MAX_BUFFERED_BYTES and self._buffer:
            raise trio.WouldBlock(f"{self._buffered_bytes} bytes are waiting to be sent: await flush() first")
        if common:
            properties += encode_properties(**common)
        now = int(time.time() * 1000)
        message = NewMessage(topic, bytes(payload), self.client_id, qos, retain, properties, now, 0,
                             _due(now, delay_s, deliver_at))
        handle = SendHandle()
        self._buffer.append((message, handle))
        self._buffered_bytes += len(payload)
        self._sent += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        if len(self._buffer) == 1 or self._full():
            self._wakeup.set()
        return handle

    async def flush(self) -> None:
        """Return once every message sent before the call is stored or failed (its handle is done)."""
        if self._idle.is_set():
            return
        self._flushing = True
        self._wakeup.set()
        await self._idle.wait()

    async def cancel_delayed(self, delayed_id: str | Position) -> bool:
        """Cancel a pending delayed message: it is never delivered. True once the cancellation is stored (per the
        store's flush policy); False when no such message is pending (an unknown id, or one fired or cancelled).

        Args:
            delayed_id: the message's id (``position.id`` of its send's position), or that position.

        Raises:
            ValueError: not a delayed message id.
            AccessDenied: the ACL does not let this producer publish to the message's topic.
            StoreUnavailable: the connection broke with the call in flight: it may or may not be cancelled.
        """
        position = delayed_id if isinstance(delayed_id, Position) else Position.parse(delayed_id)
        return await self.client.delayed_cancel(position)

    def statistics(self) -> ProducerStatistics:
        return ProducerStatistics(self._sent, self._stored, self._failed, self._batches, len(self._buffer))

    def _full(self) -> bool:
        return self._buffered_bytes >= self._batch_bytes or len(self._buffer) >= self._batch_count

    async def _run(self, nursery: trio.Nursery) -> None:
        """Cut batches: when one is full, or ``linger_ms`` after its first message (or at once on flush)."""
        while True:
            if not self._buffer:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            if not self._full() and not self._flushing:
                self._wakeup = trio.Event()
                with trio.move_on_after(self._linger_s):
                    await self._wakeup.wait()
            await self._slots.acquire()
            batch = self._take()
            self._flushing = self._flushing and bool(self._buffer)
            self._in_flight += 1
            nursery.start_soon(self._send, batch)

    def _take(self) -> list[tuple[NewMessage, SendHandle]]:
        buffer = self._buffer
        taken = 0
        size = 0
        while taken < len(buffer) and taken < self._batch_count:
            size += len(buffer[taken][0].payload)
            taken += 1
            if size >= self._batch_bytes:
                break
        batch = buffer[:taken]
        del buffer[:taken]
        self._buffered_bytes -= size
        return batch

    async def _send(self, batch: list[tuple[NewMessage, SendHandle]]) -> None:
        try:
            outcomes: list[Position | Exception] | None = None
            try:
                outcomes = await self.client.append_each([message for message, _ in batch], durable=self._durable)
            except (OSError, ValueError) as exc:  # StoreUnavailable is an OSError
                error = exc
            self._batches += 1
            for index, (_, handle) in enumerate(batch):
                outcome = outcomes[index] if outcomes is not None else error
                handle._set(outcome)
                if isinstance(outcome, BaseException):
                    self._failed += 1
                else:
                    self._stored += 1
        finally:
            self._in_flight -= 1
            self._slots.release()
            if not self._in_flight and not self._buffer:
                self._idle.set()


def _due(now: int, delay_s: float | None, deliver_at: int | None) -> int:
    """``NewMessage.deliver_at_ms`` of a send (0: not delayed; a past time: due at once)."""
    if delay_s is not None and deliver_at is not None:
        raise ValueError("give delay_s or deliver_at, not both")
    if delay_s is not None:
        if delay_s < 0:
            raise ValueError(f"delay_s must not be negative, not {delay_s!r}")
        return now + int(delay_s * 1000)
    return max(deliver_at, 1) if deliver_at is not None else 0


def unique_client_name(role: str) -> str:
    """``<role>-<host>-<pid>-<n>``: unique per connection, as the store requires of node names."""
    return f"{role}-{default_node_name()}-{next(_names)}"

