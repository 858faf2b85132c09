"""systemd readiness (gateway/app/sdnotify.py): READY=1 reaches $NOTIFY_SOCKET, a real unix datagram socket, once the
node's listeners accept connections (gateway/app/lightgate.service is Type=notify)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import closing

import pytest

from gateway.app.sdnotify import notify
from tests.helpers.processes import ROOT, WAIT_S, LightgateProcess


def datagram_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(WAIT_S)
    return sock


def test_notify_sends_one_datagram_to_a_socket_path(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with closing(datagram_socket(path)) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert notify("READY=1")
        assert sock.recv(4096) == b"READY=1"


def test_notify_reaches_an_abstract_socket_named_with_an_at_sign(monkeypatch):
    name = f"lightgate-test-{uuid.uuid4().hex}"
    with closing(datagram_socket("\0" + name)) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("READY=1")
        assert sock.recv(4096) == b"READY=1"


def test_notify_outside_systemd_sends_nothing(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify("READY=1")


def test_an_unreachable_socket_is_one_warning_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    with caplog.at_level(logging.WARNING, logger="lightgate.sdnotify"):
        assert not notify("READY=1")
    assert [r.getMessage() for r in caplog.records] == ["systemd notification not sent"]


@pytest.mark.slow
def test_serve_sends_ready_once_its_listeners_accept(tmp_path):
    path = str(tmp_path / "notify")
    with closing(datagram_socket(path)) as sock:
        node = LightgateProcess("serve", "--port", "0", "--data", str(tmp_path / "data"),
                                env={**os.environ, "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": path})
        try:
            assert sock.recv(4096) == b"READY=1"
            # Logged before READY=1 is sent: both listeners are bound by then, and accept now.
            port = node.ready("gateway node ready")
            admin_port = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
            for listener in (port, admin_port):
                socket.create_connection(("127.0.0.1", listener), timeout=WAIT_S).close()
        finally:
            node.stop()
    assert node.proc.returncode == 0
