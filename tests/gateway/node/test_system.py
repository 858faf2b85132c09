"""The ``$SYS/broker/`` tree (gateway/node/system.py): Mosquitto's names, and load averages that follow the rate."""

import math
import time

import pytest

from gateway.node.system import LOAD_WINDOWS_S, LoadAverage, SysFigures, SysTree
from tests.helpers.mqtt_fixtures import WAIT_S, connected, running_node


def test_a_steady_rate_brings_every_average_towards_it_the_short_window_first():
    load = LoadAverage(0, 0.0)
    count = 0
    for second in range(1, 61):  # 100 messages a second for a minute: 6,000 a minute
        count += 100
        load.update(count, float(second))
    one, five, fifteen = (load.averages[name] for name in LOAD_WINDOWS_S)
    assert one == pytest.approx(6000 * (1 - math.exp(-1)), rel=1e-9)  # one window's worth: 63% of the way
    assert one > five > fifteen > 0


def test_the_averages_decay_once_the_counter_stops_and_ignore_a_clock_that_did_not_move():
    load = LoadAverage(0, 0.0)
    load.update(6000, 60.0)
    before = dict(load.averages)
    load.update(6000, 60.0)  # no time passed: no rate to weigh
    assert load.averages == before
    load.update(6000, 120.0)
    assert load.averages["1min"] == pytest.approx(before["1min"] * math.exp(-1))
    assert load.averages["15min"] == pytest.approx(before["15min"] * math.exp(-60 / 900))


def test_the_tree_has_mosquittos_names_and_formats():
    tree = SysTree(0.0)
    figures = SysFigures(uptime_s=12.7, connected=3, disconnected=2, maximum=7, subscriptions=9, retained=4,
                         store_bytes=1234, messages_received=600, messages_sent=60, bytes_received=6000,
                         bytes_sent=600)
    topics = tree.topics(figures, 60.0)
    assert topics["$SYS/broker/uptime"] == b"12 seconds"
    assert topics["$SYS/broker/version"].startswith(b"lightgate ")
    assert (topics["$SYS/broker/clients/connected"], topics["$SYS/broker/clients/disconnected"],
            topics["$SYS/broker/clients/maximum"], topics["$SYS/broker/clients/total"]) == (b"3", b"2", b"7", b"5")
    assert topics["$SYS/broker/subscriptions/count"] == b"9"
    assert topics["$SYS/broker/retained messages/count"] == b"4"
    assert topics["$SYS/broker/store/messages/bytes"] == b"1234"
    assert topics["$SYS/broker/messages/received"] == b"600"
    assert topics["$SYS/broker/load/messages/received/1min"] == b"%.2f" % (600 * (1 - math.exp(-1)))
    assert {f"$SYS/broker/load/{counter}/{window}" for counter in ("messages/received", "messages/sent",
            "bytes/received", "bytes/sent") for window in LOAD_WINDOWS_S} <= topics.keys()


def _tree_topics() -> dict[str, bytes]:
    return SysTree(0.0).topics(SysFigures(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), 1.0)


@pytest.mark.slow
def test_a_running_node_publishes_the_tree(tmp_path):
    """Clients connected, disconnected (a persistent session whose client left), maximum and total; the
    subscriptions and retained counts; the store's size and the load averages, from a real node."""
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0.2") as node:
        with connected(node.port) as watcher:
            watcher.subscribe("$SYS/broker/#", 0)
            with connected(node.port, client_id="sys-away", clean=False) as away:
                away.subscribe("away/#", 1)
                pub_context = connected(node.port)
                pub = pub_context.__enter__()  # three connected at once, then the persistent one leaves
            try:
                pub.publish("sys/retained", b"kept", 1, retain=True)
                seen: dict[str, str] = {}
                wanted = {"$SYS/broker/clients/connected": "2", "$SYS/broker/clients/disconnected": "1",
                          "$SYS/broker/clients/maximum": "3", "$SYS/broker/clients/total": "3",
                          # the tree's own topics are retained messages too
                          "$SYS/broker/retained messages/count": str(len(_tree_topics()) + 1)}
                deadline = time.monotonic() + WAIT_S
                while not (all(seen.get(k) == v for k, v in wanted.items())
                           and float(seen.get("$SYS/broker/load/bytes/received/1min", "0")) > 0):
                    assert time.monotonic() < deadline, sorted(seen.items())
                    message = watcher.messages.get(timeout=WAIT_S)
                    seen[message.topic] = message.payload.decode()
            finally:
                pub_context.__exit__(None, None, None)
    assert int(seen["$SYS/broker/subscriptions/count"]) >= 2  # the watcher's and the persistent session's
    assert int(seen["$SYS/broker/store/messages/bytes"]) > 0
