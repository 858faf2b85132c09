"""A damaged index database (CURRENT, MANIFEST, a table file missing or cut short): one clear start-up line, then
`lightgate repair` brings the node back with every stored message still delivered.

The data is made by three runs of a real node, each stopped cleanly (the memtables are flushed: each run leaves
its own table files), so the tables of the second run hold index entries and a retained message below the
checkpoint that the third run's tables carry. Losing them must not lose those messages: the repair re-indexes
the CommitLog, so the persistent subscribers (of a first-level queue and of a wildcard filter) get all of them,
in order, and a new subscriber gets the retained message.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import rocksdict
import trio

from store.log.commitlog import CommitLogConfig
from store.log.errors import StartupError
from store.node import open_store
from store.dump import dump
from store.repair import repair
from tests.helpers.mqtt_fixtures import WAIT_S, Client, Node, check_nothing_before_sentinel, connected
from tests.helpers.processes import LightgateProcess

pytestmark = pytest.mark.slow

FLAGS = ("--mqtt-sys-interval-s", "0")
RUNS = 3
PER_RUN = 50
RETAINED = ("t/ret", b"retained in the second run")


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """A node's data after three runs; tests damage copies of it."""
    data = tmp_path_factory.mktemp("stored") / "data"
    for run in range(RUNS):
        node = Node(data, *FLAGS)
        try:
            if run == 0:
                for client_id, filter in (("keep", "r/#"), ("keepw", "r/+")):
                    with connected(node.port, client_id=client_id, clean=False) as sub:
                        sub.subscribe(filter, 1)
            with connected(node.port) as pub:
                for i in range(run * PER_RUN, (run + 1) * PER_RUN):
                    pub.publish(f"r/{i % 3}", b"%d" % i, 1)
                if run == 1:
                    pub.publish(*RETAINED, 1, retain=True)
        finally:
            assert node.stop() == 0
    return data


def tables(index: Path) -> tuple[list[Path], list[Path]]:
    """The table files of the light queues (first key ``A`` or ``C``, lightqueue/keys.py), oldest first, and the
    retained messages' table of the second run (the family's checkpoint ``b""`` first, the retained topic last;
    the other runs' retained tables hold only a checkpoint, as do the QoS 2 flows' family, store/awaiting.py)."""
    db = rocksdict.Rdict(str(index), rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only())
    try:
        files = [(index / f["name"].lstrip("/"), f["start_key"], f["end_key"]) for f in db.live_files()]
    finally:
        db.close()
    files.sort()
    return ([p for p, first, _ in files if first[:1] in (b"A", b"C")],
            [p for p, first, last in files if first == b"" and last == RETAINED[0].encode()])


def second_run_tables(index: Path) -> list[Path]:
    light, retained = tables(index)
    assert len(light) == RUNS and len(retained) == 1, (light, retained)
    return [light[1], retained[0]]


def garbage_in(name: str):
    def damage(index: Path) -> None:
        (next(index.glob(name))).write_bytes(b"\x00garbage")
    return damage


def tables_missing(index: Path) -> None:
    for path in second_run_tables(index):
        path.unlink()


def first_run_table_missing(index: Path) -> None:
    """The table with the queue ids, the filter activation and holders, and the first run's entries."""
    light, _ = tables(index)
    light[0].unlink()


def first_block_damaged(index: Path) -> None:
    """Bytes of the first data block of the first run's table (its filter activation): RocksDB opens the table
    (it reads the footer and index blocks) and fails on the first read of that block."""
    light, _ = tables(index)
    with open(light[0], "r+b") as f:
        f.seek(16)
        f.write(b"\xff" * 16)


def tables_cut_short(index: Path) -> None:
    for path in second_run_tables(index):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


def refused_to_start(data: Path) -> str:
    """`lightgate serve` on the damaged data: exit 1 with one error line, no traceback; that line."""
    failed = LightgateProcess("serve", "--port", "0", "--data", str(data), *FLAGS)
    assert failed.proc.wait(timeout=WAIT_S) == 1
    assert len(failed.errors()) == 1, failed.logs
    assert not [d for d in failed.logs if "Traceback" in d.get("msg", "") or "exc" in d], failed.logs
    return failed.errors()[0]["msg"]


def repaired(data: Path) -> dict:
    """`lightgate repair`: exit 0 and the line that says what it did."""
    repair = LightgateProcess("repair", "--data", str(data))
    assert repair.proc.wait(timeout=WAIT_S) == 0, repair.logs
    return repair.wait_log(lambda d: d.get("msg") == "repair done: start the node again")


def open_failure(data: Path) -> str:
    """The start-up error of the store on the damaged data, in this process (what `serve` logs as its line)."""
    async def start() -> None:
        async with open_store(data, CommitLogConfig()):
            pass

    with pytest.raises(StartupError) as failed:
        trio.run(start)
    return str(failed.value)


def repaired_here(data: Path) -> dict:
    return repair(data, CommitLogConfig())


BOTH = ("keep", "keepw")


@pytest.mark.parametrize("damage, start, fix, subscribers", [
    (garbage_in("CURRENT"), refused_to_start, repaired, BOTH),  # the command line, once
    (garbage_in("MANIFEST-*"), open_failure, repaired_here, BOTH),
    (tables_missing, open_failure, repaired_here, BOTH),
    (tables_cut_short, open_failure, repaired_here, BOTH),
    # The first run's tables held the wildcard filter's activation and queue id: the log holds them too.
    (first_run_table_missing, open_failure, repaired_here, BOTH),
    (first_block_damaged, open_failure, repaired_here, BOTH),
], ids=["CURRENT", "MANIFEST", "tables-missing", "tables-cut-short", "ids-missing", "block-damaged"])
def test_a_damaged_index_stops_the_start_with_one_line_and_repair_brings_everything_back(stored, tmp_path, damage,
                                                                                          start, fix, subscribers):
    data = tmp_path / "data"
    shutil.copytree(stored, data)
    damage(data / "index")

    line = start(data)
    assert "index database" in line and "damaged" in line and f"lightgate repair --data {data}" in line, line
    done = fix(data)
    assert done["backup"] and done["reindexed"]["entries"] > 0, done

    node = Node(data, *FLAGS)
    try:
        expected = list(range(RUNS * PER_RUN))
        with connected(node.port) as pub:  # a barrier behind the backlog, the next number: nothing may come after
            pub.publish("r/0", b"%d" % len(expected), 1)
        expected.append(len(expected))
        for client_id in subscribers:  # persistent sessions, derived again from the log: everything, in order
            sub = Client(node.port, client_id, clean=False)
            assert sub.connect().session_present
            assert [int(m.payload) for m in sub.receive(len(expected))] == expected
            sub.disconnect()
        with connected(node.port) as fresh:  # a new subscriber gets the retained message of the second run
            fresh.subscribe("t/+", 1)
            message = fresh.messages.get(timeout=WAIT_S)
            assert (message.topic, message.payload, message.retain) == (*RETAINED, True)
    finally:
        assert node.stop() == 0
    assert not node.errors(), node.errors()


def every_table_damaged(index: Path) -> None:
    """Bytes of the first data block of every table file: nothing of the index can be read."""
    for path in index.glob("*.sst"):
        with open(path, "r+b") as f:
            f.seek(16)
            f.write(b"\xff" * 16)


def test_repair_of_an_index_with_every_table_damaged_brings_back_sessions_offsets_and_filters(tmp_path):
    """Everything the index held comes back from the log: the repaired index dumps as the original did
    (store/dump.py), and a persistent subscriber resumes its session [MQTT-3.2.2-3] and gets exactly the messages
    it had not acknowledged, in order."""
    data = tmp_path / "data"
    node = Node(data, *FLAGS)
    try:
        sub = Client(node.port, "holder", clean=False)
        sub.connect()
        sub.subscribe("d/+", 1)
        with connected(node.port) as pub:
            for i in range(5):
                pub.publish(f"d/{i % 2}", b"%d" % i, 1)
            assert [int(m.payload) for m in sub.receive(5)] == list(range(5))
            sub.disconnect()
            for i in range(5, 10):
                pub.publish(f"d/{i % 2}", b"%d" % i, 1)
    finally:
        assert node.stop() == 0
    before = dump(data / "index")
    every_table_damaged(data / "index")
    open_failure(data)
    repaired_here(data)
    assert dump(data / "index") == before
    node = Node(data, *FLAGS)
    try:
        sub = Client(node.port, "holder", clean=False)
        assert sub.connect().session_present
        assert [int(m.payload) for m in sub.receive(5)] == list(range(5, 10))
        with connected(node.port) as pub:
            check_nothing_before_sentinel(sub, pub, "d/0")
        sub.disconnect()
    finally:
        assert node.stop() == 0
