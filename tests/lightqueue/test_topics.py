"""MQTT topic rules: the examples of MQTT 3.1.1 §4.7 and 5.0 §4.7-4.8, and every invalid case."""

import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightqueue.topics import (
    MAX_TOPIC_BYTES,
    TopicError,
    TopicLimits,
    first_level_queue,
    is_wildcard,
    matches,
    parse_shared,
    validate_filter,
    validate_topic,
)

# (filter, topic, matches?) - each row is an example from the specifications (3.1.1 and 5.0 §4.7).
SPEC_MATCHES = [
    # 4.7.1.2 multi-level wildcard
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),  # '#' includes the parent level
    ("sport/#", "sports", False),
    ("#", "sport/tennis/player1", True),
    ("#", "/", True),
    ("sport/tennis/#", "sport/tennis", True),
    # 4.7.1.3 single-level wildcard
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),  # '+' matches an empty level
    ("+/tennis/#", "sport/tennis/player1", True),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "finance", True),
    # 4.7.2 topics beginning with $
    ("#", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("+", "$SYS", False),
    ("$SYS/+/Clients", "$SYS/monitor/Clients", True),
    # 4.7.3 semantics: case sensitive, spaces, leading and trailing '/'
    ("ACCOUNTS", "Accounts", False),
    ("Accounts payable", "Accounts payable", True),
    ("/finance", "finance", False),
    ("finance", "/finance", False),
    ("/", "/", True),
    ("+/+", "/", True),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
]


@pytest.mark.parametrize(("filter", "topic", "expected"), SPEC_MATCHES)
def test_spec_examples(filter, topic, expected):
    assert validate_filter(filter) == filter
    assert validate_topic(topic) == topic
    assert matches(filter, topic) is expected


# (filter, part of the error message)
INVALID_FILTERS = [
    ("", "at least one character"),
    ("sport/tennis#", "'#' must occupy a whole level"),
    ("sport/tennis/#/ranking", "'#' must be the last level"),
    ("#/", "'#' must be the last level"),
    ("sport+", "'+' must occupy a whole level"),
    ("sport/+tennis", "'+' must occupy a whole level"),
    ("a/b\0c", "null character U+0000"),
    ("a/\ud800", "not valid UTF-8"),
    # wildcards a count could mistake for whole levels
    ("a/+b/+", "'+' must occupy a whole level, not be part of '+b'"),
    ("+/+x", "'+' must occupy a whole level, not be part of '+x'"),
    ("++", "'+' must occupy a whole level, not be part of '++'"),
    ("a/#/#", "'#' must be the last level (it is level 2 of 3)"),
    ("#/#", "'#' must be the last level (it is level 1 of 2)"),
    ("a/b#/#", "'#' must occupy a whole level, not be part of 'b#'"),
    ("a/##", "'#' must occupy a whole level, not be part of '##'"),
    ("+#", "'#' must occupy a whole level, not be part of '+#'"),
    ("a/+/#/", "'#' must be the last level (it is level 3 of 4)"),
]


@pytest.mark.parametrize(("filter", "message"), INVALID_FILTERS)
def test_invalid_filters(filter, message):
    """[MQTT-4.7.1-2] '#' alone in the last level, [MQTT-4.7.1-3] '+' alone in its level, [MQTT-4.7.3-1/2]; checked
    twice: a filter found invalid is never remembered as valid."""
    for _ in range(2):
        with pytest.raises(TopicError, match=re.escape(message)):
            validate_filter(filter)


INVALID_TOPICS = [
    ("", "at least one character"),
    ("sport/+", "contains the wildcard '+' at position 6"),
    ("sport/#", "contains the wildcard '#' at position 6"),
    ("a\0", "null character U+0000 at position 1"),
]


@pytest.mark.parametrize(("topic", "message"), INVALID_TOPICS)
def test_invalid_topic_names(topic, message):
    with pytest.raises(TopicError, match=re.escape(message)):
        validate_topic(topic)


def test_non_string_is_rejected():
    with pytest.raises(TopicError, match="must be a string, not bytes"):
        validate_topic(b"a/b")


def test_length_limit_counts_utf8_bytes():
    validate_topic("a" * MAX_TOPIC_BYTES)
    with pytest.raises(TopicError, match="65536 UTF-8 bytes long; the limit is 65535"):
        validate_topic("a" * (MAX_TOPIC_BYTES + 1))
    limits = TopicLimits(max_bytes=4)
    validate_topic("ab", limits)
    with pytest.raises(TopicError, match="6 UTF-8 bytes long; the limit is 4"):
        validate_topic("éèé", limits)  # 3 characters, 6 bytes


def test_depth_limit():
    limits = TopicLimits(max_levels=3)
    validate_filter("a/+/#", limits)
    with pytest.raises(TopicError, match="4 levels; the limit is 3"):
        validate_filter("a/b/c/#", limits)
    with pytest.raises(TopicError, match="4 levels; the limit is 3"):
        validate_topic("///", limits)


def test_limits_themselves_are_checked():
    with pytest.raises(ValueError, match="max_bytes"):
        TopicLimits(max_bytes=70000)
    with pytest.raises(ValueError, match="max_levels"):
        TopicLimits(max_levels=0)


def test_wildcard_and_first_level_queue():
    assert is_wildcard("a/+") and is_wildcard("#") and not is_wildcard("a/b")
    assert first_level_queue("a/b/c") == "a/#"
    assert first_level_queue("a") == "a/#"
    assert first_level_queue("/finance") == "/#"
    assert first_level_queue("$SYS/x") == "$SYS/#"
    assert matches(first_level_queue("a"), "a")  # the first-level queue holds the parent level too


SHARED = [
    ("$share/consumer1/sport/tennis/+", ("consumer1", "sport/tennis/+")),
    ("$share/consumer2/sport/tennis/+", ("consumer2", "sport/tennis/+")),
    ("$share/consumer1//finance", ("consumer1", "/finance")),
    ("$share/consumer1/+/+", ("consumer1", "+/+")),
    ("$share/g/#", ("g", "#")),
    ("sport/tennis", None),
    ("$shared/g/a", None),
    ("$SYS/#", None),
]


@pytest.mark.parametrize(("filter", "expected"), SHARED)
def test_parse_shared(filter, expected):
    assert parse_shared(filter) == expected


INVALID_SHARED = [
    ("$share/", "share name after '$share/' is empty"),
    ("$share//a/b", "share name after '$share/' is empty"),
    ("$share/g", "a topic filter must follow"),
    ("$share/g/", "a topic filter must follow"),
    ("$share/g+/a", "must not contain"),
    ("$share/#/a", "must not contain"),
    ("$share/g/a/#/b", "'#' must be the last level"),
]


@pytest.mark.parametrize(("filter", "message"), INVALID_SHARED)
def test_invalid_shared(filter, message):
    with pytest.raises(TopicError, match=re.escape(message)):
        parse_shared(filter)


LEVEL = st.sampled_from(["a", "b", "", "$x"])


@given(st.lists(LEVEL, min_size=1, max_size=5))
def test_a_topic_always_matches_itself_its_hash_filter_and_plus_pattern(levels):
    topic = "/".join(levels)
    assume(topic)
    validate_topic(topic)
    assert matches(topic, topic)
    assert matches(first_level_queue(topic), topic)
    plus = "/".join(["+"] * len(levels))
    assert matches(plus, topic) is (not topic.startswith("$"))
    assert not matches(topic + "/+", topic)


def test_a_filter_found_valid_is_not_checked_again_and_an_invalid_one_always_is():
    """A new subscription's filter is checked by the queues, the notify router and the retained store in turn (issue
    31): under the default limits a valid one is remembered (the last ``VALID_FILTERS_KEPT`` at least, twice as many
    at most), an invalid one never is, and other limits are checked in full every time."""
    from lightqueue import topics
    from tests.helpers.work import python_lines

    filter = "remembered/+/a/b/c/d/e/f/g/h/#"
    first, _ = python_lines(lambda: validate_filter(filter))
    again, _ = python_lines(lambda: validate_filter(filter))
    assert again < first // 3, (again, first)
    for _ in range(2):
        with pytest.raises(TopicError):
            validate_filter("remembered/a+/b")
    deep = TopicLimits(max_levels=3)
    for _ in range(2):
        with pytest.raises(TopicError):
            validate_filter(filter, deep)
    for n in range(2 * topics.VALID_FILTERS_KEPT):
        validate_filter(f"many/{n}/+")
    assert python_lines(lambda: validate_filter(filter))[0] > 3 * again  # forgotten: what is kept is bounded


def test_a_filter_found_valid_under_the_protocols_bounds_is_not_checked_in_full_under_the_default_limits():
    """The gateway checks a SUBSCRIBE's filter under the protocol's bounds only (its configured limits apart), the
    queues and the others under the default limits next, thousands of other filters later (issue 31): the syntax
    found valid once is not checked again, but each call's own level limit is; a byte limit below the protocol's is
    checked in full."""
    from lightqueue import topics
    from tests.helpers.work import python_lines

    protocol = TopicLimits(MAX_TOPIC_BYTES, 1000)
    filter = "bounds/+/a/b/c/d/e/f/g/h/#"
    first, _ = python_lines(lambda: validate_filter(filter, protocol))
    for n in range(topics.VALID_FILTERS_KEPT):  # other sessions' filters checked in between
        validate_filter(f"between/{n}/+", protocol)
    again, _ = python_lines(lambda: validate_filter(filter))
    assert again < first // 3, (again, first)
    deep = "deep/" * 200 + "+"
    assert validate_filter(deep, protocol) == deep
    with pytest.raises(TopicError, match="201 levels"):
        validate_filter(deep)
    with pytest.raises(TopicError, match="UTF-8 bytes long"):
        validate_filter(filter, TopicLimits(max_bytes=10))


@pytest.mark.parametrize("filter", ["#", "+", "+/+/#", "a//+/#", "/#", "+/", "$SYS/+/#", "é/+/ü/#"])
def test_wildcards_that_fill_their_levels_are_valid(filter):
    assert validate_filter(filter) == filter
    assert validate_filter(filter) == filter  # remembered


def test_a_filters_size_is_its_utf8_bytes_whether_ascii_or_not():
    """The size of an ASCII filter is its length, without encoding it; any other is encoded (a lone surrogate is
    no UTF-8, [MQTT-1.5.4-1])."""
    validate_filter("a" * (MAX_TOPIC_BYTES - 2) + "/+")  # 65,535 bytes
    with pytest.raises(TopicError, match="65536 UTF-8 bytes long"):
        validate_filter("a" * MAX_TOPIC_BYTES + "b")
    with pytest.raises(TopicError, match="65536 UTF-8 bytes long"):
        validate_filter("é" * (MAX_TOPIC_BYTES // 2) + "/+")  # 32,767 characters, 65,536 bytes
    with pytest.raises(TopicError, match="6 UTF-8 bytes long; the limit is 5"):
        validate_filter("éè/+", TopicLimits(max_bytes=5))
    with pytest.raises(TopicError, match="not valid UTF-8: lone surrogate at position 2"):
        validate_filter("a/\udc80/+")


def test_a_new_filters_check_does_not_walk_its_levels():
    """A new subscription's filter is checked in full once (issue 31: 50,000 new filters, half wildcards): its
    wildcards are counted, not looked for level by level, so a deep filter costs what a shallow one does."""
    from gateway.mqtt.limits import SYNTAX_ONLY
    from tests.helpers.work import python_lines

    shallow = python_lines(lambda: validate_filter("walk/shallow/+/#", SYNTAX_ONLY))[0]
    deep = python_lines(lambda: validate_filter("walk/deep/" + "a/+/" * 40 + "#", SYNTAX_ONLY))[0]
    assert deep <= shallow, (deep, shallow)


@settings(max_examples=500, deadline=None)
@given(st.text(st.sampled_from("a/+#"), min_size=1, max_size=12))
def test_a_filter_is_valid_exactly_when_each_wildcard_fills_its_level_and_hash_is_last(filter):
    """The counted check against the rule level by level ([MQTT-4.7.1-2], [MQTT-4.7.1-3]), twice (remembered)."""
    levels = filter.split("/")
    valid = all(level in ("+", "#") or ("+" not in level and "#" not in level) for level in levels) \
        and "#" not in levels[:-1]
    for _ in range(2):
        if valid:
            assert validate_filter(filter) == filter
        else:
            with pytest.raises(TopicError, match="must"):
                validate_filter(filter)
