"""The node's one timer task: order, cancellation, re-arming from a callback."""

import trio
import trio.testing

from gateway.timers import Timers


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
