"""The first start over a data directory written before control records existed (tests/helpers/base.py: BASE's
code, run as a subprocess): its session blobs, client ledger and QoS 2 flows are restated as control records once,
so that the log alone holds them and the derived families come back identical when deleted (store/node.py,
``_restate_legacy``).
"""

from __future__ import annotations

import pytest

from gateway.mqtt.packets import MQTT_5, Publish, Pubcomp, Pubrec, Pubrel
from gateway.mqtt.properties import Properties
from tests.helpers.base import BaseNode, base_tree
from tests.helpers.mqtt_fixtures import Node, RawClient
from tests.helpers.derived import control_kinds, derived, drop_families

pytestmark = pytest.mark.slow

HOUR = 3600


def base_data(tmp_path):
    """A data directory as BASE leaves it: a persistent subscriber, a closed client with a will pending, and a
    publisher with one QoS 2 flow awaiting PUBREL and one completed."""
    node = BaseNode(base_tree(tmp_path / "base"), tmp_path / "data")
    try:
        sub = RawClient(node.port)
        sub.connect("sub", clean=False)
        sub.subscribe("m/#", 1)
        sub.close()
        willed = RawClient(node.port, MQTT_5)
        willed.connect("willed", clean=False, will_topic="will/willed", will_payload=b"gone", will_qos=1,
                       will_properties=Properties(will_delay_interval=HOUR),
                       properties=Properties(session_expiry_interval=HOUR))
        willed.close()  # no DISCONNECT: its will waits for its delay
        pub = RawClient(node.port)
        pub.connect("pub", clean=False)
        pub.send(Publish("m/a", b"5", 2, packet_id=5))
        assert pub.receive() == Pubrec(5)
        pub.send(Publish("m/a", b"6", 2, packet_id=6))
        assert pub.receive() == Pubrec(6)
        pub.send(Pubrel(6))
        assert pub.receive() == Pubcomp(6)
        pub.close()
    finally:
        assert node.stop() == 0
    return tmp_path / "data"


def test_the_first_start_restates_what_an_earlier_version_stored_and_the_log_then_holds_it(tmp_path):
    data = base_data(tmp_path)
    node = Node(data)
    assert node.wait_log(lambda d: d.get("msg", "").startswith("session state stored before control records"))
    assert node.stop() == 0
    assert not node.errors(), node.errors()
    state = derived(data)
    assert sorted(state["sessions"]) == ["pub", "sub", "willed"]
    assert state["clients"]["willed"].will.topic == "will/willed" and state["clients"]["willed"].closed_ms
    # Packet id 5 still awaits its PUBREL: a resend must not be stored twice; 6 is complete: the publisher's next
    # message with it is new [MQTT-4.3.3-2].
    assert [(c, pid) for c, pid, _ in state["awaiting"]] == [("pub", 5)]
    kinds = control_kinds(data)
    assert {"session_saved", "client_closed", "flows_awaiting"} <= set(kinds)

    node = Node(data)  # once: a second start restates nothing
    assert node.stop() == 0
    assert "session state stored before control records restated as control records" not in \
        [d.get("msg") for d in node.logs]
    assert control_kinds(data) == kinds

    drop_families(data)
    node = Node(data)
    assert node.stop() == 0
    assert derived(data) == state
