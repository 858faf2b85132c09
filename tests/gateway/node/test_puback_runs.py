"""A subscriber's PUBACKs read at once are taken as a run (``MqttDecoder.pubacks``, ``Channel.handle_pubacks``,
``Session.puback_run``: issue 31), against a `lightgate serve` process over raw sockets: what could break is which
deliveries a PUBACK frees. The PUBACKs of a persistent subscriber's deliveries go in one write, out of order, with
gaps, an unknown and a repeated id and (5.0) one with a reason code among them; after a clean disconnect the
session's next connection gets exactly the unacknowledged ones again, with DUP and their packet ids, in order, and
then new messages.
"""

import pytest

from gateway.mqtt.packets import MQTT_5, MQTT_311, Disconnect, Pingreq, Pingresp, Puback, Publish, Suback, \
    Subscribe, SubscriptionOptions
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import raw_client, recv_until_closed, run_id


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_run_of_pubacks_frees_exactly_its_deliveries_and_the_rest_come_again_with_dup(node, level):
    run = run_id()
    topic = f"acks{run}/t"
    session = {"properties": Properties(session_expiry_interval=600)} if level == MQTT_5 else {}
    with raw_client(node.port, level) as sub, raw_client(node.port) as pub:
        sub.connect(f"sub-{run}", clean=False, **session)
        sub.send(Subscribe(1, ((topic, SubscriptionOptions(qos=1)),)))
        assert isinstance(sub.receive(), Suback)
        sub.sock.close()  # the session stays (3.1.1: not clean; 5.0: expiry 600 s)
    with raw_client(node.port, level) as sub, raw_client(node.port) as pub:
        sub.connect(f"sub-{run}", clean=False, **session)
        pub.connect(f"pub-{run}")
        pub.send(*(Publish(topic, b"m%d" % i, 1, packet_id=i + 1) for i in range(40)))
        assert sorted(pub.receive().packet_id for _ in range(40)) == list(range(1, 41))
        got = [sub.receive() for _ in range(40)]
        assert [p.payload for p in got] == [b"m%d" % i for i in range(40)]  # [MQTT-4.6.0-5]
        ids = [p.packet_id for p in got]
        kept = {5, 17}  # not acknowledged: with the 10 never acknowledged below, what the next connection gets
        acks = [Puback(ids[i]) for i in reversed(range(30)) if i not in kept]
        unknown = next(i for i in range(1, 65536) if i not in ids)
        acks[3:3] = [Puback(unknown), Puback(ids[29])]  # ignored: unknown, and already acknowledged [MQTT-4.3.2-*]
        if level == MQTT_5:  # a reason code makes it a longer PUBACK, handled on its own, and acknowledges all the
            acks[10] = Puback(acks[10].packet_id, ReasonCode.NO_MATCHING_SUBSCRIBERS)  # same [MQTT-3.4.2-1]
        sub.send(*acks, Pingreq())  # one write: read in one go
        assert isinstance(sub.receive(), Pingresp)  # handled, and nothing else sent meanwhile
        sub.send(Disconnect())
        recv_until_closed(sub.sock)
    with raw_client(node.port, level) as sub, raw_client(node.port) as pub:
        assert sub.connect(f"sub-{run}", clean=False, **session).session_present  # [MQTT-3.2.2-2]
        again = [sub.receive() for _ in range(len(kept) + 10)]
        # The unacknowledged deliveries again with DUP and their packet ids [MQTT-4.4.0-1], in order
        # [MQTT-4.6.0-2..4]: none that the run acknowledged.
        expected = [i for i in range(40) if i in kept or i >= 30]
        assert [(p.payload, p.packet_id, p.dup) for p in again] == [(b"m%d" % i, ids[i], True) for i in expected]
        pub.connect(f"pub2-{run}")
        pub.send(Publish(topic, b"after", 1, packet_id=1))
        after = sub.receive()  # next: nothing else of the old ones came twice
        assert (after.payload, after.dup) == (b"after", False)
        sub.send(*(Puback(p.packet_id) for p in [*again, after]))
