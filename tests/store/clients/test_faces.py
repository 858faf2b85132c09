"""The back-end clients' three faces, trio (producer.py, consumer.py), blocking (blocking.py) and asyncio (aio.py),
over one scenario against a real store node (RocksDB, CommitLog, RPC over TCP), run in a thread of this process:
produce with MQTT 5 properties, consume with a consumer group, commit, and a new member resuming after the commit.
And the consumers' decoding of MQTT 5 properties (properties.py)."""

import asyncio
import contextlib
import threading
import time

import pytest
import trio

from store.clients.aio import AsyncioConsumer, AsyncioProducer
from store.clients.blocking import BlockingConsumer, BlockingProducer
from store.clients.consumer import Consumer, ConsumerMessage
from store.clients.producer import Message, Producer
from store.clients.properties import NO_PROPERTIES, MessageProperties, decode_properties, encode_properties
from lightqueue.topics import TopicError
from store.log.commitlog import CommitLogConfig
from store.log.record import RecordTooLarge
from store.api import StoreUnavailable
from tests.helpers.threadstore import store_node

WAIT_S = 30.0
"""Generous: two busy cores."""

PROPERTIES = {"content_type": "application/json", "response_topic": "reply/billing", "correlation_data": b"\x00c1",
              "message_expiry_interval": 600, "payload_format_indicator": 1,
              "user_properties": [("trace", "t-1"), ("trace", "t-2")]}


@pytest.fixture
def port(tmp_path):
    with store_node(tmp_path) as port:
        yield port


# --- one scenario, three faces --------------------------------------------------------------
#
# Each face gives: produce(port, topic, payloads) -> offsets (each send's outcome, after a flush), and
# consume(port, group, filter, count) -> (messages, committed): joins, takes batches until it has ``count``
# messages, commits them, leaves. The scenario (``check_scenario``) is the same for all three.


async def send_all(producer, topic: str, payloads: list[bytes]) -> list[int]:
    """With a trio or asyncio producer: send, flush, then each send's outcome (a trio handle or an asyncio future)."""
    sent = [await producer.send(topic, payload, qos=1, **PROPERTIES) for payload in payloads]
    await producer.flush()
    return [await outcome for outcome in sent]


async def take(consumer, count: int) -> tuple[list[ConsumerMessage], int]:
    """With a trio or asyncio consumer: batches, each committed, until ``count`` messages came."""
    messages: list[ConsumerMessage] = []
    async for batch in consumer:
        messages += batch
        committed = await consumer.commit(batch)
        if len(messages) >= count:
            return messages, committed
    raise AssertionError("the iteration ended")


async def produce_async(face, port: int, topic: str, payloads: list[bytes]) -> list[int]:
    """With ``Producer`` (under trio) or ``AsyncioProducer`` (under asyncio)."""
    async with face.connect("127.0.0.1", port) as producer:
        return await send_all(producer, topic, payloads)


async def consume_async(face, deadline, port: int, group: str, filter: str,
                        count: int) -> tuple[list[ConsumerMessage], int]:
    """With ``Consumer`` and ``trio_deadline``, or ``AsyncioConsumer`` and ``asyncio.timeout``."""
    async with face.connect("127.0.0.1", port, group=group, filter=filter, auto_commit=False) as consumer:
        async with deadline(WAIT_S):
            return await take(consumer, count)


@contextlib.asynccontextmanager
async def trio_deadline(seconds: float):
    """``trio.fail_after`` as an async context manager, as ``asyncio.timeout`` is."""
    with trio.fail_after(seconds):
        yield


def blocking_produce(port: int, topic: str, payloads: list[bytes]) -> list[int]:
    with BlockingProducer.connect("127.0.0.1", port) as producer:
        futures = [producer.send(topic, payload, qos=1, **PROPERTIES) for payload in payloads]
        producer.flush()
        return [future.result(WAIT_S) for future in futures]


def blocking_consume(port: int, group: str, filter: str, count: int) -> tuple[list[ConsumerMessage], int]:
    messages: list[ConsumerMessage] = []
    with BlockingConsumer.connect("127.0.0.1", port, group=group, filter=filter, auto_commit=False) as consumer:
        for batch in consumer:
            messages += batch
            committed = consumer.commit(batch)
            if len(messages) >= count:
                return messages, committed
    raise AssertionError("the iteration ended")


def check_scenario(produce, consume) -> None:
    """Produce three messages with properties; a group member gets them in order with the properties decoded and
    commits; after a sentinel, a new member of the group starts from the commit: it gets the sentinel only."""
    payloads = [b'{"n": %d}' % i for i in range(3)]
    offsets = produce("tele/dev-1/state", payloads)
    assert offsets == sorted(offsets) and len(set(offsets)) == 3
    messages, committed = consume("billing", "tele/#", 3)
    assert [m.payload for m in messages] == payloads
    assert [m.offset for m in messages] == [0, 1, 2] and committed == 3
    for message in messages:
        props = message.properties
        assert isinstance(props, MessageProperties)
        assert (props.content_type, props.response_topic, props.correlation_data) == \
            ("application/json", "reply/billing", b"\x00c1")
        assert props.user_properties == (("trace", "t-1"), ("trace", "t-2")) and props.payload_format_indicator == 1
        assert props.message_expiry_interval == 600
        assert message.expires_ms == message.store_ms + 600_000
        assert abs(message.store_ms - time.time() * 1000) < 600_000
    produce("tele/dev-1/state", [b"sentinel"])
    (again,), committed = consume("billing", "tele/#", 1)  # the committed messages are not delivered again
    assert again.payload == b"sentinel" and again.offset == 3 and committed == 4


def test_the_trio_face(port):
    check_scenario(lambda *a: trio.run(produce_async, Producer, port, *a),
                   lambda *a: trio.run(consume_async, Consumer, trio_deadline, port, *a))


def test_the_blocking_face(port):
    check_scenario(lambda *a: blocking_produce(port, *a), lambda *a: blocking_consume(port, *a))


def test_the_asyncio_face(port):
    check_scenario(lambda *a: asyncio.run(produce_async(AsyncioProducer, port, *a)),
                   lambda *a: asyncio.run(consume_async(AsyncioConsumer, asyncio.timeout, port, *a)))


# --- what only one face can get wrong -------------------------------------------------------


def test_an_asyncio_consumer_waiting_on_the_store_leaves_the_event_loop_free(port):
    """A long poll awaited in asyncio must not block the loop: the message it waits for is produced by another
    coroutine of the same loop (a blocked loop would never send it, and the poll would end empty)."""

    async def main() -> list[bytes]:
        async with AsyncioConsumer.connect("127.0.0.1", port, group="g", filter="cmd/#", start="latest") as consumer, \
                AsyncioProducer.connect("127.0.0.1", port) as producer:
            poll = asyncio.create_task(consumer.poll(wait_s=WAIT_S))
            await asyncio.sleep(0)  # let the poll start: it runs on the trio thread from now on
            await (await producer.send("cmd/x", b"wake up"))
            batch = await asyncio.wait_for(poll, WAIT_S)
            return [m.payload for m in batch]

    assert asyncio.run(main()) == [b"wake up"]


def test_cancelling_an_asyncio_call_cancels_it_on_the_trio_thread(port):
    """A cancelled poll ends on the trio thread too (not 30 s later), and what it may have claimed at the store is
    not lost: it goes back to the group when the member leaves, as with the trio client (at least once)."""

    async def main() -> list[bytes]:
        async with AsyncioProducer.connect("127.0.0.1", port) as producer:
            async with AsyncioConsumer.connect("127.0.0.1", port, group="g", filter="idle/#",
                                               start="latest") as consumer:
                poll = asyncio.create_task(consumer.poll(wait_s=WAIT_S))
                while not consumer._thread._nursery.child_tasks:  # the call runs on the trio thread
                    await asyncio.sleep(0)
                poll.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await poll
                async with asyncio.timeout(WAIT_S / 3):  # well before the long poll's 30 s
                    while consumer._thread._nursery.child_tasks:  # cancelled there, not left running
                        await asyncio.sleep(0)
                await (await producer.send("idle/x", b"after the cancel"))
            async with AsyncioConsumer.connect("127.0.0.1", port, group="g", filter="idle/#") as again:
                return [m.payload for m in await again.poll(wait_s=WAIT_S)]

    assert asyncio.run(main()) == [b"after the cancel"]


def test_errors_raise_as_in_the_trio_face(port):
    """A bad send raises at ``send``; a refused message fails its future; no store raises from ``connect``."""
    with BlockingProducer.connect("127.0.0.1", port, batch_max_bytes=1) as producer:
        with pytest.raises(TopicError):
            producer.send("cmd/+", b"x")
        with pytest.raises(ValueError, match="qos"):
            producer.send("cmd/x", b"x", qos=3)
        with pytest.raises(RecordTooLarge):
            producer.send("cmd/x", b"x" * (CommitLogConfig().max_record_bytes + 1)).result(WAIT_S)
        assert producer.send("cmd/x", b"fine").result(WAIT_S).offset >= 0  # the producer goes on
    with pytest.raises(StoreUnavailable):
        with BlockingProducer.connect("127.0.0.1", 1, timeout_s=0.5):
            pass


def test_every_face_sends_a_batch_with_an_outcome_per_message(port):
    """``send_batch``: one future per message, in order; a refused message fails alone."""
    too_large = b"x" * (CommitLogConfig().max_record_bytes + 1)
    batch = [Message("batch/a", b"1"), Message("batch/a", too_large), Message("batch/b", b"2", qos=0)]
    with BlockingProducer.connect("127.0.0.1", port) as producer:
        futures = producer.send_batch(batch)
        blocking = [futures[0].result(WAIT_S), futures[2].result(WAIT_S)]
        with pytest.raises(RecordTooLarge):
            futures[1].result(WAIT_S)
        assert producer.statistics().batches == 1

    async def main() -> list:
        async with AsyncioProducer.connect("127.0.0.1", port) as producer:
            futures = await producer.send_batch(batch)
            with pytest.raises(RecordTooLarge):
                await futures[1]
            return [await futures[0], await futures[2]]

    positions = blocking + asyncio.run(main())
    assert [p.offset for p in positions] == sorted(p.offset for p in positions)


def test_a_blocking_send_waits_while_the_producer_holds_its_total_bytes(port):
    with BlockingProducer.connect("127.0.0.1", port, total_batch_max_bytes=1000,
                                  batch_max_delay_ms=60_000) as producer:
        first = [producer.send("full/a", b"x" * 400) for _ in range(2)]
        third: list = []
        sender = threading.Thread(target=lambda: third.append(producer.send("full/a", b"y" * 400)))
        sender.start()
        deadline = time.monotonic() + WAIT_S
        while producer.statistics().waits < 1:  # the third send is waiting for room
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sender.is_alive() and not third and producer.statistics().held_bytes == 800
        producer.flush()  # the first two leave; their answers free the room
        sender.join(WAIT_S)
        assert len(third) == 1
    assert [f.result(WAIT_S).offset for f in first + third] == sorted(f.result().offset for f in first + third)


def test_consumers_decode_the_mqtt5_properties_into_a_typed_object():
    assert decode_properties(b"") is NO_PROPERTIES
    block = encode_properties(**PROPERTIES)
    assert decode_properties(block) == MessageProperties(
        payload_format_indicator=1, message_expiry_interval=600, content_type="application/json",
        response_topic="reply/billing", correlation_data=b"\x00c1", user_properties=(("trace", "t-1"), ("trace", "t-2")))
    # what a gateway stores for an MQTT 5 publisher decodes too (the gateway's own encoder)
    from gateway.mqtt.properties import PacketType, Properties
    from gateway.mqtt.properties import encode_properties as gateway_encode
    gateway_block = gateway_encode(Properties(content_type="text/plain", user_properties=(("a", "b"),),
                                              topic_alias=3), PacketType.PUBLISH)
    assert decode_properties(gateway_block) == MessageProperties(content_type="text/plain",
                                                                 user_properties=(("a", "b"),))
    for bad in (block[:-1], b"\x03\x00\x05ab", b"\x11\x00\x00\x00\x01"):  # truncated; a CONNECT-only property
        with pytest.raises(ValueError):
            decode_properties(bad)


def test_every_face_sends_delayed_messages(tmp_path):
    """``delay_s`` and ``deliver_at`` through the trio, blocking and asyncio producers: each message is held by the
    store's timer and reaches its topic once due, not before."""
    with store_node(tmp_path) as port:
        async def trio_face() -> None:
            async with Producer.connect("127.0.0.1", port, client_id="delay-trio") as producer:
                await (await producer.send("delayed/trio", b"t", delay_s=1))
                await (await producer.send("delayed/trio", b"u", deliver_at=int(time.time() * 1000) + 1000))
                with pytest.raises(ValueError):
                    await producer.send("delayed/trio", b"v", delay_s=1, deliver_at=1)

        sent = time.monotonic()
        trio.run(trio_face)
        with BlockingProducer.connect("127.0.0.1", port, client_id="delay-blocking") as producer:
            producer.send("delayed/blocking", b"b", delay_s=1).result(timeout=WAIT_S)

        async def asyncio_face() -> None:
            async with AsyncioProducer.connect("127.0.0.1", port, client_id="delay-asyncio") as producer:
                await (await producer.send("delayed/asyncio", b"a", delay_s=1))

        asyncio.run(asyncio_face())
        with BlockingConsumer.connect("127.0.0.1", port, group="delayed", filter="delayed/#",
                                      client_id="delay-reader") as consumer:
            got: list[bytes] = []
            deadline = time.monotonic() + WAIT_S
            while len(got) < 4 and time.monotonic() < deadline:
                got += [message.payload for message in consumer.poll(wait_s=1)]
        assert sorted(got) == [b"a", b"b", b"t", b"u"]
        assert time.monotonic() - sent >= 1.0


def test_every_face_cancels_a_delayed_message_by_the_id_its_send_gave(tmp_path):
    later = int(time.time() * 1000) + 3_600_000
    with store_node(tmp_path) as port:
        async def trio_face() -> list[bool]:
            async with Producer.connect("127.0.0.1", port) as producer:
                position = await (await producer.send("delayed/trio", b"t", deliver_at=later))
                return [await producer.cancel_delayed(position.id), await producer.cancel_delayed(position.id)]

        async def asyncio_face() -> list[bool]:
            async with AsyncioProducer.connect("127.0.0.1", port) as producer:
                position = await (await producer.send("delayed/asyncio", b"a", deliver_at=later))
                return [await producer.cancel_delayed(position.id), await producer.cancel_delayed(position)]

        assert trio.run(trio_face) == [True, False]
        assert asyncio.run(asyncio_face()) == [True, False]
        with BlockingProducer.connect("127.0.0.1", port) as producer:
            position = producer.send("delayed/blocking", b"b", deliver_at=later).result(timeout=WAIT_S)
            assert [producer.cancel_delayed(position.id), producer.cancel_delayed(position.id)] == [True, False]


def test_every_face_sends_a_batch_of_payloads_to_one_topic_with_one_future(port):
    """``send_batch(payloads, topic=..., **options)``, the trio producer's cheap form, on the blocking and asyncio
    faces: one future of the batch's ``Positions`` in order, the options on every message; a bad topic raises at
    once; a payload too large fails the future (the first failed message's error) and not the others' appends."""
    too_large = b"x" * (CommitLogConfig().max_record_bytes + 1)
    with BlockingProducer.connect("127.0.0.1", port) as producer:
        blocking = producer.send_batch([b"b1", b"b2"], topic="run/a", qos=1, content_type="text/plain")
        with pytest.raises(TopicError):
            producer.send_batch([b"b3"], topic="run/+")
        refused = producer.send_batch([b"b4", too_large], topic="run/a")
        with pytest.raises(RecordTooLarge):
            refused.result(WAIT_S)
        positions = list(blocking.result(WAIT_S))

    async def main() -> list:
        async with AsyncioProducer.connect("127.0.0.1", port) as producer:
            sent = await producer.send_batch([b"a1", b"a2"], topic="run/a", qos=1, content_type="text/plain")
            with pytest.raises(TopicError):
                await producer.send_batch([b"a3"], topic="run/#")
            refused = await producer.send_batch([too_large, b"a4"], topic="run/a")
            with pytest.raises(RecordTooLarge):
                await refused
            return list(await sent)

    positions += asyncio.run(main())
    assert [p.offset for p in positions] == sorted(p.offset for p in positions) and len(positions) == 4
    messages, _ = blocking_consume(port, "runs", "run/a", 6)  # b4 and a4 stored: only the large one failed
    by_payload = {m.payload: m for m in messages}
    assert set(by_payload) == {b"b1", b"b2", b"b4", b"a1", b"a2", b"a4"}
    assert all(by_payload[p].properties.content_type == "text/plain" for p in (b"b1", b"b2", b"a1", b"a2"))
