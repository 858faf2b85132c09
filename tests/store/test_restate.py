"""Retention keeps the log complete (store/restate.py): the live state is restated before the segments go.

A small ``ControlApplier`` (the sessions a log's ``SessionSaved``/``SessionEnded`` records leave) over a real
CommitLog with small segments: after retention deleted the segments holding its records, a new applier deriving
from what remains of the log ends with the same state; a restatement that fails deletes nothing; a crash between
the restatement and the deletion loses nothing (and the restatement was on disk first); a control record
appended between reading the state and appending it is never overtaken by the restatement.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterable

import trio

from lightqueue.queues import LightQueues
from retain.store import RetainedStore
from store.control import Control, SessionEnded, SessionSaved, encode_control
from store.dispatch import Dispatcher
from store.log.commitlog import CommitLog, CommitLogConfig, read_flushed_hint
from store.log.record import Record, decode_record, encode_record
from store.rocks import open_db
from tests.helpers.processes import ROOT

SEGMENT = 64 * 1024
CONFIG = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=SEGMENT, retention_hours=0,
                         retention_max_bytes=2 * SEGMENT)


class Sessions:
    """A ControlApplier: the session blobs of the log's records (checkpoint in memory)."""

    def __init__(self, fail: bool = False) -> None:
        self.blobs: dict[str, bytes] = {}
        self.fail = fail
        self._checkpoint = 0

    @property
    def checkpoint(self) -> int:
        return self._checkpoint

    def apply(self, record: Record, control: Control) -> None:
        if isinstance(control, SessionSaved):
            self.blobs[control.client] = control.blob
        elif isinstance(control, SessionEnded):
            self.blobs.pop(control.client, None)

    def flush(self, offset: int) -> None:
        self._checkpoint = offset

    def settle(self) -> None:
        pass  # kept in memory: nothing to wait for

    def rewind(self, log_end: int) -> None:
        if self._checkpoint > log_end:  # no history: derive everything again
            self.blobs.clear()
            self._checkpoint = 0

    def restate(self) -> Iterable[Control]:
        if self.fail:
            raise OSError("the restatement could not be written")
        return [SessionSaved(client, blob) for client, blob in sorted(self.blobs.items())]


def control(log: CommitLog, item: Control) -> int:
    return log.append(encode_control(item, 1, SEGMENT)[0])


def fill(log: CommitLog, segments: int = 5) -> None:
    """Messages, until the log spans ``segments`` more segments."""
    target = log.written_offset + segments * SEGMENT
    while log.written_offset < target:
        log.append_batch([encode_record("t", b"x" * 1000) for _ in range(16)])


def derived(log: CommitLog, path, applier) -> Dispatcher:
    """A dispatcher of a new index at ``path`` that applied the whole (remaining) log to ``applier``."""
    dispatcher = Dispatcher(log, LightQueues(open_db(path)), appliers=[applier])
    while dispatcher.dispatch_once() is not None:
        pass
    return dispatcher


def written_with_live_sessions(log: CommitLog) -> int:
    """Sessions a (live) and b (ended) saved at the log's start, then five segments of messages; returns the
    offset of the last control record."""
    control(log, SessionSaved("a", b"blob-a"))
    control(log, SessionSaved("b", b"blob-b"))
    last = control(log, SessionEnded("b"))
    fill(log)
    return last


def test_after_retention_deleted_the_records_of_live_state_the_remaining_log_still_derives_it(tmp_path):
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    last = written_with_live_sessions(log)
    live = Sessions()
    derived(log, tmp_path / "index", live)
    at_deletion: list[tuple[int, int]] = []
    log.add_retention_listener(lambda _: at_deletion.append((log.flushed_offset, log.written_offset)))
    assert log.delete_expired()
    assert log.min_offset > last  # the records that made the state are gone
    flushed, written = at_deletion[0]
    assert flushed == written  # the restatement was durable before any segment was deleted
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == live.blobs == {"a": b"blob-a"}
    log.close()


def test_a_restatement_that_fails_deletes_nothing_and_the_next_run_does(tmp_path):
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    live = Sessions(fail=True)
    derived(log, tmp_path / "index", live)
    segments = len(log.segments())
    assert log.delete_expired() == [] and log.min_offset == 0 and len(log.segments()) == segments
    live.fail = False
    assert log.delete_expired() and log.min_offset > 0
    log.close()


CRASH = """
import os, sys
from pathlib import Path
from tests.store.test_restate import CONFIG, Sessions, derived, written_with_live_sessions
from store.log.commitlog import CommitLog

path = Path(sys.argv[1])
log = CommitLog.open(path / "commitlog", CONFIG)
written_with_live_sessions(log)
derived(log, path / "index", Sessions())
log.add_retention_prelude(lambda _: os._exit(17))  # after the restater's: the restatement is appended
log.delete_expired()
"""


def test_a_crash_between_the_restatement_and_the_deletion_loses_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CRASH), str(tmp_path)], cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 17
    hint = read_flushed_hint(tmp_path / "commitlog")
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    assert log.min_offset == 0  # nothing deleted
    assert hint == log.written_offset  # the restatement, last in the log, was fsynced before the crash
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == {"a": b"blob-a"}
    assert log.delete_expired() and log.min_offset > 0  # the next run deletes, restating again
    again = Sessions()
    derived(log, tmp_path / "rebuilt-after", again)
    assert again.blobs == {"a": b"blob-a"}
    log.close()


class Racing(Sessions):
    """Its first restatement races a session's end, appended after the state was read and before it is written."""

    def __init__(self, log: CommitLog) -> None:
        super().__init__()
        self.log = log
        self.raced = False

    def restate(self) -> Iterable[Control]:
        state = super().restate()
        if not self.raced:
            self.raced = True
            control(self.log, SessionEnded("a"))
        return state


def test_a_session_ended_while_its_state_was_restated_is_not_brought_back(tmp_path):
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    racing = Racing(log)
    derived(log, tmp_path / "index", racing)
    assert log.delete_expired()
    assert racing.blobs == {}
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == {}  # the stale restatement was not appended after the end it did not know
    log.close()


async def test_what_the_restatement_dispatched_first_is_announced(tmp_path):
    """The restatement dispatches what was appended since the last step (in retention's thread): the dispatch
    loop still tells the listener, and its waiters, about it."""
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    events: list[dict[str, int]] = []
    queues = LightQueues(open_db(tmp_path / "index"))
    dispatcher = Dispatcher(log, queues, events.append, appliers=[Sessions()])
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.run)
        with trio.fail_after(10):
            await dispatcher.wait_dispatched(log.written_offset)
            control(log, SessionSaved("c", b"blob-c"))
            log.append(encode_record("t", b"late"))  # no wake-up: retention's restatement dispatches it
            late = log.written_offset
            assert await trio.to_thread.run_sync(log.delete_expired)
            await dispatcher.wait_dispatched(late)
            while not any(event.get("t") == queues.max_offset("t") for event in events):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == {"a": b"blob-a", "c": b"blob-c"}  # restated with what was not dispatched yet
    log.close()


class Busy(Sessions):
    """Each of its first ``times`` restatements races a message appended after the state was read."""

    def __init__(self, log: CommitLog, times: int) -> None:
        super().__init__()
        self.log = log
        self.times = times

    def restate(self) -> Iterable[Control]:
        state = super().restate()
        if self.times:
            self.times -= 1
            self.log.append(encode_record("t", b"meanwhile"))
        return state


def test_a_log_appended_to_without_pause_is_restated_with_its_appends_held(tmp_path, monkeypatch):
    """Retention does not wait for a quiet moment that may never come: after ``ATTEMPTS`` raced tries, the state
    is read and appended under the append lock."""
    monkeypatch.setattr("store.restate.ATTEMPTS", 3)
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    busy = Busy(log, times=3)
    derived(log, tmp_path / "index", busy)
    assert log.delete_expired() and busy.times == 0
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == {"a": b"blob-a"}
    log.close()


def retained_topics(log: CommitLog, path) -> tuple[dict[str, bytes], RetainedStore]:
    """The retained messages a new index at ``path`` derives from the (remaining) log (topic -> payload), and the
    store (its dispatcher restates it before retention deletes records: close it after the log's last retention)."""
    db = open_db(path)
    retained = RetainedStore(db)
    dispatcher = Dispatcher(log, LightQueues(db), retained=retained, appliers=[Sessions()])
    while dispatcher.dispatch_once() is not None:
        pass
    return {topic: decode_record(record, 0, offset).payload for topic, offset, record in retained.kept()}, retained


def test_retained_messages_outlive_the_records_retention_deletes(tmp_path):
    """A retained message is kept whatever the log's retention ([MQTT-3.3.1-5]): restated before its record goes
    (``RetainedKept``), a rebuild from the remaining log still has it; one deleted after the restatement stays
    deleted, and a newer message on a restated topic wins over the restatement."""
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    log.append_batch([encode_record(topic, payload, retain=True) for topic, payload in
                      (("r/kept", b"old"), ("r/kept", b"kept"), ("r/gone", b"gone"), ("r/new", b"first"))])
    fill(log)
    found, live = retained_topics(log, tmp_path / "index")
    assert found == {"r/kept": b"kept", "r/gone": b"gone", "r/new": b"first"}
    assert log.delete_expired() and log.min_offset > 0  # the retained records are gone; their restatement is not
    log.append_batch([encode_record("r/gone", b"", retain=True), encode_record("r/new", b"second", retain=True)])
    found, rebuilt = retained_topics(log, tmp_path / "rebuilt")
    assert found == {"r/kept": b"kept", "r/new": b"second"}
    for store in (live, rebuilt):
        store.close()
    log.close()


class Follower:
    """A thread that confirms the log's written end as a follower's fetches do (a fetch every few ms)."""

    def __init__(self, log: CommitLog) -> None:
        self.log = log
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            written = self.log.written_offset
            if written > self.log.confirm_offset:
                self.log.confirm(written)

    def __enter__(self) -> Follower:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)  # blocked on the append lock only if the restatement deadlocked (asserted before)
        if self.log.written_offset > self.log.confirm_offset:  # its last fetch: what was appended since its last
            self.log.confirm(self.log.written_offset)        # round (a restatement just written) is confirmed too


def bounded(fn, timeout: float = 60.0):
    """``fn()`` in a daemon thread; fails the test (instead of hanging it) when it has not returned in time."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s (spinning or deadlocked)"
    return result[0]


def test_a_replicated_leader_restates_once_its_followers_confirm_and_never_deadlocks_with_them(tmp_path, monkeypatch):
    """A replicated leader's dispatch stops at the confirm offset: the restatement waits for the followers to
    confirm the end (without the append lock: they confirm through it) instead of spinning; a log appended to
    without pause defers retention rather than wait under the lock, and the next run restates and deletes."""
    monkeypatch.setattr("store.restate.ATTEMPTS", 3)
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    log.hold_confirm()
    log.append(encode_record("t", b"not confirmed yet"))
    busy = Busy(log, times=3)
    derived(log, tmp_path / "index", busy)
    with Follower(log):
        deleted = bounded(log.delete_expired)
        assert busy.times == 0
        if not deleted:  # the last append was not confirmed when the lock was taken: deferred, not waited for
            deleted = bounded(log.delete_expired)
        assert deleted and log.min_offset > 0
    again = Sessions()
    derived(log, tmp_path / "rebuilt", again)
    assert again.blobs == {"a": b"blob-a"}
    log.close()


def test_a_replicated_leader_whose_followers_never_confirm_defers_retention_with_one_line(tmp_path, monkeypatch,
                                                                                          caplog):
    monkeypatch.setattr("store.restate.CONFIRM_WAIT_S", 0.2)
    log = CommitLog.open(tmp_path / "commitlog", CONFIG)
    written_with_live_sessions(log)
    log.hold_confirm()
    log.append(encode_record("t", b"never confirmed"))
    derived(log, tmp_path / "index", Sessions())
    segments = len(log.segments())
    with caplog.at_level(logging.WARNING, logger="store.log.commitlog"):
        assert bounded(log.delete_expired) == []
    assert log.min_offset == 0 and len(log.segments()) == segments
    deferred = [r for r in caplog.records if "retention deferred" in r.getMessage()]
    assert len(deferred) == 1 and deferred[0].exc_info is None
    log.close()
