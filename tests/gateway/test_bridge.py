"""`lightgate bridge`: rules, topic mapping and the loop check; then a real bridge between a LightGate node and
a Mosquitto (and an MQTT 3.1.1-only amqtt) started by the tests."""

import argparse
import json
import os
import pwd
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.bench import peers
from gateway.app import config as cfg
from gateway.bridge import (
    Bridge,
    BridgeConfigError,
    BridgeSettings,
    Direction,
    Endpoint,
    Rule,
    loop_conflicts,
    parse_rule,
    settings_from_config,
)
from lightqueue.topics import filters_overlap
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connected, properties, run_id, wait_until
from tests.helpers.processes import ROOT

V5 = {"protocol": mqtt.MQTTv5}


# --- rules, mapping, loop check ---


@pytest.mark.parametrize("text, rule", [
    ("out tele/#", Rule(Direction.OUT, "tele/#")),
    ("IN cmd/+ cloud/", Rule(Direction.IN, "cmd/+", "cloud/")),
    ("both a/b site1/ edge/", Rule(Direction.BOTH, "a/b", "site1/", "edge/")),
    ("out tele/# '' edge/", Rule(Direction.OUT, "tele/#", "", "edge/")),
])
def test_parse_rule(text, rule):
    assert parse_rule(text) == rule
    assert parse_rule(str(rule)) == rule  # str() is the canonical, re-parseable form


@pytest.mark.parametrize("text, message", [
    ("sideways tele/#", "the direction 'sideways' is not out, in or both"),
    ("out", "got 1 field(s)"),
    ("out a b c d", "got 5 field(s)"),
    ("out a/#/b", "'#' must be the last level"),
    ("out tele/# cl+oud/", "the remote prefix 'cl+oud/' must not contain '+' or '#'"),
    ("in tele/# cloud/ #/", "the local prefix '#/' must not contain '+' or '#'"),
    ("out $share/g/tele/#", "a shared subscription cannot be bridged"),
    ("out 'tele/#", "No closing quotation"),
])
def test_parse_rule_rejects_bad_rules(text, message):
    with pytest.raises(BridgeConfigError, match=re.escape(message)):
        parse_rule(text)


def test_topics_are_renamed_by_prefix_and_direction():
    out = parse_rule("out tele/# cloud/ edge/")
    assert out.local_filter == "edge/tele/#" and out.remote_filter == "cloud/tele/#"
    assert out.to_remote("edge/tele/d1/temp") == "cloud/tele/d1/temp"
    assert out.to_remote("tele/d1/temp") is None  # not under the local prefix
    assert out.to_local("cloud/tele/d1/temp") is None  # an `out` rule never brings anything in
    inbound = parse_rule("in cmd/+ site1/")
    assert inbound.to_local("site1/cmd/d7") == "cmd/d7"
    assert inbound.to_local("site1/cmd/d7/x") is None
    assert inbound.to_remote("cmd/d7") is None
    parent = parse_rule("out # cloud/ edge/")  # `edge/#` also matches `edge`, which has no name under cloud/
    assert parent.to_remote("edge") is None
    assert parent.to_remote("edge/x") == "cloud/x"


@pytest.mark.parametrize("a, b, overlap", [
    ("a/b", "a/b", True), ("a/b", "a/c", False), ("a/+", "a/b", True), ("a/#", "a", True),
    ("a/#", "b/#", False), ("#", "x/y/z", True), ("a/+/c", "a/b/+", True), ("a/+", "a/b/c", False),
    ("#", "$SYS/x", False), ("+/x", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("cloud/#", "site/#", False),
    ("+", "/#", False), ("/#", "a", False),  # "/#" matches "/" and "/x" but no one-level topic (no empty topic)
])
def test_filters_overlap(a, b, overlap):
    assert filters_overlap(a, b) is overlap
    assert filters_overlap(b, a) is overlap


def test_loop_check_needs_no_local_or_disjoint_topics():
    both = [parse_rule("both sync/# site/")]
    assert loop_conflicts(both, local_no_local=True, remote_no_local=True) == []
    remote_old = loop_conflicts(both, local_no_local=True, remote_no_local=False)
    assert remote_old == ["rule 'both sync/# site/' publishes remote topics 'site/sync/#' that rule "
                          "'both sync/# site/' subscribes to again ('site/sync/#')"]
    assert len(loop_conflicts(both, local_no_local=False, remote_no_local=False)) == 2
    disjoint = [parse_rule("out tele/# cloud/"), parse_rule("in cmd/# cloud/ from-cloud/")]
    assert loop_conflicts(disjoint, local_no_local=False, remote_no_local=False) == []
    crossing = [parse_rule("out tele/# cloud/"), parse_rule("in tele/# cloud/ mirror/")]
    assert loop_conflicts(crossing, local_no_local=True, remote_no_local=False)
    assert not loop_conflicts(crossing, local_no_local=False, remote_no_local=True)


def conf_from(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./lightgate.toml
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.resolve(parser.parse_args(argv))


def test_settings_from_flags_and_file(tmp_path, monkeypatch):
    path = tmp_path / "lg.toml"
    path.write_text('[bridge]\nremote_host = "broker.example"\nrules = ["out tele/# cloud/", "in cmd/# cloud/"]\n')
    settings = settings_from_config(conf_from(["--config", str(path), "--port", "1999"], tmp_path, monkeypatch))
    assert settings.rules == (parse_rule("out tele/# cloud/"), parse_rule("in cmd/# cloud/"))
    assert settings.local == Endpoint("127.0.0.1", 1999)
    assert settings.remote == Endpoint("broker.example", 1883)
    flags = ["--config", str(path), "--rule", "both x/#"]  # flags replace the file's list
    assert settings_from_config(conf_from(flags, tmp_path, monkeypatch)).rules == (parse_rule("both x/#"),)


@pytest.mark.parametrize("argv, message", [
    (["--bridge-remote-host", "b"], "no rules: give at least one --rule"),
    (["--rule", "out t/#"], "bridge.remote_host is empty"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--rule", "up t/#"], "bridge.rules #2: rule 'up t/#': "
                                                                            "the direction 'up'"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--bridge-remote-cafile", "ca.pem"],
     "bridge.remote_cafile is set but bridge.remote_tls is off"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--bridge-remote-tls", "--bridge-remote-cafile", "nope.pem"],
     "bridge.remote_cafile 'nope.pem' is not a file"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--bridge-remote-password", "p"],
     "bridge.remote_password is set without bridge.remote_username"),
    (["--bridge-remote-host", "127.0.0.1", "--bridge-remote-port", "1883", "--rule", "out t/#"],
     "the remote broker mqtt://127.0.0.1:1883 is the local node itself"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--bridge-remote-port", "70000"],
     "bridge.remote_port must be between 1 and 65535"),
    (["--bridge-remote-host", "b", "--rule", "out t/#", "--port", "0"], "node.port must be the LightGate node's"),
])
def test_bad_settings_are_refused_with_the_reason(argv, message, tmp_path, monkeypatch):
    with pytest.raises(BridgeConfigError, match=re.escape(message)):
        settings_from_config(conf_from(argv, tmp_path, monkeypatch))


# --- a real bridge ---


class Mosquitto:
    """A Mosquitto on a fixed loopback port that keeps its state on disk across restarts (``persistence true``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = peers.free_port()
        (workdir / "db").mkdir(parents=True, exist_ok=True)
        self.conf = workdir / "mosquitto.conf"
        # `user`: run as root, Mosquitto would switch to user mosquitto, which cannot write into pytest's tmp_path.
        self.conf.write_text(f"user {pwd.getpwuid(os.getuid()).pw_name}\n"
                             f"listener {self.port} {peers.HOST}\nallow_anonymous true\npersistence true\n"
                             f"persistence_location {workdir / 'db'}/\nlog_dest stderr\nlog_type error\n"
                             "log_type warning\n")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.workdir / "mosquitto.log", "ab")
        self.proc = subprocess.Popen([shutil.which("mosquitto"), "-c", str(self.conf)], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        wait_until(self._accepting, what="mosquitto accepting connections")

    def _accepting(self) -> bool:
        assert self.proc.poll() is None, (self.workdir / "mosquitto.log").read_text()
        try:
            socket.create_connection((peers.HOST, self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: Mosquitto saves its sessions and queued messages, then exits."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=WAIT_S)


@pytest.fixture
def mosquitto(tmp_path):
    if reason := peers.missing("mosquitto"):
        pytest.skip(reason)
    broker = Mosquitto(tmp_path / "mosquitto")
    try:
        yield broker
    finally:
        broker.stop()


class BridgeThread:
    """A Bridge running in a thread; ``stop()`` returns once it has disconnected."""

    def __init__(self, settings: BridgeSettings) -> None:
        self.bridge = Bridge(settings)
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.bridge.run()
        except Exception as exc:  # handed to the test that owns the bridge
            self.error = exc

    def stop(self) -> None:
        self.bridge.stop()
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive()


@contextmanager
def running_bridge(local_port: int, remote_port: int, *rules: str):
    settings = BridgeSettings(Endpoint("127.0.0.1", local_port), Endpoint("127.0.0.1", remote_port),
                              tuple(parse_rule(r) for r in rules), "bridge-" + run_id(), stats_interval_s=0)
    bridge = BridgeThread(settings)
    try:
        wait_until(lambda: bridge.bridge.statistics().ready or bridge.error is not None, what="bridge ready")
        assert bridge.error is None, bridge.error
        yield bridge.bridge
    finally:
        bridge.stop()
    assert bridge.error is None, bridge.error


@pytest.mark.slow
def test_out_rule_mirrors_local_publishes_to_mapped_remote_topics(node, mosquitto):
    run = run_id()
    with connected(mosquitto.port, **V5) as remote_sub, connected(node.port) as local_pub, \
            running_bridge(node.port, mosquitto.port, f"out {run}/tele/# cloud/") as bridge:
        remote_sub.subscribe(f"cloud/{run}/#", 1)
        for i in range(20):
            local_pub.publish(f"{run}/tele/dev{i % 3}/temp", f"t{i}".encode(), qos=1)
        local_pub.publish(f"{run}/other", b"not bridged", qos=1)
        got = remote_sub.receive(20)
        assert [(m.topic, m.payload) for m in got] == [(f"cloud/{run}/tele/dev{i % 3}/temp", f"t{i}".encode())
                                                      for i in range(20)]
        assert all(m.qos == 1 for m in got)
        local_pub.publish(f"{run}/tele/last", b"last", qos=1)  # a barrier: the bridge forwards in order
        assert [m.payload for m in remote_sub.receive(1)] == [b"last"]  # the unbridged one did not come first
        # counted once the remote broker acknowledged it, which may come after its subscriber got it
        wait_until(lambda: bridge.statistics().bridged_out == 20 + 1, what="21 messages bridged out")
        stats = bridge.statistics()
        assert (stats.bridged_out, stats.bridged_in, stats.dropped, stats.errors, stats.in_flight) == (21, 0, 0, 0, 0)


@pytest.mark.slow
def test_in_rule_mirrors_remote_publishes_with_retain_and_properties(node, mosquitto):
    run = run_id()
    with connected(node.port, **V5) as local_sub, connected(mosquitto.port, **V5) as remote_pub, \
            running_bridge(node.port, mosquitto.port, f"in {run}/cmd/# cloud/ site/") as bridge:
        local_sub.paho.subscribe(f"site/{run}/cmd/#", options=SubscribeOptions(qos=1, retainAsPublished=True))
        local_sub.subacks.get(timeout=WAIT_S)
        props = properties(PacketTypes.PUBLISH, UserProperty=[("trace", "42"), ("from", "cloud")],
                           ContentType="application/json", ResponseTopic=f"cloud/{run}/reply",
                           CorrelationData=b"\x01\x02")
        info = remote_pub.paho.publish(f"cloud/{run}/cmd/dev1", b'{"on":1}', 1, False, props)
        info.wait_for_publish(WAIT_S)
        (msg,) = local_sub.receive(1)
        assert (msg.topic, msg.payload, msg.qos, msg.retain) == (f"site/{run}/cmd/dev1", b'{"on":1}', 1, False)
        assert msg.properties.UserProperty == [("trace", "42"), ("from", "cloud")]
        assert msg.properties.ContentType == "application/json"
        assert msg.properties.ResponseTopic == f"cloud/{run}/reply"
        assert msg.properties.CorrelationData == b"\x01\x02"
        remote_pub.publish(f"cloud/{run}/cmd/all", b"retained", qos=1, retain=True)
        (live,) = local_sub.receive(1)
        assert (live.payload, live.retain) == (b"retained", True)  # the bridge passed RETAIN through
        wait_until(lambda: bridge.statistics().bridged_in == 2, what="two messages bridged in")
    with connected(node.port) as late:  # the retained message is stored on the local node
        late.subscribe(f"site/{run}/cmd/all", 1)
        (kept,) = late.receive(1)
        assert (kept.payload, kept.retain) == (b"retained", True)


@pytest.mark.slow
def test_both_ways_at_once_delivers_each_message_exactly_once(node, mosquitto):
    run = run_id()
    n_out, n_in = 30, 25
    with connected(node.port) as local_sub, connected(mosquitto.port, **V5) as remote_sub, \
            connected(node.port) as local_pub, connected(mosquitto.port) as remote_pub, \
            running_bridge(node.port, mosquitto.port, f"both {run}/sync/# site/",
                           f"out {run}/up/# site/", f"in {run}/down/# site/") as bridge:
        local_sub.subscribe(f"{run}/#", 1)
        remote_sub.subscribe(f"site/{run}/#", 1)
        publishers = [
            threading.Thread(target=lambda: [local_pub.publish(f"{run}/sync/a", f"L{i}".encode(), qos=1)
                                             for i in range(n_out)]),
            threading.Thread(target=lambda: [remote_pub.publish(f"site/{run}/sync/b", f"R{i}".encode(), qos=1)
                                             for i in range(n_in)]),
        ]
        for t in publishers:
            t.start()
        local_pub.publish(f"{run}/up/x", b"up", qos=1)
        remote_pub.publish(f"site/{run}/down/y", b"down", qos=1)
        for t in publishers:
            t.join(timeout=WAIT_S)
        expected = {f"L{i}".encode() for i in range(n_out)} | {f"R{i}".encode() for i in range(n_in)}
        local = [m.payload for m in local_sub.receive(n_out + n_in + 2)]
        remote = [m.payload for m in remote_sub.receive(n_out + n_in + 2)]
        assert sorted(local) == sorted(expected | {b"up", b"down"})
        assert sorted(remote) == sorted(expected | {b"up", b"down"})
        # A barrier on each path a loop would take, one more message each way: a copy going round comes first.
        local_pub.publish(f"{run}/sync/a", b"out-last", qos=1)
        remote_pub.publish(f"site/{run}/sync/b", b"in-last", qos=1)
        assert sorted(m.payload for m in local_sub.receive(2)) == [b"in-last", b"out-last"]
        assert sorted(m.payload for m in remote_sub.receive(2)) == [b"in-last", b"out-last"]
        # counted on the receiving broker's PUBACK, which may come after its subscriber got the message
        wait_until(lambda: (bridge.statistics().bridged_out, bridge.statistics().bridged_in) == (n_out + 2, n_in + 2),
                   what="every message counted once each way")
        stats = bridge.statistics()
        assert (stats.bridged_out, stats.bridged_in, stats.dropped) == (n_out + 2, n_in + 2, 0)


class Stream:
    """A background publisher of QoS 1 messages ``m0``, ``m1``, ... until ``stop()``."""

    def __init__(self, client: Client, topic: str) -> None:
        self.acked: list[bytes] = []  # the messages the broker has PUBACKed, in order
        self._client, self._topic = client, topic
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            payload = f"m{len(self.acked)}".encode()
            self._client.publish(self._topic, payload, qos=1)  # returns after the PUBACK
            self.acked.append(payload)

    def __len__(self) -> int:
        return len(self.acked)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=WAIT_S)
        assert not self._thread.is_alive()


@contextmanager
def publishing(client: Client, topic: str):
    stream = Stream(client, topic)
    try:
        yield stream
    finally:
        stream.stop()


@contextmanager
def remote_subscriber(port: int, filter: str):
    """A subscriber with a persistent MQTT 5 session that reconnects quickly; yields the set of payloads it got."""
    got: set[bytes] = set()
    sub = Client(port, "sub-" + run_id(), protocol=mqtt.MQTTv5, clean=False)
    sub.paho.reconnect_delay_set(0.1, 0.5)
    sub.paho.on_message = lambda c, u, msg: got.add(msg.payload)
    sub.connect(properties=properties(PacketTypes.CONNECT, SessionExpiryInterval=3600))
    try:
        sub.subscribe(filter, 1)
        yield got
    finally:
        sub.paho.disconnect()
        sub.paho.loop_stop()


def check_all_arrive(got: set[bytes], stream: Stream) -> None:
    """Wait until every message the stream's broker acknowledged has arrived; fail naming the missing ones."""
    deadline = time.monotonic() + 60
    while not got.issuperset(stream.acked):
        if time.monotonic() > deadline:
            missing = sorted(set(stream.acked) - got, key=lambda p: int(p[1:]))
            pytest.fail(f"{len(missing)} of {len(stream)} acknowledged messages never arrived: {missing[:20]}")
        time.sleep(0.05)  # polling a set paho fills


@pytest.mark.slow
def test_remote_restart_mid_stream_loses_no_acknowledged_message(node, mosquitto):
    run = run_id()
    with remote_subscriber(mosquitto.port, f"cloud/{run}/#") as got, connected(node.port) as pub, \
            running_bridge(node.port, mosquitto.port, f"out {run}/tele/# cloud/") as bridge, \
            publishing(pub, f"{run}/tele/d") as published:
        wait_until(lambda: len(got) >= 20, what="the stream reaching the remote subscriber")
        mosquitto.stop()  # Mosquitto saves what it acknowledged (persistence true) and exits
        at_stop = len(published)
        wait_until(lambda: len(published) >= at_stop + 50, what="publishes while the remote is down")
        mosquitto.start()
        at_start = len(published)
        wait_until(lambda: len(published) >= at_start + 50, what="publishes after the restart")
        published.stop()
        check_all_arrive(got, published)
        assert bridge.statistics().remote_reconnects >= 1
        # At least once: a message re-sent after the restart counts twice. The subscriber may have a message
        # before the bridge has its PUBACK, hence the wait.
        wait_until(lambda: bridge.statistics().bridged_out >= len(published), what="the PUBACKs of every message")


@pytest.mark.slow
def test_mqtt_311_broker_gets_the_fallback_and_loops_are_refused(node, tmp_path):
    if reason := peers.missing("amqtt"):
        pytest.skip(reason)
    with peers.start("amqtt", tmp_path / "amqtt") as amqtt:
        run = run_id()
        with connected(amqtt.port) as remote_sub, connected(node.port) as local_pub, \
                running_bridge(node.port, amqtt.port, f"out {run}/tele/# cloud/", f"in {run}/cmd/# cloud/") as b:
            remote_sub.subscribe(f"cloud/{run}/tele/#", 1)
            local_pub.publish(f"{run}/tele/x", b"over 3.1.1", qos=1)
            (msg,) = remote_sub.receive(1)
            assert (msg.topic, msg.payload) == (f"cloud/{run}/tele/x", b"over 3.1.1")
            # counted on amqtt's PUBACK, which may come after its delivery to the subscriber
            wait_until(lambda: b.statistics().bridged_out == 1, what="the message counted as bridged out")

        settings = BridgeSettings(Endpoint("127.0.0.1", node.port), Endpoint("127.0.0.1", amqtt.port),
                                  (parse_rule(f"both {run}/sync/# cloud/"),), "loop-" + run, stats_interval_s=0)
        looping = BridgeThread(settings)
        looping.thread.join(timeout=WAIT_S)
        assert not looping.thread.is_alive()
        assert isinstance(looping.error, BridgeConfigError)
        assert "the remote broker speaks MQTT 3.1.1 (no no-local subscriptions)" in str(looping.error)
        assert f"rule 'both {run}/sync/# cloud/' publishes remote topics 'cloud/{run}/sync/#'" in str(looping.error)


# --- the command ---


def lightgate(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.app.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


class BridgeProcess:
    """``lightgate bridge --log-json`` in a subprocess, its log lines collected in a queue."""

    def __init__(self, local_port: int, remote_port: int, client_id: str, rule: str, *flags: str) -> None:
        self.proc = lightgate("bridge", "--port", str(local_port), "--bridge-remote-host", "127.0.0.1",
                              "--bridge-remote-port", str(remote_port), "--bridge-client-id", client_id,
                              "--rule", rule, "--log-json", *flags)
        self.logs: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.logs.put(json.loads(line)) for line in self.proc.stderr],
                         daemon=True).start()

    def wait_log(self, msg: str, match=lambda doc: True) -> dict:
        deadline = time.monotonic() + WAIT_S
        while True:
            doc = self.logs.get(timeout=max(0.01, deadline - time.monotonic()))
            if doc["msg"] == msg and match(doc):
                return doc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stderr.close()
        self.proc.stdout.close()


def test_command_refuses_a_bad_rule_with_the_reason(tmp_path):
    proc = lightgate("bridge", "--bridge-remote-host", "b", "--rule", "out tele/#", "--rule", "out a/#/b")
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 2
    assert "lightgate bridge: configuration error: bridge.rules #2: rule 'out a/#/b': topic filter 'a/#/b': " \
           "'#' must be the last level" in err


@pytest.mark.slow
def test_command_bridges_until_sigterm_and_logs_its_counters(node, mosquitto):
    run = run_id()
    bridge = BridgeProcess(node.port, mosquitto.port, f"cli-{run}", f"out {run}/# cloud/")
    try:
        with connected(mosquitto.port) as remote_sub, connected(node.port) as local_pub:
            remote_sub.subscribe(f"cloud/{run}/#", 1)
            assert bridge.wait_log("bridge subscribed")["side"] == "local"
            local_pub.publish(f"{run}/a", b"via the command", qos=1)
            (msg,) = remote_sub.receive(1)
            assert (msg.topic, msg.payload) == (f"cloud/{run}/a", b"via the command")
        bridge.proc.send_signal(signal.SIGTERM)
        assert bridge.proc.wait(timeout=WAIT_S) == 0
        final = bridge.wait_log("bridge stopped")
        assert (final["bridged_out"], final["errors"]) == (1, 0)
    finally:
        bridge.close()


@pytest.mark.slow
def test_bridge_killed_with_messages_in_flight_loses_none(node, mosquitto):
    """The bridge acknowledges a message to the node only once Mosquitto has PUBACKed it, so what a killed
    bridge held (here: everything it received while Mosquitto was down) is sent again by its successor."""
    run = run_id()
    rule = f"out {run}/tele/# cloud/"
    with remote_subscriber(mosquitto.port, f"cloud/{run}/#") as got, connected(node.port) as pub:
        first = BridgeProcess(node.port, mosquitto.port, f"crash-{run}", rule, "--bridge-stats-interval-s", "0.1")
        second = None
        try:
            first.wait_log("bridge subscribed")  # the bridge's session on the node exists from here on
            with publishing(pub, f"{run}/tele/d") as published:
                wait_until(lambda: len(got) >= 20, what="the stream reaching the remote subscriber")
                mosquitto.stop()
                first.wait_log("bridge statistics", lambda doc: doc["in_flight"] >= 50)
                first.proc.kill()
                mosquitto.start()
                second = BridgeProcess(node.port, mosquitto.port, f"crash-{run}", rule)
                at_start = len(published)
                wait_until(lambda: len(published) >= at_start + 50, what="publishes with the second bridge")
            check_all_arrive(got, published)
        finally:
            first.close()
            if second is not None:
                second.close()
