"""Delayed messages through SIGKILLs and a power loss of `lightgate serve`: every acknowledged one is delivered once.

A QoS 2 publisher sends delayed messages (``$delayed/<1..3>/<topic>``; its PUBCOMP means stored, under
``commitlog.flush sync`` on disk) to a persistent QoS 2 subscriber. The node is SIGKILLed while they are pending,
then, after more were published, while they are being dequeued (the subscriber has received some of them and
not all); the power-loss run also cuts the log at its flushed mark before the last start (tests/store/test_timer.py
covers the async policy's tail with the timer files ahead of the log). At the end the subscriber has every
acknowledged message (lost: 0), none twice except resends marked DUP [MQTT-3.3.1-1] (duplicated: 0), and the log
holds each delivered message exactly once (the timer fired none twice).
"""

from __future__ import annotations

import json
import queue
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import trio

from store.log.commitlog import CommitLogConfig
from store.node import open_store
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, kill, session5, subscribe5, wait_until

pytestmark = pytest.mark.slow

HALF = 20
TOPIC = "fleet/cmd"


class Subscriber:
    """The persistent QoS 2 subscriber, reconnected after each restart; what it received, in order."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, bool]] = []  # (payload, dup)
        self.client: Client | None = None

    def connect(self, node: Node, first: bool = False) -> None:
        self.client, present = session5(node.port, "delayed-sub", 3600, clean=first)
        if first:
            assert subscribe5(self.client, TOPIC, qos=2) == [2]
        else:
            assert present  # the session (and its subscription) survived the kill

    def drain(self) -> None:
        while True:
            try:
                message = self.client.messages.get_nowait()
            except queue.Empty:
                return
            self.received.append((message.payload, bool(message.dup)))

    def distinct(self) -> set[bytes]:
        self.drain()
        return {payload for payload, _ in self.received}

    def gone(self) -> None:
        self.drain()
        self.client.paho.loop_stop()


def publish(node: Node, numbers: range) -> set[bytes]:
    """Publish delayed messages at QoS 2; the payloads of those acknowledged (PUBCOMP)."""
    acked = set()
    client = Client(node.port, "delayed-pub", protocol=mqtt.MQTTv5)
    client.connect()
    for i in numbers:
        client.publish(f"$delayed/{1 + i % 3}/{TOPIC}", b"%d" % i, qos=2)  # waits for PUBCOMP
        acked.add(b"%d" % i)
    client.disconnect()
    return acked


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


async def stored_messages(data: Path) -> Counter[bytes]:
    async with open_store(data, CommitLogConfig()) as node:
        await node.dispatcher.wait_dispatched(node.log.log.written_offset)
        assert node.timers.pending == 0
        result = node.read(TOPIC, 0, max_count=10 * HALF)
        return Counter(record.payload for _, record in result.messages)


@pytest.mark.parametrize("power_loss", [False, True], ids=["sigkill", "power-loss"])
def test_delayed_messages_are_delivered_once_through_kills(tmp_path, power_loss):
    data = tmp_path / "data"
    flags = ("--commitlog-flush", "sync")
    subscriber = Subscriber()
    node = Node(data, *flags)
    subscriber.connect(node, first=True)
    acked = publish(node, range(HALF))
    pending_at_kill = HALF - len(subscriber.distinct())
    kill(node)  # 1: while delayed messages are pending
    subscriber.gone()
    assert pending_at_kill > 0

    node = Node(data, *flags)
    subscriber.connect(node)
    acked |= publish(node, range(HALF, 2 * HALF))
    wait_until(lambda: subscriber.distinct() & {b"%d" % i for i in range(HALF, 2 * HALF)}, what="a second-half message")
    in_flight = 2 * HALF - len(subscriber.distinct())
    kill(node)  # 2: while they are being dequeued
    subscriber.gone()
    if power_loss:
        cut_at_flushed_mark(data)

    node = Node(data, *flags)
    try:
        subscriber.connect(node)
        wait_until(lambda: subscriber.distinct() >= acked, what="every acknowledged message")
        subscriber.gone()
    finally:
        node.stop()
    firsts = Counter(payload for payload, dup in subscriber.received if not dup)
    report = {"acknowledged": len(acked), "delivered": len(subscriber.distinct()),
              "lost": len(acked - subscriber.distinct()), "duplicated": sum(n - 1 for n in firsts.values() if n > 1),
              "pending_at_first_kill": pending_at_kill, "undelivered_at_second_kill": in_flight}
    print(json.dumps(report))
    assert report["lost"] == 0 and report["duplicated"] == 0, report
    assert in_flight > 0, report  # the second kill did come while messages were being dequeued
    stored = trio.run(stored_messages, data)
    assert set(stored) == acked and max(stored.values()) == 1, stored  # the timer fired each exactly once
