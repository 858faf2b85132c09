"""The filter trie answers exactly what the one-filter-at-a-time matcher answers."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.filters import FilterIndex
from lightqueue.topics import matches

LEVELS = ["a", "b", "", "$s"]
topic_levels = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=5)
topics = topic_levels.map("/".join).filter(bool)


@st.composite
def filters(draw):
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=0, max_size=4))
    if draw(st.booleans()) or not levels:
        levels.append("#")
    text = "/".join(levels)
    return text or "#"


@settings(max_examples=300)
@given(st.lists(filters(), max_size=30, unique=True), st.lists(topics, min_size=1, max_size=20))
def test_matches_like_brute_force(filter_list, topic_list):
    index = FilterIndex()
    for f in filter_list:
        assert index.add(f)
    assert len(index) == len(filter_list)
    for topic in topic_list:
        expected = sorted(f for f in filter_list if matches(f, topic))
        assert sorted(index.match(topic)) == expected, topic


@settings(max_examples=200)
@given(st.lists(filters(), max_size=30, unique=True), st.data())
def test_removal_leaves_the_others_and_prunes(filter_list, data):
    index = FilterIndex()
    for f in filter_list:
        index.add(f)
    gone = data.draw(st.lists(st.sampled_from(filter_list), unique=True) if filter_list else st.just([]))
    for f in gone:
        assert f in index
        assert index.remove(f)
        assert f not in index
        assert not index.remove(f)
    kept = set(filter_list) - set(gone)
    assert set(index) == kept and len(index) == len(kept)
    for topic in data.draw(st.lists(topics, min_size=1, max_size=10)):
        assert sorted(index.match(topic)) == sorted(f for f in kept if matches(f, topic))
    for f in kept:
        index.remove(f)
    root = index._root
    assert root.empty() and len(index) == 0  # every node was pruned


def test_add_twice_and_contains():
    index = FilterIndex()
    assert index.add("a/+/c")
    assert not index.add("a/+/c")
    assert "a/+/c" in index and "a/+" not in index and "a/b/c" not in index
    assert index.add("a/+/#") and "a/+/#" in index and "a/#" not in index


def test_dollar_topics_and_parent_level():
    index = FilterIndex()
    for f in ("#", "+/x", "$SYS/#", "$SYS/+", "sport/#", "+/#"):
        index.add(f)
    assert sorted(index.match("$SYS/x")) == ["$SYS/#", "$SYS/+"]
    assert sorted(index.match("$SYS")) == ["$SYS/#"]
    assert sorted(index.match("sport")) == ["#", "+/#", "sport/#"]
    assert sorted(index.match("a/x")) == ["#", "+/#", "+/x"]

