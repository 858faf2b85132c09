"""The active-filter index: which wildcard filters match a topic, without looking at the others.

A trie over topic levels. Each node has exact-level children, at most one ``+``
child, and remembers the filter that ends at it and the filter that ends with
``#`` right below it (``#`` is always the last level, so it needs no node).
Matching walks the topic's levels once, following the exact and ``+`` branches
and collecting ``#`` filters on the way, so its cost grows with the topic's depth
and the number of matches, not with the number of filters (as Mosquitto's
``sub__search``).

Nodes are lean because an index can hold millions of filters: slotted structs
the garbage collector does not track, and the children dict is created only
for nodes that have exact children.

Concurrency: matching and changes may come from different threads; each change
leaves the trie valid at every step (a node is linked in fully built, pruned
only when empty), so a concurrent match sees the filter or not, nothing torn.
"""

from __future__ import annotations

from typing import Iterator

import msgspec

__all__ = ["FilterIndex"]


class _Node(msgspec.Struct, gc=False, eq=False):
    """One level of the trie. Untracked by the garbage collector (``gc=False``): a node refers only to its
    children, never back up, so no cycle runs through one; a node per wildcard filter held (50,000 filters, 50,000
    objects) was walked by every full collection (issue 31)."""

    children: dict[str, _Node] | None = None
    plus: _Node | None = None
    hash: str | None = None  # the filter "<path to here>/#"
    filter: str | None = None  # the filter ending exactly at this node

    def empty(self) -> bool:
        return not self.children and self.plus is None and self.hash is None and self.filter is None


class FilterIndex:
    """A set of (valid) topic filters that answers "which of them match this topic?".

    Filters are stored as given; validate them first (lightqueue.topics).
    """

    __slots__ = ("_root", "_count")

    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, filter: str) -> bool:
        levels = filter.split("/")
        node = self._walk(levels[:-1])
        if node is None:
            return False
        last = levels[-1]
        if last == "#":
            return node.hash == filter
        child = node.plus if last == "+" else (node.children or {}).get(last)
        return child is not None and child.filter == filter

    def add(self, filter: str) -> bool:
        """Add a filter; False if it was already there."""
        levels = filter.split("/")
        node = self._root
        for level in levels[:-1]:
            node = self._child(node, level)
        last = levels[-1]
        if last == "#":
            if node.hash is not None:
                return False
            node.hash = filter
        else:
            node = self._child(node, last)
            if node.filter is not None:
                return False
            node.filter = filter
        self._count += 1
        return True

    def remove(self, filter: str) -> bool:
        """Remove a filter and prune the nodes it leaves empty; False if it was not there."""
        levels = filter.split("/")
        last = levels[-1]
        path = levels if last != "#" else levels[:-1]
        trail: list[tuple[_Node, str]] = []
        node = self._root
        for level in path:
            child = node.plus if level == "+" else (node.children or {}).get(level)
            if child is None:
                return False
            trail.append((node, level))
            node = child
        if last == "#":
            if node.hash != filter:
                return False
            node.hash = None
        else:
            if node.filter != filter:
                return False
            node.filter = None
        self._count -= 1
        while trail and node.empty():
            parent, level = trail.pop()
            if level == "+":
                parent.plus = None
            else:
                assert parent.children is not None
                del parent.children[level]
                if not parent.children:
                    parent.children = None
            node = parent
        return True

    def match(self, topic: str) -> list[str]:
        """Every filter in the index that matches the topic name (MQTT rules, `$` included)."""
        levels = topic.split("/")
        depth = len(levels)
        found: list[str] = []
        root = self._root
        if topic.startswith("$"):
            # Filters starting with a wildcard never match `$` topics: skip the root's `+` and `#`.
            child = root.children.get(levels[0]) if root.children else None
            frontier = [child] if child is not None else []
            start = 1
        else:
            frontier = [root]
            start = 0
        for i in range(start, depth):
            level = levels[i]
            nxt: list[_Node] = []
            for node in frontier:
                if node.hash is not None:
                    found.append(node.hash)
                if node.children is not None:
                    child = node.children.get(level)
                    if child is not None:
                        nxt.append(child)
                if node.plus is not None:
                    nxt.append(node.plus)
            frontier = nxt
            if not frontier:
                return found
        for node in frontier:
            if node.hash is not None:
                found.append(node.hash)  # `a/#` matches the parent level `a`
            if node.filter is not None:
                found.append(node.filter)
        return found

    def __iter__(self) -> Iterator[str]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.hash is not None:
                yield node.hash
            if node.filter is not None:
                yield node.filter
            if node.plus is not None:
                stack.append(node.plus)
            if node.children:
                stack.extend(node.children.values())

    def _walk(self, levels: list[str]) -> _Node | None:
        node: _Node | None = self._root
        for level in levels:
            assert node is not None
            node = node.plus if level == "+" else (node.children or {}).get(level)
            if node is None:
                return None
        return node

    @staticmethod
    def _child(node: _Node, level: str) -> _Node:
        if level == "+":
            if node.plus is None:
                node.plus = _Node()
            return node.plus
        if node.children is None:
            node.children = {}
        child = node.children.get(level)
        if child is None:
            child = node.children[level] = _Node()
        return child
