"""Back-end producers: a service publishes to MQTT topics through the store, auto-batched, with a durability handle.

A message a producer sends is appended to the CommitLog exactly like a device's
PUBLISH (the store fixes its target queues and notifies the gateway nodes), so
devices subscribed on any gateway node receive it through the normal path::

    async with Producer.connect("store-host", 7883, username="billing", password="...") as producer:
        handle = await producer.send("cmd/dev-17/reboot", b"now", qos=1, content_type="text/plain")
        position = await handle        # appended (durable: on disk by default)
        handles = await producer.send_batch([Message("cmd/dev-18/reboot", b"now"), Message("cmd/dev-19/on", b"1")])
        batch = await producer.send_batch([b"21.5", b"21.7"], topic="tele/svc/temp", qos=0)  # payloads, one topic
        positions = await batch        # their Positions; batch[i]: message i's own handle
        await producer.flush()         # or: wait for everything sent so far
        later = await (await producer.send("cmd/dev-17/off", b"", delay_s=3600))  # a delayed message, stored
        await producer.cancel_delayed(later.id)                                  # its id: cancel it before it is due

AutoBatch (on by default, RocketMQ 5's): :meth:`Producer.send` only queues
the message and returns its handle; the producer's one batching task cuts a
batch when it holds ``batch_max_bytes`` of payload or ``batch_max_count``
messages, or ``batch_max_delay_ms`` after its first message, or at once on
:meth:`Producer.flush`, :meth:`Producer.send_batch` and when the producer
closes. A batch is one append request and one CommitLog write (one group
commit when durable), its same-topic runs written as batch records (one
record, one CRC, one index entry: docs/storage.md, "Batch records"), and
each message in it fails alone (a record over the size limit goes as a
record of its own; a topic the ACL denies fails all of that topic's
alike): its handle raises, its neighbours' do not. Up to ``IN_FLIGHT`` batches travel at once over the RPC (one to a store
in this process); the store appends them in the order sent.
A batch keeps one outcome that its messages' handles read by index (a send makes
a small view, an answer sets one outcome); ``send_batch(payloads, topic=...)``
makes no object per message at all, and the store packs such a run as one
batch record (``store.api.PayloadRun``); so does a run of sends without options
of one topic. A ``send_batch`` leaves in one request with every batch waiting
before it for the request in flight (fewer, larger requests: a request's fixed
cost is most of a small batch's); full AutoBatch batches leave one a request.
``auto_batch=False`` sends each message as its own request at once (what a
service that wants no added latency at all pays for in throughput:
docs/benchmarks.md, "Produce").

Back-pressure: messages buffered or in flight hold at most
``total_batch_max_bytes`` of payload; past it :meth:`Producer.send` waits
(senders in the order they came) until answers free room, and
:meth:`Producer.send_nowait` raises ``trio.WouldBlock``.

Order: per topic, messages are stored in the order sent. Within one batch the
messages of a topic go together (``store.api.by_topic``: the store writes a
same-topic run as batch records), so messages of different topics sent close
together may be stored in another order than sent.

Delivery guarantee: at most once per send. A handle that raises
``StoreUnavailable`` means the connection broke with the batch in flight: the
message may or may not be stored; a producer that needs at-least-once sends it
again (the consumer side tolerates duplicates; see store/clients/consumer.py).

MQTT 5 properties travel in the record as the MQTT 5 property block (the
PUBLISH form, without its length prefix), which the gateway decodes for MQTT 5
subscribers: pass it whole as ``properties=`` or use the keyword arguments for
the common ones (:func:`store.clients.properties.encode_properties`).

Blocking code and asyncio: store/clients/blocking.py and store/clients/aio.py
run this very producer on a trio thread of their own.

Resource handling: ``connect`` (and ``over``, for a store in this process) is
an async context manager owning the connection and the batching task; leaving
it flushes what was sent (unless the block raised), then closes the connection.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, final, overload

import trio

from lightqueue.topics import validate_topic
from store.api import MAIN_LOG, NewMessage, PayloadRun, Position, Positions, batch_groups
from store.clients.properties import encode_properties
from store.rpc.client import RemoteStore, default_node_name

__all__ = ["BatchHandle", "GroupAppender", "Message", "Producer", "ProducerStatistics", "SendHandle",
           "encode_properties"]

BATCH_MAX_DELAY_MS = 5
"""Default wait after a batch's first message for more to join it: a few ms cost a service little and turn
a burst of sends into one request and one CommitLog write."""

BATCH_MAX_BYTES = 1024 * 1024
"""Default payload bytes that close a batch at once: far below the RPC's append budget and frame limit."""

BATCH_MAX_COUNT = 2000
"""Default messages that close a batch at once: bounds the per-request decode work on the store."""

MAX_TOPICS_KEPT = 4096
"""Topics a producer remembers as valid (then it forgets them all and checks again): a send checks its topic only the
first time, not every time (a third of a send's cost was the check)."""

SEND_SLICE_S = 0.001
"""The longest :meth:`Producer.send` runs its caller's loop of sends without yielding to other tasks: a batch of
2,000 sends filled without a yield held up the service's other tasks (its consumer's claims and
acknowledgements, each a scheduler round) for the whole batch."""

TOTAL_BATCH_MAX_BYTES = 64 * 1024 * 1024
"""Default payload bytes buffered or in flight beyond which :meth:`Producer.send` waits: a service producing
faster than the store accepts is slowed to its pace instead of growing without bound."""

IN_FLIGHT = 4
"""Batches sent and not yet answered, over the RPC: enough to keep the store busy across a round trip. The store
serves one connection's appends in the order they came, so they are stored in the order sent. A store in this
process takes one batch at a time: concurrent appends there could reach the CommitLog in another order (two
waiting for dispatch to catch up are woken in any order)."""

_names = itertools.count(1)

R = TypeVar("R")


class GroupAppender(Protocol):
    """Where a producer appends: ``RemoteStore`` (a store node over the RPC) or ``LocalStore`` (a store in this
    process). Per group its positions, or the exception that kept that group (only) out; ``batched[i]``: group i
    goes in batch records. ``max_record_bytes``: the store's record size limit (0: unknown, nothing is batched)."""

    @property
    def max_record_bytes(self) -> int: ...

    async def append_groups(self, groups: Sequence[Sequence[NewMessage]], *, durable: bool | None = None,
                            batched: Sequence[bool] = ()) -> Sequence[Positions | Exception]: ...


class _Awaited(Generic[R]):
    """What both handles share: a view of a batch, awaited for its outcome (``result``)."""

    __slots__ = ("_batch",)

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch

    def done(self) -> bool:
        return self._batch.done

    def result(self) -> R:
        raise NotImplementedError

    async def wait(self) -> R:
        """The outcome, once the store answered."""
        await self._batch.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, R]:
        return self.wait().__await__()


@final
class SendHandle(_Awaited[Position]):
    """The outcome of one send: ``await handle`` returns the message's ``Position`` (its log and CommitLog offset;
    a delayed message's is its Delayed record's).

    A view of the message in the batch that stores it (its request's one outcome, asked by index): a send makes
    no more than this small object, and a batch's answer sets one outcome, not one per message.

    Raises (on await): ``AccessDenied`` (the ACL does not allow the topic),
    ``RecordTooLarge``, ``DelayedCapExceeded``, ``StoreUnavailable`` (the connection broke: maybe stored),
    ``OSError`` (the store's write failed: not stored).
    """

    __slots__ = ("_index",)

    def __init__(self, batch: _Batch, index: int) -> None:
        self._batch = batch
        self._index = index

    def add_done_callback(self, callback: Callable[[SendHandle], object]) -> None:
        """Call ``callback(handle)`` once the handle is done (at once if it is), on the trio thread: how the blocking
        and asyncio faces (store/clients/threaded.py) learn the outcome without a task per message."""
        self._batch.add_done_callback(lambda _: callback(self))

    def result(self) -> Position:
        """The message's position, or the send's error raised, once :meth:`done`."""
        return self._batch.result(self._index)


@final
class BatchHandle(_Awaited[Positions], Sequence[SendHandle]):
    """The outcome of a :meth:`Producer.send_batch` of payloads: one object for the whole batch, ``handle[i]`` the
    i-th message's :class:`SendHandle` (made when asked for), ``await handle`` their ``Positions`` (one log and an
    offset per message; ``positions[i]`` its ``Position``).

    Raises (on await): the first failed message's error, in order (each message's own: ``handle[i]``).
    """

    __slots__ = ("_start", "_count")

    def __init__(self, batch: _Batch, start: int, count: int) -> None:
        self._batch = batch
        self._start = start
        self._count = count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> SendHandle: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[SendHandle]: ...

    def __getitem__(self, index: int | slice) -> SendHandle | Sequence[SendHandle]:
        if isinstance(index, slice):
            return [self[i] for i in range(self._count)[index]]
        if not -self._count <= index < self._count:
            raise IndexError(f"message {index} of a batch of {self._count}")
        return SendHandle(self._batch, self._start + index % self._count)

    def add_done_callback(self, callback: Callable[[BatchHandle], object]) -> None:
        """Call ``callback(handle)`` once every message's outcome is known (at once if it is), on the trio thread."""
        self._batch.add_done_callback(lambda _: callback(self))

    def result(self) -> Positions:
        """The messages' positions, or the first failed message's error raised, once :meth:`done`."""
        return self._batch.positions(self._start, self._count)


@final
class _Batch:
    """What one request takes: the messages of sends (``messages``), then perhaps a ``send_batch`` of payloads
    (``run``), indexed in that order; and, once answered, their outcome, which their handles read."""

    __slots__ = ("messages", "run", "count", "size", "closed", "cut", "done", "_groups", "_results", "_where", "_event",
                 "_callbacks")

    def __init__(self) -> None:
        self.messages: list[NewMessage] = []
        self.run: PayloadRun | None = None
        self.count = 0  # messages
        self.size = 0  # payload bytes
        self.closed = False  # no more sends join it: full, or a send_batch's
        self.cut = False  # a send_batch's: the request takes it with every batch before it
        self.done = False
        self._groups: list[Sequence[int]] = []  # the indexes of each group appended (the whole batch: one group)
        self._results: Sequence[Positions | BaseException] = ()  # per group
        self._where: list[tuple[int, int]] | None = None  # message index -> (group, index in it), when asked
        self._event: trio.Event | None = None  # made for the first waiter only: most batches are never awaited
        self._callbacks: list[Callable[[_Batch], object]] | None = None

    def __len__(self) -> int:
        return self.count

    def unrun(self) -> None:
        """Make the run of sends this batch holds messages, so that other messages may follow them."""
        if self.run is not None:
            self.messages += self.run
            self.run = None

    def add_done_callback(self, callback: Callable[[_Batch], object]) -> None:
        if self.done:
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def settle(self, groups: list[Sequence[int]], results: Sequence[Positions | BaseException]) -> None:
        """The answer: per group (indexes of this batch), its positions or the error that kept it out."""
        self._groups, self._results = groups, results
        self.done = True
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback(self)

    def result(self, index: int) -> Position:
        if not self.done:
            raise RuntimeError("the message is not stored yet: await the handle")
        if len(self._results) == 1:
            group, k = 0, index
        else:
            if self._where is None:
                self._where = [(0, 0)] * len(self)
                for g, indexes in enumerate(self._groups):
                    for k, i in enumerate(indexes):
                        self._where[i] = (g, k)
            group, k = self._where[index]
        outcome = self._results[group]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome[k]

    def positions(self, start: int, count: int) -> Positions:
        """The positions of messages ``start`` to ``start + count``, or the first failed one's error raised."""
        if len(self._results) == 1:  # one group: the whole batch
            outcome = self._results[0]
            if isinstance(outcome, BaseException):
                raise outcome
            return Positions(outcome.log, outcome.offsets[start : start + count])
        found = [self.result(i) for i in range(start, start + count)]
        return Positions(found[0].log if found else MAIN_LOG, [p.offset for p in found])

    async def wait(self) -> None:
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()


@final
class Message:
    """One message of a :meth:`Producer.send_batch`: :meth:`Producer.send`'s arguments."""

    __slots__ = ("topic", "payload", "options")

    def __init__(self, topic: str, payload: bytes, **options: Any) -> None:
        self.topic = topic
        self.payload = payload
        self.options: Mapping[str, Any] = options


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    sent: int  # messages accepted (send, send_nowait, send_batch)
    stored: int  # messages the store appended
    failed: int  # messages whose handle raised
    batches: int  # requests sent
    buffered: int  # messages waiting for a batch
    held_bytes: int  # payload bytes buffered or in flight (at most total_batch_max_bytes, or one message's)
    waits: int  # sends that waited for room (back-pressure)


@final
class Producer:
    """Publishes to MQTT topics through a store node; create it with :meth:`connect` (or :meth:`over`)."""

    def __init__(self, client: GroupAppender, *, client_id: str, auto_batch: bool = True,
                 batch_max_delay_ms: float = BATCH_MAX_DELAY_MS, batch_max_bytes: int = BATCH_MAX_BYTES,
                 batch_max_count: int = BATCH_MAX_COUNT, total_batch_max_bytes: int = TOTAL_BATCH_MAX_BYTES,
                 durable: bool | None = True, in_flight: int = 1) -> None:
        self.client = client
        self.client_id = client_id
        self._delay_s = batch_max_delay_ms / 1000 if auto_batch else 0.0
        self._batch_bytes = batch_max_bytes
        self._batch_count = batch_max_count if auto_batch else 1
        self._total_bytes = total_batch_max_bytes
        self._durable = durable
        self._batches_buffered: deque[_Batch] = deque()  # what the next requests take, in order (the last one
        # takes sends unless closed)
        self._cuts = 0  # send_batch's batches in them
        self._buffered = 0  # messages in them
        self._topics: set[str] = set()  # topics validated already (a send's topic is checked once, not per send)
        self._buffered_bytes = 0
        self._held_bytes = 0  # buffered or in flight: what total_batch_max_bytes bounds
        self._room_lock = trio.Lock()  # senders waiting for room, first come first served
        self._room_freed = trio.Event()
        self._wakeup = trio.Event()  # set when the buffer gets its first message or fills a batch, or on flush
        self._flushing = False  # a flush waits: send what is buffered without lingering
        self._slots = trio.Semaphore(in_flight)
        self._idle = trio.Event()  # set while nothing is buffered or in flight
        self._idle.set()
        self._in_flight = 0
        self._sent = self._stored = self._failed = self._batches = self._waits = 0
        self._yielded = time.perf_counter()  # when send last let other tasks run

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
        timeout_s: float | None = 30.0,
        **settings: Any,
    ) -> AsyncIterator[Producer]:
        """Connect to the store node at ``host:port`` (its ``store.listen``) and produce until the block exits.

        Without ``port``, ``host`` is the comma-separated ``HOST:PORT`` list of a replicated store's replicas: the
        producer finds the leader and follows it when it changes (docs/cluster.md, "Replicated store").

        Args:
            username, password: the service's credentials, when the store has a password file.
            client_id: the producer id recorded with each message (and ``%c`` in ACL rules);
                default ``producer-<host>-<pid>-<n>``. Unique among the store's connections.
            timeout_s: give up if the first connection takes longer (None: retry forever).
            settings: the batching and durability settings of :meth:`over`.

        Raises:
            StoreUnavailable: no connection within ``timeout_s``.
            StoreRpcError: the store refused the connection (bad credentials, another protocol version).
        """
        name = client_id or unique_client_name("producer")
        async with RemoteStore.connect(host, port, node=name, timeout_s=timeout_s, username=username,
                                       password=password) as client, cls.over(client, client_id=name,
                                                                              **settings) as producer:
            yield producer

    @classmethod
    @asynccontextmanager
    async def over(
        cls,
        client: GroupAppender,
        *,
        client_id: str,
        auto_batch: bool = True,
        batch_max_delay_ms: float = BATCH_MAX_DELAY_MS,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        batch_max_count: int = BATCH_MAX_COUNT,
        total_batch_max_bytes: int = TOTAL_BATCH_MAX_BYTES,
        durable: bool | None = True,
    ) -> AsyncIterator[Producer]:
        """Produce through ``client`` (a connected ``RemoteStore``, or a store in this process: ``LocalStore``)
        until the block exits, then flush (unless the block raised).

        Args:
            auto_batch: group sends into batches (the module docstring); False: each send is a request of its own.
            batch_max_delay_ms, batch_max_bytes, batch_max_count: when a batch leaves (the module docstring).
            total_batch_max_bytes: payload bytes buffered or in flight beyond which ``send`` waits.
            durable: True: a handle completes once the message is on disk; None: per
                the store's flush policy; False: once it is written (not flushed).
        """
        producer = cls(client, client_id=client_id, auto_batch=auto_batch, batch_max_delay_ms=batch_max_delay_ms,
                       batch_max_bytes=batch_max_bytes, batch_max_count=batch_max_count,
                       total_batch_max_bytes=total_batch_max_bytes, durable=durable,
                       in_flight=IN_FLIGHT if isinstance(client, RemoteStore) else 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer._run, nursery)
            yield producer
            await producer.flush()
            nursery.cancel_scope.cancel()

    async def send(self, topic: str, payload: bytes, **options: Any) -> SendHandle:
        """Queue a message for ``topic`` once there is room (``total_batch_max_bytes``); returns its handle
        (``await`` it for the position). With room, it yields to other tasks only when the message fills a batch or
        ``SEND_SLICE_S`` passed since it last did.

        Args (keyword):
            qos: the QoS the message is stored with (0..2, default 1): devices receive it at
                the lower of this and their subscription's QoS.
            retain: also make it the topic's retained message (an empty payload deletes that).
            properties: an MQTT 5 PUBLISH property block, as encoded on the wire without its length.
            delay_s, deliver_at: deliver it this many seconds from now, or at this time (ms since the epoch), not
                now: a delayed message, which the store keeps until then (store/timer/; the handle's position is
                its Delayed record's, whose ``id`` is the message's id: :meth:`cancel_delayed`). A store with a
                cap of delayed messages per client fails the handle with ``DelayedCapExceeded`` when this
                producer's client id is at it.
            others: keyword arguments of :func:`encode_properties`, appended to ``properties``
                (do not set a property in both).

        Raises:
            TopicError: not a valid topic name (wildcards included).
            ValueError: a bad QoS or property value, a negative delay, or both delay_s and deliver_at.
        """
        message, payload = self._accept(topic, payload, options)
        size = len(payload)
        if self._room_lock.locked() or not self._fits(size):
            await self._room(size)
            return self._queue(topic, payload, message, size)
        handle = self._queue(topic, payload, message, size)
        now = time.perf_counter()  # a batch is ready (the batching task sends it now), or other tasks have waited
        if self._full() or now - self._yielded >= SEND_SLICE_S:  # a slice: a round per message would cost more
            self._yielded = now  # than the message
            await trio.lowlevel.checkpoint()
        return handle

    def send_nowait(self, topic: str, payload: bytes, **options: Any) -> SendHandle:
        """:meth:`send` without waiting for room.

        Raises:
            trio.WouldBlock: ``total_batch_max_bytes`` are buffered or in flight, or other sends wait for room.
            others: as :meth:`send`.
        """
        message, payload = self._accept(topic, payload, options)
        size = len(payload)
        if self._room_lock.locked() or not self._fits(size):
            raise trio.WouldBlock(f"{self._held_bytes} bytes are buffered or in flight: await send() or flush()")
        return self._queue(topic, payload, message, size)

    @overload
    async def send_batch(self, messages: Iterable[Message]) -> list[SendHandle]: ...

    @overload
    async def send_batch(self, messages: Iterable[bytes], *, topic: str, **options: Any) -> BatchHandle: ...

    async def send_batch(self, messages: Iterable[Message] | Iterable[bytes], *, topic: str | None = None,
                         **options: Any) -> list[SendHandle] | BatchHandle:
        """Send ``messages`` in one request, now (after what is buffered); their handles, in order, each with its
        message's own outcome. Checked whole first: a bad one raises and none is sent.

        With ``topic``, ``messages`` are payloads, all sent to ``topic`` with the same ``options`` (:meth:`send`'s):
        the cheap form, without an object per message (the store packs them as one batch record when they fit
        one); it returns one :class:`BatchHandle` (``await`` it for their ``Positions``; ``handle[i]``: the i-th
        message's own outcome, a payload too large failing alone as in the other form).

        Raises:
            TopicError, ValueError: as :meth:`send`, for any of the messages.
        """
        if topic is not None:
            like = self._message(topic, b"", options)
            run = PayloadRun(like, [p if type(p) is bytes else bytes(p) for p in messages])  # type: ignore[arg-type, misc]
            size = sum(map(len, run.payloads))
            await self._room(size)
            return self._queue_run(run, size)
        made = [self._message(m.topic, m.payload, m.options) for m in messages]  # type: ignore[union-attr]
        if not made:
            return []
        size = sum(len(m.payload) for m in made)
        await self._room(size)
        batch = self._open(len(made), size)
        batch.unrun()
        start = len(batch.messages)
        batch.messages += made
        batch.count += len(made)
        self._close(batch, cut=True)
        return [SendHandle(batch, i) for i in range(start, start + len(made))]

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
        return ProducerStatistics(self._sent, self._stored, self._failed, self._batches, self._buffered,
                                  self._held_bytes, self._waits)

    def _check(self, topic: str) -> None:
        """Raise ``TopicError`` unless ``topic`` is a valid topic name (checked once per topic)."""
        if topic not in self._topics:
            validate_topic(topic)
            if len(self._topics) >= MAX_TOPICS_KEPT:
                self._topics.clear()
            self._topics.add(topic)

    def _accept(self, topic: str, payload: bytes, options: Mapping[str, Any]) -> tuple[NewMessage | None, bytes]:
        """A send's arguments checked: its message, or None when it has no options (:meth:`_queue` makes one only
        if it does not join a run), and its payload as kept."""
        if options:
            message = self._message(topic, payload, options)
            return message, message.payload
        self._check(topic)
        return None, payload if type(payload) is bytes else bytes(payload)

    def _message(self, topic: str, payload: bytes, options: Mapping[str, Any]) -> NewMessage:
        """The message a send stores, its arguments checked (:meth:`send`)."""
        self._check(topic)
        now = int(time.time() * 1000)
        if not options:
            return NewMessage(topic, bytes(payload), self.client_id, 1, False, b"", now)
        common = dict(options)
        qos = common.pop("qos", 1)
        retain = common.pop("retain", False)
        properties = common.pop("properties", b"")
        delay_s = common.pop("delay_s", None)
        deliver_at = common.pop("deliver_at", None)
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
        if common:
            properties += encode_properties(**common)
        return NewMessage(topic, bytes(payload), self.client_id, qos, retain, properties, now, 0,
                          _due(now, delay_s, deliver_at))

    def _fits(self, size: int) -> bool:
        """Room for ``size`` more bytes: within the total, or nothing held (one message larger than the total goes
        alone rather than never)."""
        return not self._held_bytes or self._held_bytes + size <= self._total_bytes

    async def _room(self, size: int) -> None:
        """Wait until ``size`` bytes fit, behind the senders that waited first."""
        await trio.lowlevel.checkpoint()
        if not self._room_lock.locked() and self._fits(size):
            return
        self._waits += 1
        async with self._room_lock:
            while not self._fits(size):
                self._room_freed = trio.Event()
                await self._room_freed.wait()

    def _open(self, count: int, size: int) -> _Batch:
        """The batch that takes ``count`` more messages of ``size`` payload bytes: the last one buffered unless
        closed, or a new one (which wakes the batching task)."""
        batches = self._batches_buffered
        if batches and not batches[-1].closed:
            batch = batches[-1]
        else:
            batch = _Batch()
            batches.append(batch)
            if len(batches) == 1:
                self._wakeup.set()
        batch.size += size
        self._buffered += count
        self._buffered_bytes += size
        self._held_bytes += size
        self._sent += count
        if self._idle.is_set():
            self._idle = trio.Event()
        return batch

    def _close(self, batch: _Batch, *, cut: bool = False) -> None:
        """No more sends join ``batch``: the next request takes it, now (``cut``: a ``send_batch``'s, which goes
        with every batch waiting before it, whatever their size, as one request)."""
        batch.closed = True
        batch.cut = cut
        self._cuts += cut
        self._wakeup.set()

    def _queue(self, topic: str, payload: bytes, message: NewMessage | None, size: int) -> SendHandle:
        """Buffer one send (``message``, or None when it has no options) of ``size`` payload bytes; its handle.
        The sends without options of one topic that start a batch are kept as a run (their payloads and born
        times), which the store packs whole (``StoreNode._batch``); another send turns the run into messages."""
        batch = self._open(1, size)
        run = batch.run
        if message is None and (run.like.topic == topic if run is not None else not batch.messages):
            born = int(time.time() * 1000)
            if run is None:
                like = NewMessage(topic, b"", self.client_id, 1, False, b"", born)
                batch.run = run = PayloadRun(like, [], [])
            run.payloads.append(payload)
            run.borns.append(born)  # type: ignore[union-attr]  # a run of sends has them
            handle = SendHandle(batch, len(run) - 1)
        else:
            batch.unrun()
            handle = SendHandle(batch, len(batch.messages))
            batch.messages.append(message or NewMessage(topic, payload, self.client_id, 1, False, b"",
                                                        int(time.time() * 1000)))
        batch.count += 1
        if batch.count >= self._batch_count or batch.size >= self._batch_bytes:
            self._close(batch)
        return handle

    def _queue_run(self, run: PayloadRun, size: int) -> BatchHandle:
        """Buffer a ``send_batch`` of payloads (``run``, ``size`` bytes), after the sends the open batch holds."""
        batch = self._open(len(run), size)
        batch.unrun()
        batch.run = run
        batch.count += len(run)
        self._close(batch, cut=True)
        return BatchHandle(batch, len(batch.messages), len(run))

    def _full(self) -> bool:
        batches = self._batches_buffered
        return bool(batches) and batches[-1].closed

    async def _run(self, nursery: trio.Nursery) -> None:
        """Send batches: when one is full, or ``batch_max_delay_ms`` after its first message (or at once on flush
        and send_batch). The producer's one timer."""
        batches = self._batches_buffered
        while True:
            if not batches:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            if not batches[0].closed and not self._flushing and self._delay_s:
                self._wakeup = trio.Event()
                with trio.move_on_after(self._delay_s):
                    await self._wakeup.wait()
            await self._slots.acquire()
            taken = [batches.popleft()]
            self._cuts -= taken[0].cut
            count, size = taken[0].count, taken[0].size
            while batches and batches[0].closed and (self._cuts or count + batches[0].count <= self._batch_count
                                                     and size + batches[0].size <= self._batch_bytes):
                self._cuts -= batches[0].cut  # a send_batch's waiting: it goes with every batch before it
                count += batches[0].count
                size += batches[0].size
                taken.append(batches.popleft())
            taken[0].closed = True
            self._buffered -= count
            self._buffered_bytes -= size
            self._flushing = self._flushing and bool(batches)
            self._in_flight += 1
            nursery.start_soon(self._send, taken, size)

    async def _send(self, taken: list[_Batch], size: int) -> None:
        """Store the batches ``taken`` (``size`` payload bytes) in one request, and settle each."""
        try:
            plans = [self._groups(batch) for batch in taken]
            try:
                results = await self.client.append_groups([g for _, groups, _ in plans for g in groups],
                                                          durable=self._durable,
                                                          batched=[b for _, _, batched in plans for b in batched])
            except (OSError, ValueError) as exc:  # StoreUnavailable is an OSError
                plans = [([range(len(batch))], [], []) for batch in taken]
                results = [exc] * len(taken)
            self._batches += 1
            start = 0
            for batch, (indexes, groups, _) in zip(taken, plans):
                part = results[start : start + len(indexes)]
                start += len(indexes)
                for group, result in zip(indexes, part):
                    if isinstance(result, BaseException):
                        self._failed += len(group)
                    else:
                        self._stored += len(group)
                batch.settle(indexes, part)
        finally:
            self._in_flight -= 1
            self._held_bytes -= size
            self._room_freed.set()
            self._slots.release()
            if not self._in_flight and not self._batches_buffered:
                self._idle.set()

    def _groups(self, batch: _Batch) -> tuple[list[Sequence[int]], list[Sequence[NewMessage]], list[bool]]:
        """What a request appends of ``batch`` (one CommitLog write): its same-topic runs as batch records where
        that lets each message fail alone and keeps each topic's order (``store.api.batch_groups``: what remains,
        a topic matching very many wildcard filters, is said there). The batch's indexes of each group, the groups
        and whether each is batched."""
        max_size = self.client.max_record_bytes
        messages, run = batch.messages, batch.run
        groups: list[Sequence[NewMessage]] = []
        indexes: list[Sequence[int]] = []
        batched: list[bool] = []
        if messages:
            found, batched = batch_groups(messages, max_size)
            if len(found) == 1:  # one topic, one batched group (or one message): in order, as sent
                groups, indexes = [messages], [range(len(messages))]
            else:
                groups, indexes = [[messages[i] for i in group] for group in found], list(found)
        if run is not None:
            found, run_batched = batch_groups(run, max_size)
            start = len(messages)
            if len(found) == 1:  # the whole run in one group: as it is (the store packs it whole)
                groups.append(run)
                indexes.append(range(start, start + len(run)))
            else:
                groups += [[run[i] for i in group] for group in found]
                indexes += [[start + i for i in group] for group in found]
            batched = [*batched, *run_batched]
        return indexes, groups, batched


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

