"""The canonical dump of an index (store/dump.py, `lightgate dump`) and its consistent copy (`lightgate snapshot`).

The dump shows state, not the way it was written: the same log indexed in dispatch steps of different sizes
(entries in runs of different lengths, checkpoints at other offsets) dumps the same; a family it does not know
is dumped as hex, so state added later is covered; and it reads what a real node wrote.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from retain.store import RetainedStore
from store.dispatch import Dispatcher
from store.dump import dump
from store.log.record import encode_record
from store.rocks import open_family
from tests.helpers.dispatch import Node as Indexed
from tests.helpers.mqtt_fixtures import Client, Node, connected
from tests.helpers.processes import ROOT, LightgateProcess


def logged(path) -> None:
    """A log of messages (three topics of a first-level queue, a wildcard filter's, retained ones) and a holder
    with an offset on the filter."""
    node = Indexed(path)
    node.lq.activate("a/+", "holder", 0)
    node.lq.commit_offsets("holder", {"a/+": 2})
    for i in range(300):
        topic = f"a/{i % 3}"
        node.log.append(encode_record(topic, b"%d" % i, retain=i % 50 == 0, queues=node.lq.targets(topic)))
    node.close()


def indexed(path, scan_bytes: int) -> dict:
    """The dump of the log at ``path`` indexed ``scan_bytes`` at a time."""
    node = Indexed(path)
    retained = RetainedStore(node.db)
    node.dispatcher = Dispatcher(node.log, node.lq, retained=retained, scan_bytes=scan_bytes)
    while node.dispatcher.dispatch_once() is not None:
        pass
    node.dispatcher.close()
    retained.close()
    node.db.close()
    node.log.close()
    return dump(path / "index")


def test_the_same_log_indexed_in_steps_of_other_sizes_dumps_the_same(tmp_path):
    logged(tmp_path / "small")
    shutil.copytree(tmp_path / "small", tmp_path / "large")
    small, large = indexed(tmp_path / "small", 256), indexed(tmp_path / "large", 1 << 20)
    assert small == large
    assert len(small["queues"]["a/0"]["entries"]) == 100 and small["queues"]["a/0"]["max"] == 100
    assert len(small["queues"]["a/#"]["entries"]) == 300 and small["queues"]["a/#"]["max"] == 300
    assert len(small["queues"]["a/+"]["entries"]) == 300
    assert small["filters"]["a/+"] == {"since": 0, "holders": ["holder"]}
    assert small["offsets"] == {"holder": {"a/+": 2}}
    assert set(small["families"]["retain"]) == {"a/0", "a/1", "a/2"}


def test_a_family_it_does_not_know_is_dumped_as_hex_and_its_checkpoint_left_out(tmp_path):
    node = Indexed(tmp_path)
    family = open_family(node.db, "newcomer")
    family.put(b"", b"\x00\x01")  # a checkpoint, by the convention of retain and qos2
    family.put(b"k", b"\xff")
    family.close()
    node.close()
    assert dump(tmp_path / "index")["families"]["newcomer"] == {"6b": "ff"}


@pytest.mark.slow
def test_dump_and_snapshot_of_a_stopped_node(tmp_path):
    """`lightgate dump` prints what `dump` returns; `lightgate snapshot` refuses while the node runs (the
    CommitLog's lock) and, once it stopped, writes a copy that dumps the same and that a node starts from."""
    data = tmp_path / "data"
    node = Node(data, "--mqtt-sys-interval-s", "0")
    try:
        with connected(node.port, client_id="keep", clean=False) as sub:
            sub.subscribe("s/+", 1)
        with connected(node.port) as pub:
            for i in range(20):
                pub.publish(f"s/{i % 2}", b"%d" % i, 1, retain=i == 7)
        refused = LightgateProcess("snapshot", "--data", str(data), "--to", str(tmp_path / "snap"))
        assert refused.proc.wait(timeout=60) == 1
        assert refused.errors() and not (tmp_path / "snap").exists()
    finally:
        assert node.stop() == 0
    printed = subprocess.run([sys.executable, "-m", "gateway.app.cli", "dump", "--data", str(data)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
    state = json.loads(printed)
    assert state == dump(data / "index")
    assert state["filters"]["s/+"]["holders"] == ["keep"] and len(state["queues"]["s/+"]["entries"]) == 20
    made = LightgateProcess("snapshot", "--data", str(data), "--to", str(tmp_path / "snap"))
    assert made.proc.wait(timeout=60) == 0, made.logs
    assert dump(tmp_path / "snap") == state
    replica = tmp_path / "replica"
    replica.mkdir()
    (data / "commitlog").rename(replica / "commitlog")
    (tmp_path / "snap").rename(replica / "index")
    node = Node(replica, "--mqtt-sys-interval-s", "0")
    try:
        sub = Client(node.port, "keep", clean=False)
        assert sub.connect().session_present  # the session blobs are in the snapshot too [MQTT-3.2.2-3]
        assert [m.payload for m in sub.receive(20)] == [b"%d" % i for i in range(20)]
        sub.disconnect()
    finally:
        assert node.stop() == 0
