"""Node leases and held wills (store/leases.py), on trio's virtual clock (pytest-trio's ``autojump_clock``)."""

import trio

from store.leases import NodeLeases

LEASE_S = 5.0


def will(client_id: str):
    return (f"will/{client_id}", b"gone", {"client_id": client_id, "qos": 1})


class Appended:
    """The append callback: records what was appended, and when (virtual time)."""

    def __init__(self):
        self.messages = []
        self.changed = trio.Event()

    async def __call__(self, messages):
        self.messages += [(trio.current_time(), m) for m in messages]
        self.changed.set()
        self.changed = trio.Event()
        return [0] * len(messages)


async def test_wills_fire_lease_plus_delay_after_the_last_frame(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.hold("gw1", "a", will("a"), 0)
        leases.hold("gw1", "b", will("b"), 3)
        await trio.sleep(2)
        leases.seen("gw1")
        last_frame = trio.current_time()
        leases.disconnected("gw1")
        while len(appended.messages) < 2:
            await appended.changed.wait()
        assert [(t - last_frame, m[0]) for t, m in appended.messages] == [(LEASE_S, "will/a"), (LEASE_S + 3, "will/b")]
        stats = leases.statistics()
        assert (stats.nodes, stats.wills_held, stats.wills_fired, stats.leases_ended) == (0, 0, 2, 1)


async def test_reconnecting_within_the_lease_keeps_the_wills_held(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.hold("gw1", "a", will("a"), 0)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S - 1)
        leases.connected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert appended.messages == []
        assert leases.statistics().wills_held == 1
        nursery.cancel_scope.cancel()


async def test_a_node_with_another_connection_keeps_its_lease(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.connected("gw1")  # a replacing connection shook hands before the old one ended
        leases.hold("gw1", "a", will("a"), 0)
        leases.disconnected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert appended.messages == []
        nursery.cancel_scope.cancel()


async def test_dropped_will_does_not_fire(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.hold("gw1", "a", will("a"), 0)
        leases.drop("gw1", "a")
        leases.disconnected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert appended.messages == []
        assert leases.statistics().leases_ended == 1


async def test_resuming_on_another_node_within_the_delay_cancels_the_will(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.connected("gw2")
        leases.hold("gw1", "a", will("a"), 30)
        leases.hold("gw1", "b", will("b"), 30)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S + 1)
        assert leases.statistics().wills_pending == 2
        leases.drop("gw2", "a")  # a resumed on gw2 without a will
        leases.hold("gw2", "b", will("b2"), 30)  # b resumed with a new will
        await trio.sleep(100)
        assert appended.messages == []
        assert leases.statistics().wills_held == 1  # b's new will, under gw2's lease
        nursery.cancel_scope.cancel()


async def test_another_nodes_drop_leaves_a_will_held_by_the_client_now(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.connected("gw2")
        leases.hold("gw2", "a", will("a"), 0)  # a moved to gw2 ...
        leases.drop("gw1", "a")  # ... and gw1 reports its old connection closed afterwards
        leases.disconnected("gw2")
        while not appended.messages:
            await appended.changed.wait()
        assert appended.messages[0][1][0] == "will/a"
        nursery.cancel_scope.cancel()


async def test_a_node_back_within_its_lease_resumes_it_and_after_its_end_gets_a_new_one(autojump_clock):
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(Appended(), nursery, LEASE_S)
        epoch, _ = leases.connected("gw1")
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S - 1)
        assert leases.connected("gw1", epoch) == (epoch, True)
        leases.disconnected("gw1")
        await trio.sleep(LEASE_S + 1)
        assert leases.epoch("gw1") == 0  # ended
        new_epoch, resumed = leases.connected("gw1", epoch)
        assert not resumed and new_epoch != epoch
        nursery.cancel_scope.cancel()


async def test_a_client_resuming_on_another_node_drops_the_will_the_first_node_holds(autojump_clock):
    appended = Appended()
    async with trio.open_nursery() as nursery:
        leases = NodeLeases(appended, nursery, LEASE_S)
        leases.connected("gw1")
        leases.connected("gw2")
        leases.hold("gw1", "a", will("a"), 0)
        leases.resumed_on("gw2", "a")  # gw1 is frozen: it never drops the will itself
        leases.disconnected("gw1")
        await trio.sleep(10 * LEASE_S)
        assert appended.messages == []
        assert leases.statistics().leases_ended == 1
        nursery.cancel_scope.cancel()
