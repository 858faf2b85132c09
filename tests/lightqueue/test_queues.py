"""Light queues over a real RocksDB and a real CommitLog: ids, filters, indexing, pulls, offsets, retention."""

import contextlib
import re
from dataclasses import dataclass

import pytest
import rocksdict

import lightqueue.queues
from lightqueue import keys
from lightqueue.queues import TOPIC_IDS, LightQueues, is_implicit
from lightqueue.targets import decode_queues, encode_queues
from lightqueue.topics import TopicError
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import decode_record, encode_record
from store.rocks import open_db
from tests.helpers.dispatch import dump

SEGMENT = 4096


def decode(raw, offset):
    return decode_record(raw, 0, offset)


class Env:
    """A CommitLog and light queues in a temporary directory, with helpers to append and index."""

    def __init__(self, path, open_index=open_db, **config):
        self.path = path
        self.log = CommitLog.open(path / "commitlog", CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, **config))
        self.open_index = open_index
        self.db = open_index(path / "index")
        self.lq = LightQueues(self.db)

    def append(self, *topics, payload=b"p"):
        records = [encode_record(t, payload, queues=self.lq.targets(t)) for t in topics]
        return self.log.append_batch(records)

    def index(self):
        changed = {}
        while self.lq.checkpoint < self.log.written_offset:
            scan = self.log.scan(self.lq.checkpoint)
            changed.update(self.lq.index(scan.records, scan.next_offset))
        return changed

    def activate(self, filter, holder):
        return self.lq.activate(filter, holder, self.log.written_offset)

    def topics(self, queue, start=0):
        result = self.lq.pull(queue, start, 1000, 1 << 30, self.log, decode)
        return [m.topic for _, m in result.messages]

    def entry_keys(self, qid):
        return [k for k, _ in self.lq._scan(keys.entry_prefix(qid))]

    def reopen(self):
        self.db.close()
        self.db = self.open_index(self.path / "index")
        self.lq = LightQueues(self.db)

    def close(self):
        self.db.close()
        self.log.close()


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def test_queue_ids_are_stable_and_survive_reopen(env):
    a = env.lq.queue_id("a/b")
    b = env.lq.queue_id("a/+")
    assert a != b and env.lq.queue_id("a/b") == a
    assert env.lq.queue_name(a) == "a/b"
    env.reopen()
    assert env.lq.queue_id("a/b") == a and env.lq.queue_id("a/+") == b
    assert env.lq.queue_id("new") > max(a, b)


def test_targets_list_the_queue_ids_of_active_wildcards_only(env):
    assert env.lq.targets("a/b/c") == b""
    env.activate("a/+/c", "s1")
    env.activate("a/#", "s1")  # implicit first-level filter: never listed
    env.activate("a/b/c", "s1")  # exact filter: the topic queue, never listed
    env.activate("#", "s2")
    ids = {env.lq.queue_id("a/+/c"), env.lq.queue_id("#")}
    assert decode_queues(env.lq.targets("a/b/c")) == tuple(sorted(ids))  # ascending ids, not names
    assert len(env.lq.targets("a/b/c")) == 8
    assert decode_queues(env.lq.targets("$SYS/b/c")) == ()
    assert sorted(env.lq.active_filters()) == ["#", "a/+/c"]
    assert env.lq.release("#", "s2")
    assert decode_queues(env.lq.targets("a/b/c")) == (env.lq.queue_id("a/+/c"),)  # the cache was invalidated


def test_activation_allocates_the_filter_id_durably_and_targets_never_allocate(env):
    env.activate("+/b", "s1")
    next_id = env.lq.statistics().next_queue_id
    (listed,) = decode_queues(env.lq.targets("a/b"))
    assert env.lq.queue_name(listed) == "+/b"
    for i in range(50):
        env.lq.targets(f"t{i}/b")
    assert env.lq.statistics().next_queue_id == next_id  # matching allocated nothing
    env.activate("+/b", "s2")  # a second holder keeps the id
    env.reopen()  # nothing was dispatched: the id survives on the activation's own write
    assert env.lq.queue_name(listed) == "+/b"
    assert decode_queues(env.lq.targets("a/b")) == (listed,)
    env.append("a/b")
    env.index()
    assert env.topics("+/b") == ["a/b"]


def test_activate_rejects_invalid_filters(env):
    with pytest.raises(TopicError, match="must be the last level"):
        env.activate("a/#/b", "s1")
    assert env.lq.holders("a/#/b") == []


def test_records_go_to_topic_first_level_and_matching_active_filters(env):
    env.activate("+/b", "s1")
    env.activate("x/+", "s1")
    env.append("a/b", "a", "a/c", "x/b")
    changed = env.index()
    assert changed == {"a/b": 1, "a/#": 3, "+/b": 2, "a": 1, "a/c": 1, "x/b": 1, "x/#": 1, "x/+": 1}
    assert env.topics("a/#") == ["a/b", "a", "a/c"]  # the first-level queue holds the parent level
    assert env.topics("a") == ["a"]
    assert env.topics("+/b") == ["a/b", "x/b"]
    assert env.lq.statistics().entries_indexed == 11


def test_a_filter_indexes_only_records_appended_after_its_activation(env):
    env.activate("+/b", "s1")
    env.append("a/b")
    before = env.log.written_offset
    env.append("c/b")  # lists "+/b" already, but "x/+" is not active yet
    assert env.activate("x/+", "s2") == 0
    env.append("x/b", "x/c")
    env.index()
    assert env.topics("x/+") == ["x/b", "x/c"]
    assert env.lq.offset_at("+/b", before) == 1
    assert env.lq.offset_at("+/b", env.log.written_offset) == env.lq.max_offset("+/b") == 3


def test_released_filter_stops_indexing_even_for_records_that_list_it(env):
    env.activate("+/b", "s1")
    env.append("a/b", "c/b")  # both list "+/b"
    assert env.lq.release("+/b", "s1")
    env.index()
    assert env.lq.max_offset("+/b") == 0
    assert env.topics("a/b") == ["a/b"]


def test_listed_ids_that_are_not_active_filters_are_skipped(env):
    env.activate("+/b", "s1")
    old = env.lq.queue_id("+/b")
    env.append("a/b")  # lists the old id
    assert env.lq.release("+/b", "s1")
    assert env.activate("+/b", "s2") == 0
    new = env.lq.queue_id("+/b")
    assert new != old and env.lq.queue_name(old) is None
    env.log.append_batch([encode_record("t/b", b"p", queues=encode_queues([old, 10**6]))])
    env.append("c/b")  # lists the new id
    changed = env.index()
    assert changed == {"a/b": 1, "a/#": 1, "t/b": 1, "t/#": 1, "c/b": 1, "c/#": 1, "+/b": 1}
    assert env.topics("+/b") == ["c/b"]


def test_indexing_is_idempotent_and_the_checkpoint_never_moves_back(env):
    env.append("a/b", "a/c")
    scan = env.log.scan(0)
    env.lq.index(scan.records, scan.next_offset)
    assert env.lq.index(scan.records, scan.next_offset) == {}  # all below the checkpoint
    assert env.lq.max_offset("a/#") == 2
    with pytest.raises(ValueError, match="cannot move back"):
        env.lq.index([], 0)


def test_state_survives_reopen(env):
    env.activate("+/b", "s1")
    env.append("a/b")
    env.index()
    checkpoint = env.lq.checkpoint
    env.reopen()
    assert env.lq.checkpoint == checkpoint
    assert list(env.lq.active_filters()) == ["+/b"]
    assert env.lq.holders("+/b") == ["s1"]
    assert env.lq.max_offset("+/b") == 1
    assert decode_queues(env.lq.targets("z/b")) == (env.lq.queue_id("+/b"),)


def test_pull_pages_by_count_and_bytes(env):
    env.append(*["t"] * 10, payload=b"x" * 100)
    env.index()
    size = env.log.read(0).size
    r = env.lq.pull("t", 0, 4, 1 << 20, env.log, decode)
    assert [o for o, _ in r.messages] == [0, 1, 2, 3] and r.next_offset == 4 and not r.expired
    r = env.lq.pull("t", 4, 100, size * 3 + 1, env.log, decode)
    assert [o for o, _ in r.messages] == [4, 5, 6] and r.next_offset == 7
    r = env.lq.pull("t", 7, 100, 1, env.log, decode)  # one message is always returned
    assert [o for o, _ in r.messages] == [7] and r.messages[0][1].payload == b"x" * 100
    r = env.lq.pull("t", 8, 100, 1 << 20, env.log, decode)
    assert [o for o, _ in r.messages] == [8, 9] and r.next_offset == 10
    for start in (10, 25):  # at (or past) the head: nothing, and the offset stays
        r = env.lq.pull("t", start, 100, 1 << 20, env.log, decode)
        assert r.messages == [] and r.next_offset == start and not r.expired
    assert env.lq.pull("nothing/here", 3, 10, 100, env.log, decode).next_offset == 3
    with pytest.raises(ValueError, match="must be positive"):
        env.lq.pull("t", 0, 0, 100, env.log, decode)


def test_commit_and_get_offsets(env):
    env.append("a/b")
    env.index()
    env.lq.commit_offsets("s1", {"a/b": 1, "a/#": 0, "fresh/queue": 7})
    env.lq.commit_offsets("s2", {"a/b": 0})
    assert env.lq.get_offsets("s1") == {"a/b": 1, "a/#": 0, "fresh/queue": 7}
    env.lq.commit_offsets("s1", {"a/b": 2})
    env.reopen()
    assert env.lq.get_offsets("s1") == {"a/b": 2, "a/#": 0, "fresh/queue": 7}
    assert env.lq.get_offsets("s2") == {"a/b": 0}
    with pytest.raises(ValueError, match="must not be negative"):
        env.lq.commit_offsets("s1", {"a/b": -1})


def test_a_committed_offset_never_moves_back(env):
    """A connection taken over on another node may commit after its successor: its older offset is left out,
    the other offsets of the same write are kept."""
    env.append("a/b", "a/b", "a/b")
    env.index()
    env.lq.commit_offsets("s1", {"a/b": 3})
    env.lq.commit_offsets("s1", {"a/b": 1, "fresh/queue": 2})
    assert env.lq.get_offsets("s1") == {"a/b": 3, "fresh/queue": 2}
    env.lq.commit_offsets("s1", {"a/b": 3})  # the same offset again: nothing to write
    assert env.lq.get_offsets("s1") == {"a/b": 3, "fresh/queue": 2}


def test_last_release_deletes_the_filter_queue(env):
    env.activate("+/b", "s1")
    env.activate("+/b", "s2")
    env.append("a/b", "c/b")
    env.index()
    qid = env.lq.queue_id("+/b")
    env.lq.commit_offsets("s1", {"+/b": 1})
    env.lq.commit_offsets("s2", {"+/b": 2})
    assert env.lq.release("+/b", "s1")
    assert env.lq.get_offsets("s1") == {}  # the holder's own offset goes with it
    assert env.topics("+/b") == ["a/b", "c/b"]
    assert not env.lq.release("+/b", "s1")
    assert env.lq.release("+/b", "s2")
    assert env.entry_keys(qid) == []
    assert env.lq.queue_name(qid) is None and env.lq.max_offset("+/b") == 0
    assert env.lq.get_offsets("s2") == {}
    assert env.lq.targets("a/b") == b""
    assert env.lq.statistics().queues_removed == 1
    # Reactivated, it is a new queue starting at 0 with new messages only.
    assert env.activate("+/b", "s3") == 0
    env.append("d/b")
    env.index()
    assert env.topics("+/b") == ["d/b"] and env.lq.queue_id("+/b") != qid


def test_releasing_an_implicit_or_exact_filter_keeps_its_queue(env):
    env.activate("a/#", "s1")
    env.activate("a/b", "s1")
    env.append("a/b")
    env.index()
    assert env.lq.release("a/#", "s1") and env.lq.release("a/b", "s1")
    assert env.topics("a/#") == ["a/b"] and env.topics("a/b") == ["a/b"]
    assert is_implicit("a/#") and not is_implicit("+/#") and not is_implicit("a/b/#")


def test_delete_owner_removes_offsets_and_releases_filters(env):
    env.activate("+/b", "s1")
    env.activate("x/#", "s1")
    env.activate("+/b", "s2")
    env.append("x/b")
    env.index()
    env.lq.commit_offsets("s1", {"x/b": 1, "x/#": 1})
    env.lq.delete_owner("s1")
    assert env.lq.get_offsets("s1") == {}
    assert env.lq.held_by("s1") == []
    assert env.lq.holders("+/b") == ["s2"] and env.lq.holders("x/#") == []
    assert list(env.lq.active_filters()) == ["+/b"]
    env.lq.delete_owner("s2")
    assert list(env.lq.active_filters()) == [] and env.lq.max_offset("+/b") == 0


def test_retention_deletes_expired_entries_and_unreferenced_queues(tmp_path):
    env = Env(tmp_path, retention_hours=0, retention_max_bytes=SEGMENT)
    try:
        env.log.add_retention_listener(env.lq.on_retention)
        env.activate("dev/+", "group")
        env.activate("dev/2", "device2")  # an exact subscription keeps its topic queue
        env.append(*[f"dev/{i}" for i in range(8)], payload=b"x" * 300)
        env.lq.commit_offsets("device3", {"dev/3": 1})  # an offset keeps a queue too
        dev_end = env.log.written_offset
        env.append(*["other"] * 20, payload=b"x" * 300)
        env.index()
        assert env.lq.max_offset("dev/+") == 8
        qid5 = env.lq.queue_id("dev/5")
        deleted = env.log.delete_expired()
        assert deleted and env.log.min_offset >= dev_end  # every dev/ record is gone
        assert env.lq.retained_offset == env.log.min_offset
        assert env.lq.min_offset("dev/+") == env.lq.max_offset("dev/+") == 8
        assert env.entry_keys(env.lq.queue_id("dev/+")) == []
        r = env.lq.pull("dev/+", 0, 10, 1 << 20, env.log, decode)
        assert r.messages == [] and r.next_offset == 8 and r.expired
        assert env.lq.queue_name(qid5) is None  # empty and unreferenced: removed
        assert env.lq.max_offset("dev/2") == 1 and env.lq.max_offset("dev/3") == 1  # referenced: kept
        assert env.lq.max_offset("dev/#") == 0  # the first-level queue was unreferenced too
        remaining = env.topics("other")
        assert 0 < len(remaining) < 20
        first = env.lq.min_offset("other")
        assert first == 20 - len(remaining)
        r = env.lq.pull("other", 0, 1, 1 << 20, env.log, decode)
        assert r.expired and r.messages[0][0] == first and r.next_offset == first + 1
    finally:
        env.close()


def test_pull_skips_entries_of_deleted_segments_before_cleanup(tmp_path):
    env = Env(tmp_path, retention_hours=0, retention_max_bytes=SEGMENT)
    try:
        env.append(*["t"] * 30, payload=b"x" * 300)
        env.index()
        env.log.delete_expired()  # no listener: the index still points at deleted records
        r = env.lq.pull("t", 0, 100, 1 << 20, env.log, decode)
        assert r.expired and r.messages and r.messages[0][1].offset >= env.log.min_offset
        assert r.next_offset == 30
    finally:
        env.close()


def test_rewind_drops_entries_past_the_log_end(env):
    env.activate("+/b", "s1")
    env.append("a/b", "a/c")
    end = env.log.written_offset
    env.append("c/b", "a/b")
    env.index()
    env.lq.rewind(end)
    assert env.lq.checkpoint == end
    assert env.lq.max_offset("+/b") == 1 and env.lq.max_offset("a/#") == 2 and env.lq.max_offset("c/b") == 0
    assert env.entry_keys(env.lq.queue_id("a/b")) == [keys.entry_key(env.lq.queue_id("a/b"), 0)]
    env.reopen()
    assert env.lq.checkpoint == end and env.lq.max_offset("a/b") == 1



class _SignallingLock:
    """Wraps the index lock so the test knows when a thread is waiting for it."""

    def __init__(self, inner):
        import threading

        self.inner = inner
        self.waiting = threading.Event()

    def __enter__(self):
        self.waiting.set()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def test_a_new_holder_never_lands_on_a_filter_its_last_holder_is_removing(env):
    """Release by the last holder and activation by a new one interleave: the new
    holder must end up on an active filter (else ``topic/#`` receives nothing)."""
    import threading

    lq, f = env.lq, "race/+/x"
    lq.activate(f, "a", 0)
    spy = lq._lock = _SignallingLock(lq._lock)
    spy.inner.acquire()  # park the release just before it removes the filter
    try:
        releasing = threading.Thread(target=lq.release, args=(f, "a"))
        releasing.start()
        assert spy.waiting.wait(10), "release never reached the index lock"
        activating = threading.Thread(target=lq.activate, args=(f, "b", 0))
        activating.start()
    finally:
        spy.inner.release()
    releasing.join(10)
    activating.join(10)
    assert not releasing.is_alive() and not activating.is_alive()
    assert f in set(lq.active_filters())
    assert lq.holders(f) == ["b"]
    assert lq.release(f, "b") and not lq.release(f, "b")  # a second release is a harmless no-op


# --- runs: a queue's entries of one index batch under one key ---------------------------------


@dataclass
class Rec:
    """An indexable record at a made-up CommitLog offset (the runs tests never read the log)."""

    offset: int
    size: int = 100
    store_ms: int = 0
    topic: str = "t"
    queues: tuple = ()
    batch_count: int = 0


def index_records(env, first, count, size=100):
    """Index ``count`` records of 100 bytes on topic t from log offset ``first``, in one batch; log offsets."""
    offsets = [first + i * size for i in range(count)]
    env.lq.index([Rec(o, size, store_ms=o) for o in offsets], offsets[-1] + size)
    return offsets


def pulled(env, queue, start, count):
    """(queue offset, log offset) pairs: ``cached`` answers every entry with its log offset, nothing is read."""
    result = env.lq.pull(queue, start, count, 1 << 30, env.log, decode, cached=lambda log_offset: log_offset)
    return result.messages, result.next_offset, result.expired


def test_one_batch_writes_a_queue_s_entries_as_runs_and_pulls_read_across_them(env):
    run = keys.RUN_ENTRIES
    offsets = index_records(env, 0, 2 * run + 100)
    qid = env.lq.queue_id("t")
    assert env.entry_keys(qid) == [keys.entry_key(qid, 0), keys.entry_key(qid, run), keys.entry_key(qid, 2 * run)]
    assert env.lq.max_offset("t") == env.lq.max_offset("t/#") == 2 * run + 100
    messages, next_offset, expired = pulled(env, "t", run - 5, 10)  # across the first two runs
    assert messages == [(q, offsets[q]) for q in range(run - 5, run + 5)] and next_offset == run + 5 and not expired
    more = index_records(env, offsets[-1] + 100, 3)  # the next batch: a run of its own, continuing the offsets
    assert env.entry_keys(qid)[-1] == keys.entry_key(qid, 2 * run + 100)
    messages, next_offset, _ = pulled(env, "t", 2 * run + 98, 100)
    assert [log for _, log in messages] == offsets[-2:] + more and next_offset == 2 * run + 103
    assert env.lq.offset_at("t", offsets[run + 3]) == run + 3
    assert env.lq.offset_at("t", offsets[run + 3] + 1) == run + 4  # between two entries: the next one
    assert env.lq.offset_at_time("t", offsets[2 * run]) == 2 * run  # store ms = log offset here
    # A queue with a later id and no entries: the key before its first is t/#'s last run, which is not its
    assert env.lq.queue_id("z") > env.lq.queue_id("t/#") and env.lq.log_offset("z", 2 * run + 101) is None


def test_retention_inside_a_run_hides_its_expired_entries_and_a_later_pass_deletes_the_run(env):
    offsets = index_records(env, 0, 10)
    env.lq.on_retention(offsets[4])  # the log now starts inside the run
    qid = env.lq.queue_id("t")
    assert env.lq.min_offset("t") == 4 and env.entry_keys(qid) == [keys.entry_key(qid, 0)]  # the run stays whole
    messages, next_offset, expired = pulled(env, "t", 0, 100)
    assert messages == [(q, offsets[q]) for q in range(4, 10)] and next_offset == 10 and expired
    more = index_records(env, offsets[-1] + 100, 5)
    env.lq.on_retention(more[2])
    assert env.lq.min_offset("t") == 12 and env.entry_keys(qid) == [keys.entry_key(qid, 10)]
    assert pulled(env, "t", 4, 100)[0] == [(12, more[2]), (13, more[3]), (14, more[4])]
    # t/# has the next queue id: the key before its first run is t's last run, which is not t/#'s
    assert env.lq.queue_id("t/#") == qid + 1 and env.lq.log_offset("t/#", 9) is None  # its run is deleted
    assert pulled(env, "t/#", 0, 100) == ([(12, more[2]), (13, more[3]), (14, more[4])], 15, True)
    assert env.lq.log_offset("t/#", 12) == more[2]


def test_rewind_inside_a_run_keeps_the_entries_before_the_log_end(env):
    offsets = index_records(env, 0, 10)
    env.lq.rewind(offsets[6])
    qid = env.lq.queue_id("t")
    assert env.lq.max_offset("t") == 6 and env.entry_keys(qid) == [keys.entry_key(qid, 0)]
    assert pulled(env, "t", 0, 100)[0] == [(q, offsets[q]) for q in range(6)]
    again = index_records(env, offsets[6], 4)  # re-dispatch from the new end
    assert again == offsets[6:]
    assert pulled(env, "t", 0, 100)[0] == [(q, offsets[q]) for q in range(10)]


def test_an_index_with_one_key_per_entry_reads_as_runs_of_one(env):
    """The layout before runs: every entry its own key. Nothing is converted; it is read as it is."""
    qid = env.lq.queue_id("t")
    for q in range(10):
        env.db.put(keys.entry_key(qid, q), keys.ENTRY.pack(q * 100, 100, q * 100))
    env.db.put(keys.max_key(qid), keys.U64.pack(10))
    env.reopen()
    assert pulled(env, "t", 3, 4)[0] == [(q, q * 100) for q in range(3, 7)]
    assert env.lq.offset_at("t", 450) == 5 and env.lq.offset_at_time("t", 700) == 7
    env.lq.on_retention(500)
    assert env.lq.min_offset("t") == 5 and len(env.entry_keys(qid)) == 5
    env.lq.rewind(800)
    assert env.lq.max_offset("t") == 8 and pulled(env, "t", 0, 100)[0] == [(q, q * 100) for q in range(5, 8)]


def test_the_topic_keyed_caches_are_bounded_in_bytes_not_only_in_entries(env, monkeypatch):
    """6,000 distinct 65 KB topics: the target-section cache (65,536 entries) and the queue-state cache (262,144)
    each kept every topic string, 390 MB apiece. Bounded in bytes, they keep what their budget allows (issue 21)."""
    import gc
    import tracemalloc

    from lightqueue import queues as module

    monkeypatch.setattr(module, "TARGET_CACHE_BYTES", 4 * 2**20, raising=False)  # 39 MB of topics overflow them
    monkeypatch.setattr(module, "QUEUE_CACHE_BYTES", 4 * 2**20, raising=False)
    env.lq = LightQueues(env.db)  # made with the budgets above
    env.activate("+/x", "holder")  # a wildcard, so sections are not all empty
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for n in range(600):
            topic = f"{n:05d}/" + "x" * 65_000
            env.lq.targets(topic)
            env.lq.queue_id(topic)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    stats = env.lq.statistics()
    assert stats.cached_targets < 600 and stats.cached_queues < 600
    assert held < 12 * 2**20, f"{held / 2**20:.0f} MiB held for 39 MB of topics (budgets: 2 x 4 MiB)"


def test_an_index_from_before_the_id_split_gives_filters_ids_from_its_counter_and_topics_from_2_32(env):
    """One counter gave every queue its id before control records; filter ids are written in records now, so the
    ids dispatch gives topic queues must never be ids a writer may choose for a filter."""
    env.db.put(keys.NEXT_ID, keys.U64.pack(7))  # ids 1-6 taken, topics and filters alike
    env.reopen()
    assert env.lq.filter_id("a/+") == 7 and env.lq.filter_id("a/b") == 0 and env.lq.filter_id("a/#") == 0
    env.activate("a/+", "s1")
    env.append("a/b")
    env.index()
    assert env.lq.queue_id("a/+") == 7 and env.lq.queue_id("a/b") == TOPIC_IDS and env.lq.filter_id("x/+") == 8
    env.reopen()
    assert env.lq.statistics().next_queue_id == TOPIC_IDS + 2 and env.lq.filter_id("x/+") == 8


def test_forgetting_control_state_keeps_the_queues_of_filters_activated_before_the_log_end(env):
    """What a rewind does when control records past the log's end were applied: everything they made goes, and
    the activations before the end find their queues again when applied anew."""
    env.lq.activate("a/+", "s1", 0, applied=10)
    env.append("a/b")
    env.index()
    env.lq.activate("b/+", "s2", 500, applied=510)
    env.lq.commit_offsets("s1", {"a/+": 1}, applied=520)
    env.lq.forget_controls(400)
    assert env.lq.applied == 0 and env.lq.holders("a/+") == [] and env.lq.get_offsets("s1") == {}
    assert list(env.lq.active_filters()) == [] and env.lq.targets("a/b") == b""
    assert env.db.get(keys.name_key("b/+")) is None  # activated past the end: its queue goes whole
    assert env.lq.activate("a/+", "s1", 0, 1, applied=10) == 1  # applied again: its queue, entries and all
    assert env.topics("a/+") == ["a/b"] and env.lq.filter_id("c/+") == 3  # ids are never given out twice


# --- batch records: one entry for many queue offsets ------------------------------------------


def index_layout(env, first, layout, size=100):
    """Index one record per item of ``layout`` (its batch count, 0: a single record) from log offset ``first``,
    in one dispatch step; the records."""
    records = [Rec(first + i * size, size, store_ms=first + i * size, batch_count=count)
               for i, count in enumerate(layout)]
    env.lq.index(records, first + len(layout) * size)
    return records


def pulled_positions(env, records, queue, start, count, max_bytes=1 << 30):
    """(queue offset, log position) pairs: ``cached`` answers every entry with its log offset, and a batch
    record's messages are at that offset + their index (store/log/record.py)."""
    counts = {r.offset: r.batch_count for r in records}
    result = env.lq.pull(queue, start, count, max_bytes, env.log, decode, cached=lambda log_offset: log_offset,
                         unpack=lambda log_offset: [log_offset + i for i in range(counts[log_offset])])
    return result.messages, result.next_offset, result.expired


def positions_of(records):
    """Every message's log position, in queue order (a record's queue offsets are its messages')."""
    return [r.offset + i for r in records for i in range(r.batch_count or 1)]


def test_a_batch_record_is_one_entry_of_a_batch_run_and_pulls_serve_its_messages_from_any_queue_offset(env):
    records = index_layout(env, 0, [0, 16, 16, 0, 3])
    positions = positions_of(records)
    qid = env.lq.queue_id("t")
    # singles, then the two batches in one batch run, a single, a batch: a key where the kind of entry changes
    assert env.entry_keys(qid) == [keys.entry_key(qid, q) for q in (0, 1, 33, 34)]
    assert env.lq.max_offset("t") == env.lq.max_offset("t/#") == 37 == len(positions)
    for start in range(37):
        messages, next_offset, expired = pulled_positions(env, records, "t", start, 100)
        assert messages == [(q, positions[q]) for q in range(start, 37)] and next_offset == 37 and not expired
    messages, next_offset, _ = pulled_positions(env, records, "t", 5, 20)  # ends inside the second batch
    assert messages == [(q, positions[q]) for q in range(5, 25)] and next_offset == 25
    messages, next_offset, _ = pulled_positions(env, records, "t", 0, 100, max_bytes=150)  # a batch costs its size
    assert messages == [(0, 0)] and next_offset == 1
    assert env.lq.log_offset("t", 20) == positions[20] == 200 + 3
    assert env.lq.offset_at("t", 200) == 17 and env.lq.offset_at("t", 150) == 17  # the batch's first message
    assert env.lq.offset_at("t", 101) == 2 and env.lq.offset_at_time("t", 300) == 33


def test_rewind_and_retention_cut_batch_runs_at_their_records(env):
    records = index_layout(env, 0, [4, 4, 4, 0])
    positions = positions_of(records)
    env.lq.rewind(200)  # the log lost the third batch and the single
    qid = env.lq.queue_id("t")
    assert env.lq.max_offset("t") == 8 and env.entry_keys(qid) == [keys.entry_key(qid, 0)]
    assert pulled_positions(env, records, "t", 0, 100)[0] == [(q, positions[q]) for q in range(8)]
    again = index_layout(env, 200, [4, 0])  # re-dispatch from the new end
    assert pulled_positions(env, records + again, "t", 6, 100)[0] == [(q, positions[q]) for q in range(6, 13)]
    env.lq.on_retention(100)  # the log now starts at the second batch
    assert env.lq.min_offset("t") == 4
    messages, next_offset, expired = pulled_positions(env, records + again, "t", 0, 100)
    assert messages == [(q, positions[q]) for q in range(4, 13)] and next_offset == 13 and expired


class CountingDb:
    """A RocksDB handle that counts the bytes of the write batches written through it (RocksDB's own encoding)."""

    def __init__(self, db):
        self._db = db
        self.written = 0

    def write(self, batch, options):
        self.written += batch.size_in_bytes()
        return self._db.write(batch, options)

    def __getattr__(self, name):
        return getattr(self._db, name)


@pytest.mark.parametrize(("per_step", "ratio"), [(1, 4), (64, 10)])
def test_a_batch_of_16_costs_the_index_a_tenth_of_the_bytes_of_16_single_records(env, per_step, ratio):
    """Issue 30's target: index bytes per message >= 10x fewer for batches of 16 (docs/storage.md, "Batch
    records"). Dispatch writes 1,024 messages, ``per_step`` appends of 16 per step (64: a busy log; 1: an idle one,
    where every step's checkpoint and max offsets, the same for both, are most of what a batch costs), as single
    records and as batch records."""
    costs = {}
    for kind in ("single", "batch"):
        counting = CountingDb(env.db)
        env.lq = LightQueues(counting)
        start, queued = env.lq.checkpoint, env.lq.max_offset("t")
        for step in range(64 // per_step):
            first = start + step * per_step * 16 * 100
            index_layout(env, first, [0] * 16 * per_step if kind == "single" else [16] * per_step)
        assert env.lq.max_offset("t") - queued == 1024  # a queue offset per message either way
        costs[kind] = counting.written / 1024
    print(f"index bytes per message, {per_step} append(s) of 16 per dispatch step: {costs}")
    assert costs["single"] >= ratio * costs["batch"], costs



RUN = [("r/+", "s1", 7), ("r/+", "s2", 0), ("r/x", "s1", 0), ("q/+", "s1", 1 << 40), ("q/+/bad/#/x", "s1", 9),
       ("p/+", "s3", 8)]
"""A run of activations as ``Activated`` records carry them: a new filter twice (the first record's id wins), an
exact filter (id 0), a refused id and a refused filter in the middle, and one more new filter after them."""


def test_a_run_of_activations_applied_in_one_write_leaves_what_one_at_a_time_leaves(env, tmp_path):
    """Dispatch applies a run of ``Activated`` records in one RocksDB write (issue 31): the same state, ids and
    refusals as one record at a time, each refusal alone."""
    errors = env.lq.activate_all([(f, h, 0, qid or None) for f, h, qid in RUN], applied=100)
    assert [type(e).__name__ if e else None for e in errors] == [None, None, None, "ValueError", "TopicError", None]
    one = Env(tmp_path / "one")
    try:
        for n, (filter, holder, qid) in enumerate(RUN):
            with pytest.raises(ValueError) if n in (3, 4) else contextlib.nullcontext():
                one.lq.activate(filter, holder, 0, qid or None, applied=100)
        assert dump(env.db) == dump(one.db)
    finally:
        one.close()
    assert env.lq.applied == 100 and env.lq.queue_id("r/+") == 7 and env.lq.queue_id("p/+") == 8
    assert env.lq.holders("r/+") == ["s1", "s2"] and env.lq.holders("q/+") == [] and not env.lq.is_active("q/+")
    env.append("r/a", "p/a", "q/a")
    env.index()
    assert env.topics("r/+") == ["r/a"] and env.topics("p/+") == ["p/a"] and env.topics("q/+") == []
    env.reopen()
    assert env.lq.is_active("r/+") and env.lq.is_active("p/+") and env.lq.filter_id("new/+") == 9


class CountedReads:
    """Opens the index database with RocksDB's own statistics on: ``reads()`` is its point reads so far."""

    def __init__(self):
        self.options = rocksdict.Options(raw_mode=True)
        self.options.create_if_missing(True)
        self.options.enable_statistics()

    def __call__(self, path):
        return rocksdict.Rdict(str(path), self.options)

    def reads(self):
        return int(re.search(r"rocksdb\.number\.keys\.read COUNT : (\d+)", self.options.get_statistics()).group(1))


def test_a_name_without_a_queue_is_read_once_until_a_queue_is_made_under_it(tmp_path):
    """A new subscription to a topic nobody published to: its start (``offset_at``) finds no queue, and the node's
    read of its head right after (``max_offset``) read the database for it again, ~2 us a read against a memtable a
    subscribe storm fills (issue 31). The name is remembered absent (found so under the lock that every maker of a
    queue holds) until a queue is made under it: by dispatch, for a message on it, or by an activation."""
    counted = CountedReads()
    env = Env(tmp_path, open_index=counted)
    try:
        env.activate("t/1", "s1")
        before = counted.reads()
        assert env.lq.offset_at("t/1", env.log.written_offset) == 0
        assert env.lq.max_offset("t/1") == env.lq.max_offset("t/1") == 0 and env.lq.min_offset("t/1") == 0
        assert counted.reads() - before == 1
        env.append("t/1", "t/2")
        env.index()  # dispatch made the queue of t/1
        assert env.lq.max_offset("t/1") == 1 and env.topics("t/1") == ["t/1"]
        assert env.lq.offset_at("t/1", env.log.written_offset) == 1 and env.lq.min_offset("t/1") == 0
        assert env.lq.offset_at("w/+", env.log.written_offset) == 0  # not active yet: no queue
        env.activate("w/+", "s1")  # its queue is made
        env.append("w/x")
        env.index()
        assert env.lq.max_offset("w/+") == 1 and env.topics("w/+") == ["w/x"]
        env.reopen()
        assert env.lq.max_offset("t/1") == 1 and env.lq.max_offset("w/+") == 1 and env.topics("w/+") == ["w/x"]
    finally:
        env.close()


def test_the_names_remembered_without_a_queue_are_bounded(tmp_path, monkeypatch):
    """Names are client input (a filter up to 65,535 bytes): those remembered absent are forgotten all at once
    when ``ABSENT_NAMES`` (or ``ABSENT_BYTES``) would be passed, and read again."""
    monkeypatch.setattr(lightqueue.queues, "ABSENT_NAMES", 4)
    counted = CountedReads()
    env = Env(tmp_path, open_index=counted)
    try:
        names = [f"n/{i}" for i in range(5)]
        assert env.lq.starts(names, 0) == [0] * 5  # the fifth found the memory full
        before = counted.reads()
        assert [env.lq.max_offset(name) for name in names] == [0] * 5
        assert counted.reads() - before == 4  # the four forgotten are read again, the fifth is remembered
    finally:
        env.close()


def test_the_ids_of_a_run_of_first_activations_are_given_once_each_and_refusals_stay_alone(env):
    """``filter_ids`` gives the records of one write their ids (store/node.py ``activate_all``): a new wildcard
    filter takes the next id not given out (``given``, ids of records not applied yet, or the applied next id),
    one filter twice one id, an active filter its own; an exact filter or ``a/#`` 0; a refusal in its place."""
    env.activate("old/+", "s1")  # id 1; the next filter id is 2
    ids, given = env.lq.filter_ids(["a/+", "x/y", "old/+", "a/+", "a/#", "a/#/b", "b/+"], 5)
    assert ids[:5] == [5, 0, 1, 5, 0] and isinstance(ids[5], TopicError) and ids[6] == 6 and given == 7
    ids, given = env.lq.filter_ids(["c/+"], 0)  # nothing given ahead: the applied next id
    assert ids == [2] and given == 3
    ids, given = env.lq.filter_ids(["d/+", "e/f", "g/+"], lightqueue.queues.MAX_QUEUE_ID)
    assert ids[:2] == [lightqueue.queues.MAX_QUEUE_ID, 0] and isinstance(ids[2], ValueError)
    assert given == lightqueue.queues.MAX_QUEUE_ID + 1
    assert env.lq.filter_id("c/+") == 2 and env.lq.filter_id("old/+") == 1  # nothing given by asking
