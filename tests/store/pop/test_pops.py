"""POP consumption at a real store node (store/pop/pops.py, through ``LocalStore``): pops, acks, invisible times,
revives, dead letters, and the state derived again from the log after a restart and a rebuild."""

import shutil

import pytest
import trio

from store.clients.properties import decode_properties
from store.api import NewMessage, PullRequest, dlq_topic, pop_owner
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store

WAIT_S = 20.0  # conditions are waited for with this timeout, never slept for
TOPIC = "tele/dev1/temp"


@pytest.fixture
async def api(store):
    local = LocalStore(store, "test")
    yield local
    local.close()


async def publish(store, *payloads: bytes) -> None:
    await store.append([NewMessage(TOPIC, p, "dev1", 1) for p in payloads])
    await store.dispatcher.wait_dispatched(store.log.log.written_offset)


async def pop(api, member="m1", max_count=100, invisible_s=30.0, wait_s=0.0, **options):
    return await api.pop("g", "tele/#", member, max_count, invisible_s=invisible_s, wait_s=wait_s,
                         start="earliest", **options)


async def test_members_pop_one_queue_at_once_and_each_message_goes_to_one(store, api):
    await publish(store, *(b"%d" % i for i in range(10)))
    first = await pop(api, "m1", max_count=4)
    second = await pop(api, "m2", max_count=100)
    assert [m.record.payload for m in first] == [b"0", b"1", b"2", b"3"]
    assert [m.record.payload for m in second] == [b"%d" % i for i in range(4, 10)]
    assert {m.attempt for m in first + second} == {1}
    assert await pop(api, "m3") == []


async def test_acks_advance_the_committed_offset_only_past_acknowledged_messages(store, api):
    await publish(store, b"a", b"b", b"c")
    popped = await pop(api)
    assert await api.pop_ack([popped[1].handle, popped[2].handle]) == [True, True]
    assert (await api.get_offsets(pop_owner("g")))["tele/#"] == 0  # "a" is not acknowledged
    assert await api.pop_ack([popped[0].handle, popped[0].handle]) == [True, False]
    assert (await api.get_offsets(pop_owner("g")))["tele/#"] == 3
    assert await api.pop_ack([popped[0].handle]) == [False]  # acknowledged already


async def test_a_message_not_acknowledged_in_time_comes_back_with_its_next_attempt_and_the_old_ack_is_stale(
        store, api):
    await publish(store, b"a", b"b")
    held = await pop(api, "hung", invisible_s=0.2)
    assert await api.pop_ack([held[1].handle]) == [True]
    again = await pop(api, "m2", wait_s=WAIT_S)  # woken by the revive step
    assert [(m.record.payload, m.attempt, m.offset) for m in again] == [(b"a", 2, held[0].offset)]
    assert await api.pop_ack([held[0].handle]) == [False]  # handed out again since
    assert await api.pop_ack([again[0].handle]) == [True]


async def test_change_invisible_gives_a_new_handle_and_zero_makes_the_message_visible_at_once(store, api):
    await publish(store, b"a")
    (held,) = await pop(api)
    longer = await api.change_invisible(held.handle, 60.0)
    assert longer is not None and longer != held.handle
    assert await api.change_invisible(held.handle, 1.0) is None  # stale
    assert await api.change_invisible(longer, 0.0) is not None  # a nack
    (again,) = await pop(api, "m2", wait_s=WAIT_S)
    assert again.attempt == 2 and again.record.payload == b"a"


async def test_after_max_attempts_a_message_goes_to_the_dead_letter_topic_with_where_it_came_from(store, api):
    await publish(store, b"poison", b"fine")
    popped = await pop(api, invisible_s=0.1, max_attempts=2)
    await api.pop_ack([popped[1].handle])
    (again,) = await pop(api, wait_s=WAIT_S, invisible_s=0.1, max_attempts=2)
    assert again.attempt == 2
    with trio.fail_after(WAIT_S):
        while (await api.get_offsets(pop_owner("g")))["tele/#"] != 2:  # dead-lettered: done
            await store.dispatcher.wait_dispatched(store.log.log.written_offset + 1)
    (result,) = await api.pull([PullRequest(dlq_topic("g"), 0)])
    (_, letter), = result.messages
    assert letter.topic == "$dlq/g" and letter.payload == b"poison" and letter.client_id == "dev1" and letter.qos == 1
    props = dict(decode_properties(letter.properties).user_properties)
    assert props["dlq-topic"] == TOPIC and props["dlq-attempts"] == "2" and props["dlq-client"] == "dev1"
    assert props["dlq-group"] == "g" and props["dlq-offset"] == str(popped[0].offset)
    assert await pop(api) == []


async def test_a_pop_waits_for_new_messages(store, api, nursery):
    got = []

    async def waiting():
        got.extend(await pop(api, wait_s=WAIT_S))

    nursery.start_soon(waiting)
    await trio.testing.wait_all_tasks_blocked()
    await publish(store, b"late")
    with trio.fail_after(WAIT_S):
        while not got:
            await trio.sleep(0.01)
    assert got[0].record.payload == b"late"


async def test_bad_pops_and_handles_are_refused_with_reasons(api):
    with pytest.raises(ValueError, match="positive"):
        await api.pop("g", "tele/#", "m", 0, invisible_s=1.0)
    with pytest.raises(ValueError):
        await api.pop("g/#", "tele/#", "m", 1, invisible_s=1.0)
    with pytest.raises(ValueError, match="receipt handle"):
        await api.pop_ack(["not-a-handle"])
    with pytest.raises(ValueError, match="receipt handle"):
        await api.change_invisible("x" * 10_000, 1.0)


@pytest.mark.parametrize("rebuild", [False, True], ids=["restart", "rebuild"])
async def test_in_flight_messages_and_their_handles_outlive_a_restart_and_a_rebuild_from_the_log(tmp_path, rebuild):
    data = tmp_path / "data"
    async with open_store(data, CommitLogConfig()) as node:
        api = LocalStore(node, "test")
        await publish(node, b"a", b"b", b"c")
        popped = await pop(api)
        assert await api.pop_ack([popped[0].handle]) == [True]
        api.close()
    if rebuild:
        shutil.rmtree(data / "index")  # the derived state goes: dispatch derives it again from the log
    async with open_store(data, CommitLogConfig()) as node:
        api = LocalStore(node, "test")
        assert await pop(api, "m2") == []  # b and c are still in flight
        assert await api.pop_ack([popped[0].handle, popped[1].handle]) == [False, True]
        assert await api.change_invisible(popped[2].handle, 0.0) is not None
        (back,) = await pop(api, "m2", wait_s=WAIT_S)
        assert back.record.payload == b"c" and back.attempt == 2
        api.close()
