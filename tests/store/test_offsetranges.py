"""Offset sets kept as ranges (store/offsetranges.py): what a consumer group member holds and acknowledges."""

import random

from store.offsetranges import OffsetRanges, ranges_of


def test_ranges_of_gives_runs_of_consecutive_offsets_in_order():
    assert ranges_of([]) == []
    assert ranges_of([7, 3, 4, 5, 9, 8, 4]) == [(3, 3), (7, 3)]  # unsorted, a duplicate counted once
    assert ranges_of(range(10_000)) == [(0, 10_000)]


def test_adding_merges_touching_and_overlapping_ranges():
    held = OffsetRanges()
    held.add(10, 5)
    held.add(20, 5)
    assert held.ranges() == [(10, 5), (20, 5)] and len(held) == 10 and held.low() == 10
    held.add(15, 5)  # touches both: one range
    assert held.ranges() == [(10, 15)] and len(held) == 15
    held.add(0, 12)  # overlaps the start
    held.add(5, 0)  # nothing
    assert held.ranges() == [(0, 25)] and len(held) == 25


def test_removing_splits_ranges_and_counts_only_what_was_held():
    held = OffsetRanges()
    held.add(0, 100)
    assert held.remove(10, 10) == 10
    assert held.remove(15, 10) == 5  # 15-19 gone already
    assert held.ranges() == [(0, 10), (25, 75)]
    assert held.remove(-5, 0) == 0 and held.remove(500, 3) == 0
    assert held.remove_below(30) == 15
    assert held.ranges() == [(30, 70)] and held.low() == 30 and len(held) == 70
    assert held.remove(0, 1000) == 70 and held.low() is None and list(held) == []


def test_it_behaves_as_a_set_of_offsets():
    rng = random.Random(30)
    held, model = OffsetRanges(), set()
    for _ in range(2000):
        base, count = rng.randrange(300), rng.randrange(-2, 20)
        if rng.random() < 0.5:
            held.add(base, count)
            model.update(range(base, base + count))
        else:
            gone = model & set(range(base, base + count))
            assert held.remove(base, count) == len(gone)
            model -= gone
        assert list(held) == sorted(model) and len(held) == len(model)
        assert held.low() == min(model, default=None)
        assert ranges_of(model) == held.ranges()
