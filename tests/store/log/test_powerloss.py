"""Power loss under the async flush policy: the CommitLog loses its unflushed tail, RocksDB keeps its WAL'd state.

A real `lightgate serve` process is SIGKILLed; the test then does to the
CommitLog what a power loss does to it (everything after the `flushed` mark is
gone: the bytes read as zeros, later segments never reached the disk) and keeps
RocksDB as the process left it. Consumer offsets, filter activations, session
blobs and the client ledger are derived from the log's control records and
persisted after the log, so what was past the flushed mark is lost with it, as
the async policy allows, and nothing derived points past the new end. After the restart every message acknowledged to a publisher must reach
the persistent subscribers that lost their positions, a fresh subscriber, and
the admin API must report their lag right.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from functools import partial

import pytest

from tests.helpers.powerloss import lose_unflushed_tail
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, connected, quiet, wait_until

NEVER_FLUSH = ("--commitlog-flush-min-bytes", str(1 << 30), "--commitlog-flush-force-interval-ms", str(3_600_000),
               "--mqtt-sys-interval-s", "0")
"""Nothing is fsynced while the test runs (the async policy's thresholds are out of reach), so the flushed mark
stays where the last clean start left it and everything published after it is the power loss's to take."""

BEFORE = 20  # messages flushed by a clean restart: they survive
LOST = 150  # messages acknowledged, delivered and acknowledged by the subscribers, then lost with the log's tail
AFTER = 150  # messages acknowledged after recovery: every one must arrive
DEVICES = 5  # topics pl/d0/t .. pl/d4/t; the filter pl/d1/+ sees one message in five


def admin_session(port: int, client_id: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/sessions/{client_id}", timeout=WAIT_S) as reply:
        return json.loads(reply.read())


def admin_port(node: Node) -> int:
    return node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]


def publish(port: int, first: int, count: int) -> None:
    """QoS 1 messages ``first`` .. ``first + count - 1``, each acknowledged before the next."""
    with connected(port) as pub:
        for i in range(first, first + count):
            pub.publish(f"pl/d{i % DEVICES}/t", str(i).encode(), 1)


def received(client: Client, count: int) -> list[int]:
    got = [int(m.payload) for m in client.receive(count)]
    # No barrier: a sentinel would be a record of the log whose tail this test cuts, moving the queue offsets and
    # lags it asserts. A fixed wait.
    quiet(client.messages)
    return got


@pytest.mark.slow
def test_nothing_acknowledged_after_a_power_loss_is_skipped(tmp_path):
    data = tmp_path / "data"
    node = Node(data, *NEVER_FLUSH)
    try:
        keep = Client(node.port, "keep", clean=False)  # persistent, on a wildcard filter active from the start
        keep.connect()
        keep.subscribe("pl/+/t", 1)
        publish(node.port, 0, BEFORE)
        assert received(keep, BEFORE) == list(range(BEFORE))
        keep.disconnect()
    finally:
        assert node.stop() == 0  # a clean stop flushes: the first messages are below the flushed mark

    node = Node(data, *NEVER_FLUSH)
    try:
        keep.port = node.port
        keep.connect()
        publish(node.port, BEFORE, 50)
        late = Client(node.port, "late", clean=False)  # a filter first activated past the flushed mark
        late.connect()
        late.subscribe("pl/d1/+", 1)
        publish(node.port, BEFORE + 50, LOST - 50)
        assert received(keep, LOST) == list(range(BEFORE, BEFORE + LOST))
        assert received(late, (LOST - 50) // DEVICES) == [i for i in range(BEFORE + 50, BEFORE + LOST)
                                                          if i % DEVICES == 1]
        keep.disconnect()  # the sessions are saved and their offsets committed, both past the flushed mark
        late.disconnect()
        admin = admin_port(node)
        wait_until(lambda: all(s["lag"] == 0 and not s["connected"] for s in map(partial(admin_session, admin),
                                                                                 ("keep", "late"))),
                   what="both sessions saved")
        node.kill()
    except BaseException:
        node.kill()
        raise
    assert lose_unflushed_tail(data / "commitlog") > 0

    node = Node(data, *NEVER_FLUSH)
    try:
        admin = admin_port(node)
        with connected(node.port, client_id="fresh") as fresh:
            fresh.subscribe("pl/#", 1)
            first = BEFORE + LOST  # new payloads; their queue offsets reuse the lost ones
            publish(node.port, first, AFTER)
            assert received(fresh, AFTER) == list(range(first, first + AFTER))
        assert admin_session(admin, "keep")["lag"] == AFTER
        with pytest.raises(urllib.error.HTTPError):  # every record of its session was past the flushed mark
            admin_session(admin, "late")
        keep.port = late.port = node.port
        assert keep.connect().session_present
        assert received(keep, AFTER) == list(range(first, first + AFTER))
        assert not late.connect().session_present
        wait_until(lambda: admin_session(admin, "keep")["lag"] == 0, what="the resumed session's lag back to 0")
        keep.disconnect()
        late.disconnect()
    finally:
        assert node.stop() == 0
    assert not node.errors(), node.errors()
    # Everything RocksDB holds is derived from the log and persisted only after it: nothing was past its new end.
    assert not [d for d in node.logs if "pulled back" in d.get("msg", "")], node.logs
