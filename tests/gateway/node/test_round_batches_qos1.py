"""A read round's QoS 1 PUBLISHes to one topic become batch records too (store/node.py ``_encode_runs``), against a
`lightgate serve` process over raw MQTT 5 sockets (issue 31): what could break is what a PUBACK promises and when.

One publisher sends a burst in one write, so the node reads it in one round: QoS 1 runs on two topics (some with
a User Property), QoS 0 messages among them, a QoS 2 message (its packet id keeps it a record of its own). The
PUBACKs come in the order of the PUBLISHes, each once the message is stored; the node is then SIGKILLed: every
acknowledged message is in the CommitLog (the runs as batch records, each message with its client id, QoS and
properties), and a persistent subscriber that acknowledged half of its deliveries gets at least the rest again after the
restart, in order.
"""

from pathlib import Path

from gateway.mqtt.codec import encode
from gateway.mqtt.packets import MQTT_5, PacketType, Pingreq, Pingresp, Puback, Publish, Pubrec, Suback, Subscribe, \
    SubscriptionOptions
from gateway.mqtt.properties import Properties, encode_properties
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_BATCH
from tests.helpers.mqtt_fixtures import Node, kill, raw_client, run_id

SESSION = Properties(session_expiry_interval=600)


def _burst(base: str) -> list[Publish]:
    """QoS 1 on ``base/a`` (every fourth with a User Property, every seventh a QoS 0 between them), a QoS 2
    message, then QoS 1 on ``base/b``: packet ids 1.. in order, 121 QoS 1/2 ones (the node takes 128 at a time)."""
    burst: list[Publish] = []
    for i in range(80):
        if i % 7 == 3:
            burst.append(Publish(f"{base}/a", b"zero%d" % i))
        props = Properties(user_properties=(("i", str(i)),)) if i % 4 == 0 else Properties()
        burst.append(Publish(f"{base}/a", b"a%d" % i, 1, packet_id=len(burst) + 1, properties=props))
    burst.append(Publish(f"{base}/a", b"two", 2, packet_id=len(burst) + 1))
    return burst + [Publish(f"{base}/b", b"b%d" % i, 1, packet_id=len(burst) + 1 + i) for i in range(40)]


def test_qos1_runs_are_batch_records_acknowledged_in_order_and_kept_through_a_sigkill(tmp_path: Path):
    run = run_id()
    base = f"round1{run}"
    burst = _burst(base)
    data = tmp_path / "data"
    node = Node(data)
    try:
        with raw_client(node.port, MQTT_5) as sub, raw_client(node.port, MQTT_5) as pub:
            sub.connect(f"sub-{run}", clean=True, properties=SESSION)
            sub.send(Subscribe(1, ((f"{base}/#", SubscriptionOptions(qos=1)),)))
            assert isinstance(sub.receive(), Suback)
            pub.connect(f"pub-{run}")
            pub.sock.sendall(b"".join(encode(packet, MQTT_5) for packet in [*burst, Pingreq()]))
            answers = [pub.receive() for _ in range(sum(1 for p in burst if p.qos) + 1)]
            # A PUBACK per QoS 1 PUBLISH with its packet id [MQTT-4.3.2-2], in the order received [MQTT-4.6.0-2];
            # the QoS 2 one's PUBREC [MQTT-4.3.3-8] and the PINGRESP besides.
            assert [a.packet_id for a in answers if isinstance(a, Puback)] == \
                [p.packet_id for p in burst if p.qos == 1], answers
            assert all(a.reason_code.value == 0 for a in answers if isinstance(a, (Puback, Pubrec)))
            assert [type(a) for a in answers].count(Pubrec) == 1 and Pingresp in map(type, answers)
            got = [sub.receive() for _ in burst]
            assert all(isinstance(p, Publish) for p in got), got
            # In the order sent [MQTT-4.6.0-5], at the QoS sent (the subscription allows 1; QoS 2 goes down to it),
            # each with its own User Properties.
            assert [(p.topic, p.payload, min(p.qos, 1), p.properties.user_properties) for p in burst] == \
                [(p.topic, p.payload, p.qos, p.properties.user_properties) for p in got]
            delivered = [p for p in got if p.qos]
            half = len(delivered) // 2
            sub.send(*(Puback(p.packet_id) for p in delivered[:half]))
            sub.send(Pingreq())  # its PINGRESP comes after the PUBACKs before it are handled
            assert isinstance(sub.receive(), Pingresp)
        kill(node)  # every PUBACK was sent before: each of those messages must be in the log
        with CommitLog.open(data / "commitlog", CommitLogConfig()) as log:
            records = [r for r in log.scan(log.min_offset, 1 << 30).records if r.topic.startswith(base)]
        stored = [m for r in records for m in (r.messages if r.flags & FLAG_BATCH else (r,))]
        assert [(m.topic, m.payload, m.qos, m.client_id, m.properties) for m in stored] == \
            [(p.topic, p.payload, p.qos, f"pub-{run}", _record_properties(p)) for p in burst]
        batches = [r for r in records if r.flags & FLAG_BATCH]
        assert any(m.qos == 1 for r in batches for m in r.messages), "no QoS 1 run was batched"
        assert not any(m.qos == 2 for r in batches for m in r.messages)  # its packet id keeps it single
        node = Node(data)
        with raw_client(node.port, MQTT_5) as sub:
            connack = sub.connect(f"sub-{run}", clean=False, properties=SESSION)
            assert connack.session_present  # [MQTT-3.2.2-2]
            again = [sub.receive()]
            while again[-1].payload != delivered[-1].payload and len(again) <= len(got):
                again.append(sub.receive())
            # Every unacknowledged message again [MQTT-4.4.0-1], in order [MQTT-4.6.0-2]: from where the session's
            # committed acknowledgements stood at the kill (those after it come again: at least once).
            resent = [p.payload for p in again if p.qos]
            assert len(resent) >= len(delivered) - half and resent == [p.payload for p in delivered][-len(resent):]
            sub.send(*(Puback(p.packet_id) for p in again if p.qos))
    finally:
        node.stop()


def _record_properties(packet: Publish) -> bytes:
    """The properties a record keeps of ``packet``: its property block, none for none."""
    return encode_properties(packet.properties, PacketType.PUBLISH) if packet.properties.user_properties else b""
