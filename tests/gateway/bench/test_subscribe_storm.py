"""The session-filters attack's raw-socket client against a real ``lightgate serve``: what it counts, where it stops."""

import threading

import pytest

from gateway.bench.subscribe_storm import SubscribeStorm, filter_for, subscribe_packet
from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_311, Subscribe, SubscriptionOptions
from tests.helpers.mqtt_fixtures import WAIT_S, Client, running_node, wait_until


@pytest.mark.parametrize("n", [1, 2, 65535, 65536, 200_001])
def test_a_subscribe_is_what_the_codec_encodes(n):
    packet_id = (n - 1) % 65535 + 1  # ids wrap past 65,535 and are never 0 [MQTT-2.3.1-1]
    expected = encode(Subscribe(packet_id, ((filter_for(7, n), SubscriptionOptions(qos=1)),)), MQTT_311)
    assert subscribe_packet(n, filter_for(7, n), 1) == expected


def test_filters_over_the_limit_count_as_refused(tmp_path):
    # 3 sessions x 8 filters, 5 allowed each: the rest get SUBACK 0x80 [MQTT-3.9.3-2], each SUBACK with the
    # packet id of its SUBSCRIBE [MQTT-3.8.4-2] (the storm stops at any other).
    with running_node(tmp_path / "data", "--limits-max-subscriptions", "5") as node:
        storm = SubscribeStorm(3, 8, 4, client_id="storm-limit-{}", timeout_s=WAIT_S)
        seen = storm.run("127.0.0.1", node.port)
    assert seen["granted"] == 3 * 5 and seen["refused"] == 3 * 3, seen
    assert "ended" not in seen and seen["slowest_session_s"] >= 0


def test_the_storm_stops_at_a_connection_the_broker_closes(tmp_path):
    # A client connecting with a session's client id takes it over: the broker closes the storm's connection
    # [MQTT-3.1.4-2], and the storm ends there, reporting what it was answered so far.
    filters = 200_000
    with running_node(tmp_path / "data") as node:
        storm = SubscribeStorm(1, filters, 64, client_id="storm-taken-{}", timeout_s=WAIT_S)
        seen: dict = {}
        runner = threading.Thread(target=lambda: seen.update(storm.run("127.0.0.1", node.port)))
        runner.start()
        try:
            wait_until(lambda: storm.granted > 0, what="the storm's first SUBACK")
            usurper = Client(node.port, "storm-taken-0", clean=False)
            usurper.connect()
        finally:
            runner.join(WAIT_S)
        assert not runner.is_alive()
        usurper.disconnect()
    assert seen["ended"].startswith(("ConnectionError", "ConnectionResetError", "BrokenPipeError")), seen
    assert 0 < seen["granted"] + seen["refused"] < filters
