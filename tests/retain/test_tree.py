"""The retained-topic tree finds exactly what the one-filter reference matcher finds, at the cost of its matches."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topics import matches
from retain.tree import TopicTree

LEVELS = ["a", "b", "", "$s", "$"]
topics = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def filters(draw):
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=1, max_size=5))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"


def tree_of(topic_offsets):
    tree = TopicTree()
    for topic, offset in topic_offsets.items():
        tree.set(topic, offset)
    return tree


@settings(max_examples=150)
@given(st.dictionaries(topics, st.integers(0, 2**64 - 1), max_size=40), st.lists(filters(), min_size=1, max_size=10))
def test_match_equals_brute_force(topic_offsets, filter_list):
    tree = tree_of(topic_offsets)
    assert len(tree) == len(topic_offsets)
    for f in [*filter_list, "#", "+", "+/#"]:
        expected = sorted((t, o) for t, o in topic_offsets.items() if matches(f, t))
        assert sorted(tree.match(f)) == expected, f


@settings(max_examples=100)
@given(st.dictionaries(topics, st.integers(0, 1000), min_size=1, max_size=40), st.data())
def test_remove_keeps_the_others_and_prunes_every_node(topic_offsets, data):
    tree = tree_of(topic_offsets)
    gone = data.draw(st.lists(st.sampled_from(sorted(topic_offsets)), unique=True))
    for topic in gone:
        assert tree.remove(topic) == topic_offsets[topic]
        assert tree.remove(topic) is None and tree.get(topic) is None
    kept = {t: o for t, o in topic_offsets.items() if t not in gone}
    assert sorted(tree.items()) == sorted(kept.items())
    for f in data.draw(st.lists(filters(), min_size=1, max_size=5)):
        assert sorted(tree.match(f)) == sorted((t, o) for t, o in kept.items() if matches(f, t))
    for topic in kept:
        tree.remove(topic)
    stats = tree.statistics()
    assert stats.topics == 0 and stats.nodes == 0 and tree._root.children is None


def test_dollar_topics_only_match_filters_that_name_them():
    tree = tree_of({"$SYS/broker/load": 1, "$SYS": 2, "a/b": 3, "a": 4})
    assert sorted(tree.match("#")) == [("a", 4), ("a/b", 3)]
    assert sorted(tree.match("+/#")) == [("a", 4), ("a/b", 3)]
    assert tree.match("+/broker/+") == []
    assert sorted(tree.match("$SYS/#")) == [("$SYS", 2), ("$SYS/broker/load", 1)]
    assert tree.match("$SYS/+/load") == [("$SYS/broker/load", 1)]
    assert tree.match("a/+") == [("a/b", 3)]


def test_hash_matches_the_parent_level_and_empty_levels():
    tree = tree_of({"a": 1, "a/": 2, "a//c": 3, "/a": 4, "b": 5})
    assert sorted(tree.match("a/#")) == [("a", 1), ("a/", 2), ("a//c", 3)]
    assert sorted(tree.match("a/+")) == [("a/", 2)]
    assert tree.match("+/a") == [("/a", 4)]
    assert tree.match("a/+/c") == [("a//c", 3)]


def test_set_replaces_the_offset_without_adding_a_topic():
    tree = TopicTree()
    tree.set("a/b", 10)
    tree.set("a/b", 20)
    assert len(tree) == 1 and tree.get("a/b") == 20 and tree.get("a") is None
    assert tree.statistics().nodes == 2
    tree.set("a", 5)  # an inner node can hold a topic too
    assert tree.remove("a/b") == 20
    assert tree.items() == [("a", 5)] and tree.statistics().nodes == 1


def test_exact_lookup_in_a_large_tree_visits_one_node_per_level():
    tree = TopicTree()
    for device in range(20_000):
        tree.set(f"devices/{device}/status", device)
        tree.set(f"solo{device}", device)
    before = tree.statistics().nodes_visited
    assert tree.match("solo12345") == [("solo12345", 12345)]
    assert tree.statistics().nodes_visited - before == 1
    assert tree.match("devices/777/status") == [("devices/777/status", 777)]
    assert tree.statistics().nodes_visited - before == 1 + 3
    assert tree.match("devices/777/+") == [("devices/777/status", 777)]
    assert tree.statistics().nodes_visited - before == 1 + 3 + 3


def test_very_deep_topics_do_not_exhaust_the_stack():
    deep = "/".join(["x"] * 20_000)
    tree = tree_of({deep: 1, "x": 2})
    assert sorted(tree.match("#")) == [("x", 2), (deep, 1)]
    assert tree.match(deep) == [(deep, 1)]
    assert tree.remove(deep) == 1 and tree.statistics().nodes == 1


def test_a_filter_whose_first_level_holds_no_topic_walks_nothing_and_still_counts():
    """Each new subscription asks the tree for its retained messages (issue 31: 50,000 subscriptions at once, on a
    node whose only retained messages are its own under $SYS): a filter whose first level is literal and holds no
    topic is answered without walking the tree; the others are walked as before."""
    from tests.helpers.work import python_lines

    tree = TopicTree()
    tree.set("$SYS/broker/uptime", 3)
    filter = "a/+/c/d/e/f/g/#"
    lines, found = python_lines(lambda: tree.match(filter))
    assert found == [] and lines <= 6, lines
    assert tree.match("#") == [] and tree.match("+/broker/uptime") == []  # [MQTT-4.7.2-1]
    assert tree.match("$SYS/#") == [("$SYS/broker/uptime", 3)]
    tree.set("a/b/c/d/e/f/g", 7)
    assert tree.match(filter) == [("a/b/c/d/e/f/g", 7)]
    tree.remove("a/b/c/d/e/f/g")
    assert tree.match(filter) == []
    assert tree.statistics().matches == 6
