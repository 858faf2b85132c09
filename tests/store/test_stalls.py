"""The store's watchdog of its own stalls (store/stalls.py), on trio's virtual clock.

A jump of the clock (``MockClock.jump``) runs no task meanwhile: to the store it is exactly a stall of its loop.
"""

import math

import trio
import trio.testing

from store.stalls import STALL_S, TICK_S, StallWatch


async def test_a_late_tick_is_a_stall_and_silence_counts_from_its_end(autojump_clock):
    watch = StallWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(10 * STALL_S)  # ticking on time: no stall
        assert watch.awake_since() == -math.inf and watch.stalls == 0
        autojump_clock.jump(STALL_S + 2 * TICK_S)
        resumed = trio.current_time()
        assert watch.awake_since() == resumed  # the late tick has not run yet: the store resumes now
        await trio.testing.wait_all_tasks_blocked()
        assert watch.awake_since() == resumed and watch.stalls == 1
        await trio.sleep(10 * STALL_S)
        assert watch.awake_since() == resumed
        nursery.cancel_scope.cancel()


async def test_a_watch_that_does_not_run_sees_no_stall(autojump_clock):
    watch = StallWatch()
    autojump_clock.jump(100 * STALL_S)
    assert watch.awake_since() == -math.inf



async def test_a_watch_run_by_two_owners_goes_on_ticking_when_one_stops(autojump_clock):
    """Two RPC servers over one store (a test serves a second one, with a token, beside the leader's) each run the
    store's watch: the first to stop cleared the clock the other's next tick reads (a TypeError that ended the
    other server, and the store with it, when that server outlived the first by a tick: on a loaded machine)."""
    watch = StallWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        async with trio.open_nursery() as second:
            second.start_soon(watch.run)
            await trio.sleep(TICK_S / 2)
            second.cancel_scope.cancel()
        await trio.sleep(10 * TICK_S)  # the first owner's watch ticks on
        autojump_clock.jump(STALL_S + 2 * TICK_S)
        await trio.testing.wait_all_tasks_blocked()
        assert watch.stalls == 1 and watch.awake_since() == trio.current_time()
        nursery.cancel_scope.cancel()
