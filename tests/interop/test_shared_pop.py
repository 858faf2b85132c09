"""End to end against `lightgate serve`: MQTT shared subscriptions on the store's POP groups (docs/consumer-groups.md,
"MQTT shared subscriptions"): a member that hangs or goes loses only what it holds, to the other members."""

import pytest

from gateway.mqtt.packets import Puback, Publish, Pubrec
from tests.helpers.mqtt_fixtures import (check_hung_member_holds_only_its_window, check_nothing_before_sentinel,
                                        connected, raw_client, run_id, running_node)

INVISIBLE_S = "1"


@pytest.fixture(scope="module")
def short_node(tmp_path_factory):
    """A node whose shared subscriptions' members have 1 s to acknowledge a message."""
    with running_node(tmp_path_factory.mktemp("node") / "data", "--mqtt-shared-invisible-s", INVISIBLE_S) as node:
        yield node


def test_a_member_that_never_acknowledges_loses_its_messages_to_another_after_the_invisible_time(short_node):
    """A QoS 1 message not acknowledged within mqtt.shared_invisible_s goes to another member (5.0 section 4.8.2:
    the server may send it to another subscriber of the shared subscription); a late PUBACK counts for nothing."""
    run = run_id()
    topic, share = f"hung{run}/t", f"$share/g{run}/hung{run}/t"
    with raw_client(short_node.port) as hung, connected(short_node.port) as pub:
        hung.connect(f"hung-{run}")
        hung.subscribe(share, 1)
        for i in range(3):
            pub.publish(topic, str(i).encode(), 1)
        held = [hung.receive() for _ in range(3)]
        assert [p.payload for p in held] == [b"0", b"1", b"2"]
        with connected(short_node.port) as other:
            other.subscribe(share, 1)
            assert sorted(m.payload for m in other.receive(3)) == [b"0", b"1", b"2"]
            hung.send(Puback(held[0].packet_id))  # too late: the message was handed out again
            hung.close()  # gives back nothing: its handles are stale
            check_nothing_before_sentinel(other, pub, topic)


def test_a_hung_member_holds_only_its_window_and_gives_it_back_when_it_goes(interop_node):
    """A member pops only what its Receive Maximum lets it send: while it hangs the other member gets the rest at
    once, and when it disconnects what it held goes to the other member without waiting for the invisible time
    (30 s, longer than the test waits)."""
    check_hung_member_holds_only_its_window(interop_node.port, interop_node.port)


def test_a_qos2_member_owns_a_message_from_its_pubrec(short_node):
    """A QoS 2 message whose PUBREC came is the member's: only its PUBREL is owed (4.3.3), so the group does not
    hand it to another member, however long the PUBCOMP takes or when the member goes ([MQTT-4.8.2-5]); the one
    whose PUBREC did not come within the invisible time does go (docs/consumer-groups.md: where this departs from
    [MQTT-4.8.2-4])."""
    run = run_id()
    topic, share = f"two{run}/t", f"$share/g{run}/two{run}/t"
    with raw_client(short_node.port) as slow, connected(short_node.port) as pub:
        slow.connect(f"two-{run}")
        slow.subscribe(share, 2)
        pub.publish(topic, b"recorded", 2)
        pub.publish(topic, b"unanswered", 2)
        first, second = slow.receive(), slow.receive()
        assert isinstance(first, Publish) and (first.payload, second.payload) == (b"recorded", b"unanswered")
        slow.send(Pubrec(first.packet_id))
        assert slow.receive().packet_id == first.packet_id  # PUBREL; no PUBCOMP is sent
        with connected(short_node.port) as other:
            other.subscribe(share, 2)
            assert [m.payload for m in other.receive(1)] == [b"unanswered"]  # after the invisible time
            slow.close()
            check_nothing_before_sentinel(other, pub, topic)  # "recorded" comes to no one else
