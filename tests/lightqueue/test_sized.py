"""The cache bounded by entries and bytes."""

import sys

from lightqueue.sized import ENTRY_OVERHEAD, SizedCache


def test_oldest_entries_go_first_when_either_bound_is_passed():
    cache: SizedCache[str, bytes] = SizedCache(max_entries=3, max_bytes=10_000)
    for key in "abcd":
        cache.put(key, b"v")
    assert len(cache) == 3 and cache.get("a") is None and cache.get("d") == b"v"
    cost = sys.getsizeof("0" + "x" * 1000) + sys.getsizeof(b"") + ENTRY_OVERHEAD
    small: SizedCache[str, bytes] = SizedCache(max_entries=1000, max_bytes=cost * 5 // 2)
    for n in range(10):
        small.put(f"{n}" + "x" * 1000, b"")
    assert len(small) == 2 and small.get("9" + "x" * 1000) == b"" and small.bytes == 2 * cost


def test_the_bytes_follow_puts_replacements_pops_and_clear():
    cache: SizedCache[str, bytes] = SizedCache(100, 1 << 20)
    cache.put("k", b"1")
    cache.put("k", b"22")  # replaced, not counted twice
    assert cache.bytes == sys.getsizeof("k") + sys.getsizeof(b"22") + ENTRY_OVERHEAD
    assert cache.pop("k") == b"22" and cache.pop("k") is None and cache.bytes == 0
    cache.put("a", b"")
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_an_entry_larger_than_the_whole_budget_is_not_kept():
    cache: SizedCache[str, bytes] = SizedCache(100, 1000)
    cache.put("small", b"")
    cache.put("x" * 5000, b"")
    assert cache.get("x" * 5000) is None and cache.get("small") == b""
