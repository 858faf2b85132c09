"""The back-end clients for asyncio: the trio Producer, Consumer and PopConsumer on a trio thread, awaited without
blocking.

::

    async with AsyncioProducer.connect("store-host", 7883, username="billing", password="...") as producer:
        future = await producer.send("cmd/dev-17/reboot", b"now", qos=1, content_type="text/plain")
        position = await future
        futures = await producer.send_batch([Message("cmd/dev-18/reboot", b"now"), Message("cmd/dev-19/on", b"1")])
        positions = await (await producer.send_batch([b"21.5", b"21.7"], topic="tele/dev-17/temp"))
        await producer.flush()
        await producer.cancel_delayed((await producer.send("cmd/dev-17/off", b"", delay_s=60)).id)

    async with AsyncioConsumer.connect("store-host", 7883, group="billing", filter="tele/#") as consumer:
        async for batch in consumer:
            for message in batch:
                await handle(message.topic, message.payload, message.properties.user_properties)

The trio clients run unchanged on their own thread (threaded.py); each call
is a ``concurrent.futures.Future`` that asyncio awaits through
``asyncio.wrap_future``, so a coroutine waiting on the store (a long poll, a
durable append) leaves the event loop free and holds no executor thread.
Cancelling the awaiting task cancels the call on the trio side. Only
:meth:`AsyncioProducer.send` runs briefly on the caller's thread when the
producer has room (it waits for the trio thread to queue the message,
microseconds, so that a bad topic raises at once, as in the trio face); when
it holds ``total_batch_max_bytes``, the send is awaited until there is room.

Arguments, guarantees and errors are the trio clients' (producer.py, consumer.py, pop.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Self, TypeVar, final, overload

from store.api import Position, Positions
from store.clients.blocking import send_futures, send_run
from store.clients.consumer import Batch, Consumer
from store.clients.pop import PopConsumer, PopMessage, Receipt
from store.clients.producer import Message, Producer, ProducerStatistics
from store.clients.threaded import Face

__all__ = ["AsyncioConsumer", "AsyncioPopConsumer", "AsyncioProducer", "Message"]

T = TypeVar("T")


class _Asyncio(Face[T]):
    @classmethod
    @asynccontextmanager
    async def connect(cls, host: str, port: int | None = None, **options: Any) -> AsyncIterator[Self]:
        """Connect as the trio client's ``connect(host, port, **options)`` does (same arguments, same errors);
        leaving the block leaves the client as the block did (raised or not)."""
        thread = cls.start(host, port, options)
        face = cls(thread, await asyncio.wrap_future(thread.opened))
        try:
            yield face
        except BaseException as exc:
            await asyncio.wrap_future(thread.close(exc))
            raise
        await asyncio.wrap_future(thread.close())


@final
class AsyncioProducer(_Asyncio[Producer]):
    """:class:`store.clients.producer.Producer` for asyncio; create it with :meth:`connect`."""

    trio_client = Producer.connect

    async def send(self, topic: str, payload: bytes, **options: Any) -> asyncio.Future[Position]:
        """Queue a message (``Producer.send``'s arguments), awaiting room while the producer holds
        ``total_batch_max_bytes``; await the future it returns for the message's ``Position``.

        Raises: ``Producer.send``'s errors (TopicError, ValueError).
        """
        (future,) = await self._queued([Message(topic, payload, **options)])
        return future

    @overload
    async def send_batch(self, messages: Iterable[Message]) -> list[asyncio.Future[Position]]: ...

    @overload
    async def send_batch(self, messages: Iterable[bytes], *, topic: str,
                         **options: Any) -> asyncio.Future[Positions]: ...

    async def send_batch(self, messages: Iterable[Message] | Iterable[bytes], *, topic: str | None = None,
                         **options: Any) -> list[asyncio.Future[Position]] | asyncio.Future[Positions]:
        """``Producer.send_batch``: the messages in one request; a future per message, in order.

        With ``topic``, ``messages`` are payloads, all sent to ``topic`` with the same ``options`` (``send``'s):
        the cheap form (no object per message), one future of their ``Positions`` (raising the first failed
        message's error: a payload too large fails alone at the store, as in the other form).

        Raises: ``Producer.send``'s errors, for any of the messages (then none is sent).
        """
        if topic is not None:
            queued = send_run(self._thread, self._client, list(messages), topic, options)  # type: ignore[arg-type]
            batch = await asyncio.wrap_future(queued)
            return asyncio.wrap_future(batch)
        return await self._queued(list(messages))  # type: ignore[arg-type]

    async def _queued(self, messages: list[Message]) -> list[asyncio.Future[Position]]:
        queued = send_futures(self._thread, self._client, messages)
        futures = queued.result() if queued.done() else await asyncio.wrap_future(queued)
        return [asyncio.wrap_future(future) for future in futures]

    async def flush(self) -> None:
        """Return once every message sent before the call is stored or failed."""
        await asyncio.wrap_future(self._thread.submit(self._client.flush))

    async def cancel_delayed(self, delayed_id: str | Position) -> bool:
        """Cancel a pending delayed message by its id (``Producer.cancel_delayed``), awaited."""
        return await asyncio.wrap_future(self._thread.submit(self._client.cancel_delayed, delayed_id))

    def statistics(self) -> ProducerStatistics:
        return self._thread.call(self._client.statistics)


@final
class AsyncioConsumer(_Asyncio[Consumer]):
    """:class:`store.clients.consumer.Consumer` for asyncio; create it with :meth:`connect`."""

    trio_client = Consumer.connect

    @property
    def committed(self) -> int:
        """The group's committed offset, as the store last said."""
        return self._client.committed

    async def poll(self, max_count: int | None = None, wait_s: float | None = None) -> Batch:
        """``Consumer.poll``, awaited: the loop runs meanwhile."""
        return await asyncio.wrap_future(self._thread.submit(self._client.poll, max_count, wait_s))

    async def commit(self, batch: Batch | list[int]) -> int:
        """``Consumer.commit``, awaited: the committed offset, durable on return."""
        return await asyncio.wrap_future(self._thread.submit(self._client.commit, batch))

    async def __aiter__(self) -> AsyncIterator[Batch]:
        """The trio consumer's ``async for``, batch by batch (its auto-commit included)."""
        batches = aiter(self._client)
        while True:
            yield await asyncio.wrap_future(self._thread.submit(anext, batches))


@final
class AsyncioPopConsumer(_Asyncio[PopConsumer]):
    """:class:`store.clients.pop.PopConsumer` for asyncio; create it with :meth:`connect`."""

    trio_client = PopConsumer.connect

    async def pop(self, max_count: int | None = None, invisible_s: float | None = None,
                  wait_s: float | None = None) -> list[PopMessage]:
        """``PopConsumer.pop``, awaited: the loop runs meanwhile."""
        return await asyncio.wrap_future(self._thread.submit(self._client.pop, max_count, invisible_s, wait_s))

    async def ack(self, receipt: Receipt) -> bool:
        """``PopConsumer.ack``: whether it counted, durable on return."""
        return await asyncio.wrap_future(self._thread.submit(self._client.ack, receipt))

    async def ack_all(self, receipts: list[Receipt]) -> list[bool]:
        return await asyncio.wrap_future(self._thread.submit(self._client.ack_all, receipts))

    async def nack(self, receipt: Receipt, delay_s: float = 0.0) -> str | None:
        return await asyncio.wrap_future(self._thread.submit(self._client.nack, receipt, delay_s))

    async def change_invisible_time(self, receipt: Receipt, invisible_s: float) -> str | None:
        return await asyncio.wrap_future(self._thread.submit(self._client.change_invisible_time, receipt,
                                                             invisible_s))
