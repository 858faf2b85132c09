"""A read round's QoS 0 PUBLISHes to one topic become batch records (store/node.py ``append_nowait``): against a
`lightgate serve` process over raw MQTT 5 sockets, nothing a client can observe changes (issue 31, item 2).

One publisher sends a burst in one write, so the node reads it in one round (or, on a connection its own task reads,
a WebSocket's, in one round of its own): same-topic runs with and without
properties, a retained message, a topic alias, a QoS 1 message and a PINGREQ between them. A subscriber gets
every message in the order sent, with its own properties; the publisher's No Local subscription gets none of
them; the retained message is the one kept; and the CommitLog holds the runs as batch records, in read order.
"""

from pathlib import Path

import trio
from trio_websocket import open_websocket

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import (MQTT_5, Connack, Connect, Pingreq, Pingresp, Puback, Publish, Suback, Subscribe,
                                  SubscriptionOptions)
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_BATCH
from tests.helpers.mqtt_fixtures import WAIT_S, raw_client, run_id, running_node

EXPIRY_S = 600


def _burst(base: str) -> list[Publish]:
    """The publisher's burst: runs on ``base/a`` (every third message with a User Property, every fifth with a
    Message Expiry Interval), one on ``base/b``, a retained one, fifty through a Topic Alias, a QoS 1 one."""
    def props(i: int) -> Properties:
        return Properties(user_properties=(("i", str(i)),) if i % 3 == 0 else (),
                          message_expiry_interval=EXPIRY_S if i % 5 == 0 else None)
    burst = [Publish(f"{base}/a", b"a%d" % i, 0, properties=props(i)) for i in range(100)]
    burst += [Publish(f"{base}/b", b"b0"), Publish(f"{base}/a", b"kept", 0, retain=True)]
    burst += [Publish(f"{base}/c", b"c0", properties=Properties(topic_alias=1))]
    burst += [Publish("", b"c%d" % i, properties=Properties(topic_alias=1)) for i in range(1, 50)]
    burst += [Publish(f"{base}/a", b"q1", 1, packet_id=1)]
    return burst + [Publish(f"{base}/a", b"z%d" % i) for i in range(50)]


def _as_sent(packet: Publish, base: str) -> tuple:
    """What a subscriber must see of a sent PUBLISH: its topic (an alias resolved), payload, QoS, RETAIN (the
    subscription keeps it: Retain As Published), User Properties, and whether it expires."""
    topic = packet.topic or f"{base}/c"
    return (topic, packet.payload, packet.qos, packet.retain, packet.properties.user_properties,
            packet.properties.message_expiry_interval is not None)


def test_a_read_rounds_qos0_runs_are_batch_records_and_every_client_sees_what_it_saw_before(tmp_path: Path):
    run = run_id()
    base = f"round{run}"
    burst = _burst(base)
    with running_node(tmp_path / "data") as node:
        with raw_client(node.port, MQTT_5) as sub, raw_client(node.port, MQTT_5) as pub:
            sub.connect(f"sub-{run}")
            sub.send(Subscribe(1, ((f"{base}/#", SubscriptionOptions(qos=1, retain_as_published=True)),)))
            assert isinstance(sub.receive(), Suback)
            pub.connect(f"pub-{run}")
            pub.send(Subscribe(1, ((f"{base}/#", SubscriptionOptions(qos=1, no_local=True)),)))
            assert isinstance(pub.receive(), Suback)
            pub.sock.sendall(b"".join(encode(packet, MQTT_5) for packet in [*burst, Pingreq()]))
            # No Local [MQTT-3.8.3-3]: the publisher gets its own messages through no subscription, only the
            # PUBACK of its QoS 1 message (once stored) and the PINGRESP (at once).
            answers = {type(p): p for p in (pub.receive(), pub.receive())}
            assert answers.keys() == {Puback, Pingresp} and answers[Puback].packet_id == 1, answers
            got = [sub.receive() for _ in burst]
            assert all(isinstance(p, Publish) for p in got), got
            # In the order sent [MQTT-4.6.0-5], each with its own properties; a Message Expiry Interval goes on
            # less the time waited [MQTT-3.3.2-6]; the alias is resolved, none sent to this subscriber.
            assert [_as_sent(p, base) for p in got] == [_as_sent(p, base) for p in burst]
            assert all(p.properties.message_expiry_interval <= EXPIRY_S for p in got
                       if p.properties.message_expiry_interval is not None)
            assert all(p.properties.topic_alias is None for p in got)
            sub.send(Puback(got[[p.payload for p in got].index(b"q1")].packet_id))
            pub.send(Pingreq())  # sent once the subscriber has every message: none came to the publisher meanwhile
            assert isinstance(pub.receive(), Pingresp)
        with raw_client(node.port, MQTT_5) as late:
            late.connect(f"late-{run}")
            late.send(Subscribe(1, ((f"{base}/a", SubscriptionOptions(qos=0)),)))
            assert isinstance(late.receive(), Suback)
            retained = late.receive()  # the retained message kept, RETAIN set [MQTT-3.3.1-9]
            assert isinstance(retained, Publish) and (retained.payload, retained.retain) == (b"kept", True)
            assert retained.properties == EMPTY_PROPERTIES
    with CommitLog.open(tmp_path / "data" / "commitlog", CommitLogConfig()) as log:
        records = [r for r in log.scan(log.min_offset, 1 << 30).records if r.topic.startswith(base)]
    batches = [r for r in records if r.flags & FLAG_BATCH]
    assert batches and all(len(r.messages) > 1 and r.topic in (f"{base}/a", f"{base}/c") for r in batches)
    stored = [m.payload for r in records for m in (r.messages if r.flags & FLAG_BATCH else (r,))]
    assert stored == [p.payload for p in burst]  # the log keeps the read order
    assert not any(m.retain for r in batches for m in r.messages)  # it stays a record of its own


async def test_a_burst_read_by_the_connections_own_task_is_appended_as_one_round(tmp_path: Path):
    """A WebSocket connection is read by its task, not the poller (as a polled socket's backlog after a pause):
    its read's PUBLISHes go to the store together, as a poller round's do, not one append per message."""
    run = run_id()
    topic = f"wsround{run}/a"
    burst = [Publish(topic, b"w%d" % i) for i in range(100)]
    with running_node(tmp_path / "data", "--ws-port", "8080") as node:
        ws_port = node.wait_log(lambda doc: doc.get("msg") == "gateway node ready")["ws_port"]
        decoder = MqttDecoder(role=Role.CLIENT, protocol_level=MQTT_5)

        async def receive(ws) -> object:
            while (packet := decoder.next_packet()) is NEED_DATA:
                decoder.feed(await ws.get_message())
            return packet

        with trio.fail_after(WAIT_S):
            async with open_websocket("127.0.0.1", ws_port, "/mqtt", use_ssl=False, subprotocols=["mqtt"]) as ws:
                await ws.send_message(encode(Connect(MQTT_5, f"ws-{run}", True), MQTT_5))
                assert isinstance(await receive(ws), Connack)
                await ws.send_message(b"".join(encode(packet, MQTT_5) for packet in [*burst, Pingreq()]))
                assert isinstance(await receive(ws), Pingresp)
    with CommitLog.open(tmp_path / "data" / "commitlog", CommitLogConfig()) as log:
        records = [r for r in log.scan(log.min_offset, 1 << 30).records if r.topic == topic]
    assert [m.payload for r in records for m in (r.messages if r.flags & FLAG_BATCH else (r,))] == \
        [p.payload for p in burst]  # in read order
    assert len(records) < 10 and all(r.flags & FLAG_BATCH for r in records), [len(r.messages) for r in records]
