"""Every packet family on a full data disk, embedded and in a cluster, on a real tmpfs filled for real.

While the disk is full: a CONNECT that must delete stored state (clean start of a
stored session, or a session whose deletion waits) is refused with CONNACK 0x97
(MQTT 5) or return code 3 (3.1.1); a resume reads only and succeeds; SUBSCRIBE
is refused per filter (0x97, 3.1.1: 0x80); UNSUBSCRIBE, DISCONNECT, session
saves, offset commits and session expiry take effect for the client at once
and their store writes wait for room. The node stays up, nothing logs a
traceback, the store logs the episode once (not per request), and once space
frees every write held back lands by itself: filters are released, the expired
session is gone, and a session saved while full resumes from that save after a
restart of the process that kept it in memory.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from gateway.mqtt.packets import (MQTT_5, MQTT_311, Connack, Connect, Disconnect, Pingreq, Pingresp, Puback, Publish,
                             Suback, Subscribe, SubscriptionOptions, Unsuback, Unsubscribe)
from gateway.mqtt.properties import Properties
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.cluster import free_port
from tests.helpers.fulldisk import FLAGS, fill, full_lines
from tests.helpers.prometheus import metric
from tests.helpers.mqtt_fixtures import RawClient, wait_until
from tests.helpers.processes import LightgateProcess

pytestmark = pytest.mark.slow

WAIT_S = 30.0  # two busy cores, up to three processes


@dataclass
class Deployment:
    """The processes under test: ``sessions`` is the one that keeps sessions in memory (restarted by the test)."""

    start_sessions: Callable[[], LightgateProcess]
    store: LightgateProcess
    sessions: LightgateProcess

    @property
    def port(self) -> int:
        return self.sessions.wait_log(lambda d: d.get("msg") == "gateway node ready")["port"]

    @property
    def admin(self) -> int:
        return self.sessions.wait_log(lambda d: d.get("msg") == "admin API ready")["port"]

    def restart_sessions(self) -> None:
        assert self.sessions.stop() == 0
        self.sessions = self.start_sessions()

    def processes(self) -> list[LightgateProcess]:
        return [self.store] if self.store is self.sessions else [self.store, self.sessions]


def embedded(disk: Path) -> Deployment:
    def start() -> LightgateProcess:
        return LightgateProcess("serve", "--port", "0", "--data", str(disk / "data"), *FLAGS, wait_s=WAIT_S)

    node = start()
    return Deployment(start, node, node)


def cluster(disk: Path) -> Deployment:
    store_port = free_port()
    store = LightgateProcess("store", "--data", str(disk / "data"), "--listen", f"127.0.0.1:{store_port}",
                             *FLAGS[:4],  # the commitlog flags: the store takes no mqtt.* flag
                             wait_s=WAIT_S)
    store.wait_log(lambda d: d.get("msg") == "store node ready")

    def start() -> LightgateProcess:
        return LightgateProcess("gateway", "--store", f"127.0.0.1:{store_port}", "--port", "0",
                                "--mqtt-sys-interval-s", "0", wait_s=WAIT_S)

    return Deployment(start, store, start())


def rid() -> str:
    return uuid.uuid4().hex[:6]


def open5(port: int, client_id: str, *, clean: bool, expiry: int = 3600) -> tuple[RawClient, Connack]:
    client = RawClient(port, MQTT_5)
    client.send(Connect(MQTT_5, client_id, clean, properties=Properties(session_expiry_interval=expiry)))
    connack = client.receive()
    assert isinstance(connack, Connack), connack
    return client, connack


def open311(port: int, client_id: str, *, clean: bool) -> tuple[RawClient, Connack]:
    client = RawClient(port, MQTT_311)
    client.send(Connect(MQTT_311, client_id, clean))
    connack = client.receive()
    assert isinstance(connack, Connack), connack
    return client, connack


def refused(client: RawClient, connack: Connack, reason: ReasonCode) -> None:
    """The CONNACK refuses with ``reason`` and the server closes the connection [MQTT-3.2.2-5] [MQTT-3.2.2-7]."""
    assert connack.reason_code is reason and not connack.session_present, connack
    assert client.sock.recv(1) == b""
    client.close()


def subscribe(client: RawClient, filter: str, packet_id: int = 1) -> tuple[ReasonCode, ...]:
    client.send(Subscribe(packet_id, ((filter, SubscriptionOptions(qos=1)),)))
    suback = client.receive()
    assert isinstance(suback, Suback) and suback.packet_id == packet_id, suback
    return suback.reason_codes


def ping(client: RawClient) -> None:
    """A barrier: everything sent before the PINGREQ has been processed once its PINGRESP is here."""
    client.send(Pingreq())
    assert isinstance(client.receive(), Pingresp)


def bye(client: RawClient) -> None:
    """DISCONNECT, and wait for the server to close the connection."""
    client.send(Disconnect())
    assert client.sock.recv(1) == b""
    client.close()


def publish(client: RawClient, topic: str, payload: bytes, packet_id: int) -> ReasonCode:
    client.send(Publish(topic, payload, 1, packet_id=packet_id))
    ack = client.receive()
    assert isinstance(ack, Puback) and ack.packet_id == packet_id, ack
    return ack.reason_code


def receive_acking(client: RawClient) -> Publish:
    message = client.receive()
    assert isinstance(message, Publish), message
    client.send(Puback(message.packet_id))
    return message


def no_traceback(process: LightgateProcess) -> None:
    assert [d for d in process.logs if "exc" in d or d.get("msg", "").startswith(("connection failed",
                                                                                   "RPC request failed"))] == []


@pytest.mark.parametrize("deploy", [embedded, cluster])
def test_every_packet_family_on_a_full_disk_is_answered_and_resumes_when_space_frees(small_disk, deploy):
    dep = deploy(small_disk)
    filler = small_disk / "filler"
    try:
        port, admin, run = dep.port, dep.admin, rid()
        # Before the disk fills: stored sessions, a few stored messages, connected clients.
        keep5, keep3, brief = f"keep5-{run}", f"keep3-{run}", f"brief-{run}"
        client, _ = open5(port, keep5, clean=True)
        assert subscribe(client, f"k{run}/#") == (ReasonCode.GRANTED_QOS_1,)
        bye(client)
        client, _ = open311(port, keep3, clean=False)
        assert subscribe(client, f"k{run}/#") == (ReasonCode.GRANTED_QOS_1,)
        assert subscribe(client, f"q{run}/#", 2) == (ReasonCode.GRANTED_QOS_1,)
        bye(client)
        short, _ = open5(port, brief, clean=True, expiry=1)
        assert subscribe(short, f"b{run}/+") == (ReasonCode.GRANTED_QOS_1,)
        plain, _ = open311(port, f"plain3-{run}", clean=True)
        assert subscribe(plain, f"p{run}/+") == (ReasonCode.GRANTED_QOS_1,)
        live, _ = open5(port, f"live-{run}", clean=True)
        assert subscribe(live, f"u{run}/+") == (ReasonCode.GRANTED_QOS_1,)
        watcher, _ = open5(port, f"watcher-{run}", clean=True)
        assert subscribe(watcher, f"w{run}/#") == (ReasonCode.GRANTED_QOS_1,)
        willer = RawClient(port, MQTT_5)
        willer.send(Connect(MQTT_5, f"willer-{run}", True, will_topic=f"w{run}/gone", will_payload=b"will", will_qos=1))
        assert isinstance(willer.receive(), Connack)
        pub, _ = open5(port, f"pub-{run}", clean=True, expiry=0)
        stored = [b"stored-%d" % i for i in range(5)]
        for i, payload in enumerate(stored):
            assert publish(pub, f"k{run}/1", payload, i + 1) is ReasonCode.SUCCESS
        filters = metric(admin, "lightgate_active_filters")

        fill(filler)
        assert publish(pub, f"k{run}/1", b"refused", 9) is ReasonCode.QUOTA_EXCEEDED

        # CONNECT with clean start must delete the stored session: refused, nothing deleted.
        refused(*open5(port, keep5, clean=True), ReasonCode.QUOTA_EXCEEDED)
        refused(*open311(port, keep3, clean=True), ReasonCode.SERVER_UNAVAILABLE)  # return code 3
        # A resume only reads: it succeeds and the stored messages are delivered; acknowledged offsets, the
        # UNSUBSCRIBE and the session saved at DISCONNECT wait for room.
        client, connack = open311(port, keep3, clean=False)
        assert connack.session_present and connack.reason_code is ReasonCode.SUCCESS
        assert [receive_acking(client).payload for _ in stored] == stored
        client.send(Unsubscribe(5, (f"q{run}/#",)))
        assert isinstance(client.receive(), Unsuback)
        bye(client)
        # SUBSCRIBE is refused per filter; the connection goes on.
        fresh5, connack = open5(port, f"fresh5-{run}", clean=True)
        assert connack.reason_code is ReasonCode.SUCCESS
        assert subscribe(fresh5, f"f{run}/+") == (ReasonCode.QUOTA_EXCEEDED,)
        ping(fresh5)
        fresh3, _ = open311(port, f"fresh3-{run}", clean=True)
        assert subscribe(fresh3, f"f{run}/+") == (ReasonCode.UNSPECIFIED_ERROR,)  # 0x80 [MQTT-3.9.3-2]
        ping(fresh3)
        # UNSUBSCRIBE takes effect for the client at once; the store's release waits for room, so subscribing
        # the same filter again is refused until then.
        live.send(Unsubscribe(2, (f"u{run}/+",)))
        unsuback = live.receive()
        assert isinstance(unsuback, Unsuback) and unsuback.reason_codes == (ReasonCode.SUCCESS,), unsuback
        assert subscribe(live, f"u{run}/+", 3) == (ReasonCode.QUOTA_EXCEEDED,)
        ping(live)
        # DISCONNECT of a clean session and the expiry of a persistent one: their deletion waits for room, and
        # the expired session cannot be resumed meanwhile.
        bye(plain)
        mark = len(dep.store.logs)
        bye(short)
        dep.store.wait_log(lambda d: d.get("msg", "").startswith("session expiry waits for room")  # the store's
                           and d.get("client_id") == brief, after=mark)  # expiry (store/leases.py)
        refused(*open5(port, brief, clean=False), ReasonCode.QUOTA_EXCEEDED)
        # A will due while full waits for room [MQTT-3.1.2-8].
        refused_qos1 = 'lightgate_messages_refused_total{qos="1"}'
        before = metric(admin, refused_qos1)
        willer.close()  # no DISCONNECT: the will is due now
        wait_until(lambda: metric(admin, refused_qos1) > before, what="the will refused once", timeout=WAIT_S)
        for process in dep.processes():
            assert process.proc.poll() is None
            no_traceback(process)

        mark = len(dep.sessions.logs)
        filler.unlink()  # space frees: everything held back lands by itself
        dep.sessions.wait_log(lambda d: d.get("msg", "").startswith("store writes held back by the full data disk "
                                                                    "are done"), after=mark)
        wait_until(lambda: metric(admin, "lightgate_active_filters") == filters - 3,
                   what="u/+ (unsubscribed), p/+ (clean session closed) and b/+ (expired) released", timeout=WAIT_S)
        client, connack = open5(port, brief, clean=False)
        assert connack.reason_code is ReasonCode.SUCCESS and not connack.session_present  # expired
        bye(client)
        client, connack = open5(port, keep5, clean=True)
        assert connack.reason_code is ReasonCode.SUCCESS and not connack.session_present
        bye(client)
        assert subscribe(live, f"u{run}/+", 4) == (ReasonCode.GRANTED_QOS_1,)
        assert publish(pub, f"u{run}/x", b"after", 10) is ReasonCode.SUCCESS
        assert receive_acking(live).payload == b"after"
        will = receive_acking(watcher)
        assert (will.topic, will.payload) == (f"w{run}/gone", b"will")
        for client in (live, pub, fresh5, fresh3, watcher):
            client.close()

        # The session saved (and the offsets committed) while the disk was full reached the store: after a
        # restart of the process that kept it in memory, it resumes after the messages it acknowledged then,
        # without the subscription it dropped then.
        dep.restart_sessions()
        port = dep.port
        client, connack = open311(port, keep3, clean=False)
        assert connack.session_present
        pub, _ = open5(port, f"pub2-{run}", clean=True, expiry=0)
        assert publish(pub, f"q{run}/1", b"unsubscribed", 1) is ReasonCode.SUCCESS
        assert publish(pub, f"k{run}/1", b"sentinel", 2) is ReasonCode.SUCCESS
        assert receive_acking(client).payload == b"sentinel"  # not one of the five acknowledged while full
        client.close()
        pub.close()
        started, cleared = full_lines(dep.store)
        assert len(started) == 1 and len(cleared) == 1, (started, cleared)  # once per episode, not per request
        for process in dep.processes():
            no_traceback(process)
            assert [d for d in process.errors() if not d["msg"].startswith("data disk full")] == []
    finally:
        filler.unlink(missing_ok=True)
        for process in reversed(dep.processes()):
            assert process.stop() == 0
