"""Signals to real node processes: SIGHUP reloads (TLS certificates, password file, ACL, limits, log level) and never
ends the process; SIGTERM tells MQTT 5 clients (DISCONNECT 0x8B, Server shutting down) before it closes.

`serve`, and the cluster's `store` and `gateway` processes; real clients (paho, TLS sockets).
"""

import signal
import socket
import ssl

import paho.mqtt.client as mqtt
import pytest
import trustme

from gateway.auth.passwords import PasswordFile
from tests.helpers.cluster import Gateway, Store, free_port
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, connected
from tests.helpers.processes import LightgateProcess

pytestmark = pytest.mark.slow

ACL = "default allow\npattern\ndeny subscribe secret/#\n"
ACL_MORE = ACL + "deny subscribe private/#\n"
BROKEN_ACL = "default allow\npattern\nallow read #\n"  # 'read' is not an access word: line 3 is refused


def reloads(process: LightgateProcess, after: int) -> dict[str, dict]:
    """The SIGHUP log lines since ``after``, by item, once the last item (the log level) is logged."""
    process.wait_log(lambda doc: doc.get("item") == "log_level", after=after)
    return {doc["item"]: doc for doc in process.logs[after:] if str(doc.get("msg", "")).startswith("SIGHUP")}


def hangup(process: LightgateProcess) -> dict[str, dict]:
    after = len(process.logs)
    process.proc.send_signal(signal.SIGHUP)
    items = reloads(process, after)
    assert process.proc.poll() is None  # SIGHUP's default action ends a process (exit 129): never here
    return items


def served_certificate(port: int, ca: str) -> bytes:
    """The certificate the node's TLS listener presents to a new handshake (DER)."""
    context = ssl.create_default_context(cafile=ca)
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def subscribe_code(port: int, topic: str) -> int:
    client = Client(port, protocol=mqtt.MQTTv5)
    client.connect()
    try:
        (code,) = client.subscribe(topic)
        return code.value
    finally:
        client.disconnect()


def test_sighup_reloads_each_item_keeps_a_broken_file_out_and_never_exits(tmp_path):
    ca = trustme.CA()
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))

    def issue() -> None:
        leaf = ca.issue_cert("127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))

    issue()
    passwords = PasswordFile.load_or_empty(tmp_path / "users.txt")
    passwords.set_password("alice", "alice-pw")
    passwords.save()
    acl = tmp_path / "acl.txt"
    acl.write_text(ACL)
    config = tmp_path / "lightgate.toml"
    config.write_text('[log]\nlevel = "info"\n')
    node = Node(tmp_path / "data", "--config", str(config), "--tls-port", "8883", "--tls-certfile", str(cert),
                "--tls-keyfile", str(key), "--auth-password-file", str(passwords.path), "--auth-allow-anonymous",
                "true", "--auth-acl-file", str(acl))
    try:
        tls_port = node.wait_log(lambda doc: doc.get("msg") == "gateway node ready")["tls_port"]
        first = served_certificate(tls_port, str(ca_file))
        items = hangup(node)  # nothing changed: every item says so, and the node lives on
        assert {item: doc["change"] for item, doc in items.items()} == {
            "tls": "unchanged", "password_file": "unchanged", "acl": "unchanged", "limits": "unchanged",
            "log_level": "unchanged"}
        issue()  # a renewed certificate, a broken ACL, a new user, a new log level
        acl.write_text(BROKEN_ACL)
        passwords.set_password("bob", "bob-pw")
        passwords.save()
        config.write_text('[log]\nlevel = "debug"\n')
        items = hangup(node)
        assert {item: doc["change"] for item, doc in items.items()} == {
            "tls": "reloaded", "password_file": "reloaded", "acl": "failed", "limits": "unchanged",
            "log_level": "reloaded"}
        assert "acl.txt:3" in items["acl"]["msg"] and items["acl"]["level"] == "error"
        assert served_certificate(tls_port, str(ca_file)) != first
        assert subscribe_code(node.port, "secret/x") == 0x87  # the ACL in effect before the broken edit
        with connected(node.port, clean=False) as client:  # an acknowledged delivery: its commit logs at debug
            client.subscribe("debug/x")
            client.publish("debug/x", b"1")
            client.receive(1)
        node.wait_log(lambda doc: doc.get("msg") == "offsets committed")
        acl.write_text(ACL_MORE)
        items = hangup(node)
        assert items["acl"]["change"] == "reloaded"
        assert subscribe_code(node.port, "private/x") == 0x87
        bob = Client(node.port)
        bob.paho.username_pw_set("bob", "bob-pw")
        bob.connect()
        bob.disconnect()
    finally:
        assert node.stop() == 0


def test_sighup_reloads_the_limits_for_new_connections_and_keeps_bad_ones_out(tmp_path):
    config = tmp_path / "lightgate.toml"
    config.write_text("[limits]\nmax_subscriptions = 1\n")
    node = Node(tmp_path / "data", "--config", str(config), "--mqtt-sys-interval-s", "0")
    try:
        with connected(node.port, protocol=mqtt.MQTTv5) as before:
            assert [code.value for code in before.subscribe("a/1") + before.subscribe("a/2")] == [1, 0x97]
        config.write_text("[limits]\nmax_subscriptions = 2\nmax_connections = 1\n")
        items = hangup(node)
        assert items["limits"]["change"] == "reloaded" and items["limits"]["limits.max_subscriptions"] == 2
        assert "limits.max_connections 0 -> 1, limits.max_subscriptions 1 -> 2;" in items["limits"]["msg"]
        with connected(node.port, protocol=mqtt.MQTTv5) as after:  # the one connection now allowed
            assert [code.value for code in after.subscribe("b/1") + after.subscribe("b/2")] == [1, 1]
            with socket.create_connection(("127.0.0.1", node.port), timeout=WAIT_S) as second:
                assert second.recv(1) == b""  # closed at accept: limits.max_connections is 1
        config.write_text("[limits]\nmax_subscriptions = 3\nmax_topic_levels = 500\n")  # 500: above the store's 128
        items = hangup(node)
        assert items["limits"]["change"] == "failed" and items["limits"]["level"] == "error"
        assert "max_topic_levels must be 1..128" in items["limits"]["msg"]
        with connected(node.port, protocol=mqtt.MQTTv5) as kept:  # the limits in effect before the bad edit
            codes = kept.subscribe("c/1") + kept.subscribe("c/2") + kept.subscribe("c/3")
            assert [code.value for code in codes] == [1, 1, 0x97]
        config.write_text("[limits]\nmax_subscriptions = 2\nmax_connections = 1\n")
        assert hangup(node)["limits"]["change"] == "unchanged"  # compared with the limits in effect
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("protocol", [mqtt.MQTTv5, mqtt.MQTTv311])
def test_sigterm_tells_mqtt5_clients_the_server_is_shutting_down(tmp_path, protocol):
    """MQTT 5 (section 3.14.2.1): DISCONNECT 0x8B before the close; 3.1.1 has no server DISCONNECT: a close."""
    node = Node(tmp_path / "data")
    client = Client(node.port, protocol=protocol)
    client.connect()
    try:
        node.proc.send_signal(signal.SIGTERM)
        reason = client.disconnects.get(timeout=WAIT_S)
        assert node.proc.wait(timeout=WAIT_S) == 0
    finally:
        client.paho.loop_stop()
    if protocol == mqtt.MQTTv5:
        assert reason.value == 0x8B
    else:
        assert reason.is_failure  # the connection was lost: no packet to say why
    node.wait_log(lambda doc: doc.get("reason") == "SERVER_SHUTTING_DOWN")


def test_the_cluster_store_and_gateway_survive_sighup_and_the_gateway_says_goodbye_on_sigterm(tmp_path):
    store = Store(tmp_path / "data", free_port())
    gateway = None
    try:
        assert hangup(store) == {"log_level": store.logs[-1]}  # a store without auth.* reloads its log level
        gateway = Gateway(store.port)
        assert set(hangup(gateway)) == {"limits", "log_level"}
        client = Client(gateway.port, protocol=mqtt.MQTTv5)
        client.connect()
        gateway.proc.send_signal(signal.SIGTERM)
        assert client.disconnects.get(timeout=WAIT_S).value == 0x8B
        client.paho.loop_stop()
        assert gateway.proc.wait(timeout=WAIT_S) == 0
    finally:
        if gateway is not None:
            gateway.stop()
        assert store.stop() == 0


def test_gateway_workers_pass_sighup_on_and_live(tmp_path):
    """`lightgate gateway --workers 2`: the parent forwards SIGHUP to its workers (each reloads) and lives on."""
    store = Store(tmp_path / "data", free_port())
    workers = None
    try:
        workers = Gateway(store.port, "--workers", "2", "--admin-port", "0")
        workers.wait_log(lambda doc: len([d for d in workers.logs if d.get("msg") == "gateway node ready"]) == 2)
        after = len(workers.logs)
        workers.proc.send_signal(signal.SIGHUP)
        workers.wait_log(lambda doc: len([d for d in workers.logs[after:] if d.get("item") == "log_level"]) == 2)
        assert workers.proc.poll() is None
        assert workers.stop() == 0
    finally:
        if workers is not None:
            workers.stop()
        store.stop()
