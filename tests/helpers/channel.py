"""Driving the sans-IO MQTT channel without sockets: a clock, connects, subscribes, and the actions it returns."""

from __future__ import annotations

from gateway.mqtt.actions import (
    Activate, Activated, Authorizer, Deliver, Message, OpenSession, PatchSession, SaveSession, Send, SessionOpened,
    SessionSaved,
)
from gateway.mqtt.channel import Channel, ChannelConfig
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role
from gateway.mqtt.packets import MQTT_5, Connect, Publish, Subscribe
from gateway.mqtt.properties import Properties
from gateway.mqtt.session import SessionState
from gateway.mqtt.state import State

T0 = 1_700_000_000.0


class Clock:
    """A settable wall clock for the channel (seconds)."""

    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def of(actions: list, cls: type) -> list:
    return [a for a in actions if type(a) is cls]


def sent(actions: list) -> list:
    return [p for a in of(actions, Send) for p in a.packets]


def delivered(actions: list, level: int = MQTT_5) -> list[Publish]:
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)
    for action in of(actions, Deliver):
        decoder.feed(action.data)
    out = []
    while (packet := decoder.next_packet()) is not NEED_DATA:
        out.append(packet)
    return out


def connect(
    level: int = MQTT_5,
    *,
    config: ChannelConfig = ChannelConfig(),
    state: SessionState | None = None,
    client_id: str = "dev1",
    clean: bool = True,
    authorizer: Authorizer | None = None,
    **fields,
) -> tuple[Channel, Clock, list]:
    """A connected channel and the actions of its SessionOpened."""
    clock = Clock()
    channel = Channel(config, clock)
    first = channel.handle_in(Connect(protocol_level=level, client_id=client_id, clean_start=clean, **fields))
    assert of(first, OpenSession), first
    actions = channel.handle_event(SessionOpened(state is not None, state, authorizer=authorizer))
    assert channel.state is State.CONNECTED
    return channel, clock, actions


def subscribe(channel: Channel, *entries, starts: dict | None = None, packet_id: int = 1, retained=(), **props):
    """SUBSCRIBE, answer the Activate (and the session saves it asks for); returns (activate action, actions after
    Activated)."""
    actions = channel.handle_in(Subscribe(packet_id, tuple(entries), Properties(**props)))
    (activate,) = of(actions, Activate)
    starts = starts if starts is not None else {sub.filter: 0 for sub in activate.subscriptions}
    return activate, saved(channel, channel.handle_event(Activated(activate.ref, starts, retained)))


def msg(offset: int, topic: str = "a/b", qos: int = 1, queue: str = "a/b", **fields) -> Message:
    return Message(topic, b"m%d" % offset, qos, queue=queue, offset=offset, store_ms=int(T0 * 1000), **fields)


def saved(channel: Channel, actions: list) -> list:
    """``actions`` and what answering their session saves and patches (``SessionSaved``) brings, the node's
    part."""
    out = list(actions)
    for save in of(actions, SaveSession) + of(actions, PatchSession):
        if save.ref is not None:
            out += saved(channel, channel.handle_event(SessionSaved(save.ref)))
    return out
