"""MQTT topic names and topic filters: validation, matching, overlap and the `$share` prefix.

One definition of the MQTT 3.1.1 / 5.0 rules (3.1.1 §4.7, 5.0 §4.7-4.8) for every
package that handles topics: the gateway validates PUBLISH topic names and
SUBSCRIBE filters with it, ``retain/`` and the filter trie match with the same
semantics, and the light queues name queues after it.

The rules, as implemented here:

- Levels are separated by ``/``; empty levels are legal (``a//b``, ``/a``, ``a/``).
- ``+`` matches exactly one level (an empty one included) and must fill its level.
- ``#`` matches any number of levels, zero included, so ``a/#`` also matches the
  parent ``a``; it must fill its level and be the last level.
- Filters that start with a wildcard do not match topics that start with ``$``
  (``#`` and ``+/x`` never match ``$SYS/x``; ``$SYS/#`` does).
- Topic names (PUBLISH) contain no wildcards. Names and filters are at least one
  character, contain no U+0000 and are at most 65535 UTF-8 bytes; the byte and
  level limits can be lowered with :class:`TopicLimits`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_TOPIC_BYTES",
    "SHARE_PREFIX",
    "TopicError",
    "TopicLimits",
    "filters_overlap",
    "first_level_queue",
    "is_wildcard",
    "matches",
    "parse_shared",
    "validate_filter",
    "validate_topic",
]

MAX_TOPIC_BYTES = 65535
"""MQTT encodes topic strings with a u16 length prefix, so no topic can be longer."""

SHARE_PREFIX = "$share/"
"""MQTT 5 shared subscriptions: ``$share/<group>/<filter>`` (5.0 §4.8.2)."""


class TopicError(ValueError):
    """A topic name or filter breaks an MQTT rule; the message says which and where."""


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """Operator limits on top of the protocol's (a broker may refuse long or deep topics).

    ``max_levels`` is counted in levels: ``a/b/c`` has 3.
    """

    max_bytes: int = MAX_TOPIC_BYTES
    max_levels: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.max_bytes <= MAX_TOPIC_BYTES:
            raise ValueError(f"max_bytes must be between 1 and {MAX_TOPIC_BYTES}, not {self.max_bytes}")
        if self.max_levels < 1:
            raise ValueError(f"max_levels must be at least 1, not {self.max_levels}")


DEFAULT_LIMITS = TopicLimits()
"""The protocol maximum for length and EMQX's default depth (128 levels): generous, yet bounded."""


def _check_common(text: str, what: str, limits: TopicLimits) -> int:
    """Check what topic names and filters share; return the number of levels."""
    if not isinstance(text, str):
        raise TopicError(f"{what} must be a string, not {type(text).__name__}")
    if not text:
        raise TopicError(f"{what} must be at least one character long")
    if "\0" in text:
        raise TopicError(f"{what} {text!r} contains the null character U+0000 at position {text.index(chr(0))}")
    if text.isascii():  # a byte a character and no lone surrogate: its size without encoding it (most topics)
        size = len(text)
    else:
        try:
            size = len(text.encode())
        except UnicodeEncodeError as exc:
            raise TopicError(f"{what} {text!r} is not valid UTF-8: lone surrogate at position {exc.start}") from None
    if size > limits.max_bytes:
        raise TopicError(f"{what} is {size} UTF-8 bytes long; the limit is {limits.max_bytes}")
    levels = text.count("/") + 1
    if levels > limits.max_levels:
        raise TopicError(f"{what} has {levels} levels; the limit is {limits.max_levels}")
    return levels


def validate_topic(topic: str, limits: TopicLimits = DEFAULT_LIMITS) -> str:
    """Check a topic name for PUBLISH (and for a will message); return it unchanged.

    Raises:
        TopicError: empty, U+0000, not UTF-8, too long or too deep, or a wildcard.
    """
    _check_common(topic, "topic name", limits)
    for wildcard in "+#":
        if wildcard in topic:
            raise TopicError(
                f"topic name {topic!r} contains the wildcard {wildcard!r} at position {topic.index(wildcard)}; "
                "wildcards are only allowed in subscription filters"
            )
    return topic


VALID_FILTERS_KEPT = 4096
"""How many filters found valid :func:`validate_filter` remembers at least, and twice as many at most: the last ones
(two sets of this many, the older forgotten when the newer is full). A new subscription's filter is checked by the
gateway (the protocol's bounds), the queues, the notify router and the retained store in turn, up to 3,200 other
filters apart in issue 31's attack (50 sessions with 64 SUBSCRIBEs in flight each): four checks of each filter were
a tenth of a SUBSCRIBE's cost. A filter found valid under any limits has a valid syntax within the protocol's
length; a later check under other limits compares only its level count, remembered with it (limits on its bytes
below the protocol's are checked in full)."""

_valid_filters: list[dict[str, int]] = [{}, {}]  # the newer, the older, each filter -> its levels; plain dict
# operations: safe from threads


def validate_filter(filter: str, limits: TopicLimits = DEFAULT_LIMITS) -> str:
    """Check a topic filter for SUBSCRIBE/UNSUBSCRIBE; return it unchanged.

    ``$share/...`` is not special here: strip it with :func:`parse_shared` first.

    Raises:
        TopicError: empty, U+0000, not UTF-8, too long or too deep, or a
            misplaced ``+`` / ``#``.
    """
    newer, older = _valid_filters
    if type(filter) is str:
        levels = newer.get(filter) or older.get(filter)
        if levels is not None and levels <= limits.max_levels and limits.max_bytes == MAX_TOPIC_BYTES:
            return filter
    levels = _check_common(filter, "topic filter", limits)
    pluses = filter.count("+")
    hashes = filter.count("#")
    if pluses or hashes:
        # Every wildcard fills its level and '#' is the last: counted, not walked level by level (a new
        # subscription's filter is checked here once, issue 31); the walk says what is wrong with the others.
        parts = filter.split("/")
        if parts.count("+") != pluses or (hashes and (hashes != 1 or parts[-1] != "#")):
            _refuse_wildcards(filter, parts)
    if len(newer) >= VALID_FILTERS_KEPT:
        older, newer = newer, {}
        _valid_filters[:] = newer, older
    newer[filter] = levels
    return filter


def _refuse_wildcards(filter: str, levels: list[str]) -> None:
    """Raise the TopicError saying where ``filter``'s first misplaced wildcard is."""
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level in ("+", "#"):
            if level == "#" and i != last:
                raise TopicError(f"topic filter {filter!r}: '#' must be the last level (it is level {i + 1} of {last + 1})")
            continue
        if "#" in level:
            raise TopicError(f"topic filter {filter!r}: '#' must occupy a whole level, not be part of {level!r}")
        if "+" in level:
            raise TopicError(f"topic filter {filter!r}: '+' must occupy a whole level, not be part of {level!r}")


def is_wildcard(filter: str) -> bool:
    """True when a (valid) filter contains ``+`` or ``#``; a filter without them names one topic."""
    return "+" in filter or "#" in filter


def matches(filter: str, topic: str) -> bool:
    """Does the (valid) filter match the (valid) topic name?

    The reference matcher: one filter, one topic, level by level. The filter
    trie answers the same question for many filters at once.
    """
    if topic.startswith("$") and filter[:1] in ("+", "#"):
        return False
    f_levels = filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i == len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def filters_overlap(a: str, b: str) -> bool:
    """Is there a topic name that both (valid) filters match?"""
    if (a[:1] in ("+", "#") and b.startswith("$")) or (b[:1] in ("+", "#") and a.startswith("$")):
        return False
    a_levels = a.split("/")
    b_levels = b.split("/")
    for i in range(max(len(a_levels), len(b_levels))):
        x = a_levels[i] if i < len(a_levels) else None
        y = b_levels[i] if i < len(b_levels) else None
        if x == "#" or y == "#":
            if x is not None and y is not None:
                return True
            # One filter has ended: "#" must match zero levels, so the shared topic is the levels
            # before i, which must not be the empty topic (a single level forced to "").
            return not (i == 1 and "" in (a_levels[0], b_levels[0]))
        if x is None or y is None:
            return False
        if x != "+" and y != "+" and x != y:
            return False
    return True


def first_level_queue(topic: str) -> str:
    """The first-level queue of a topic: ``a/b/c`` -> ``a/#`` (also the queue of the filter ``a/#``)."""
    head, _, _ = topic.partition("/")
    return head + "/#"


def parse_shared(filter: str, limits: TopicLimits = DEFAULT_LIMITS) -> tuple[str, str] | None:
    """Split a shared subscription ``$share/<group>/<filter>`` into ``(group, filter)``.

    Returns None when ``filter`` is not a shared subscription. The inner filter
    is validated with :func:`validate_filter`.

    Raises:
        TopicError: the share name is empty or contains a wildcard, or the
            inner filter is missing or invalid.
    """
    if not filter.startswith(SHARE_PREFIX):
        return None
    group, sep, inner = filter[len(SHARE_PREFIX):].partition("/")
    if not group:
        raise TopicError(f"shared subscription {filter!r}: the share name after '$share/' is empty")
    if "+" in group or "#" in group:
        raise TopicError(f"shared subscription {filter!r}: the share name {group!r} must not contain '+' or '#'")
    if "\0" in group:
        raise TopicError(f"shared subscription {filter!r}: the share name contains the null character U+0000")
    if not sep or not inner:
        raise TopicError(f"shared subscription {filter!r}: a topic filter must follow '$share/{group}/'")
    try:
        validate_filter(inner, limits)
    except TopicError as exc:
        raise TopicError(f"shared subscription {filter!r}: {exc}") from None
    return group, inner
