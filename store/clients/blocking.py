"""The back-end clients for blocking code: the trio Producer and Consumer, each on a trio thread of its own.

::

    with BlockingProducer.connect("store-host", 7883, username="billing", password="...") as producer:
        future = producer.send("cmd/dev-17/reboot", b"now", qos=1, content_type="text/plain")
        position = future.result()    # appended (durable: on disk by default)
        futures = producer.send_batch([Message("cmd/dev-18/reboot", b"now"), Message("cmd/dev-19/reboot", b"now")])
        positions = producer.send_batch([b"21.5", b"21.7"], topic="tele/dev-17/temp").result()  # one future
        producer.flush()              # or: wait for everything sent so far
        producer.cancel_delayed(producer.send("cmd/dev-17/off", b"", delay_s=60).result().id)

    with BlockingConsumer.connect("store-host", 7883, group="billing", filter="tele/#") as consumer:
        for batch in consumer:        # the previous batch is acknowledged when the next is asked for
            for message in batch:
                handle(message.topic, message.payload, message.properties.content_type)

    with BlockingPopConsumer.connect("store-host", 7883, group="billing", filter="tele/#", invisible_s=30) as pops:
        for message in pops.pop(max_count=16):
            handle(message.payload)
            pops.ack(message)

The arguments, batching, guarantees (at most once per send; at least once per
consumer group and POP group), reconnection and errors are the trio clients' (producer.py,
consumer.py, pop.py): these faces run them unchanged (threaded.py says how, and why
not anyio). Calls may come from any thread; ``send`` blocks its caller while
the producer holds ``total_batch_max_bytes`` (the trio face's back-pressure).

Resource handling: ``connect`` owns the trio thread; leaving the block flushes
the producer (unless the block raised) or leaves the group, then ends it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Self, TypeVar, final, overload

import trio

from store.api import Position, Positions
from store.clients.consumer import Batch, Consumer
from store.clients.pop import PopConsumer, PopMessage, Receipt
from store.clients.producer import BatchHandle, Message, Producer, ProducerStatistics, SendHandle
from store.clients.threaded import Face, TrioThread

__all__ = ["BlockingConsumer", "BlockingPopConsumer", "BlockingProducer", "Message", "send_futures", "send_run"]

T = TypeVar("T")


@overload
def future_of(handle: SendHandle) -> concurrent.futures.Future[Position]: ...


@overload
def future_of(handle: BatchHandle) -> concurrent.futures.Future[Positions]: ...


def future_of(handle: SendHandle | BatchHandle) -> concurrent.futures.Future[Any]:
    """The handle's outcome as a future any thread can wait on (made on the trio thread)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def settle(done: SendHandle | BatchHandle) -> None:
        try:
            future.set_result(done.result())
        except Exception as exc:  # the send's error, for the waiter to raise
            future.set_exception(exc)

    handle.add_done_callback(settle)  # type: ignore[arg-type]  # each handle calls back with itself
    return future


def send_futures(thread: TrioThread[Producer], producer: Producer, messages: list[Message]
                 ) -> concurrent.futures.Future[list[concurrent.futures.Future[Position]]]:
    """``producer.send`` of one message (``producer.send_batch`` of several) from another thread: completes with
    the messages' futures once they are queued, at once when there is room (one call into the trio thread),
    after the producer's back-pressure wait otherwise."""
    if len(messages) == 1:
        (message,) = messages
        try:
            handles = [thread.call(producer.send_nowait, message.topic, message.payload, **message.options)]
        except trio.WouldBlock:
            pass
        else:
            queued: concurrent.futures.Future[list[concurrent.futures.Future[Position]]] = concurrent.futures.Future()
            queued.set_result([future_of(handle) for handle in handles])
            return queued

    async def send() -> list[concurrent.futures.Future[Position]]:
        return [future_of(handle) for handle in await producer.send_batch(messages)]

    return thread.submit(send)


def send_run(thread: TrioThread[Producer], producer: Producer, payloads: list[bytes], topic: str,
             options: dict[str, Any]) -> concurrent.futures.Future[concurrent.futures.Future[Positions]]:
    """``producer.send_batch(payloads, topic=topic, **options)`` from another thread: completes with the one future
    of the batch's ``Positions`` once it is queued (after the producer's back-pressure wait, if any)."""

    async def send() -> concurrent.futures.Future[Positions]:
        return future_of(await producer.send_batch(payloads, topic=topic, **options))

    return thread.submit(send)


class _Blocking(Face[T]):
    @classmethod
    @contextmanager
    def connect(cls, host: str, port: int | None = None, **options: Any) -> Iterator[Self]:
        """Connect as the trio client's ``connect(host, port, **options)`` does (same arguments, same errors);
        leaving the block leaves the client as the block did (raised or not)."""
        thread = cls.start(host, port, options)
        face = cls(thread, thread.opened.result())
        try:
            yield face
        except BaseException as exc:
            thread.close(exc).result()
            raise
        thread.close().result()


@final
class BlockingProducer(_Blocking[Producer]):
    """:class:`store.clients.producer.Producer` for blocking code; create it with :meth:`connect`."""

    trio_client = Producer.connect

    def send(self, topic: str, payload: bytes, **options: Any) -> concurrent.futures.Future[Position]:
        """Queue a message (``Producer.send``'s arguments), waiting while the producer holds
        ``total_batch_max_bytes``; the future gives its position or error.

        Raises (at once): ``Producer.send``'s errors (TopicError, ValueError).
        """
        (future,) = send_futures(self._thread, self._client, [Message(topic, payload, **options)]).result()
        return future

    @overload
    def send_batch(self, messages: Iterable[Message]) -> list[concurrent.futures.Future[Position]]: ...

    @overload
    def send_batch(self, messages: Iterable[bytes], *, topic: str,
                   **options: Any) -> concurrent.futures.Future[Positions]: ...

    def send_batch(self, messages: Iterable[Message] | Iterable[bytes], *, topic: str | None = None,
                   **options: Any) -> list[concurrent.futures.Future[Position]] | concurrent.futures.Future[Positions]:
        """``Producer.send_batch``: the messages in one request; a future per message, in order.

        With ``topic``, ``messages`` are payloads, all sent to ``topic`` with the same ``options`` (``send``'s):
        the cheap form (no object per message), one future of their ``Positions`` (raising the first failed
        message's error: a payload too large fails alone at the store, as in the other form).

        Raises (at once): ``Producer.send``'s errors, for any of the messages (then none is sent).
        """
        if topic is not None:
            return send_run(self._thread, self._client, list(messages), topic, options).result()  # type: ignore[arg-type]
        return send_futures(self._thread, self._client, list(messages)).result()  # type: ignore[arg-type]

    def flush(self) -> None:
        """Return once every message sent before the call is stored or failed."""
        self._thread.submit(self._client.flush).result()

    def cancel_delayed(self, delayed_id: str | Position) -> bool:
        """Cancel a pending delayed message by its id (``Producer.cancel_delayed``)."""
        return self._thread.submit(self._client.cancel_delayed, delayed_id).result()

    def statistics(self) -> ProducerStatistics:
        return self._thread.call(self._client.statistics)


@final
class BlockingConsumer(_Blocking[Consumer]):
    """:class:`store.clients.consumer.Consumer` for blocking code; create it with :meth:`connect`.

    ``committed`` is the group's committed offset, as the store last said.
    """

    trio_client = Consumer.connect

    @property
    def committed(self) -> int:
        return self._client.committed

    def poll(self, max_count: int | None = None, wait_s: float | None = None) -> Batch:
        """Claim the next batch (``Consumer.poll``)."""
        return self._thread.submit(self._client.poll, max_count, wait_s).result()

    def commit(self, batch: Batch | list[int]) -> int:
        """Acknowledge a batch (``Consumer.commit``); the group's committed offset, durable on return."""
        return self._thread.submit(self._client.commit, batch).result()

    def __iter__(self) -> Iterator[Batch]:
        """Batches as they come, as ``async for`` over the trio consumer gives them (auto-commit included)."""
        batches = aiter(self._client)
        while True:
            yield self._thread.submit(anext, batches).result()


@final
class BlockingPopConsumer(_Blocking[PopConsumer]):
    """:class:`store.clients.pop.PopConsumer` for blocking code; create it with :meth:`connect`."""

    trio_client = PopConsumer.connect

    def pop(self, max_count: int | None = None, invisible_s: float | None = None,
            wait_s: float | None = None) -> list[PopMessage]:
        """``PopConsumer.pop``."""
        return self._thread.submit(self._client.pop, max_count, invisible_s, wait_s).result()

    def ack(self, receipt: Receipt) -> bool:
        """``PopConsumer.ack``: whether it counted, durable on return."""
        return self._thread.submit(self._client.ack, receipt).result()

    def ack_all(self, receipts: list[Receipt]) -> list[bool]:
        return self._thread.submit(self._client.ack_all, receipts).result()

    def nack(self, receipt: Receipt, delay_s: float = 0.0) -> str | None:
        return self._thread.submit(self._client.nack, receipt, delay_s).result()

    def change_invisible_time(self, receipt: Receipt, invisible_s: float) -> str | None:
        return self._thread.submit(self._client.change_invisible_time, receipt, invisible_s).result()
