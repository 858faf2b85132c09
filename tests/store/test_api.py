"""The seam's helpers for batches (store/api.py): ``PayloadRun``, ``batch_groups``; and the store packing a run."""

import pytest
from msgspec.structs import replace

from store.api import NewMessage, PayloadRun, batch_groups
from store.log.record import new_batch, new_batch_of

LIKE = NewMessage("r/t", b"", client_id="svc", qos=1, properties=b"\x01\x01", born_ms=0)
MESSAGES = [replace(LIKE, payload=b"p%d" % i, born_ms=i * 7) for i in range(5)]  # born 0: the store's time


def test_messages_alike_but_for_payload_and_born_time_are_a_run_that_packs_as_they_would():
    run = PayloadRun.of(MESSAGES)
    assert run is not None and list(run) == MESSAGES and list(run[1:3]) == MESSAGES[1:3]
    assert isinstance(run[1:3], PayloadRun) and len(run) == 5 and run[-1] == MESSAGES[-1]
    packed = new_batch_of("r/t", run.like, run.payloads, 99, b"", compress=False, borns=run.borns)
    assert packed == new_batch("r/t", MESSAGES, 99)
    assert [m.born_ms for m in packed[1].messages] == [99, 7, 14, 21, 28]


@pytest.mark.parametrize("unlike", [
    replace(LIKE, topic="r/other"), replace(LIKE, client_id="other"), replace(LIKE, qos=0),
    replace(LIKE, retain=True), replace(LIKE, properties=b""), replace(LIKE, deliver_at_ms=1),
    replace(LIKE, qos=2, packet_id=9),
], ids=["topic", "client-id", "qos", "retain", "properties", "delayed", "packet-id"])
def test_messages_that_differ_in_more_are_not_a_run(unlike):
    assert PayloadRun.of([*MESSAGES, unlike]) is None
    assert PayloadRun.of([unlike, *MESSAGES]) is None
    assert PayloadRun.of([*MESSAGES[:2], unlike, *MESSAGES[2:]]) is None
    assert PayloadRun.of([LIKE]) is None  # one message: nothing to share


@pytest.mark.parametrize("field", [
    {"deliver_at_ms": 1}, {"qos": 2, "packet_id": 9}, {"properties": memoryview(bytearray(b"\x01\x01"))},
], ids=["delayed", "packet-id", "writable-view"])
def test_messages_alike_in_what_a_batch_record_cannot_hold_are_not_a_run(field):
    """All compared at once, messages that all share a delay or a packet id are alike, and still no run (a batch
    record holds neither); properties that are a view of a writable buffer make none either (the run keeps its
    first message's properties, to be the same in every message's record)."""
    assert PayloadRun.of([replace(m, **field) for m in MESSAGES]) is None


def test_one_topic_that_fits_is_one_batched_group_and_what_does_not_fit_is_alone():
    """The shortcut (one topic, every message small enough) and the walk agree: a run of payloads of which one is
    too large for a batch record, or messages of one topic of which one is delayed, are cut as message by message."""
    assert batch_groups(MESSAGES, 4096) == ([[0, 1, 2, 3, 4]], [True])
    assert batch_groups(PayloadRun(LIKE, [b"a", b"b"]), 4096) == ([[0, 1]], [True])
    too_large = PayloadRun(LIKE, [b"a", b"b", b"x" * 4000, b"c"])
    assert batch_groups(too_large, 4096) == ([[0, 1], [2], [3]], [True, False, False])
    delayed = [*MESSAGES[:2], replace(LIKE, deliver_at_ms=1), *MESSAGES[2:]]
    assert batch_groups(delayed, 4096) == ([[0, 1], [2], [3, 4, 5]], [True, False, True])
    assert batch_groups([*MESSAGES[:2], replace(LIKE, topic="r/b")], 4096) == ([[0, 1], [2]], [True, False])
