"""retain/store.py over a real RocksDB: dispatch staging, latest offset wins, persistence, crashes, lookups."""

import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import rocksdict
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topics import TopicError, matches
from retain.store import CHECKPOINT_KEY, RETAIN_FAMILY, Retained, RetainedStore
from store.log.record import encode_record
from store.rocks import open_db

NO_WAL = rocksdict.WriteOptions()
NO_WAL.disable_wal = True

INDEX_CHECKPOINT = b"C"  # stands in for the light queues' checkpoint in the default family


class Env:
    """A RocksDB with a retained store, and a stand-in dispatcher that commits one batch per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = open_db(path)
        self.retained = RetainedStore(self.db)

    def dispatch(self, updates, next_offset: int) -> list[bool]:
        """Stage ``(topic, offset, record or None)`` updates and the checkpoints, write without the WAL, commit."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        staged = [self.retained.stage(batch, topic, offset, record) for topic, offset, record in updates]
        self.retained.stage_checkpoint(batch, next_offset)
        batch.put(INDEX_CHECKPOINT, next_offset.to_bytes(8, "big"))
        self.db.write(batch, NO_WAL)
        self.retained.commit_staged()
        return staged

    def contents(self) -> dict[bytes, bytes]:
        """Every key and value of the retain family, read straight from RocksDB."""
        family = self.db.get_column_family(RETAIN_FAMILY)
        result = dict(family.items())
        del family
        return result

    def reopen(self) -> None:
        self.close()
        self.db = open_db(self.path)
        self.retained = RetainedStore(self.db)

    def close(self) -> None:
        self.retained.close()
        self.db.close()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path / "index")
    yield e
    e.close()


def record(topic: str, payload: bytes = b"on") -> bytes:
    """A real CommitLog record, the same bytes on every call."""
    return encode_record(topic, payload, retain=True, born_ms=1_700_000_000_000, store_ms=1_700_000_000_001)


def test_dispatched_updates_are_visible_after_commit_and_survive_reopen(env):
    batch = rocksdict.WriteBatch(raw_mode=True)
    assert env.retained.stage(batch, "home/kitchen/light", 10, record("home/kitchen/light"))
    assert env.retained.stage(batch, "home/hall/light", 20, record("home/hall/light"))
    env.retained.stage_checkpoint(batch, 30)
    assert env.retained.lookup("home/+/light") == []  # staged only
    env.db.write(batch, NO_WAL)
    assert env.retained.commit_staged() == 2
    expected = [
        Retained("home/hall/light", 20, record("home/hall/light")),
        Retained("home/kitchen/light", 10, record("home/kitchen/light")),
    ]
    assert env.retained.lookup("home/+/light") == expected  # sorted by topic
    assert env.retained.lookup("home/kitchen/light") == expected[1:]
    assert env.retained.count == 2 and env.retained.checkpoint == 30
    env.reopen()
    assert env.retained.lookup("#") == expected
    assert env.retained.count == 2 and env.retained.checkpoint == 30


def test_an_empty_payload_deletes_the_retained_message(env):
    env.dispatch([("a/b", 1, record("a/b")), ("a/c", 2, record("a/c"))], 10)
    assert env.dispatch([("a/b", 11, None), ("a/zz", 12, None)], 20) == [True, False]  # a/zz held nothing
    assert [r.topic for r in env.retained.lookup("a/#")] == ["a/c"]
    env.reopen()
    assert [r.topic for r in env.retained.lookup("a/#")] == ["a/c"]
    assert env.contents().keys() == {b"a/c", CHECKPOINT_KEY}


def test_the_latest_log_offset_wins(env):
    env.dispatch([("t", 100, record("t", b"new"))], 110)
    assert env.dispatch([("t", 50, record("t", b"old")), ("t", 50, None)], 120) == [False, False]
    assert env.dispatch([("t", 200, record("t", b"newer")), ("t", 150, record("t", b"older"))], 210) == [True, False]
    [kept] = env.retained.lookup("t")
    assert (kept.log_offset, kept.record) == (200, record("t", b"newer"))
    assert env.retained.statistics().stale == 3
    assert not env.retained.set("t", 199, record("t", b"admin, too old"))
    assert env.retained.set("t", 201, record("t", b"admin"))
    assert env.retained.lookup("t")[0].record == record("t", b"admin")


def test_applying_the_same_records_again_changes_nothing(env):
    updates = [("a", 1, record("a")), ("b", 2, record("b")), ("a", 3, None), ("c/d", 4, record("c/d")),
               ("a", 5, record("a", b"again")), ("b", 6, None)]
    env.dispatch(updates[:3], 3)
    env.dispatch(updates[3:], 7)
    before, found = env.contents(), env.retained.lookup("#")
    assert [r.topic for r in found] == ["a", "c/d"]
    # Re-dispatch from the start (the index checkpoint was behind): every update is a repeat.
    assert env.dispatch(updates, 7) == [False] * 6
    assert env.contents() == before and env.retained.lookup("#") == found
    env.reopen()
    assert env.contents() == before and env.retained.lookup("#") == found


def test_a_batch_that_is_never_written_is_invisible_now_and_after_reopen(env):
    env.dispatch([("kept", 1, record("kept"))], 2)
    batch = rocksdict.WriteBatch(raw_mode=True)
    env.retained.stage(batch, "lost", 5, record("lost"))
    env.retained.stage(batch, "kept", 6, None)
    env.retained.stage_checkpoint(batch, 10)
    with pytest.raises(ValueError, match="another dispatch batch is still staged"):
        env.retained.stage(rocksdict.WriteBatch(raw_mode=True), "other", 7, record("other"))
    env.retained.discard_staged()  # the dispatcher's write failed
    assert [r.topic for r in env.retained.lookup("#")] == ["kept"] and env.retained.checkpoint == 2
    # The same updates stage again into the next batch: the discarded ones left no trace.
    assert env.dispatch([("lost", 5, record("lost"))], 10) == [True]
    env.reopen()
    assert [r.topic for r in env.retained.lookup("#")] == ["kept", "lost"]
    assert env.retained.checkpoint == 10


WORKER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import rocksdict
    from retain.store import RetainedStore
    from store.rocks import open_db

    path, mode = Path(sys.argv[1]), sys.argv[2]
    db = open_db(path)
    retained = RetainedStore(db)
    if mode == "admin":
        retained.set("admin/t", 7, b"admin record")
    else:
        no_wal = rocksdict.WriteOptions()
        no_wal.disable_wal = True
        batch = rocksdict.WriteBatch(raw_mode=True)
        retained.stage(batch, "a", 150, b"a@150")
        retained.stage(batch, "b", 160, b"b@160")
        retained.stage_checkpoint(batch, 200)
        batch.put(b"C", (200).to_bytes(8, "big"))
        db.write(batch, no_wal)
        retained.commit_staged()
        if mode == "flush-retain-first":
            retained.flush()
        db.flush()  # as LightQueues.flush: the default family only
    os.kill(os.getpid(), signal.SIGKILL)
""")


def crash_after(path: Path, mode: str) -> None:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(path), mode], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


def test_after_a_crash_the_checkpoint_says_what_to_feed_again(env):
    env.dispatch([("a", 10, b"a@10")], 100)
    env.close()
    crash_after(env.path, "flush-index-only")
    env.db = open_db(env.path)
    env.retained = RetainedStore(env.db)
    # The index family was flushed past the batch, the retain family was not: its update is gone...
    assert env.db.get(INDEX_CHECKPOINT) == (200).to_bytes(8, "big")
    assert [(r.topic, r.log_offset) for r in env.retained.lookup("#")] == [("a", 10)]
    # ...and its checkpoint says so; feeding the records from there again restores it.
    assert env.retained.checkpoint == 100
    env.dispatch([("a", 150, b"a@150"), ("b", 160, b"b@160")], 200)
    assert [(r.topic, r.log_offset, r.record) for r in env.retained.lookup("#")] == [("a", 150, b"a@150"), ("b", 160, b"b@160")]


def test_flushing_the_retain_family_first_loses_nothing_in_a_crash(env):
    env.close()
    crash_after(env.path, "flush-retain-first")
    env.db = open_db(env.path)
    env.retained = RetainedStore(env.db)
    assert env.retained.checkpoint == 200
    assert [(r.topic, r.log_offset) for r in env.retained.lookup("#")] == [("a", 150), ("b", 160)]


def test_direct_writes_use_the_wal_and_survive_a_crash(env):
    env.close()
    crash_after(env.path, "admin")
    env.db = open_db(env.path)
    env.retained = RetainedStore(env.db)
    assert env.retained.lookup("admin/#") == [Retained("admin/t", 7, b"admin record")]
    assert env.retained.delete("admin/t") and not env.retained.delete("admin/t")
    env.reopen()
    assert env.retained.count == 0


def test_rewind_drops_messages_past_the_end_of_the_log(env):
    env.dispatch([("a", 10, b"a"), ("b", 500, b"b"), ("$SYS/c", 900, b"c")], 1000)
    assert env.retained.rewind(500) == 2
    assert [r.topic for r in env.retained.lookup("#")] == ["a"] and env.retained.lookup("$SYS/#") == []
    assert env.retained.checkpoint == 500
    env.reopen()
    assert env.retained.count == 1 and env.retained.checkpoint == 500
    assert env.dispatch([("b", 700, b"b again")], 800) == [True]  # the offset is new again


def test_exact_lookup_among_many_topics_touches_one_node_and_one_record(env):
    updates = [(f"devices/{i}/status", i, b"up %d" % i) for i in range(20_000)]
    updates += [(f"solo{i}", 20_000 + i, b"solo %d" % i) for i in range(20_000)]
    env.dispatch(updates, 40_000)
    env.reopen()  # the tree is rebuilt from the family
    assert env.retained.count == 40_000
    before = env.retained.statistics()
    assert env.retained.lookup("solo4242") == [Retained("solo4242", 24_242, b"solo 4242")]
    after = env.retained.statistics()
    assert (after.nodes_visited - before.nodes_visited, after.records_read - before.records_read) == (1, 1)
    assert after.lookups == before.lookups + 1
    assert env.retained.lookup("devices/17/+") == [Retained("devices/17/status", 17, b"up 17")]
    final = env.retained.statistics()
    assert (final.nodes_visited - after.nodes_visited, final.records_read - after.records_read) == (3, 1)


def test_dollar_topics_and_listing_topics(env):
    env.dispatch([("$SYS/uptime", 1, b"u"), ("b/x", 2, b"b"), ("a", 3, b"a"), ("a/y", 4, b"y")], 5)
    assert [r.topic for r in env.retained.lookup("#")] == ["a", "a/y", "b/x"]
    assert [r.topic for r in env.retained.lookup("+/+")] == ["a/y", "b/x"]
    assert [r.topic for r in env.retained.lookup("$SYS/#")] == ["$SYS/uptime"]
    assert list(env.retained.iter_topics()) == ["a", "a/y", "b/x"]
    assert list(env.retained.iter_topics("a/#")) == ["a", "a/y"]
    assert list(env.retained.iter_topics("$SYS/+")) == ["$SYS/uptime"]
    stats = env.retained.statistics()
    assert (stats.topics, stats.nodes, stats.records_read) == (4, 6, 3 + 2 + 1)


def test_bad_input_is_refused_and_stages_nothing(env):
    batch = rocksdict.WriteBatch(raw_mode=True)
    with pytest.raises(TopicError, match="wildcard"):
        env.retained.stage(batch, "a/+", 1, b"r")
    with pytest.raises(ValueError, match="record is empty"):
        env.retained.stage(batch, "a", 1, b"")
    with pytest.raises(ValueError, match="log_offset"):
        env.retained.stage(batch, "a", -1, b"r")
    with pytest.raises(TypeError, match="must be bytes"):
        env.retained.stage(batch, "a", 1, "text")
    with pytest.raises(ValueError, match="next_log_offset"):
        env.retained.stage_checkpoint(batch, -5)
    with pytest.raises(TypeError, match="delete"):
        env.retained.set("a", 1, None)
    with pytest.raises(TopicError, match="last level"):
        env.retained.lookup("a/#/b")
    assert batch.is_empty() and env.retained.statistics().staged == 0
    env.retained.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.retained.lookup("a")
    env.retained = RetainedStore(env.db)


def test_the_default_family_is_left_alone(env):
    env.dispatch([("a", 1, b"a")], 2)
    env.retained.set("b", 3, b"b")
    env.retained.delete("a")
    assert rocksdict.Rdict.list_cf(str(env.path)) == ["default", RETAIN_FAMILY]
    assert list(env.db.keys()) == [INDEX_CHECKPOINT]  # only the stand-in dispatcher's own key


histories = st.lists(st.tuples(st.sampled_from(["a", "a/b", "a/c", "$x", "d//e"]), st.booleans()), max_size=40)


@settings(max_examples=25)
@given(histories, st.lists(st.integers(1, 8), min_size=1, max_size=10), st.sets(st.integers(0, 10)), st.integers(0, 40))
def test_random_histories_match_a_model(history, batch_sizes, reopen_after, replay_from):
    """Records at log offsets 0, 1, 2...: puts and deletes, batches, reopens, then a re-dispatch from anywhere."""
    model: dict[str, tuple[int, bytes]] = {}
    prepared = [(t, offset, b"%s@%d" % (t.encode(), offset) if put else None) for offset, (t, put) in enumerate(history)]
    for topic, offset, rec in prepared:
        if rec is None:
            model.pop(topic, None)
        else:
            model[topic] = (offset, rec)
    with tempfile.TemporaryDirectory() as tmp:
        env = Env(Path(tmp))
        try:
            position, n = 0, 0
            while position < len(prepared):
                size = batch_sizes[n % len(batch_sizes)]
                env.dispatch(prepared[position:position + size], min(position + size, len(prepared)))
                if n in reopen_after:
                    env.reopen()
                position += size
                n += 1
            assert env.dispatch(prepared[replay_from:], len(prepared)) == [False] * len(prepared[replay_from:])
            for f in ["#", "a/#", "+/+", "$x", "d/+/e"]:
                expected = [Retained(t, o, r) for t, (o, r) in sorted(model.items()) if matches(f, t)]
                assert env.retained.lookup(f) == expected, f
            assert env.retained.count == len(model)
        finally:
            env.close()


def test_match_all_answers_each_filter_as_match_and_refuses_a_batch_with_an_invalid_filter(env):
    """A connection's SUBSCRIBEs are matched together (``LocalStore.retained_all``): each filter's answer is its own,
    in order, and an invalid filter anywhere refuses them all before any is counted."""
    env.dispatch([("a/b", 10, record("a/b")), ("a/c", 20, record("a/c")), ("$SYS/x", 30, record("$SYS/x"))], 31)
    filters = ["a/+", "nothing/here", "#", "a/b", "$SYS/#", "+/c"]
    found = env.retained.match_all(filters)
    assert [sorted(each) for each in found] == [sorted(env.retained.match(f)) for f in filters]
    assert [sorted(each) for each in found] == [[("a/b", 10), ("a/c", 20)], [], [("a/b", 10), ("a/c", 20)],
                                                [("a/b", 10)], [("$SYS/x", 30)], [("a/c", 20)]]
    lookups = env.retained.statistics().lookups
    assert lookups == 2 * len(filters)
    with pytest.raises(TopicError):
        env.retained.match_all(["a/+", "a/#/b"])
    assert env.retained.statistics().lookups == lookups
