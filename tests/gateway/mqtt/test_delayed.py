"""``$delayed/<seconds>/<topic>`` in the channel (gateway/mqtt/delayed.py): the ACL is asked about the real topic at
publish time, and the message goes to the node as a delayed message of that topic."""

from gateway.mqtt.actions import Append, Denied
from gateway.mqtt.packets import MQTT_5, Puback, Publish
from gateway.mqtt.reasons import ReasonCode as R
from tests.gateway.mqtt.test_channel import Denying, connect, of, sent


def test_the_acl_is_asked_about_the_real_topic_at_publish_time():
    channel, _, _ = connect(MQTT_5, authorizer=Denying())
    actions = channel.handle_in(Publish("$delayed/5/no/t", qos=1, packet_id=1))
    assert not of(actions, Append) and of(actions, Denied) == [Denied("publish", "no/t", "QoS 1 message dropped")]
    assert sent(actions) == [Puback(1, R.NOT_AUTHORIZED)]  # [MQTT-3.4.2-1] reason 0x87
    (append,) = of(channel.handle_in(Publish("$delayed/5/ok/t", b"p", qos=1, packet_id=2)), Append)
    (message,) = append.messages
    assert message.topic == "ok/t" and message.deliver_at_ms == message.born_ms + 5000


def test_a_delayed_qos0_message_waits_for_the_stores_answer():
    channel, _, _ = connect(MQTT_5)
    (append,) = of(channel.handle_in(Publish("$delayed/1/a", qos=0)), Append)
    assert append.ref is not None  # a refusal (the client's cap) closes the connection instead of going unseen
    (plain,) = of(channel.handle_in(Publish("a", qos=0)), Append)
    assert plain.ref is None
