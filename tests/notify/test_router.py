"""notify/router.py: events go only to nodes with sessions on the queue; registrations are counted; metrics add up."""

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topics import TopicError
from notify.router import NotifyRouter


def test_events_go_only_to_nodes_with_sessions_on_the_queue():
    router = NotifyRouter()
    router.register("gw1", "a/b")
    router.register("gw1", "a/+")
    router.register("gw2", "a/+")
    router.register("gw3", "x")
    routed = router.route({"a/b": 7, "a/+": 9, "a/#": 12, "nobody": 3})
    assert routed == {"gw1": {"a/b": 7, "a/+": 9}, "gw2": {"a/+": 9}}
    routed["gw1"]["a/+"] = 0
    assert routed["gw2"] == {"a/+": 9}  # each node gets its own dict
    assert router.route({}) == {}


def test_registrations_are_counted_per_node_and_queue():
    router = NotifyRouter()
    assert router.register("gw1", "q") == 1
    assert router.register("gw1", "q") == 2  # a second local session on the same queue
    assert router.queues("gw1") == {"q": 2}
    assert router.unregister("gw1", "q") == 1
    assert router.route({"q": 1}) == {"gw1": {"q": 1}}  # one session left
    assert router.unregister("gw1", "q") == 0
    assert router.route({"q": 2}) == {}
    assert router.unregister("gw1", "q") is None and router.unregister("gw9", "q") is None
    assert router.queues("gw1") == {} and router.statistics().registrations == 0


def test_a_dropped_node_gets_nothing_and_is_forgotten():
    router = NotifyRouter()
    for queue in ("q1", "q2", "q2"):
        router.register("gone", queue)
    router.register("stays", "q2")
    router.route({"q1": 1})
    assert router.drop_node("gone") == 2
    assert router.route({"q1": 2, "q2": 3}) == {"stays": {"q2": 3}}
    stats = router.statistics()
    assert stats.nodes == 1 and stats.sent == {"stays": 1} and stats.registrations == 1
    assert router.unregister("gone", "q2") is None  # late unregisters are harmless
    assert router.drop_node("gone") == 0


def test_sent_and_suppressed_counts():
    router = NotifyRouter()
    router.register("gw1", "a")
    router.register("gw2", "a")
    router.register("gw2", "b")
    router.register("gw3", "c")
    router.unregister("gw3", "c")  # gw3 stays known with no sessions: broadcast would still notify it
    router.route({"a": 1, "b": 1, "zzz": 1})
    router.route({"b": 2})
    stats = router.statistics()
    assert stats.sent == {"gw1": 1, "gw2": 3, "gw3": 0}
    # a: gw3 skipped (1); b twice: gw1, gw3 skipped (2 + 2); zzz: all three skipped (3).
    assert stats.suppressed == 1 + 2 + 2 + 3
    assert stats.unrouted == 1
    assert (stats.nodes, stats.registrations) == (3, 3)


def test_bad_registrations_are_refused():
    router = NotifyRouter()
    with pytest.raises(ValueError, match="node"):
        router.register("", "q")
    with pytest.raises(TopicError, match="last level"):
        router.register("gw1", "a/#/b")
    assert router.statistics().nodes == 0


@settings(max_examples=100)
@given(
    st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.sampled_from(["q1", "q2", "q3", "q4"]), st.booleans())),
    st.dictionaries(st.sampled_from(["q1", "q2", "q3", "q4", "q5"]), st.integers(0, 100)),
)
def test_routing_matches_a_model_of_session_counts(operations, events):
    router = NotifyRouter()
    sessions: dict[tuple[str, str], int] = {}
    for node, queue, add in operations:
        if add:
            router.register(node, queue)
            sessions[(node, queue)] = sessions.get((node, queue), 0) + 1
        elif sessions.get((node, queue)):
            router.unregister(node, queue)
            sessions[(node, queue)] -= 1
    expected: dict[str, dict[str, int]] = {}
    for (node, queue), count in sessions.items():
        if count and queue in events:
            expected.setdefault(node, {})[queue] = events[queue]
    assert router.route(events) == expected
    known = {node for node, _ in sessions}
    stats = router.statistics()
    assert stats.suppressed == len(events) * len(known) - sum(len(v) for v in expected.values())


def test_a_registration_costs_the_routers_two_map_entries_and_nothing_per_queue_beside():
    """A node's 50,000 subscriptions are 50,000 queues that only it reads (issue 31): each held a tuple of one node
    name (48 B more a queue); the queues a node alone reads share one. Routing is unchanged as others come and go."""
    router = NotifyRouter()
    router.register("gw1", "warm/up")
    queues = [f"fleet/{n}/+/{n}" for n in range(4000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for queue in queues:
            router.register("gw1", queue)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100 * len(queues), f"{grown / len(queues):.0f} bytes a registration"
    router.register("gw2", queues[0])
    assert router.route({queues[0]: 5, queues[1]: 6}) == {"gw1": {queues[0]: 5, queues[1]: 6}, "gw2": {queues[0]: 5}}
    router.unregister("gw1", queues[0])
    assert router.route({queues[0]: 7, queues[1]: 8}) == {"gw1": {queues[1]: 8}, "gw2": {queues[0]: 7}}
    assert router.drop_node("gw2") == 1 and router.route({queues[0]: 9}) == {}
