"""A run of SUBSCRIBEs through a SIGKILL of a real ``lightgate serve``: every filter of a run is one activation
record (``ActivatedRun``, issue 31), and every subscription that got its SUBACK before the kill holds after the
restart and receives what is published to it ([MQTT-3.8.4-1], [MQTT-3.1.2-4]: the session of a client with
CleanSession 0 resumes with its subscriptions).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_311, Packet, Suback, Subscribe, SubscriptionOptions
from store.control import Activated, ActivatedRun, decode_control
from store.log.commitlog import CommitLog
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, connected, kill, raw_client, run_id

pytestmark = pytest.mark.slow

PACKETS = 40
FILTERS = 25  # per SUBSCRIBE: 1,000 in all, written while the node is killed


def packets_until_closed(sock: socket.socket) -> Iterator[Packet]:
    """The packets the node sends until the connection closes (it was killed meanwhile)."""
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=MQTT_311)
    while True:
        packet = decoder.next_packet()
        if packet is not NEED_DATA:
            yield packet
            continue
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return
        if not data:
            return
        decoder.feed(data)


def send_each(sock: socket.socket, filters: list[list[str]]) -> None:
    """A SUBSCRIBE of each list of ``filters``, one send each (the node reads them in runs of what arrived), until
    the node is gone."""
    for p, packet in enumerate(filters):
        try:
            sock.sendall(encode(Subscribe(p + 1, tuple((f, SubscriptionOptions(qos=1)) for f in packet)), MQTT_311))
        except OSError:  # killed
            return


def activations_in(data: Path, client_id: str) -> tuple[int, list[str]]:
    """The activation records of ``client_id`` in the node's log: how many, and the filters they hold, in order."""
    with CommitLog.open(data / "commitlog") as log:
        controls = [decode_control(r) for r in log.scan(log.min_offset, 1 << 30).records if r.control]
    runs = [c for c in controls if isinstance(c, (Activated, ActivatedRun)) and c.holder == client_id]
    return len(runs), [f for c in runs for f in (c.filters if isinstance(c, ActivatedRun) else [c.filter])]


def test_subscriptions_acknowledged_before_a_sigkill_during_a_run_hold_after_the_restart(tmp_path):
    data = tmp_path / "data"
    prefix, client_id = run_id(), "runner-" + run_id()
    filters = [[f"{prefix}/{p}/{f}/+" for f in range(FILTERS)] for p in range(PACKETS)]
    node = Node(data, "--commitlog-flush", "sync", "--mqtt-sys-interval-s", "0")
    try:
        with raw_client(node.port, MQTT_311) as raw:
            raw.connect(client_id, clean=False)
            sender = threading.Thread(target=send_each, args=(raw.sock, filters))
            sender.start()
            sent = packets_until_closed(raw.sock)
            first = next(sent)
            kill(node)  # while later SUBSCRIBEs are read, activated, answered
            subacks = [first, *sent]
            sender.join()
    finally:
        node.stop()
    print(f"{len(subacks)} SUBACKs of {PACKETS} before the kill")
    assert all(isinstance(suback, Suback) for suback in subacks)
    granted = [f for suback in subacks for f in filters[suback.packet_id - 1]]
    assert all(not code.is_failure for suback in subacks for code in suback.reason_codes)
    records, activated = activations_in(data, client_id)
    print(f"{len(granted)} filters granted, {len(activated)} activated in {records} records")
    assert set(granted) <= set(activated)
    assert records <= len(activated) // FILTERS  # a run's filters share a record: not one record each
    node = Node(data, "--commitlog-flush", "sync", "--mqtt-sys-interval-s", "0")
    try:
        subscriber = Client(node.port, client_id, clean=False)
        assert subscriber.connect().session_present
        try:
            with connected(node.port) as publisher:
                for f in granted:
                    publisher.publish(f.replace("+", "x"), f.encode(), qos=1)
                got = subscriber.receive(len(granted))
            assert sorted(m.payload.decode() for m in got) == sorted(granted)
        finally:
            subscriber.disconnect()
    finally:
        node.stop()
    assert not node.errors()
