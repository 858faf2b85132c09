"""The reader's MQTT topic matcher (spark_analytics.topics): MQTT 3.1.1/5.0 section 4.7."""

from __future__ import annotations

import pytest

from spark_analytics.topics import TopicFilter, matches, validate_filter


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b/c", "a/b/c", True),
        ("a/b/c", "a/b", False),
        ("a/b", "a/b/c", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a//c", True),  # an empty level is a level
        ("a/+/c", "a/x/y/c", False),
        ("a/+", "a", False),
        ("+", "a", True),
        ("+", "a/b", False),
        ("+/+", "/a", True),
        ("a/#", "a", True),  # '#' also matches the parent level
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("#", "a/b", True),
        ("#", "/", True),
        ("+/#", "a", True),
        ("#", "$SYS/broker", False),  # '$' topics are not matched by leading wildcards
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker", True),
        ("$SYS/+", "$SYS/broker", True),
        ("a/$x", "a/$x", True),
        ("A/b", "a/b", False),  # case sensitive
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ],
)
def test_matches(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected
    assert TopicFilter(topic_filter).matches(topic) is expected


@pytest.mark.parametrize("bad", ["", "a/#/b", "a#", "a/b#", "a+/b", "a/+b", "##"])
def test_invalid_filters_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_filter(bad)


def test_valid_filter_levels() -> None:
    assert validate_filter("a/+/#") == ("a", "+", "#")
    assert validate_filter("/") == ("", "")
