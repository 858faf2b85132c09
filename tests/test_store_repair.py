"""A damaged index database (RocksDB's CURRENT file): one clear start-up line, then `lightgate repair` brings
the node back with every stored message still delivered to the persistent subscriber that had not read them."""

from __future__ import annotations

import pytest

from processes import LightgateProcess
from test_gateway_server import WAIT_S, Client, Node, connected
from mqtt_fixtures import quiet

FLAGS = ("--mqtt-sys-interval-s", "0")
MESSAGES = 50


@pytest.mark.slow
def test_a_damaged_index_stops_the_start_with_one_line_and_repair_brings_everything_back(tmp_path):
    data = tmp_path / "data"
    node = Node(data, *FLAGS)
    try:
        with connected(node.port, client_id="keep", clean=False) as sub:
            sub.subscribe("r/#", 1)
        with connected(node.port) as pub:
            for i in range(MESSAGES):
                pub.publish(f"r/{i % 3}", b"%d" % i, 1)
    finally:
        assert node.stop() == 0
    (data / "index" / "CURRENT").write_bytes(b"\x00garbage")

    failed = LightgateProcess("serve", "--port", "0", "--data", str(data), *FLAGS)
    assert failed.proc.wait(timeout=WAIT_S) == 1
    assert len(failed.errors()) == 1, failed.logs
    line = failed.errors()[0]["msg"]
    assert "index database" in line and "damaged" in line and f"lightgate repair --data {data}" in line, line
    assert not [d for d in failed.logs if "Traceback" in d.get("msg", "")], failed.logs

    repair = LightgateProcess("repair", "--data", str(data), *FLAGS)
    assert repair.proc.wait(timeout=WAIT_S) == 0, repair.logs
    assert repair.wait_log(lambda d: d.get("msg") == "repair done: start the node again")["backup"]

    node = Node(data, *FLAGS)
    try:
        sub = Client(node.port, "keep", clean=False)
        assert sub.connect().session_present
        assert [int(m.payload) for m in sub.receive(MESSAGES)] == list(range(MESSAGES))
        quiet(sub.messages)
        sub.disconnect()
    finally:
        assert node.stop() == 0
    assert not node.errors(), node.errors()
