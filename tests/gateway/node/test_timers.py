"""The node's one timer task: order, cancellation, re-arming from a callback."""

import weakref

import trio
import trio.testing

from gateway.node.timers import SWEEP_FROM, TICK_S, Timers


async def test_timers_fire_in_deadline_order_and_cancelled_ones_never(autojump_clock):
    timers = Timers()
    fired: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        timers.call_later(3, lambda: fired.append("c"))
        timers.call_later(1, lambda: fired.append("a"))
        cancelled = timers.call_later(2, lambda: fired.append("never"))
        cancelled.cancel()

        def rearm() -> None:  # a keepalive re-arms itself from its callback
            fired.append("b")
            if fired.count("b") < 2:
                timers.call_later(0.5, rearm)

        timers.call_later(1.5, rearm)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert fired == ["a", "b", "b", "c"]
    assert len(timers) == 0


async def test_an_earlier_timer_wakes_a_sleeping_task(autojump_clock):
    timers = Timers()
    fired = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        timers.call_later(1000, lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        timers.call_later(1, fired.set)
        await fired.wait()
        assert trio.current_time() - start < 2
        nursery.cancel_scope.cancel()


async def test_a_failing_callback_is_logged_and_the_others_still_fire(autojump_clock, caplog):
    timers = Timers()
    fired: list[str] = []

    def broken() -> None:
        raise RuntimeError("a connection's bug")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        timers.call_later(1, broken)
        timers.call_later(2, lambda: fired.append("after"))
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert fired == ["after"]
    assert "timer callback failed" in caplog.text and "a connection's bug" in caplog.text


def test_a_cancelled_timer_lets_go_of_its_callback_at_once():
    """A closed connection's timers wait in the heap until their deadlines (a keep alive: up to 27 hours); holding
    the connection's callbacks kept it and its buffers (a partial 1 MB packet) alive all that time."""
    timers = Timers()

    class Owner:
        def fire(self) -> None:
            raise AssertionError("cancelled")

    owner = Owner()
    gone = weakref.ref(owner)
    trio.run(_arm_and_cancel, timers, owner.fire)
    del owner
    assert gone() is None
    assert len(timers) == 1  # still in the heap until its deadline, but empty


async def _arm_and_cancel(timers: Timers, callback) -> None:
    timers.call_later(3600, callback).cancel()


def test_cancelled_handles_are_swept_so_the_heap_grows_with_live_timers_only():
    """Connections that come and go with a long keep alive each leave a cancelled handle behind."""
    timers = Timers()

    async def churn() -> None:
        live = [timers.call_later(3600, lambda: None) for _ in range(100)]
        for _ in range(50_000):  # connect, arm, disconnect
            timers.call_later(3600, lambda: None).cancel()
        assert all(not t.cancelled for t in live)

    trio.run(churn)
    assert len(timers) <= 2 * SWEEP_FROM


class Owner:
    """A wheel deadline's owner that records when it expired."""

    def __init__(self, name: str, fired: list[tuple[str, float]]) -> None:
        self.name = name
        self.fired = fired
        self.tick: int | None = None

    def expired(self) -> None:
        self.tick = None
        self.fired.append((self.name, trio.current_time()))


async def test_wheel_deadlines_come_due_at_most_a_tick_late_once_per_owner_and_never_when_disarmed(autojump_clock):
    """Keep alives and CONNECT deadlines are a connection in a wheel slot, not two objects per device (issue 31):
    re-arming moves the owner (it expires once, at the new deadline), disarming removes it."""
    timers = Timers()
    fired: list[tuple[str, float]] = []
    moved, kept, disarmed = Owner("moved", fired), Owner("kept", fired), Owner("disarmed", fired)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        moved.tick = timers.arm(moved, 1.0, None)
        kept.tick = timers.arm(kept, 2.0, None)
        disarmed.tick = timers.arm(disarmed, 1.5, None)
        moved.tick = timers.arm(moved, 3.0, moved.tick)  # traffic came: the keep alive moves on
        timers.disarm(disarmed, disarmed.tick)
        assert len(timers) == 2
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert [name for name, _ in fired] == ["kept", "moved"]
    for (_, at), delay in zip(fired, (2.0, 3.0)):
        assert delay <= at - start <= delay + TICK_S
    assert len(timers) == 0
