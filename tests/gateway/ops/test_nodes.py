"""The CPU share of the cluster view (gateway/ops/nodes.py): measured between two looks at a process's CPU time;
the figures of a real process come from tests/gateway/ops/test_admin.py and tests/cluster/test_admin.py."""

from gateway.ops.nodes import MIN_INTERVAL_S, CpuShares
from store.usage import ProcessUsage, process_usage


class Clock:
    """The wall clock the shares are measured against, moved by the test (time is outside what is tested)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_share_is_the_cpu_time_between_two_looks_over_the_wall_time_between_them():
    clock = Clock()
    shares = CpuShares(clock)
    assert shares.shares([("gw-1", ProcessUsage(7, 3.0, 10, 60.0))]) == [5.0]  # first look: the lifetime average
    clock.now += 2.0
    assert shares.shares([("gw-1", ProcessUsage(7, 4.5, 10, 62.0))]) == [75.0]  # 1.5 CPU s in 2 s
    clock.now += MIN_INTERVAL_S / 10
    assert shares.shares([("gw-1", ProcessUsage(7, 4.6, 10, 62.1))]) == [75.0]  # too close: the last share
    clock.now += 1.0
    # against the look that measured (4.5 CPU s): 2 CPU s in 1.05 s, two threads busy
    assert shares.shares([("gw-1", ProcessUsage(7, 6.5, 10, 63.1))]) == [round(200 / 1.05, 1)]


def test_a_restarted_process_starts_over_and_the_old_one_is_forgotten():
    clock = Clock()
    shares = CpuShares(clock)
    shares.shares([("gw-1", ProcessUsage(7, 3.0, 10, 60.0)), ("store", ProcessUsage(8, 1.0, 10, 10.0))])
    clock.now += 1.0
    assert shares.shares([("gw-1", ProcessUsage(9, 0.5, 10, 1.0))]) == [50.0]  # a new pid: its own average
    assert set(shares._looks) == {("gw-1", 9)}  # one look per process listed, no more
    assert shares.shares([("x", ProcessUsage(1, 0.0, 10, 0.0))]) == [None]  # no age known: no share yet


def test_this_process_measures_itself():
    before = process_usage()
    sum(i * i for i in range(200_000))  # some CPU time
    after = process_usage()
    assert before.pid == after.pid and after.cpu_s > before.cpu_s > 0
    assert after.rss_bytes > 1 << 20 and after.age_s >= before.age_s > 0
