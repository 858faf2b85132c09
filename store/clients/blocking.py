"""The back-end clients for blocking code: the trio Producer and Consumer, each on a trio thread of its own.

::

    with BlockingProducer.connect("store-host", 7883, username="billing", password="...") as producer:
        future = producer.send("cmd/dev-17/reboot", b"now", qos=1, content_type="text/plain")
        position = future.result()    # appended (durable: on disk by default)
        producer.flush()              # or: wait for everything sent so far

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
not anyio). Calls may come from any thread.

Resource handling: ``connect`` owns the trio thread; leaving the block flushes
the producer (unless the block raised) or leaves the group, then ends it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self, TypeVar, final

from store.api import Position
from store.clients.consumer import Batch, Consumer
from store.clients.pop import PopConsumer, PopMessage, Receipt
from store.clients.producer import Producer, ProducerStatistics, SendHandle
from store.clients.threaded import Face

__all__ = ["BlockingConsumer", "BlockingPopConsumer", "BlockingProducer", "send_future"]

T = TypeVar("T")


def send_future(producer: Producer, topic: str, payload: bytes, options: dict[str, Any]) -> \
        concurrent.futures.Future[Position]:
    """``producer.send`` (run on the trio thread) with its handle's outcome as a future any thread can wait on."""
    future: concurrent.futures.Future[Position] = concurrent.futures.Future()

    def settle(handle: SendHandle) -> None:
        try:
            future.set_result(handle.result())
        except Exception as exc:  # the send's error, for the waiter to raise
            future.set_exception(exc)

    producer.send(topic, payload, **options).add_done_callback(settle)
    return future


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
        """Queue a message (``Producer.send``'s arguments); the future gives its CommitLog offset or error.

        Raises (at once): ``Producer.send``'s errors (TopicError, ValueError, ``trio.WouldBlock``).
        """
        return self._thread.call(send_future, self._client, topic, payload, options)

    def flush(self) -> None:
        """Return once every message sent before the call is stored or failed."""
        self._thread.submit(self._client.flush).result()

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
