"""A full data disk under a real `lightgate serve` process, on a small real tmpfs, filled under load and freed.

The node must stay up throughout: new QoS 1 messages are refused with PUBACK
0x97 (Quota exceeded) for MQTT 5 and by closing the connection for 3.1.1
(never a false acknowledgement), QoS 0 ones are dropped and counted, stored
messages keep being delivered, the condition is logged once when it starts and
once when it clears, and publishing resumes by itself once space is freed. No
acknowledged message is lost. Starting on a full disk fails with one clear line.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from gateway.mqtt.packets import MQTT_5, MQTT_311, Puback, Publish
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.fulldisk import FLAGS, fill, full_lines
from tests.helpers.prometheus import metric
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, RawClient, wait_until
from tests.helpers.processes import LightgateProcess

PAYLOAD = b"x" * 200


class Load:
    """An MQTT 5 publisher sending QoS 1 messages one after the other, recording what each PUBACK said."""

    def __init__(self, port: int) -> None:
        self.client = RawClient(port, MQTT_5)
        self.client.connect("load-" + uuid.uuid4().hex[:6])
        self.acked: list[bytes] = []
        self.refused: list[ReasonCode] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            payload = b"%d:" % i + PAYLOAD
            self.client.send(Publish("f/load", payload, 1, packet_id=i % 60000 + 1))
            ack = self.client.receive()
            assert isinstance(ack, Puback), ack
            if ack.reason_code is ReasonCode.SUCCESS:
                self.acked.append(payload)
            else:
                self.refused.append(ack.reason_code)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        self.client.close()


@pytest.mark.slow
def test_a_full_disk_refuses_new_messages_keeps_delivering_and_resumes_by_itself(small_disk):
    node = Node(small_disk / "data", *FLAGS)
    filler = small_disk / "filler"
    try:
        admin = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        sub = Client(node.port, "sub", clean=False)
        sub.connect()
        sub.subscribe("f/#", 1)
        load = Load(node.port)
        try:
            wait_until(lambda: len(load.acked) >= 200, what="messages acknowledged before the disk fills")
            fill(filler)  # under load
            wait_until(lambda: len(load.refused) >= 20, what="publishes refused on the full disk")
            assert set(load.refused) <= {ReasonCode.QUOTA_EXCEEDED, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR}
            assert node.proc.poll() is None
            # 3.1.1 cannot refuse a QoS 1 message: the connection is closed, with no PUBACK [MQTT-3.3.4-1]
            old = RawClient(node.port, MQTT_311)
            old.connect("old-" + uuid.uuid4().hex[:6])
            old.send(Publish("f/old", b"refused", 1, packet_id=1))
            old.sock.settimeout(WAIT_S)
            assert old.sock.recv(1024) == b""
            old.close()
            q0 = RawClient(node.port, MQTT_5)
            q0.connect("q0-" + uuid.uuid4().hex[:6])
            q0.send(Publish("f/q0", b"dropped", 0))  # QoS 0: dropped and counted, nothing said
            wait_until(lambda: metric(admin, 'lightgate_messages_refused_total{qos="0"}') >= 1,
                       what="the QoS 0 message counted as refused")
            q0.close()
            assert metric(admin, "lightgate_store_disk_full") == 1
            acked_while_full = len(load.acked)
            filler.unlink()  # resumes by itself: no restart
            wait_until(lambda: len(load.acked) >= acked_while_full + 200, what="publishing resumed")
        finally:
            load.close()
        wait_until(lambda: metric(admin, "lightgate_store_disk_full") == 0, what="the metric cleared")
        expected = set(load.acked)
        got: set[bytes] = set()
        while not expected <= got:  # every acknowledged message is delivered (at least once)
            got.add(sub.messages.get(timeout=WAIT_S).payload)
        sub.disconnect()
        started, cleared = full_lines(node)
        assert len(started) == 1 and len(cleared) == 1, (started, cleared)
        assert node.proc.poll() is None
    finally:
        filler.unlink(missing_ok=True)
        assert node.stop() == 0
    assert [d for d in node.errors() if not d["msg"].startswith("data disk full")] == [], node.errors()


@pytest.mark.slow
def test_starting_on_a_full_disk_fails_with_one_clear_line(small_disk):
    node = Node(small_disk / "data", *FLAGS)
    assert node.stop() == 0
    fill(small_disk / "filler")
    failed = LightgateProcess("serve", "--port", "0", "--data", str(small_disk / "data"), *FLAGS)
    assert failed.proc.wait(timeout=WAIT_S) == 1
    errors = failed.errors()
    assert len(errors) == 1 and "data disk under" in errors[0]["msg"] and "is full" in errors[0]["msg"], failed.logs
    assert not [d for d in failed.logs if "Traceback" in d.get("msg", "")], failed.logs
