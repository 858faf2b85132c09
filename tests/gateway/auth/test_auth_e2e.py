"""Authentication and ACLs enforced by `lightgate serve`: CONNACK refusals, the brute-force delay, PUBLISH and
SUBSCRIBE denials in MQTT 3.1.1 and 5.0, %u/%c rules, takeovers and resumed sessions, startup errors.

Every refusal from one source address makes the next one from it wait longer, so each test that expects a
refusal connects from its own loopback address (127.0.0.N): its first refusal waits exactly
``auth.failure_delay_s``.
"""

import itertools
import os
import shutil
import socket
import subprocess
import sys
import time

import paho.mqtt.client as mqtt
import pytest

from gateway.auth.passwords import PasswordFile
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role
from gateway.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Connack,
    Connect,
    Disconnect,
    Puback,
    Pubcomp,
    Pubrec,
    Pubrel,
    Publish,
)
from gateway.mqtt.reasons import ReasonCode
from tests.helpers.mqtt_fixtures import WAIT_S, Client, RawClient, run_id, running_node
from tests.helpers.processes import ROOT

FAILURE_DELAY_S = 0.5
"""The node's ``auth.failure_delay_s``: long enough to measure, short enough for a test run."""

PASSWORDS = {"alice": "alice-pw", "carol": "carol-pw", "watcher": "watcher-pw"}

ACL = """\
default deny

user alice
deny publish alice/readonly/#
allow both alice/#

user watcher
allow subscribe #

pattern
allow publish tele/%c/#
allow subscribe cmd/%c/#
allow both home/%u/#
"""

_SOURCES = itertools.count(2)


def fresh_source() -> str:
    """A loopback address no other test has used, so its refusals are its first (Linux routes all of 127/8)."""
    return f"127.0.0.{next(_SOURCES)}"


def write_auth_files(directory) -> tuple[str, str]:
    passwords = PasswordFile.load_or_empty(directory / "users.txt")
    for user, password in PASSWORDS.items():
        passwords.set_password(user, password)
    passwords.save()
    acl = directory / "acl.txt"
    acl.write_text(ACL)
    return str(passwords.path), str(acl)


def auth_flags(directory, *extra: str) -> tuple[str, ...]:
    password_file, acl_file = write_auth_files(directory)
    return ("--auth-password-file", password_file, "--auth-acl-file", acl_file,
            "--auth-failure-delay-s", str(FAILURE_DELAY_S), *extra)


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auth")
    with running_node(directory / "data", *auth_flags(directory)) as node:
        yield node
    assert node.proc.returncode == 0


def user_client(port: int, user: str | None, *, protocol=mqtt.MQTTv311, client_id: str | None = None,
                clean: bool = True) -> Client:
    """A connected paho client, logged in as ``user`` (None: anonymous)."""
    client = Client(port, client_id, protocol=protocol, clean=clean)
    if user is not None:
        client.paho.username_pw_set(user, PASSWORDS[user])
    client.connect()
    return client


def codes(suback) -> list[int]:
    return [int(getattr(rc, "value", rc)) for rc in suback]


class SourcedClient(RawClient):
    """A raw client connecting from a chosen loopback address."""

    def __init__(self, port: int, level: int, source: str) -> None:
        self.level = level
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(source, 0))
        self._decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)

    def __enter__(self) -> "SourcedClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def refused(self, connect: Connect) -> tuple[bytes, Connack, float]:
        """Send ``connect``; return every byte the server sent before closing, the CONNACK, and the seconds taken."""
        started = time.monotonic()
        self.send(connect)
        data = b""
        while chunk := self.sock.recv(4096):
            data += chunk
        elapsed = time.monotonic() - started
        decoder = MqttDecoder(role=Role.CLIENT, protocol_level=self.level)
        decoder.feed(data)
        connack = decoder.next_packet()
        assert isinstance(connack, Connack) and decoder.next_packet() is NEED_DATA, data
        return data, connack, elapsed


def refuse(port: int, level: int, **fields) -> tuple[bytes, Connack, float]:
    with SourcedClient(port, level, fresh_source()) as client:
        return client.refused(Connect(level, "refused-" + run_id(), True, **fields))


# --- CONNECT ----------------------------------------------------------------------------


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_wrong_password_and_unknown_user_get_the_same_delayed_refusal(auth_node, level):
    wrong = refuse(auth_node.port, level, username="alice", password=b"not-her-password")
    unknown = refuse(auth_node.port, level, username="mallory", password=b"alice-pw")
    for data, connack, elapsed in (wrong, unknown):
        assert connack.reason_code is ReasonCode.BAD_USER_NAME_OR_PASSWORD
        assert elapsed >= FAILURE_DELAY_S
    assert wrong[0] == unknown[0]  # byte for byte: nothing tells which part was wrong
    if level == MQTT_311:
        assert wrong[0] == b"\x20\x02\x00\x04"  # return code 4: bad user name or password
    line = auth_node.wait_log(lambda doc: doc.get("msg", "").startswith("connection refused")
                              and doc.get("reason") == "BAD_USER_NAME_OR_PASSWORD")
    assert "not-her-password" not in str(auth_node.logs) and line["client_id"].startswith("refused-")


def test_failures_from_one_source_wait_longer_each_time(auth_node):
    source = fresh_source()
    delays = []
    for _ in range(2):
        with SourcedClient(auth_node.port, MQTT_5, source) as client:
            _, connack, elapsed = client.refused(Connect(MQTT_5, "guess-" + run_id(), username="alice", password=b"x"))
        assert connack.reason_code is ReasonCode.BAD_USER_NAME_OR_PASSWORD
        delays.append(elapsed)
    assert delays[0] >= FAILURE_DELAY_S and delays[1] >= 2 * FAILURE_DELAY_S


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_anonymous_is_refused_when_a_password_file_is_set(auth_node, level):
    data, connack, elapsed = refuse(auth_node.port, level)
    assert connack.reason_code is ReasonCode.NOT_AUTHORIZED and elapsed >= FAILURE_DELAY_S
    if level == MQTT_311:
        assert data == b"\x20\x02\x00\x05"  # return code 5: not authorized


@pytest.mark.parametrize("level", [MQTT_311, MQTT_5], ids=["3.1.1", "5.0"])
def test_a_will_the_client_may_not_publish_refuses_the_connect(auth_node, level):
    data, connack, _ = refuse(auth_node.port, level, username="alice", password=b"alice-pw",
                              will_topic="elsewhere/dead", will_payload=b"bye")
    assert connack.reason_code is ReasonCode.NOT_AUTHORIZED
    with SourcedClient(auth_node.port, level, fresh_source()) as client:
        client.connect("will-" + run_id(), username="alice", password=b"alice-pw", will_topic="alice/dead")


def test_an_unauthenticated_takeover_does_not_disconnect_the_authenticated_client(auth_node):
    run = run_id()
    owner = user_client(auth_node.port, "alice", client_id=f"owned-{run}")
    try:
        owner.subscribe(f"alice/{run}/#")
        for fields in ({"username": "alice", "password": b"wrong"}, {}):
            with SourcedClient(auth_node.port, MQTT_311, fresh_source()) as client:
                _, connack, _ = client.refused(Connect(MQTT_311, f"owned-{run}", True, **fields))
            assert connack.reason_code.is_failure
        assert owner.disconnects.empty() and owner.paho.is_connected()
        owner.publish(f"alice/{run}/still", b"here", 1)
        assert [m.payload for m in owner.receive(1)] == [b"here"]  # the session is the same, still subscribed
    finally:
        owner.disconnect()


# --- PUBLISH ----------------------------------------------------------------------------


@pytest.fixture
def watcher(auth_node):
    client = user_client(auth_node.port, "watcher")
    assert codes(client.subscribe("#", 1)) == [1]
    yield client
    client.disconnect()


def first_topic(watcher: Client, prefix: str) -> str:
    """The topic of the first message under ``prefix`` the ``#`` watcher gets (other tests share the node)."""
    while True:
        message = watcher.messages.get(timeout=WAIT_S)
        if message.topic.startswith(prefix):
            return message.topic


def test_mqtt5_denied_publish_gets_puback_0x87_and_is_not_delivered(auth_node, watcher):
    run = run_id()
    with SourcedClient(auth_node.port, MQTT_5, "127.0.0.1") as alice:
        alice.connect(f"pub5-{run}", username="alice", password=b"alice-pw")
        alice.send(Publish(f"alice/readonly/{run}", b"no", qos=1, packet_id=1))
        assert alice.receive() == Puback(1, ReasonCode.NOT_AUTHORIZED)
        alice.send(Publish(f"alice/readonly/{run}", b"no", qos=2, packet_id=2))
        assert alice.receive() == Pubrec(2, ReasonCode.NOT_AUTHORIZED)
        alice.send(Publish(f"alice/readonly/{run}", b"no", qos=0))
        alice.send(Publish(f"alice/{run}/ok", b"yes", qos=1, packet_id=3))
        assert alice.receive() == Puback(3)
    assert first_topic(watcher, "alice/") == f"alice/{run}/ok"  # in order: the denied ones were never stored


def test_mqtt311_denied_publish_is_acknowledged_dropped_and_logged(auth_node, watcher):
    run = run_id()
    with SourcedClient(auth_node.port, MQTT_311, "127.0.0.1") as alice:
        alice.connect(f"pub311-{run}", username="alice", password=b"alice-pw")
        alice.send(Publish(f"alice/readonly/{run}", b"no", qos=1, packet_id=1))
        assert alice.receive() == Puback(1)  # no negative acknowledgement in 3.1.1: the connection stays
        alice.send(Publish(f"alice/readonly/{run}", b"no", qos=2, packet_id=2))
        assert alice.receive() == Pubrec(2)
        alice.send(Pubrel(2))
        assert alice.receive() == Pubcomp(2)
        alice.send(Publish(f"alice/{run}/ok", b"yes", qos=1, packet_id=3))
        assert alice.receive() == Puback(3)
    assert first_topic(watcher, "alice/") == f"alice/{run}/ok"
    auth_node.wait_log(lambda doc: doc.get("msg", "").startswith("publish denied by the ACL")
                       and doc.get("client_id") == f"pub311-{run}" and doc.get("topic") == f"alice/readonly/{run}"
                       and doc.get("username") == "alice" and "QoS 2" in doc["msg"])
    counts = [doc["acl_denials"] for doc in auth_node.logs if doc.get("client_id") == f"pub311-{run}"
              and doc.get("msg", "").startswith("publish denied")]
    assert len(counts) == 2 and counts[1] > counts[0]  # each denial is counted


# --- SUBSCRIBE --------------------------------------------------------------------------


@pytest.mark.parametrize(("protocol", "denied"), [(mqtt.MQTTv311, 0x80), (mqtt.MQTTv5, 0x87)], ids=["3.1.1", "5.0"])
def test_subscribe_denial_is_per_filter(auth_node, protocol, denied):
    run = run_id()
    alice = user_client(auth_node.port, "alice", protocol=protocol)
    try:
        alice.paho.subscribe([(f"alice/{run}/#", 1), ("secret/#", 1), ("#", 1), (f"$share/g{run}/alice/{run}/+", 1)])
        assert codes(alice.subacks.get(timeout=WAIT_S)) == [1, denied, denied, 1]
        alice.publish(f"alice/{run}/x", b"mine", 1)
        assert [m.payload for m in alice.receive(2)] == [b"mine", b"mine"]  # the plain and the shared subscription
    finally:
        alice.disconnect()
    auth_node.wait_log(lambda doc: doc.get("msg", "").startswith("subscribe denied by the ACL")
                       and doc.get("topic") == "secret/#" and doc.get("username") == "alice")


def test_user_and_client_id_substitution_end_to_end(auth_node, watcher):
    run = run_id()
    device = f"dev{run}"
    carol = user_client(auth_node.port, "carol", protocol=mqtt.MQTTv5, client_id=device)
    try:
        assert codes(carol.subscribe(f"home/carol/{run}/#")) == [1]
        assert codes(carol.subscribe(f"cmd/{device}/#")) == [1]
        assert codes(carol.subscribe("home/alice/#")) == [0x87]  # %u is carol
        assert codes(carol.subscribe("cmd/other/#")) == [0x87]  # %c is her client id
        carol.paho.publish(f"tele/other/{run}", b"no", 1).wait_for_publish(timeout=WAIT_S)  # PUBACK 0x87
        carol.publish(f"tele/{device}/t", b"21.5", 1)
        assert first_topic(watcher, "tele/") == f"tele/{device}/t"
        carol.publish(f"home/carol/{run}/lamp", b"on", 1)
        assert [m.topic for m in carol.receive(1)] == [f"home/carol/{run}/lamp"]
    finally:
        carol.disconnect()


def test_a_resumed_session_keeps_only_what_the_new_login_may_subscribe(auth_node):
    run = run_id()
    session = f"shared-device-{run}"
    alice = user_client(auth_node.port, "alice", client_id=session, clean=False)
    assert codes(alice.subscribe(f"alice/{run}/#")) == [1]
    alice.disconnect()
    carol = user_client(auth_node.port, "carol", client_id=session, clean=False)
    try:
        auth_node.wait_log(lambda doc: doc.get("msg", "").startswith("subscribe denied by the ACL")
                           and doc.get("client_id") == session and doc.get("topic") == f"alice/{run}/#")
        carol.subscribe(f"home/carol/{run}/#")
        publisher = user_client(auth_node.port, "alice")
        try:
            publisher.publish(f"alice/{run}/private", b"for alice", 1)
        finally:
            publisher.disconnect()
        carol.publish(f"home/carol/{run}/x", b"for carol", 1)
        assert [m.payload for m in carol.receive(1)] == [b"for carol"]  # alice's message was not delivered first
    finally:
        carol.disconnect()


def test_a_takeover_by_another_user_suspends_the_owners_subscriptions_and_the_owner_resumes_them(auth_node):
    """A user that takes a client id over does not get the subscriptions it may not make, and does not strip
    them from the session either (docs/security.md, "Takeovers by another user"): the owner gets them back,
    with what was published meanwhile."""
    run = run_id()
    session = f"device-{run}"

    def login(user: str, client_id: str = session) -> tuple[RawClient, Connack]:
        client = RawClient(auth_node.port, MQTT_311)
        return client, client.connect(client_id, clean=False, username=user, password=PASSWORDS[user].encode())

    alice, _ = login("alice")
    alice.subscribe(f"alice/{run}/#", qos=0)
    carol, connack = login("carol")  # takes the client id over while alice is connected
    alice.close()
    try:
        assert connack.session_present
        auth_node.wait_log(lambda doc: doc.get("msg", "").startswith("subscribe denied by the ACL")
                           and doc.get("client_id") == session and doc.get("topic") == f"alice/{run}/#")
        carol.subscribe(f"home/carol/{run}/#", qos=0)
        publisher, _ = login("alice", f"pub-{run}")
        publisher.send(Publish(f"alice/{run}/private", b"while away", 0), Disconnect())
        publisher.close()
        carol.send(Publish(f"home/carol/{run}/x", b"for carol", 0))
        packet = carol.receive()
        assert isinstance(packet, Publish) and packet.payload == b"for carol"
        carol.send(Disconnect())
    finally:
        carol.close()
    alice, connack = login("alice")
    try:
        assert connack.session_present
        publisher, _ = login("alice", f"pub-{run}")
        publisher.send(Publish(f"alice/{run}/after", b"sentinel", 0), Disconnect())
        publisher.close()
        got = [alice.receive(), alice.receive()]
        assert [(p.topic, p.payload) for p in got] == [(f"alice/{run}/private", b"while away"),
                                                       (f"alice/{run}/after", b"sentinel")]
    finally:
        alice.close()


# --- anonymous access and startup ---------------------------------------------------------


@pytest.mark.slow
def test_anonymous_allowed_explicitly_gets_the_pattern_rules_only(tmp_path):
    with running_node(tmp_path / "data", *auth_flags(tmp_path, "--auth-allow-anonymous", "true")) as node:
        device = f"anon{run_id()}"
        anonymous = user_client(node.port, None, client_id=device)
        try:
            assert codes(anonymous.subscribe(f"cmd/{device}/#")) == [1]  # %c applies to anonymous clients
            assert codes(anonymous.subscribe("home/+/#")) == [0x80]  # %u does not: no user name to substitute
            assert codes(anonymous.subscribe("alice/#")) == [0x80]  # nor do user sections
        finally:
            anonymous.disconnect()
        user_client(node.port, "alice").disconnect()  # users still log in
        data, connack, _ = refuse(node.port, MQTT_311, username="alice", password=b"wrong")
        assert data == b"\x20\x02\x00\x04"  # a wrong password is still refused


@pytest.mark.slow
def test_a_password_file_written_by_mosquitto_passwd_logs_its_users_in(tmp_path):
    """A Mosquitto user's file as it is: mosquitto_passwd's $7$ (PBKDF2-SHA512) lines, mosquitto_pub logging in."""
    if shutil.which("mosquitto_passwd") is None or shutil.which("mosquitto_pub") is None:
        pytest.skip("mosquitto_passwd or mosquitto_pub is not installed (apt-get install mosquitto mosquitto-clients)")
    path = tmp_path / "mosquitto.pw"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(path), "alice", PASSWORDS["alice"]], check=True,
                   capture_output=True, timeout=30)
    assert path.read_text().startswith("alice:$7$")
    with running_node(tmp_path / "data", "--auth-password-file", str(path),
                      "--auth-failure-delay-s", str(FAILURE_DELAY_S)) as node:
        sub = user_client(node.port, "alice")  # paho, as alice
        try:
            sub.subscribe("fleet/#", 1)
            sent = subprocess.run(["mosquitto_pub", "-p", str(node.port), "-u", "alice", "-P", PASSWORDS["alice"],
                                   "-q", "1", "-t", "fleet/one", "-m", "from mosquitto_pub"],
                                  capture_output=True, text=True, timeout=WAIT_S)
            assert sent.returncode == 0, sent.stderr
            (message,) = sub.receive(1)
            assert message.payload == b"from mosquitto_pub"
        finally:
            sub.disconnect()
        data, connack, _ = refuse(node.port, MQTT_311, username="alice", password=b"wrong")
        assert data == b"\x20\x02\x00\x04"  # 3.1.1 return code 4: bad user name or password


@pytest.mark.parametrize(("flag", "content", "expected"), [
    ("--auth-password-file", None, "cannot read the password file"),
    ("--auth-password-file", "alice:plaintext\n", ":1:"),
    ("--auth-acl-file", None, "cannot read the ACL file"),
    ("--auth-acl-file", "user alice\nallow read a/#\n", ":2:"),
])
def test_a_missing_or_broken_auth_file_stops_the_start_with_the_reason(tmp_path, flag, content, expected):
    path = tmp_path / "auth.txt"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "serve", "--port", "0", "--data", str(tmp_path / "data"), flag, str(path)],
        capture_output=True, text=True, timeout=WAIT_S * 3,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stderr
    assert "gateway node not started" in proc.stderr and str(path) in proc.stderr and expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before the store was opened
