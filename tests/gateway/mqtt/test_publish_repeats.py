"""``Channel.handle_repeats``: a QoS 0 PUBLISH and those read right after it that repeat it but for their payloads
(``MqttDecoder.repeats``) answer as the same packets handled one by one would: one ``Append`` of a ``PayloadRun``
when the first is a plain QoS 0 message, else each with its own checks (issue 31).
"""

from __future__ import annotations

import pytest

from gateway.mqtt.actions import Action, Append, Close, Denied, LimitHit
from gateway.mqtt.channel import ChannelConfig
from gateway.mqtt.packets import MQTT_5, MQTT_311, Publish
from store.api import NewMessage, PayloadRun
from tests.helpers.channel import connect, of


class Denying:
    """An ``Authorizer`` that refuses the topics under ``no/``."""

    def may_publish(self, topic: str) -> bool:
        return not topic.startswith("no/")

    def may_subscribe(self, filter: str) -> bool:
        return True

    def may_read(self, topic: str) -> bool:
        return True


def _flat(actions: list[Action]) -> list[object]:
    """The actions with each ``Append`` as its ref and messages one by one: what a run must amount to."""
    out: list[object] = []
    for action in actions:
        if type(action) is Append:
            out += [(action.ref, m) for m in action.messages]
        else:
            out.append(action)
    return out


PAYLOADS = [b"p%d" % i for i in range(1, 6)]

CASES = {
    "plain": ("t/1", {}),
    "acl": ("no/t", {"authorizer": Denying()}),
    "rate": ("t/1", {"config": ChannelConfig(publish_rate=1, publish_burst=3)}),
    "bytes rate": ("t/1", {"config": ChannelConfig(publish_bytes_rate=8)}),
    "wildcard": ("t/+", {}),  # [MQTT-3.3.2-2]
    "levels": ("a/b/c/d", {"config": ChannelConfig(max_topic_levels=3)}),
    "delayed": ("$delayed/5/t", {}),
}


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
@pytest.mark.parametrize("case", CASES)
def test_a_run_answers_as_its_packets_one_by_one(level: int, case: str):
    topic, kwargs = CASES[case]
    run, _, _ = connect(level, **kwargs)
    each, _, _ = connect(level, **kwargs)
    got = run.handle_repeats(Publish(topic, b"p0"), PAYLOADS)
    want = [a for p in [b"p0", *PAYLOADS] for a in each.handle_in(Publish(topic, p))]
    assert _flat(got) == _flat(want)
    assert run.state is each.state and run.conn.pending == each.conn.pending


def test_a_plain_qos0_run_is_one_append_without_a_message_each():
    channel, _, _ = connect(MQTT_311)
    (append,) = channel.handle_repeats(Publish("t/1", b"p0"), PAYLOADS)
    assert type(append) is Append and append.ref is None and isinstance(append.messages, PayloadRun)
    assert append.messages.payloads == [b"p0", *PAYLOADS]
    like = append.messages.like
    assert isinstance(like, NewMessage) and (like.topic, like.client_id, like.qos, like.retain) == \
        ("t/1", "dev1", 0, False)


def test_a_rate_charges_every_message_of_a_run():
    """A run is not one message to the publish rate: over it the rest are dropped, each counted."""
    channel, _, _ = connect(MQTT_5, config=ChannelConfig(publish_rate=1, publish_burst=2))
    actions = channel.handle_repeats(Publish("t", b"p0"), PAYLOADS)
    assert sum(len(a.messages) for a in of(actions, Append)) == 2
    assert len(of(actions, LimitHit)) == len(PAYLOADS) - 1


def test_a_refused_first_message_refuses_the_run():
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    actions = channel.handle_repeats(Publish("no/t", b"p0"), PAYLOADS)
    assert not of(actions, Append) and len(of(actions, Denied)) == 1 + len(PAYLOADS)
    channel, _, _ = connect(MQTT_5)
    actions = channel.handle_repeats(Publish("t/#", b"p0"), PAYLOADS)  # [MQTT-3.3.2-2]: closed at the first
    assert not of(actions, Append) and len(of(actions, Close)) == 1
