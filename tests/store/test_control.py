"""Control records (store/control.py): their encoding, and dispatch applying them in log order between messages."""

import pytest

from lightqueue.queues import LightQueues
from store.control import Activated, ActivatedRun, Committed, ControlError, FlowsReleased, SessionEnded, \
    SessionSaved, activated_runs, decode_control, encode_control
from store.dispatch import Dispatcher
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import FLAG_CONTROL, Record, decode_record, encode_record, new_control
from store.rocks import open_db


class Seen:
    """A ControlApplier that remembers what it was given, and where dispatch stood on the messages then."""

    def __init__(self, queues: LightQueues, checkpoint: int = 0) -> None:
        self.queues = queues
        self.applied: list[tuple[int, object, int]] = []  # (offset, control, queue "t"'s max offset when applied)
        self._checkpoint = checkpoint
        self.flushed: list[int] = []

    @property
    def checkpoint(self) -> int:
        return self._checkpoint

    def apply(self, record: Record, control: object) -> None:
        self.applied.append((record.offset, control, self.queues.max_offset("t")))

    def flush(self, offset: int) -> None:
        self.flushed.append(offset)
        self._checkpoint = offset

    def settle(self) -> None:
        pass  # kept in memory: nothing to wait for

    def rewind(self, log_end: int) -> None:
        self._checkpoint = min(self._checkpoint, log_end)


@pytest.mark.parametrize("control", [
    Activated("a/+", "c1", 7), Committed("$group/g", {"a/b": 3, "c": 0}), SessionSaved("c1", b"\x00blob"),
    SessionEnded("c1"), FlowsReleased([("c1", 5, 1234)]), ActivatedRun("c1", ["a/+", "a/b", "é/+"], [7, 0, 8]),
])
def test_a_control_record_decodes_to_what_was_encoded(control):
    raw, made = encode_control(control, 1_700_000_000_000, 1 << 20)
    record = decode_record(raw, 0, 0)
    assert record.control and record.flags == FLAG_CONTROL and record.qos == 0 and not record.retain
    assert record.topic.startswith("$store/") and record == made
    assert decode_control(record) == control


def test_a_run_of_activations_is_one_record_split_only_past_the_size_given():
    """Issue 31: one record for a SUBSCRIBE run's filters, not one each; past the record size limit, more (each
    under it, the filters in order), a filter too large for one alone in its own."""
    filters = [(f"dev/{i:04}/+", i + 1) for i in range(1000)]
    (run,) = activated_runs("c1", filters, 512 << 10)
    assert run == ActivatedRun("c1", [f for f, _ in filters], [q for _, q in filters])
    assert len(encode_control(run, 0, 1 << 20)[0]) < 20 * 1000  # 122 B a filter as Activated records
    runs = activated_runs("c1", [("x" * 3000, 0), *filters[:300], ("y" * 9000, 0)], 8 << 10)
    assert [len(r.filters) for r in runs] == [1, 157, 143, 1]  # 52 B counted a filter of 10 characters
    assert [f for r in runs for f in r.filters] == ["x" * 3000, *(f for f, _ in filters[:300]), "y" * 9000]
    assert all(len(encode_control(r, 0, 1 << 20)[0]) < 8 << 10 for r in runs[:-1])


def test_an_activated_run_with_more_filters_than_ids_does_not_decode():
    raw, _ = encode_control(ActivatedRun("c1", ["a/+", "b/+"], [1, 2]), 0, 1 << 20)
    record = decode_record(raw.replace(b"\x92\x01\x02", b"\x91\x01"), 0, 0)  # ids [1, 2] -> [1], no CRC check
    with pytest.raises(ControlError, match="2 filters with 1 queue ids"):
        decode_control(record)


def test_a_message_on_a_store_topic_is_not_a_control_record():
    """Control-ness is the flag: a client may publish to any ``$store/...`` name it is allowed to."""
    record = decode_record(encode_record("$store/committed", b"x"), 0, 0)
    assert not record.control


def test_dispatch_applies_control_records_between_the_messages_around_them(tmp_path):
    log = CommitLog.open(tmp_path / "commitlog", CommitLogConfig())
    db = open_db(tmp_path / "index")
    queues = LightQueues(db)
    seen = Seen(queues)
    dispatcher = Dispatcher(log, queues, appliers=[seen])
    first = encode_control(Committed("o", {"t": 1}), 1, 1 << 20)[0]
    second = encode_control(SessionEnded("c"), 2, 1 << 20)[0]
    offsets = log.append_batch([encode_record("t", b"1"), first, encode_record("t", b"2"), encode_record("t", b"3"),
                                second, encode_record("t", b"4")])
    dispatcher.dispatch_once()
    assert [(o, c) for o, c, _ in seen.applied] == [(offsets[1], Committed("o", {"t": 1})),
                                                    (offsets[4], SessionEnded("c"))]
    assert [at for _, _, at in seen.applied] == [1, 3]  # the messages before each were indexed first
    assert queues.max_offset("t") == 4 and queues.max_offset("$store/committed") == 0  # controls are not indexed
    dispatcher.close()
    assert seen.flushed == [log.written_offset]
    db.close()
    log.close()


def test_redispatch_applies_only_past_the_appliers_checkpoint_and_skips_an_unreadable_body(tmp_path, caplog):
    log = CommitLog.open(tmp_path / "commitlog", CommitLogConfig())
    db = open_db(tmp_path / "index")
    queues = LightQueues(db)
    bad = new_control("$store/unknown", b"\xc1", 3, "c")[0]
    offsets = log.append_batch([encode_control(SessionEnded("a"), 1, 1 << 20)[0], bad,
                                encode_control(SessionEnded("b"), 2, 1 << 20)[0]])
    seen = Seen(queues, checkpoint=offsets[1])
    dispatcher = Dispatcher(log, queues, appliers=[seen])
    dispatcher.dispatch_once()
    assert [c for _, c, _ in seen.applied] == [SessionEnded("b")]
    assert "control record skipped" in caplog.text
    db.close()
    log.close()
