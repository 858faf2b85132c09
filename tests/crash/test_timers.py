"""Delayed messages through SIGKILLs and a power loss of `lightgate serve`: every acknowledged one is delivered once.

A QoS 2 publisher sends delayed messages (``$delayed/<1..3>/<topic>``; its PUBCOMP means stored, under
``commitlog.flush sync`` on disk) to a persistent QoS 2 subscriber (gateway/bench/crashclients.py: it counts a
message when its PUBLISH comes, so one the node delivered just before a kill is not lost with a client library's
state). The node is SIGKILLed while they are pending,
then, after more were published, while they are being dequeued (the subscriber has received some of them and
not all); the power-loss run also cuts the log at its flushed mark before the last start (tests/store/test_timer.py
covers the async policy's tail with the timer files ahead of the log). At the end the subscriber has every
acknowledged message (lost: 0), none twice except resends marked DUP [MQTT-3.3.1-1] (duplicated: 0), and the log
holds each delivered message exactly once (the timer fired none twice). A message cancelled through the admin API
just before a SIGKILL stays cancelled: the restarted node neither lists nor delivers it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import trio

from gateway.bench.crashclients import STAMP, Subscriber, address_cycle, message_key
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from tests.helpers.admin import Admin
from tests.helpers.crashkit import EmbeddedNode
from tests.helpers.mqtt_fixtures import Client, session5, subscribe5

pytestmark = pytest.mark.slow

HALF = 20
TOPIC = "fleet/cmd"
WAIT_S = 60.0


def publish(port: int, numbers: range) -> set[int]:
    """Publish delayed messages at QoS 2 (blocking); the message keys of those acknowledged (PUBCOMP)."""
    acked = set()
    client = Client(port, "delayed-pub", protocol=mqtt.MQTTv5)
    client.connect()
    for i in numbers:
        client.publish(f"$delayed/{1 + i % 3}/{TOPIC}", STAMP.pack(0, i), qos=2)  # waits for PUBCOMP
        acked.add(message_key(0, i))
    client.disconnect()
    return acked


async def until(condition, what: str) -> None:
    """Wait for ``condition`` (the subscriber's state, checked as it changes: every 10 ms)."""
    with trio.fail_after(WAIT_S):
        while not condition():
            await trio.sleep(0.01)


def cut_at_flushed_mark(data: Path) -> None:
    """The power loss: every byte of the log after its flushed mark is gone (the timer's files are kept)."""
    log = data / "commitlog"
    flushed = int.from_bytes((log / "flushed").read_bytes()[:8], "big")
    for segment in sorted(log.glob("0*[0-9]")):
        base, size = int(segment.name), segment.stat().st_size
        if base + size > flushed:
            with open(segment, "r+b") as handle:
                handle.seek(max(0, flushed - base))
                handle.write(bytes(size - max(0, flushed - base)))


async def queue_payloads(data: Path, topic: str) -> list[bytes]:
    """What the stopped node's log delivered to ``topic``."""
    async with open_store(data, CommitLogConfig()) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        return [record.payload for _, record in node.read(topic, 0, max_count=100).messages]


async def stored_messages(data: Path) -> Counter[int]:
    async with open_store(data, CommitLogConfig()) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 0
        result = node.read(TOPIC, 0, max_count=10 * HALF)
        return Counter(message_key(*STAMP.unpack_from(record.payload)) for _, record in result.messages)


async def scenario(data: Path, power_loss: bool) -> dict:
    node = await trio.to_thread.run_sync(EmbeddedNode, data, "sync")
    port = node.addresses[0][1]
    subscriber = Subscriber(0, 2, TOPIC, prefix="delayed-sub-")  # delivers at PUBLISH, PUBREL only frees the id
    stop = trio.Event()
    acked: set[int] = set()
    undelivered: list[int] = []  # at each kill

    def killed(then: Callable[[], None] | None = None) -> None:
        """Between a SIGKILL and the restart: count what the subscriber has not received by then (in trio's thread,
        where it counts; counted before the kill, it would include what the node delivered meanwhile), then
        ``then()``."""
        undelivered.append(trio.from_thread.run_sync(lambda: len(acked - set(subscriber.counts))))
        if then is not None:
            then()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(subscriber.run, address_cycle(node.addresses), stop)
            await until(lambda: subscriber.connects, "the subscriber's session")
            acked |= await trio.to_thread.run_sync(publish, port, range(HALF))
            await trio.to_thread.run_sync(node.crash, killed)  # 1: while delayed messages are pending
            second = await trio.to_thread.run_sync(publish, port, range(HALF, 2 * HALF))
            acked |= second
            await until(lambda: second & set(subscriber.counts), "a second-half message")
            # 2: while they are being dequeued (and, for the power loss, the log cut at its flushed mark)
            await trio.to_thread.run_sync(node.crash, partial(killed, partial(cut_at_flushed_mark, data))
                                          if power_loss else killed)
            with trio.move_on_after(WAIT_S):
                await until(lambda: subscriber.has(acked), "every acknowledged message")
            stop.set()
    finally:
        await trio.to_thread.run_sync(node.stop)
    return {"acknowledged": len(acked), "delivered": len(acked & set(subscriber.counts)),
            "lost": len(acked - set(subscriber.counts)),
            "duplicated": sum(count - 1 for count in subscriber.counts.values()),
            "sessions_lost": subscriber.sessions_lost, "pending_at_first_kill": undelivered[0],
            "undelivered_at_second_kill": undelivered[1], "errors": node.errors()}


@pytest.mark.parametrize("power_loss", [False, True], ids=["sigkill", "power-loss"])
def test_delayed_messages_are_delivered_once_through_kills(tmp_path, power_loss):
    data = tmp_path / "data"
    report = trio.run(scenario, data, power_loss)
    print(json.dumps(report))
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["sessions_lost"] == 0, report
    assert report["pending_at_first_kill"] > 0 and report["undelivered_at_second_kill"] > 0, report
    assert not report["errors"], report
    stored = trio.run(stored_messages, data)
    assert set(stored) == {message_key(0, i) for i in range(2 * HALF)} and max(stored.values()) == 1, stored


def test_a_cancellation_survives_a_sigkill_of_the_node(tmp_path):
    data = tmp_path / "data"
    topic = "fleet/cancel"
    node = EmbeddedNode(data, "sync", admin=True)
    port = node.addresses[0][1]
    try:
        sub, _ = session5(port, "cancel-sub", 600)
        assert subscribe5(sub, topic, qos=1) == [1]
        sub.disconnect()  # its session, and its place in the topic's queue, wait in the store
        pub = Client(port, "cancel-pub", protocol=mqtt.MQTTv5)
        pub.connect()
        ids = []
        pub.paho.on_publish = lambda c, u, mid, rc, props: ids.append(dict(props.UserProperty)["delayed-id"])
        for delay_s, payload in ((4, b"cancelled"), (6, b"kept")):
            pub.paho.publish(f"$delayed/{delay_s}/{topic}", payload, 1).wait_for_publish(timeout=WAIT_S)
        pub.disconnect()
        admin = Admin(node.admin_port)
        assert admin.request("DELETE", f"/api/v1/delayed/{ids[0]}")[0] == 200
        admin.close()
        node.crash()  # at once: the cancellation is in the log, not yet under the timer's checkpoint
        admin = Admin(node.admin_port)
        listed = admin.get(f"/api/v1/delayed?topic={topic}")["messages"]
        assert [m["id"] for m in listed] in ([ids[1]], [])  # "kept" may have fired already on a slow restart
        assert admin.request("DELETE", f"/api/v1/delayed/{ids[0]}")[0] == 404
        admin.close()
        sub, present = session5(port, "cancel-sub", 600)
        assert present
        assert sub.messages.get(timeout=WAIT_S).payload == b"kept"  # the first the session gets: never "cancelled"
        sub.disconnect()
    finally:
        node.stop()
    assert not node.errors()
    assert trio.run(queue_payloads, data, topic) == [b"kept"]
