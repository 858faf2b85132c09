"""The retained-topic tree: which topics hold a retained message, found by filter.

A tree over topic levels (as Mosquitto's ``retain.c``): each node is one level
and knows the CommitLog offset of the retained message of the topic ending at
it, if any. It holds no message bytes (they stay in RocksDB, see
``retain.store``), so a node costs a slotted object and a dict entry.

Matching a filter walks its literal levels with one dict lookup each,
enumerates the children at a ``+`` and the whole subtree at a ``#`` (the parent
level included: ``a/#`` matches ``a``), so the work grows with the filter's
depth and the matches found, not with the number of retained topics; a filter
whose literal first level holds no topic is answered without a walk. Filters
that start with ``+`` or ``#`` never match topics that start with ``$``.

Topics and filters must be valid (``lightqueue.topics``); this module does not
check them again. Not thread-safe: ``RetainedStore`` serialises access.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias, final

__all__ = ["TopicTree", "TopicTreeStatistics"]


_Path: TypeAlias = "tuple[str, _Path] | None"
"""A node's levels as a linked list, last level first: extending it costs the same at any depth."""


class _Node:
    __slots__ = ("children", "offset")

    def __init__(self) -> None:
        self.children: dict[str, _Node] | None = None  # created with the first child: most nodes are leaves
        self.offset: int | None = None  # CommitLog offset of the retained message of this topic, if any


@dataclass(frozen=True, slots=True)
class TopicTreeStatistics:
    topics: int
    nodes: int  # the root excluded
    matches: int  # calls to match() since creation
    nodes_visited: int  # nodes stepped into by match(), summed: the cost of lookups


@final
class TopicTree:
    """A set of topic names, each with the CommitLog offset of its retained message."""

    __slots__ = ("_root", "_topics", "_nodes", "_matches", "_visited")

    def __init__(self) -> None:
        self._root = _Node()
        self._topics = 0
        self._nodes = 0
        self._matches = 0
        self._visited = 0

    def __len__(self) -> int:
        return self._topics

    def get(self, topic: str) -> int | None:
        """The offset stored for ``topic``, or None when it has no retained message."""
        node: _Node | None = self._root
        for level in topic.split("/"):
            children = node.children
            node = children.get(level) if children is not None else None
            if node is None:
                return None
        return node.offset

    def set(self, topic: str, offset: int) -> None:
        """Add ``topic`` or replace its offset."""
        node = self._root
        for level in topic.split("/"):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(level)
            if child is None:
                child = children[level] = _Node()
                self._nodes += 1
            node = child
        if node.offset is None:
            self._topics += 1
        node.offset = offset

    def remove(self, topic: str) -> int | None:
        """Remove ``topic``, pruning the nodes it leaves empty.

        Returns:
            the offset it had, or None when it was not there.
        """
        trail: list[tuple[_Node, str]] = []
        node = self._root
        for level in topic.split("/"):
            children = node.children
            child = children.get(level) if children is not None else None
            if child is None:
                return None
            trail.append((node, level))
            node = child
        offset = node.offset
        if offset is None:
            return None
        node.offset = None
        self._topics -= 1
        while trail and node.offset is None and not node.children:
            parent, level = trail.pop()
            assert parent.children is not None
            del parent.children[level]
            if not parent.children:
                parent.children = None
            self._nodes -= 1
            node = parent
        return offset

    def match(self, filter: str) -> list[tuple[str, int]]:
        """Every ``(topic, offset)`` whose topic the filter matches, in no particular order."""
        first = filter.partition("/")[0]
        if first != "+" and first != "#" and first not in (self._root.children or ()):
            # No walk (nor split) when the first level holds nothing: every new subscription matches (issue 31,
            # 50,000 at once), most under a level no retained message is (a node's own are under $SYS).
            self._matches += 1
            return []
        levels = filter.split("/")
        depth = len(levels)
        found: list[tuple[str, int]] = []
        visited = 0
        stack: list[tuple[_Node, int, _Path]] = [(self._root, 0, None)]
        while stack:
            node, i, path = stack.pop()
            if i == depth:
                if node.offset is not None:
                    found.append((_join(path), node.offset))
                continue
            level = levels[i]
            if level == "#":
                if i and node.offset is not None:
                    found.append((_join(path), node.offset))
                visited += _collect(node, path, i == 0, found)
                continue
            children = node.children
            if children is None:
                continue
            if level == "+":
                for name, child in children.items():
                    if i or name[:1] != "$":
                        stack.append((child, i + 1, (name, path)))
                        visited += 1
            else:
                child = children.get(level)
                if child is not None:
                    stack.append((child, i + 1, (level, path)))
                    visited += 1
        self._matches += 1
        self._visited += visited
        return found

    def items(self) -> list[tuple[str, int]]:
        """Every ``(topic, offset)`` in the tree, ``$`` topics included, in no particular order."""
        found: list[tuple[str, int]] = []
        _collect(self._root, None, False, found)
        return found

    def statistics(self) -> TopicTreeStatistics:
        return TopicTreeStatistics(self._topics, self._nodes, self._matches, self._visited)


def _join(path: _Path) -> str:
    parts = []
    while path is not None:
        level, path = path
        parts.append(level)
    parts.reverse()
    return "/".join(parts)


def _collect(top: _Node, path: _Path, at_root: bool, found: list[tuple[str, int]]) -> int:
    """Append every topic strictly below ``top`` to ``found``; return the number of nodes visited.

    Iterative, so a topic thousands of levels deep cannot exhaust the stack.
    """
    if top.children is None:
        return 0
    stack = [(child, (name, path)) for name, child in top.children.items() if not (at_root and name[:1] == "$")]
    visited = 0
    while stack:
        node, node_path = stack.pop()
        visited += 1
        if node.offset is not None:
            found.append((_join(node_path), node.offset))
        if node.children is not None:
            stack.extend((child, (name, node_path)) for name, child in node.children.items())
    return visited
