"""The embedded node in-process: session blobs in the store, session encoding, session expiry over real sockets."""

import logging
from dataclasses import replace
from functools import partial

import msgspec
import pytest
import trio

from gateway.mqtt.actions import InFlight, Phase, Subscription
from gateway.app.embedded import serve_gateway
from gateway.auth.authn import Authenticator
from gateway.mqtt.channel import ChannelConfig
from gateway.mqtt.codec import encode
from gateway.node.connection import serve_mqtt
from gateway.node.guard import Guard
from gateway.node.listeners import ListenerSpec
from gateway.node.node import GatewayNode
from gateway.node.sessions import rejoin, split
from gateway.mqtt.session import decode_session, encode_session
from gateway.mqtt.packets import (MQTT_311, Connack, Connect, Disconnect, Puback, Publish, Suback, Subscribe,
                                  SubscriptionOptions)
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.session import SessionState
from store.api import MAIN_LOG, Position
from store.local import LocalStore
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from tests.helpers.trio_mqtt import DEFAULTS, RawClient



async def test_session_blobs_are_durable_and_droppable(tmp_path):
    async with open_store(tmp_path, CommitLogConfig()) as store:
        sessions = store.sessions
        await sessions.save_session("kept", b"one")
        await sessions.save_session("kept", b"two")  # the latest wins
        await sessions.save_session("dropped", b"x")
        assert await sessions.end_session("dropped")
        assert not await sessions.end_session("never-saved")  # harmless
    async with open_store(tmp_path, CommitLogConfig()) as store:
        assert await store.sessions.load_session("kept") == b"two"
        assert await store.sessions.load_session("dropped") is None


def test_session_state_round_trips_through_its_blob():
    state = SessionState(
        "dev-1", 3600, (Subscription("a/+", "a/+", SubscriptionOptions(qos=2)),), {"a/+": 3}, {"a/+": 5},
        frozenset({7}), (InFlight(9, "a/+", 4, 2, Phase.RELEASED),), 10, {3: Position(MAIN_LOG, 700)}, {"a/+": 2}, True,
    )
    assert decode_session(encode_session(state)) == state
    with pytest.raises(msgspec.DecodeError):
        decode_session(b"\x93not a session")


def test_suspended_subscriptions_rejoin_every_save_and_a_reused_packet_id_is_delivered_again():
    state = SessionState("dev", 60, (Subscription("a/#", "a/#"), Subscription("b/#", "b/#")), {"a/#": 3, "b/#": 5},
                         {"a/#": 4, "b/#": 9}, frozenset(), (InFlight(7, "b/#", 6, 1), InFlight(8, "b/#", 7, 1)), 9)
    kept, suspended = split(state, {"b/#"})
    assert [s.filter for s in kept.subscriptions] == ["a/#"] and not kept.inflight and "b/#" not in kept.offsets
    assert [s.filter for s in suspended.subscriptions] == ["b/#"] and len(suspended.inflight) == 2
    live = replace(kept, inflight=(InFlight(7, "a/#", 3, 1),))  # the connection reused packet id 7
    whole = rejoin(live, suspended)
    assert [s.filter for s in whole.subscriptions] == ["a/#", "b/#"]
    assert whole.offsets["b/#"] == 5 and whole.cursors["b/#"] == 6  # back to the message whose id was reused
    assert [(e.packet_id, e.filter) for e in whole.inflight] == [(7, "a/#"), (8, "b/#")]
    resubscribed = replace(live, subscriptions=(*live.subscriptions, Subscription("b/#", "b/#")))
    assert rejoin(resubscribed, suspended) == resubscribed  # made again meanwhile: the live one wins


async def test_session_expires_after_disconnect_and_releases_its_filter(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    settings = {**DEFAULTS, "node.data": str(tmp_path), "node.port": 0}
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_gateway, settings)
        client = RawClient(await trio.open_tcp_stream(host, port))
        await client.send(Connect(client_id="exp", clean_start=False, properties=Properties(session_expiry_interval=1)))
        connack = await client.receive()
        assert isinstance(connack, Connack) and not connack.session_present
        await client.send(Subscribe(1, (("exp/+/x", SubscriptionOptions(qos=1)),)))
        assert isinstance(await client.receive(), Suback)
        await client.send(Disconnect())
        await client.stream.aclose()
        with trio.fail_after(10):
            while "session expired" not in caplog.text:  # the expiry timer runs after the close
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    async with open_store(tmp_path, CommitLogConfig()) as store:
        assert await store.sessions.load_session("exp") is None
        assert store.queues.holders("exp/+/x") == []


async def test_mqtt5_protocol_error_is_answered_with_a_disconnect_before_the_close(tmp_path):
    settings = {**DEFAULTS, "node.data": str(tmp_path), "node.port": 0}
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_gateway, settings)
        client = RawClient(await trio.open_tcp_stream(host, port))
        await client.send(Connect(client_id="bad5"))
        assert isinstance(await client.receive(), Connack)
        await client.stream.send_all(b"\x36\x00")  # PUBLISH with QoS 3: malformed
        disconnect = await client.receive()
        assert isinstance(disconnect, Disconnect) and disconnect.reason_code is ReasonCode.MALFORMED_PACKET
        with trio.fail_after(10):
            assert await client.stream.receive_some(1) == b""  # then the server closes
        nursery.cancel_scope.cancel()


PUBLISHERS = 3
PIPELINED = 60  # each publisher's QoS 1 PUBLISHes, sent in one write without waiting for PUBACKs


async def test_a_read_round_delivers_the_news_of_what_it_appended_in_its_own_step(tmp_path):
    """The node runs without its task that consumes the store's events (``consume_events``): a QoS 1 fan-in's
    messages appended at the end of a read round reach their subscriber from that step (``GatewayNode.news_now``),
    not one scheduling round of the event loop later for dispatch and another for the news (at a fan-in's load,
    each as long as a read round of hundreds of PUBLISHes). Each publisher's messages arrive in the order it sent
    them, each once [MQTT-4.6.0-2] [MQTT-4.6.0-5], and each publisher has every PUBACK, in order [MQTT-4.6.0-2]."""
    async with open_store(tmp_path, CommitLogConfig(segment_bytes=1 << 20)) as store:
        local = LocalStore(store, lease=True)
        try:
            async with trio.open_nursery() as nursery:
                node = GatewayNode(local, nursery, ChannelConfig(), 10.0,
                                   guard=Guard(Authenticator(None, allow_anonymous=True)))
                nursery.start_soon(node.timers.run)
                nursery.start_soon(node.reads.run)
                (bound,) = await nursery.start(partial(serve_mqtt, node, [ListenerSpec("tcp", "127.0.0.1", 0)]))

                async def client(client_id: str) -> RawClient:
                    mqtt = RawClient(await trio.open_tcp_stream("127.0.0.1", bound.port), MQTT_311)
                    await mqtt.send(Connect(MQTT_311, client_id, True))
                    assert isinstance(await mqtt.receive(), Connack)
                    return mqtt

                sub = await client("sub")
                await sub.send(Subscribe(1, (("fan/#", SubscriptionOptions(qos=1)),)))
                assert isinstance(await sub.receive(), Suback)
                pubs = [await client(f"pub-{i}") for i in range(PUBLISHERS)]
                for i, pub in enumerate(pubs):
                    await pub.stream.send_all(b"".join(
                        encode(Publish(f"fan/{i}", b"%d" % n, 1, packet_id=n + 1), MQTT_311) for n in range(PIPELINED)))
                received: dict[str, list[bytes]] = {f"fan/{i}": [] for i in range(PUBLISHERS)}
                with trio.fail_after(10):
                    for pub in pubs:
                        assert [(await pub.receive()).packet_id for _ in range(PIPELINED)] \
                            == list(range(1, PIPELINED + 1))
                    for _ in range(PUBLISHERS * PIPELINED):
                        publish = await sub.receive()
                        assert isinstance(publish, Publish) and publish.qos == 1
                        received[publish.topic].append(publish.payload)
                        await sub.send(Puback(publish.packet_id))
                assert received == {f"fan/{i}": [b"%d" % n for n in range(PIPELINED)] for i in range(PUBLISHERS)}
                nursery.cancel_scope.cancel()
        finally:
            local.close()
