"""Consumer groups (store/groups.py): the hand-out logic alone, then the coordinator over a real store node.

Also ``LightQueues.offset_at_time`` (lightqueue/queues.py), which a group uses to start from a timestamp.
"""

import pytest
import trio

from lightqueue.queues import LightQueues
from store.api import NewMessage, group_owner
from store.groups import DECODED, MAX_UNACKED, WHOLE, GroupState, entry_ranges
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record
from store.node import decode
from store.rocks import open_db

WAIT_S = 20.0  # every condition is waited for with this timeout, never slept for


# --- GroupState: no I/O ---------------------------------------------------------------------


def test_members_get_a_fair_share_of_the_backlog_and_never_the_same_offset():
    state = GroupState(cursor=0)
    state.join("a")
    state.join("b")
    returned, fresh = state.plan("a", max_count=100, head=10)
    assert (returned, fresh) == ([], 5)  # half of the backlog of 10
    state.hand_out("a", [(0, 5)])
    state.advance(5)
    returned, fresh = state.plan("b", max_count=100, head=10)
    assert (returned, fresh) == ([], 3)  # ceil(5 / 2)
    state.hand_out("b", [(5, 3)])
    state.advance(8)
    assert state.plan("a", max_count=1, head=10) == ([], 1)  # max_count caps the share
    assert {m: list(held) for m, held in state.held.items()} == {"a": [0, 1, 2, 3, 4], "b": [5, 6, 7]}


def test_a_leaving_member_hands_back_its_offsets_and_they_go_out_first_lowest_first():
    state = GroupState(cursor=0)
    for member in ("a", "b"):
        state.join(member)
    state.hand_out("a", [(0, 3)])
    state.hand_out("b", [(3, 1)])
    state.advance(4)
    assert state.ack("a", [(1, 1)]) == 1
    assert state.leave("a") == 2
    assert state.committed() == 0  # handed back is not acknowledged
    returned, fresh = state.plan("b", max_count=10, head=6)
    assert returned == [0, 2] and fresh == 2
    state.hand_out("b", [(offset, 1) for offset in returned])
    assert state.returned == []


def test_committed_is_the_lowest_offset_not_acknowledged():
    state = GroupState(cursor=10)
    state.join("a")
    state.join("b")
    assert state.committed() == 10
    state.hand_out("a", [(10, 2)])
    state.hand_out("b", [(12, 2)])
    state.advance(14)
    assert state.committed() == 10
    state.ack("b", [(12, 2)])
    assert state.committed() == 10  # acknowledged above a held offset: the group cannot move past it
    state.ack("a", [(10, 1)])
    assert state.committed() == 11
    state.ack("a", [(11, 1)])
    assert state.committed() == 14
    assert state.ack("a", [(11, 1), (99, 1)]) == 0  # not held (any more): ignored


def test_offsets_read_for_a_member_that_left_meanwhile_go_back_to_the_group():
    state = GroupState(cursor=0)
    state.join("a")
    state.join("b")
    state.leave("a")
    state.hand_out("a", [(0, 2)])
    assert sorted(state.returned) == [0, 1] and "a" not in state.held


def test_a_member_holding_the_maximum_unacknowledged_gets_nothing_more():
    state = GroupState(cursor=0)
    state.join("a")
    state.hand_out("a", [(0, MAX_UNACKED)])
    state.advance(MAX_UNACKED)
    assert state.plan("a", max_count=10, head=MAX_UNACKED + 100) == ([], 0)
    with pytest.raises(KeyError):
        state.plan("stranger", max_count=10, head=10)


# --- LightQueues.offset_at_time ---------------------------------------------------------------


def test_offset_at_time_finds_the_first_entry_stored_at_or_after_a_time(tmp_path):
    log = CommitLog.open(tmp_path / "commitlog", CommitLogConfig())
    db = open_db(tmp_path / "index")
    try:
        queues = LightQueues(db)
        records = [encode_record("t/a", b"x", store_ms=ms) for ms in (1000, 2000, 2000, 3000)]
        log.append_batch(records)
        scan = log.scan(0)
        queues.index(scan.records, scan.next_offset)
        assert [queues.offset_at_time("t/a", ms) for ms in (0, 1000, 1001, 2000, 2500, 3000, 3001)] == \
            [0, 0, 1, 1, 3, 3, 4]
        assert queues.offset_at_time("t/#", 2000) == 1  # the first-level queue holds the same records
        assert queues.offset_at_time("never/written", 0) == 0
    finally:
        db.close()
        log.close()


# --- GroupCoordinator over a real store node --------------------------------------------------

G = group_owner("g")
A = ("a", "")  # back-end members: each connection is its node
B = ("b", "")


@pytest.fixture
def groups(store):
    return store.groups


async def publish(store, *payloads: bytes, topic: str = "tele/dev1/temp") -> None:
    await store.append([NewMessage(topic, p) for p in payloads])
    await store.dispatcher.wait_dispatched(store.log.log.written_offset)


async def claim(groups, member, max_count=100, wait_s=0.0, group=G, queue="tele/#"):
    return (await groups.claim(member, group, queue, max_count, 1 << 20, wait_s, DECODED)).messages


def payloads(entries) -> list[bytes]:
    return [record.payload for _, record in entries]


def offsets(entries) -> list[int]:
    return [offset for offset, _ in entries]


async def test_two_members_share_the_queue_and_each_message_goes_to_one(store, groups):
    await publish(store, *[b"%d" % i for i in range(10)])
    assert await groups.join(A, G, "tele/#", "earliest") == 0
    await groups.join(B, G, "tele/#")
    got = {A: [], B: []}
    sizes = []
    for member in (A, B, A, B):
        claimed = await claim(groups, member)
        sizes.append(len(claimed))
        got[member] += payloads(claimed)
    assert sizes == [5, 3, 1, 1]  # each claim takes a fair share of what is left: ceil(backlog / members)
    assert sorted(got[A] + got[B], key=int) == [b"%d" % i for i in range(10)]
    assert await claim(groups, A) == []


async def test_a_claim_in_process_serves_the_records_kept_decoded_in_memory_not_decoded_again(store, groups):
    """A batch record's messages were decoded once, when it was appended (``RecentRecords``): a claim of a store in
    this process hands out those very records (reading the log and decoding each message again was most of an
    embedded consumer's CPU)."""
    await store.append([NewMessage("tele/dev1/temp", b"%d" % i) for i in range(5)], batch=True)
    await publish(store, b"single")
    await groups.join(A, G, "tele/#", "earliest")
    got = await claim(groups, A)
    assert payloads(got) == [b"0", b"1", b"2", b"3", b"4", b"single"] and offsets(got) == [0, 1, 2, 3, 4, 5]
    batch = store.recent.get(got[0][1].offset)
    assert all(record is kept for (_, record), kept in zip(got, batch.messages))
    assert got[5][1] is store.recent.get(got[5][1].offset)


async def test_acknowledged_offsets_are_committed_under_the_group_name_and_survive_a_reload(store, groups):
    await publish(store, b"0", b"1", b"2")
    await groups.join(A, G, "tele/#", "earliest")
    got = await claim(groups, A, 2)
    assert await groups.ack(A, G, "tele/#", offsets(got)) == 2  # stored; applied in dispatch's next step
    await store.caught_up()
    assert store.queues.get_offsets(G) == {"tele/#": 2}
    groups.leave_node("a")  # the last member: the group is unloaded; the store keeps its offset
    assert await groups.join(B, G, "tele/#", "latest") == 2  # the committed offset wins over the start
    assert payloads(await claim(groups, B, 10)) == [b"2"]


async def test_unacknowledged_messages_of_a_member_that_goes_are_delivered_to_another(store, groups):
    await publish(store, b"0", b"1", b"2", b"3")
    await groups.join(A, G, "tele/#", "earliest")
    await groups.join(B, G, "tele/#")
    got_a = await claim(groups, A)
    got_b = await claim(groups, B)
    await groups.ack(B, G, "tele/#", offsets(got_b))
    groups.leave_node("a")
    assert payloads(got_a) == [b"0", b"1"] and payloads(got_b) == [b"2"]
    again = await claim(groups, B)
    assert payloads(again) == [b"0", b"1", b"3"]  # handed back first, then the rest of the backlog
    assert await groups.ack(B, G, "tele/#", offsets(again)) == 4


async def test_a_member_acknowledges_what_it_holds_below_an_offset(store, groups):
    await publish(store, b"0", b"1", b"2", b"3")
    await groups.join(A, G, "tele/#", "earliest")
    assert offsets(await claim(groups, A)) == [0, 1, 2, 3]
    assert await groups.ack(A, G, "tele/#", below=3) == 3  # an MQTT session acknowledges by its committed offset


async def test_a_claim_waits_for_new_messages_and_wakes_on_their_dispatch(store, groups, nursery):
    await groups.join(A, G, "tele/+/temp", "latest")  # a wildcard filter: the group activates it
    claimed = []

    async def wait_for_one():
        claimed.extend(await claim(groups, A, 10, WAIT_S, queue="tele/+/temp"))

    async with trio.open_nursery() as waiting:
        waiting.start_soon(wait_for_one)
        await trio.testing.wait_all_tasks_blocked()
        await publish(store, b"new", topic="tele/dev9/temp")
    assert payloads(claimed) == [b"new"]
    assert store.queues.holders("tele/+/temp") == [G]


async def test_a_claim_waiting_for_room_under_the_unacknowledged_cap_goes_on_when_an_ack_makes_some(
        store, groups, nursery):
    """A member holding ``MAX_UNACKED`` gets nothing more; its acknowledgement wakes its claim waiting meanwhile (a
    consumer with claims in flight), which does not sleep out its long poll while the backlog waits."""
    await store.append([NewMessage("tele/dev1/temp", b"%d" % i) for i in range(MAX_UNACKED + 1)], batch=True)
    await store.dispatcher.wait_dispatched(store.log.log.written_offset)
    await groups.join(A, G, "tele/#", "earliest")
    held = await claim(groups, A, MAX_UNACKED)
    assert len(held) == MAX_UNACKED
    claimed = []

    async def wait_for_room():
        claimed.extend(await claim(groups, A, 10, wait_s=10 * WAIT_S))  # longer than the test waits

    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as waiting:
            waiting.start_soon(wait_for_room)
            await trio.testing.wait_all_tasks_blocked()
            await groups.ack(A, G, "tele/#", offsets(held[:1]))
    assert offsets(claimed) == [MAX_UNACKED]


async def test_a_member_holds_claims_of_whole_batch_records_and_acknowledges_ranges_of_them(store, groups):
    """Over the RPC (the ``WHOLE`` form) a claim takes batch records whole; a member may hold several of 8,000
    messages (a consumer with claims in flight: more than 10,000), acknowledges them as ``(base, count)`` ranges,
    and what it did not acknowledge, inside a record too, goes to another member when it leaves (at least once)."""
    for record in range(3):
        await store.append([NewMessage("tele/dev1/temp", b"%d" % (record * 8000 + i)) for i in range(8000)],
                           batch=True)
    await store.dispatcher.wait_dispatched(store.log.log.written_offset)
    await groups.join(A, G, "tele/#", "earliest")
    claims = [(await groups.claim(A, G, "tele/#", 8000, 16 << 20, 0.0, WHOLE)).messages for _ in range(3)]
    assert [entry_ranges(entries, WHOLE) for entries in claims] == [[(0, 8000)], [(8000, 8000)], [(16000, 8000)]]
    assert [len(entries) for entries in claims] == [1, 1, 1]  # one value per batch record
    assert await groups.ack(A, G, "tele/#", ranges=[(0, 8000), (8100, 7900)]) == 8000
    await groups.join(B, G, "tele/#")
    groups.leave_node("a")
    again = await claim(groups, B, 20_000)
    assert offsets(again) == [*range(8000, 8100), *range(16000, 24000)]
    assert payloads(again)[:2] == [b"8000", b"8001"]
    assert await groups.ack(B, G, "tele/#", ranges=entry_ranges(again, DECODED)) == 24000


async def test_a_group_starts_where_it_is_told_when_it_has_no_offset(store, groups):
    await publish(store, b"0", b"1", b"2", b"3")
    m = ("m", "")
    assert await groups.join(m, "earliest", "tele/#", "earliest") == 0
    assert await groups.join(m, "latest", "tele/#", "latest") == 4
    assert await groups.join(m, "at-2", "tele/#", "offset", 2) == 2
    assert await groups.join(m, "beyond", "tele/#", "offset", 99) == 4  # clamped to the head
    last = store.queues.pull("tele/#", 3, 1, 1 << 20, store.log.log, decode)
    store_ms = last.messages[0][1].store_ms
    assert await groups.join(m, "by-time", "tele/#", "time", store_ms + 1) == 4
    assert await groups.join(m, "by-time-0", "tele/#", "time", 0) == 0


async def test_bad_joins_and_claims_are_refused_with_reasons(groups):
    with pytest.raises(ValueError, match="start must be"):
        await groups.join(A, G, "tele/#", "yesterday")
    with pytest.raises(ValueError, match="must not be empty"):
        await groups.join(A, "", "tele/#")
    with pytest.raises(ValueError, match="join first"):
        await claim(groups, A, 1)
    with pytest.raises(ValueError, match="join first"):
        await groups.ack(A, G, "tele/#", [0])
