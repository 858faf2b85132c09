"""The per-node queue cache over a real store: fills after events, hits, read-through, bounds."""

from pathlib import Path

import trio

from gateway.node.cache import QueueCache, from_record
from store.api import NewMessage
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.log.record import new_record
from store.node import open_store

CONFIG = CommitLogConfig(segment_bytes=1 << 20, max_record_bytes=64 << 10)


async def publish(client: LocalStore, topic: str, count: int, start: int = 0) -> None:
    await client.append([NewMessage(topic, f"m{start + i}".encode()) for i in range(count)])
    store = client.store
    with trio.fail_after(10):
        await store.dispatcher.wait_dispatched(store.log.log.written_offset)


async def test_events_fill_the_cache_once_and_sessions_read_from_memory(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as store:
        client = LocalStore(store)
        cache = QueueCache(client)
        start = await client.activate("cmd/+", "s1")
        cache.watch("cmd/+")
        cache.watch("cmd/+")  # two local sessions on one queue
        client.watch("cmd/+")
        messages, next_offset, expired = await cache.read("cmd/+", start, 10)  # seeds the run (empty queue)
        assert (messages, next_offset, expired) == ([], start, False)
        await publish(client, "cmd/a", 3)
        with trio.fail_after(10):
            events = await client.events()
        await cache.fill(events)  # the empty read seeded the run at the head: the event fills it
        assert cache.statistics().fills == 1
        first, after, _ = await cache.read("cmd/+", start, 10)
        assert [m.payload for m in first] == [b"m0", b"m1", b"m2"] and after == start + 3
        assert cache.statistics().hits == 1
        await publish(client, "cmd/b", 2, start=3)
        with trio.fail_after(10):
            await cache.fill(await client.events())
        stats = cache.statistics()
        assert stats.fills == 2 and stats.messages == 5
        reads_before = stats.store_reads
        for _ in range(2):  # both sessions: answered from memory, the same Message objects
            again, after, _ = await cache.read("cmd/+", start + 3, 10)
            assert [m.payload for m in again] == [b"m3", b"m4"] and after == start + 5
        assert cache.statistics().store_reads == reads_before and cache.statistics().hits == 3
        client.close()


async def test_a_session_behind_the_cache_reads_the_store(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as store:
        client = LocalStore(store)
        cache = QueueCache(client, max_messages=4)
        await client.activate("t/#", "s")
        cache.watch("t/#")
        await publish(client, "t/x", 10)
        recent, _, _ = await cache.read("t/#", 6, 4)  # seeds the run at 6
        assert [m.offset for m in recent] == [6, 7, 8, 9]
        old, after, _ = await cache.read("t/#", 0, 3)  # behind the run: a store read that does not disturb it
        assert [m.offset for m in old] == [0, 1, 2] and after == 3
        assert cache.statistics().messages == 4
        await publish(client, "t/x", 3, start=10)
        await cache.fill({"t/#": 13})
        assert cache.statistics().messages == 4  # bounded: the oldest went
        hit, _, _ = await cache.read("t/#", 9, 10)
        assert [m.offset for m in hit] == [9, 10, 11, 12]
        client.close()


async def test_the_byte_budget_evicts_the_least_recently_extended_queue(tmp_path: Path):
    async with open_store(tmp_path, CONFIG) as store:
        client = LocalStore(store)
        cache = QueueCache(client, max_bytes=1500)
        for queue in ("q/a", "q/b"):
            await client.activate(queue, "s")
            cache.watch(queue)
        await publish(client, "q/a", 4)
        await publish(client, "q/b", 4)
        await cache.read("q/a", 0, 4)
        await cache.read("q/b", 0, 4)
        stats = cache.statistics()
        assert stats.queues == 1 and stats.bytes <= 1500  # q/a went, q/b (extended last) stayed
        await cache.read("q/b", 0, 4)
        assert cache.statistics().hits == 1
        cache.unwatch("q/b")
        assert cache.statistics().queues == 0 and cache.statistics().bytes == 0
        client.close()


async def test_the_byte_budget_counts_what_decoded_user_properties_take(tmp_path: Path):
    """Each message with 32 User Properties takes ~5 KB decoded; counted as 200 bytes, the 64 MiB budget could
    hold gigabytes of them (issue 21). The estimate must cover at least what tracemalloc sees."""
    import tracemalloc

    from gateway.mqtt.properties import PacketType, Properties, encode_properties

    props = encode_properties(Properties(user_properties=tuple((f"key{i}", f"value{i}") for i in range(32))),
                              PacketType.PUBLISH)
    async with open_store(tmp_path, CONFIG) as store:
        client = LocalStore(store)
        cache = QueueCache(client)
        start = await client.activate("p/+", "s1")
        cache.watch("p/+")
        await client.append([NewMessage("p/a", b"x", properties=props) for _ in range(200)])
        with trio.fail_after(10):
            await store.dispatcher.wait_dispatched(store.log.log.written_offset)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            messages, _, _ = await cache.read("p/+", start, 1000)
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert len(messages) == 200
        assert cache.statistics().bytes >= held * 0.8, (cache.statistics().bytes, held)
        client.close()


def test_guard_a_records_flags_become_the_messages_qos_and_retain():
    # What a subscriber's RETAIN as published [MQTT-3.3.1-12] and delivered QoS [MQTT-3.8.4-8] read: the
    # record's flags, decoded by ``from_record`` without a call per flag.
    for qos in (0, 1, 2):
        for retain in (False, True):
            _, record = new_record("t/a", b"x", 1, "c", qos=qos, retain=retain)
            message = from_record(record, "t/#", 7)
            assert (message.qos, message.retain, message.offset, message.queue) == (qos, retain, 7, "t/#")
            assert type(message.retain) is bool
