"""The admin endpoint's connection slots (gateway/ops/slots.py): idle connections give way, busy ones do not; and,
against a `lightgate serve` process over real sockets, a flood of idle connections never makes the node look dead."""

import socket

import pytest

from gateway.ops.slots import Slots, SlotStatistics
from tests.helpers.admin import Admin, admin_port
from tests.helpers.mqtt_fixtures import WAIT_S, running_node


def test_at_the_limit_the_longest_idle_gives_way_and_busy_ones_never_do():
    closed: list[str] = []
    slots = Slots(3)
    a, b, c = (slots.take(lambda name=name: closed.append(name)) for name in "abc")
    assert a and b and c and slots.full()
    a.busy()
    b.busy()
    b.idle()  # b waits on its client again: c has waited longer
    d = slots.take(lambda: closed.append("d"))
    assert d is not None and closed == ["c"]  # the longest idle, not the busy one
    c.release()  # its task ends later: releasing again changes nothing
    assert slots.statistics() == SlotStatistics(open=3, busy=1, reclaimed=1, refused=0)
    b.busy()
    d.busy()
    assert slots.take(lambda: closed.append("e")) is None  # every request is being answered: refused
    assert closed == ["c"] and slots.statistics() == SlotStatistics(open=3, busy=3, reclaimed=1, refused=1)
    a.release()  # a busy connection ended: its slot is free
    assert slots.take(lambda: None) is not None and closed == ["c"]


def test_no_limit_takes_nothing_back():
    slots = Slots(0)
    taken = [slots.take(lambda: pytest.fail("closed")) for _ in range(1000)]
    assert all(taken) and not slots.full() and slots.statistics().open == 1000


def closed_by_server(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (EOF), waiting at most WAIT_S."""
    sock.settimeout(WAIT_S)
    received = b""
    while data := sock.recv(65536):
        received += data
    return received


@pytest.mark.slow
def test_a_hundred_idle_connections_leave_healthz_and_metrics_answered_and_are_closed(tmp_path):
    """32 idle TCP connections took the admin port (and the container's HEALTHCHECK) down for 60 s: /healthz and
    /metrics were answered 503. Now each new connection takes the place of the longest idle one, and every idle
    one is closed at admin.header_timeout_s (default 5 s)."""
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0") as node:
        port = admin_port(node)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(100)]
        try:
            probe = Admin(port)
            status, _, body = probe.request("GET", "/healthz")
            assert (status, body) == (200, {"status": "ok"})
            status, _, metrics = probe.request("GET", "/metrics")
            assert status == 200 and b"lightgate_connections" in metrics
            probe.close()
            for sock in idle:
                assert closed_by_server(sock) == b""  # closed without a word: given way, or past the deadline
        finally:
            for sock in idle:
                sock.close()
    lines = [doc for doc in node.logs if doc.get("msg", "").startswith("admin connections at the limit")]
    assert lines and not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


@pytest.mark.slow
def test_at_the_cap_a_new_connection_closes_the_longest_idle_one_before_any_deadline(tmp_path):
    """A kept-alive connection and connections that never sent a byte give way at once, not at their deadline."""
    with running_node(tmp_path / "data", "--mqtt-sys-interval-s", "0", "--admin-max-connections", "3",
                      "--admin-header-timeout-s", "3600") as node:
        port = admin_port(node)
        kept = Admin(port)
        assert kept.get("/healthz") == {"status": "ok"}  # then idle between requests, the longest
        idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(2)]
        try:
            probe = Admin(port)
            assert probe.get("/healthz") == {"status": "ok"}
            assert kept.conn.sock.recv(1) == b""  # the kept-alive one gave way
            scraper = Admin(port)
            assert scraper.get("/metrics")
            assert closed_by_server(idle[0]) == b""  # then the longest of those that never sent a byte
            assert probe.get("/healthz") == {"status": "ok"}  # the probe, idle for less long, kept its place
            probe.close()
            scraper.close()
        finally:
            kept.close()
            for sock in idle:
                sock.close()
