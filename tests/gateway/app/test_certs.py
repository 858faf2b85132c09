"""``lightgate tls-certs``: the files it writes let real clients (paho-mqtt, mosquitto_pub) reach ``lightgate serve``
over TLS and mTLS, verifying the node against the test CA; it never overwrites a file."""

import os
import shutil
import ssl
import stat
import subprocess
import sys

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509

from tests.helpers.mqtt_fixtures import WAIT_S, Client, running_node
from tests.helpers.processes import ROOT


def tls_certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.app.cli", "tls-certs", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_files_chain_to_the_ca_name_the_hosts_and_keep_the_keys_private(tmp_path):
    done = tls_certs("--out", str(tmp_path), "--host", "127.0.0.1", "--host", "gw.example", "--client", "alice")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice.key", "alice.pem", "ca.key", "ca.pem", "server.key",
                                                         "server.pem"]
    assert {stat.S_IMODE((tmp_path / f"{n}.key").stat().st_mode) for n in ("ca", "server", "alice")} == {0o600}
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    alice = x509.load_pem_x509_certificate((tmp_path / "alice.pem").read_bytes())
    for leaf in (server, alice):
        leaf.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["gw.example"]
    assert alice.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "alice"
    assert f"--tls-certfile {tmp_path / 'server.pem'} --tls-keyfile {tmp_path / 'server.key'}" in done.stdout


def test_a_second_run_signs_new_clients_with_the_same_ca_and_overwrites_nothing(tmp_path):
    assert tls_certs("--out", str(tmp_path), "--host", "localhost").returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    done = tls_certs("--out", str(tmp_path), "--client", "bob")
    assert done.returncode == 0, done.stderr
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    x509.load_pem_x509_certificate((tmp_path / "bob.pem").read_bytes()).verify_directly_issued_by(ca)
    again = tls_certs("--out", str(tmp_path), "--host", "localhost", "--client", "carol")
    assert (again.returncode, again.stdout) == (1, "")
    assert again.stderr == (f"lightgate tls-certs: {tmp_path / 'server.pem'}, {tmp_path / 'server.key'} already "
                            f"exist: remove them or use another --out\n")
    assert not (tmp_path / "carol.pem").exists()  # nothing written when one file is taken
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith("bob.")} == before


@pytest.mark.parametrize(("args", "why"), [
    ((), "nothing to issue"),
    (("--client", "ca"), "client name 'ca' cannot name its files"),
    (("--client", "../x"), "cannot name its files"),
    (("--host", "h", "--days", "0"), "--days must be at least 1"),
])
def test_bad_requests_get_one_line_and_exit_1(tmp_path, args, why):
    done = tls_certs("--out", str(tmp_path / "pki"), *args)
    assert done.returncode == 1 and done.stderr.startswith("lightgate tls-certs: ") and why in done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "pki").exists()


def test_half_a_ca_is_refused(tmp_path):
    assert tls_certs("--out", str(tmp_path), "--client", "a").returncode == 0
    (tmp_path / "ca.key").unlink()
    done = tls_certs("--out", str(tmp_path), "--client", "b")
    assert done.returncode == 1 and "has only one of ca.pem and ca.key" in done.stderr


class TlsClient(Client):
    """A paho client over TLS that verifies the node's certificate and host name against ``cafile``."""

    def __init__(self, host: str, port: int, cafile, cert: tuple | None = None, **kwargs) -> None:
        super().__init__(port, **kwargs)
        self.host = host
        certfile, keyfile = cert or (None, None)
        self.paho.tls_set(ca_certs=str(cafile), certfile=certfile and str(certfile), keyfile=keyfile and str(keyfile),
                          cert_reqs=ssl.CERT_REQUIRED)

    def connect(self, **kwargs):
        self.paho.connect(self.host, self.port, keepalive=self.keepalive, **kwargs)
        self.paho.loop_start()
        flags, rc = self.connacks.get(timeout=WAIT_S)
        assert not rc.is_failure, rc
        return flags


@pytest.mark.slow
def test_paho_and_mosquitto_reach_serve_over_tls_and_mtls_with_the_written_files(tmp_path):
    pki = tmp_path / "pki"
    done = tls_certs("--out", str(pki), "--host", "localhost", "--host", "127.0.0.1", "--client", "sensor-17")
    assert done.returncode == 0, done.stderr
    other = tmp_path / "other"
    assert tls_certs("--out", str(other), "--host", "localhost").returncode == 0
    with running_node(tmp_path / "data", "--tls-port", "8883", "--tls-certfile", str(pki / "server.pem"),
                      "--tls-keyfile", str(pki / "server.key"), "--tls-cafile", str(pki / "ca.pem"),
                      "--tls-require-client-cert") as node:  # node.port 0: the TLS listener takes a free port too
        tls_port = node.wait_log(lambda doc: doc.get("msg") == "gateway node ready")["tls_port"]
        client_cert = (pki / "sensor-17.pem", pki / "sensor-17.key")
        sub = TlsClient("localhost", tls_port, pki / "ca.pem", client_cert)  # the host name is checked too
        sub.connect()
        try:
            sub.subscribe("tele/#", 1)
            pub = TlsClient("127.0.0.1", tls_port, pki / "ca.pem", client_cert)
            pub.connect()
            pub.publish("tele/sensor-17/t", b"paho over mTLS", 1)
            pub.disconnect()
            assert sub.receive(1)[0].payload == b"paho over mTLS"
            if shutil.which("mosquitto_pub"):
                sent = subprocess.run(["mosquitto_pub", "-h", "localhost", "-p", str(tls_port), "--cafile",
                                       str(pki / "ca.pem"), "--cert", str(client_cert[0]), "--key", str(client_cert[1]),
                                       "-q", "1", "-t", "tele/sensor-17/t", "-m", "mosquitto over mTLS"],
                                      capture_output=True, text=True, timeout=WAIT_S)
                assert sent.returncode == 0, sent.stderr
                assert sub.receive(1)[0].payload == b"mosquitto over mTLS"
        finally:
            sub.disconnect()
        stranger = TlsClient("localhost", tls_port, other / "ca.pem", client_cert)
        with pytest.raises(ssl.SSLCertVerificationError):  # the node's certificate is not from another CA
            stranger.paho.connect("localhost", tls_port)
