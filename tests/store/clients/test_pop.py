"""The POP consumer's three faces (store/clients/pop.py, and its blocking and asyncio wrappers) against a real store
node serving its RPC: one scenario per face (pop, ack, nack, the retry's attempt, a stale ack), and the dead-letter
topic read back with the ordinary consumer."""

import asyncio

import pytest
import trio

from store.clients.aio import AsyncioPopConsumer, AsyncioProducer
from store.clients.blocking import BlockingPopConsumer, BlockingProducer
from store.clients.consumer import Consumer
from store.clients.pop import PopConsumer
from store.clients.producer import Producer
from tests.helpers.threadstore import WAIT_S, store_node


@pytest.fixture
def port(tmp_path):
    with store_node(tmp_path) as port:
        yield port


# Each face's run: produce two messages, pop both, ack the first, nack the second; pop again: the second comes back
# as attempt 2 and is acknowledged; the first handle's second ack is stale. Returns what the scenario checks.


async def run_async(producer_face, consumer_face, port: int) -> list:
    async with producer_face.connect("127.0.0.1", port) as producer:
        for payload in (b"one", b"two"):
            await producer.send("jobs/a", payload, qos=1)
        await producer.flush()
    async with consumer_face.connect("127.0.0.1", port, group="workers", filter="jobs/#", invisible_s=60,
                                     wait_s=WAIT_S) as consumer:
        first = await consumer.pop()
        acked = await consumer.ack(first[0])
        nacked = await consumer.nack(first[1], 0.0)
        again = await consumer.pop()
        return [[(m.payload, m.attempt) for m in first], acked, nacked is not None,
                [(m.payload, m.attempt) for m in again], await consumer.ack_all([again[0], first[0]])]


def run_blocking(port: int) -> list:
    with BlockingProducer.connect("127.0.0.1", port) as producer:
        for payload in (b"one", b"two"):
            producer.send("jobs/a", payload, qos=1)
        producer.flush()
    with BlockingPopConsumer.connect("127.0.0.1", port, group="workers", filter="jobs/#", invisible_s=60,
                                     wait_s=WAIT_S) as consumer:
        first = consumer.pop()
        acked = consumer.ack(first[0].handle)
        nacked = consumer.nack(first[1], 0.0)
        again = consumer.pop()
        return [[(m.payload, m.attempt) for m in first], acked, nacked is not None,
                [(m.payload, m.attempt) for m in again], consumer.ack_all([again[0], first[0]])]


EXPECTED = [[(b"one", 1), (b"two", 1)], True, True, [(b"two", 2)], [True, False]]


async def trio_scenario(port: int) -> list:
    with trio.fail_after(WAIT_S):
        return await run_async(Producer, PopConsumer, port)


async def asyncio_scenario(port: int) -> list:
    async with asyncio.timeout(WAIT_S):
        return await run_async(AsyncioProducer, AsyncioPopConsumer, port)


def test_the_trio_face(port):
    assert trio.run(trio_scenario, port) == EXPECTED


def test_the_blocking_face(port):
    assert run_blocking(port) == EXPECTED


def test_the_asyncio_face(port):
    assert asyncio.run(asyncio_scenario(port)) == EXPECTED


async def dead_letter_scenario(port: int) -> list:
    with trio.fail_after(WAIT_S):
        async with Producer.connect("127.0.0.1", port) as producer:
            await producer.send("jobs/poison", b"bad", qos=1)
            await producer.flush()
        async with PopConsumer.connect("127.0.0.1", port, group="workers", filter="jobs/#", invisible_s=0.1,
                                       max_attempts=2, wait_s=WAIT_S) as consumer:
            attempts = [m.attempt for m in await consumer.pop()] + [m.attempt for m in await consumer.pop()]
        async with Consumer.connect("127.0.0.1", port, group="ops", filter="$dlq/workers", wait_s=WAIT_S) as dlq:
            (letter,) = await dlq.poll()
        return [attempts, letter.payload, dict(letter.properties.user_properties)["dlq-topic"]]


def test_a_message_never_acknowledged_ends_in_the_dead_letter_topic_read_by_the_ordinary_consumer(port):
    assert trio.run(dead_letter_scenario, port) == [[1, 2], b"bad", "jobs/poison"]


def test_bad_settings_are_refused_before_connecting():
    async def main() -> None:
        async with PopConsumer.connect("127.0.0.1", 1, group="g", filter="a/#", invisible_s=0):
            pass

    with pytest.raises(ValueError, match="invisible_s"):
        trio.run(main)
