"""MQTT topic filters (`+`, `#`) for the reader's topic push-down.

spark_analytics may import only ``store.record``, so it keeps its own small
matcher instead of importing lightqueue's. The rules are MQTT 3.1.1 / 5.0
section 4.7: levels split on ``/``; ``+`` matches exactly one level; ``#`` is
the last level and matches the parent and any number of levels below it; a
topic that starts with ``$`` is not matched by a filter whose first level is a
wildcard.
"""

from __future__ import annotations

__all__ = ["TopicFilter", "matches", "validate_filter"]


def validate_filter(topic_filter: str) -> tuple[str, ...]:
    """Check a filter against the MQTT rules; return its levels.

    Raises:
        ValueError: the filter is empty, has ``#`` anywhere but alone in the
            last level, or ``+`` sharing a level with other characters.
    """
    if not topic_filter:
        raise ValueError("a topic filter must not be empty")
    levels = tuple(topic_filter.split("/"))
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"topic filter {topic_filter!r}: '#' must be alone in the last level")
        if "+" in level and level != "+":
            raise ValueError(f"topic filter {topic_filter!r}: '+' must be alone in its level")
    return levels


class TopicFilter:
    """A validated filter, split once and matched against many topics."""

    __slots__ = ("text", "_levels")

    def __init__(self, topic_filter: str) -> None:
        self.text = topic_filter
        self._levels = validate_filter(topic_filter)

    def __repr__(self) -> str:
        return f"TopicFilter({self.text!r})"

    def matches(self, topic: str) -> bool:
        levels = self._levels
        if topic.startswith("$") and levels[0] in ("+", "#"):
            return False
        parts = topic.split("/")
        for i, want in enumerate(levels):
            if want == "#":
                return True
            if i == len(parts):
                return False
            if want != "+" and want != parts[i]:
                return False
        return len(parts) == len(levels)


def matches(topic_filter: str, topic: str) -> bool:
    """True when ``topic`` matches ``topic_filter`` under the MQTT rules."""
    return TopicFilter(topic_filter).matches(topic)
