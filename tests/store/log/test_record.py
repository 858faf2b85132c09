"""The record format v1 (store/log/record.py): round trips, limits, framing and corruption checks."""

from __future__ import annotations

import pytest
from msgspec.structs import replace
from hypothesis import given, settings
from hypothesis import strategies as st

from crc32c import crc32c

from lightqueue.targets import MAX_QUEUE_ID, encode_queues
from store.api import NewMessage
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import (
    EOS_SIZE,
    FLAG_BATCH,
    FLAG_RETAIN,
    FLAG_ZSTD,
    ZSTD_MAX_BODY,
    ZSTD_MIN_BODY,
    HEADER,
    HEADER_SIZE,
    MAGIC_EOS,
    MAGIC_V1,
    CorruptRecord,
    RecordTooLarge,
    batch_part,
    check_frame,
    decode_record,
    encode_eos,
    encode_message,
    encode_record,
    new_batch,
    new_batch_of,
)
import zstandard

from tests.helpers.batches import malformed_batch, noise, readings, zstd_batch

MiB = 1024 * 1024
U63 = st.integers(min_value=0, max_value=2**63 - 1)
names = st.text(max_size=40)


@given(
    topic=names,
    client_id=names,
    payload=st.binary(max_size=2000),
    properties=st.binary(max_size=100),
    queues=st.lists(st.integers(min_value=0, max_value=MAX_QUEUE_ID), max_size=12),
    qos=st.sampled_from([0, 1, 2]),
    retain=st.booleans(),
    born_ms=U63,
    store_ms=U63,
    offset=U63,
)
def test_encode_check_decode_round_trip(topic, client_id, payload, properties, queues, qos, retain,
                                        born_ms, store_ms, offset):
    raw = encode_record(topic, payload, client_id=client_id, qos=qos, retain=retain, properties=properties,
                        queues=encode_queues(queues), born_ms=born_ms, store_ms=store_ms)
    assert check_frame(raw, 0, len(raw)) == (MAGIC_V1, len(raw))
    rec = decode_record(raw, 0, offset)
    assert (rec.offset, rec.size, rec.topic, rec.client_id, rec.payload, rec.properties) == (
        offset, len(raw), topic, client_id, payload, properties)
    assert rec.queues == tuple(sorted(set(queues)))
    assert (rec.qos, rec.retain, rec.born_ms, rec.store_ms) == (qos, retain, born_ms, store_ms)
    assert rec.flags == qos | (FLAG_RETAIN if retain else 0)


@given(prefix=st.binary(max_size=64), topic=names, payload=st.binary(max_size=300))
def test_a_record_is_found_inside_a_larger_buffer(prefix, topic, payload):
    raw = encode_record(topic, payload)
    buf = memoryview(prefix + raw + b"\0" * 16)
    assert check_frame(buf, len(prefix), len(buf)) == (MAGIC_V1, len(raw))
    assert decode_record(buf, len(prefix), 7).payload == payload


@given(topic=st.text(min_size=1, max_size=30), payload=st.binary(max_size=200), data=st.data())
def test_every_single_byte_change_is_detected(topic, payload, data):
    raw = bytearray(encode_record(topic, payload, client_id="dev"))
    pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1), label="pos")
    raw[pos] ^= data.draw(st.integers(min_value=1, max_value=255), label="xor")
    with pytest.raises(CorruptRecord):
        check_frame(bytes(raw), 0, len(raw))


def test_empty_payload_and_empty_everything():
    raw = encode_record("", b"")
    assert len(raw) == HEADER_SIZE
    rec = decode_record(raw, 0, 0)
    assert (rec.topic, rec.payload, rec.client_id, rec.queues, rec.properties) == ("", b"", "", (), b"")


def test_maximum_size_record_is_accepted_and_one_byte_more_is_rejected():
    topic = "fleet/ünïcødé/温度"
    payload_len = MiB - HEADER_SIZE - len(topic.encode())
    raw = encode_record(topic, b"\xab" * payload_len, max_size=MiB)
    assert len(raw) == MiB
    rec = decode_record(raw, 0, 0)
    assert rec.topic == topic and len(rec.payload) == payload_len
    with pytest.raises(RecordTooLarge, match="exceeds the maximum record size"):
        encode_record(topic, b"\xab" * (payload_len + 1), max_size=MiB)


@given(st.text(min_size=1, max_size=50))
def test_unicode_topics_and_client_ids(text):
    raw = encode_record(text, text.encode(), client_id=text[::-1])
    rec = decode_record(raw, 0, 0)
    assert rec.topic == text and rec.client_id == text[::-1]


def test_field_limits_and_qos_are_checked():
    with pytest.raises(ValueError, match="65535"):
        encode_record("t" * 65536, b"")
    with pytest.raises(ValueError, match="QoS"):
        encode_record("t", b"", qos=3)


def test_the_target_queues_section_is_four_bytes_per_queue_id():
    plain = encode_record("a/b", b"x", client_id="c")
    raw = encode_record("a/b", b"x", client_id="c", queues=encode_queues(range(10, 0, -1)))
    assert len(raw) == len(plain) + 40
    assert decode_record(raw, 0, 0).queues == tuple(range(1, 11))


def test_a_section_that_is_not_whole_queue_ids_is_refused_when_encoding():
    with pytest.raises(ValueError, match="not a whole number of queue ids"):
        encode_record("a/b", b"x", queues=b"\x00\x00\x00")


def with_section_length(raw: bytes, queues_len: int) -> bytes:
    """``raw`` (a record without properties) with ``queues_len`` bytes of its payload moved to the
    target-queues section, and a valid CRC: well framed, but not a whole number of queue ids."""
    fields = list(HEADER.unpack_from(raw))
    fields[8] += queues_len
    fields[10] -= queues_len
    body = HEADER.pack(*fields)[8:] + raw[HEADER_SIZE:]
    return raw[:4] + crc32c(body).to_bytes(4, "big") + body


def test_a_well_framed_record_with_a_bad_section_is_corrupt():
    raw = with_section_length(encode_record("a/b", b"payload"), 3)
    with pytest.raises(CorruptRecord, match="target-queues length 3 is not a whole number of queue ids"):
        check_frame(raw, 0, len(raw))
    with pytest.raises(CorruptRecord, match="section of 3 bytes is not a whole number of 4-byte queue ids"):
        decode_record(raw, 0, 0)
    whole = with_section_length(encode_record("a/b", b"payload"), 4)  # the helper itself keeps records valid
    assert check_frame(whole, 0, len(whole)) == (MAGIC_V1, len(whole))
    assert decode_record(whole, 0, 0).queues == (int.from_bytes(b"payl", "big"),)


@settings(max_examples=50)
@given(st.integers(min_value=EOS_SIZE, max_value=1 << 30))
def test_end_of_segment_marker(remaining):
    marker = encode_eos(remaining)
    assert len(marker) == EOS_SIZE
    buf = marker + b"\0" * 8
    if remaining <= len(buf):
        assert check_frame(buf, 0, remaining) == (MAGIC_EOS, remaining)
    else:
        with pytest.raises(CorruptRecord, match="end-of-segment marker claims"):
            check_frame(buf, 0, len(buf))


def test_zeros_mean_nothing_written_and_short_garbage_is_corrupt():
    assert check_frame(b"\0" * 64, 0, 64) == (0, 0)
    assert check_frame(b"\0" * 8, 0, 8) == (0, 0)
    with pytest.raises(CorruptRecord, match="too short"):
        check_frame(b"\1" * 8, 0, 8)


def test_torn_record_overruns_the_readable_end():
    raw = encode_record("a/b", b"x" * 100)
    with pytest.raises(CorruptRecord, match="overruns"):
        check_frame(raw[:-1], 0, len(raw) - 1)


def test_unknown_magic_is_refused():
    raw = bytearray(encode_record("a", b"x"))
    raw[8:12] = (0x4C470002).to_bytes(4, "big")
    with pytest.raises(CorruptRecord, match="unknown magic"):
        check_frame(bytes(raw), 0, len(raw))


# --- batch records ------------------------------------------------------------------------------


def test_a_batch_record_decodes_to_its_messages_at_their_positions_and_each_reencodes_alone():
    items = [NewMessage("b/t", b"p%d" % i, client_id=f"c{i}", qos=i % 3, retain=i == 1,
                        properties=b"\x01\x01" if i else b"", born_ms=10 + i) for i in range(3)]
    raw, made = new_batch("b/t", items, 99, queues=encode_queues([7]))
    assert check_frame(raw, 0, len(raw)) == (MAGIC_V1, len(raw))
    record = decode_record(raw, 0, 1_000)
    made.place(1_000)
    assert record == made and record.batch_count == 3 and record.flags & FLAG_BATCH and record.payload == b""
    assert [(m.offset, m.client_id, m.qos, m.retain, m.properties, m.born_ms, m.store_ms, m.topic, m.queues,
             m.payload) for m in record.messages] == [
        (1_000 + i, f"c{i}", i % 3, i == 1, b"\x01\x01" if i else b"", 10 + i, 99, "b/t", (7,), b"p%d" % i)
        for i in range(3)]
    alone = [decode_record(encode_message(m), 0, m.offset) for m in record.messages]
    assert [replace(r, size=0) for r in alone] == [replace(m, size=0) for m in record.messages]  # sizes as stored
    assert decode_record(encode_record("b/t", b"x"), 0, 0).batch_count == 0


def test_a_part_of_a_batch_record_is_a_batch_record_of_those_messages_at_their_positions():
    """What a reader served fewer than half of a batch record's messages gets (``batch_part``): a valid record of
    just those, each message decoding as it does from the whole record at its position; the record whole for half
    or more, and always for a compressed body. ``decode_record``'s ``first``/``stop`` build only the messages
    asked for, the whole body still checked."""
    items = [NewMessage("b/t", b"p%d" % i, client_id=f"c{i % 3}", qos=i % 3, retain=i == 1,
                        properties=b"\x01\x01" if i % 2 else b"", born_ms=10 + i) for i in range(40)]
    raw, _ = new_batch("b/t", items, 99, queues=encode_queues([7, 9]))
    whole = decode_record(raw, 0, 1_000).messages
    for first, stop in ((0, 1), (5, 12), (21, 40), (39, 40)):
        part = batch_part(raw, first, stop)
        assert part is not None and len(part) < len(raw)
        assert check_frame(part, 0, len(part)) == (MAGIC_V1, len(part))
        assert decode_record(part, 0, 1_000 + first).messages == whole[first:stop]
        assert decode_record(raw, 0, 1_000, first, stop).messages == whole[first:stop]
    assert batch_part(raw, 0, 20) is None and batch_part(raw, 10, 40) is None  # half or more: the record whole
    packed, _ = new_batch("b/t", items, 99, compress=True)
    assert packed[12] & FLAG_ZSTD and batch_part(packed, 5, 6) is None
    broken = bytearray(raw)
    broken[HEADER_SIZE + len("b/t") + 8] ^= 0xFF  # the body's message count, past the header: it does not parse
    with pytest.raises(CorruptRecord):
        decode_record(bytes(broken), 0, 1_000, 0, 1)


def test_a_batch_refuses_what_a_batch_record_cannot_hold():
    with pytest.raises(ValueError, match="at least one"):
        new_batch("b/t", [], 1)
    with pytest.raises(ValueError, match="packet id"):
        new_batch("b/t", [NewMessage("b/t", b"", qos=2, packet_id=1)], 1)
    with pytest.raises(RecordTooLarge):
        new_batch("b/t", [NewMessage("b/t", b"x" * 100)] * 10, 1, max_size=1_000)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
@pytest.mark.parametrize("like", [
    NewMessage("b/t", b"", client_id="svc-1", qos=1, born_ms=10),
    NewMessage("b/t", b"", client_id="", qos=0, retain=True, properties=b"\x01\x01"),  # born 0: the store's time
], ids=["plain", "retained-with-properties"])
def test_a_batch_of_payloads_is_the_batch_record_of_their_messages(like, compress):
    """``new_batch_of`` packs payloads alike in one pass: its bytes and its messages are exactly those of
    ``new_batch`` over one message per payload, at their positions."""
    payloads = [b"", b"x", *readings(30)]
    queues = encode_queues([3, 7])
    expected = new_batch("b/t", [replace(like, payload=p) for p in payloads], 99, queues, compress=compress)
    raw, made = new_batch_of("b/t", like, payloads, 99, queues, compress=compress)
    assert raw == expected[0] and made == expected[1] and bool(raw[12] & FLAG_ZSTD) == compress
    made.place(500)
    assert decode_record(raw, 0, 500) == made
    assert [(m.offset, m.payload) for m in made.messages] == [(500 + i, p) for i, p in enumerate(payloads)]


def test_a_batch_of_payloads_refuses_what_new_batch_refuses():
    with pytest.raises(ValueError, match="at least one"):
        new_batch_of("b/t", NewMessage("b/t", b""), [], 1)
    with pytest.raises(ValueError, match="packet id"):
        new_batch_of("b/t", NewMessage("b/t", b"", qos=2, packet_id=1), [b""], 1)
    with pytest.raises(ValueError, match="QoS"):
        new_batch_of("b/t", NewMessage("b/t", b"", qos=3), [b""], 1)
    with pytest.raises(RecordTooLarge):  # decided on the raw body, as new_batch does
        new_batch_of("b/t", NewMessage("b/t", b""), [b"x" * 100] * 10, 1, max_size=1_000, compress=True)
    items = [NewMessage("b/t", b"x" * 100)] * 7
    assert new_batch_of("b/t", items[0], [b"x" * 100] * 7, 1, max_size=1_000) == \
        new_batch("b/t", items, 1, max_size=1_000)


def test_a_batch_whose_body_does_not_parse_is_skipped_alone_by_a_scan(tmp_path):
    """Its CRC is right (a writer's bug, not damage): a scan skips it like a CRC-bad record and goes on."""
    with CommitLog.open(tmp_path, CommitLogConfig()) as log:
        before = log.append(encode_record("a", b"1"))
        bad = log.append(malformed_batch("b/t", 5))
        after = log.append(encode_record("a", b"2"))
        with pytest.raises(CorruptRecord, match="body"):
            decode_record(log.read_bytes(bad, after - bad), 0, bad)
        scan = log.scan(0)
    assert [r.offset for r in scan.records] == [before, after]
    assert [(c.offset, c.end) for c in scan.corrupt] == [(bad, after)]


# --- compressed batch bodies (FLAG_ZSTD) ----------------------------------------------------------


def test_a_compressed_batch_decodes_to_the_messages_a_raw_one_does():
    """The body is one zstd frame and the CRC covers it as stored: the frame checks without inflating it."""
    items = [NewMessage("b/t", p, client_id=f"c{i % 2}", qos=i % 3, retain=i == 1,
                        properties=b"\x01\x01" if i else b"", born_ms=10 + i) for i, p in enumerate(readings(20))]
    raw, made = new_batch("b/t", items, 99, queues=encode_queues([7]))
    packed, packed_made = new_batch("b/t", items, 99, queues=encode_queues([7]), compress=True)
    assert packed[12] == FLAG_BATCH | FLAG_ZSTD and not raw[12] & FLAG_ZSTD
    assert len(packed) < len(raw) // 2 and packed_made.size == len(packed)
    assert check_frame(packed, 0, len(packed)) == (MAGIC_V1, len(packed))
    plain, record = decode_record(raw, 0, 1_000), decode_record(packed, 0, 1_000)
    packed_made.place(1_000)
    assert record == packed_made and record.batch_count == 20
    assert record.messages == plain.messages  # each message as a raw batch holds it, its size included


@pytest.mark.parametrize("items, compressed", [
    ([NewMessage("b/t", p) for p in readings(1)], False),  # a body shorter than ZSTD_MIN_BODY: not tried
    ([NewMessage("b/t", p) for p in noise(4, 1024)], False),  # random bytes: their headers save 2%, not an eighth
    ([NewMessage("b/t", p) for p in noise(16, 64)], True),  # small random payloads: their headers save a quarter
    ([NewMessage("b/t", p) for p in readings(4)], True),  # telemetry JSON: four readings already save half
], ids=["one-reading", "random-kilobytes", "random-64-bytes", "four-readings"])
def test_a_batch_body_is_compressed_only_when_it_saves_an_eighth(items, compressed):
    raw, _ = new_batch("b/t", items, 1)
    packed, record = new_batch("b/t", items, 1, compress=True)
    assert bool(packed[12] & FLAG_ZSTD) == compressed == bool(record.flags & FLAG_ZSTD)
    assert len(packed) <= len(raw) - (len(raw) - HEADER_SIZE - 3) // 8 if compressed else packed == raw
    assert decode_record(packed, 0, 0).messages == decode_record(raw, 0, 0).messages
    assert (len(raw) - HEADER_SIZE - 3 < ZSTD_MIN_BODY) == (len(items) == 1)


def test_whether_a_batch_fits_the_record_limit_is_decided_on_its_raw_body():
    """Ten compressible messages of 100 bytes do not fit a 1,000-byte record, compressed or not: what the store
    accepts does not depend on how well a batch compresses."""
    with pytest.raises(RecordTooLarge):
        new_batch("b/t", [NewMessage("b/t", b"x" * 100)] * 10, 1, max_size=1_000, compress=True)
    raw, _ = new_batch("b/t", [NewMessage("b/t", b"x" * 100)] * 7, 1, max_size=1_000, compress=True)
    assert raw[12] & FLAG_ZSTD and len(raw) < 200


def _frame_without_size(body: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=False).compress(body)


def _frame_claiming(size: int) -> bytes:
    """A zstd frame header (single segment) that states ``size`` bytes of content in 8 bytes, then one empty raw block."""
    return (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + size.to_bytes(8, "little") + b"\x01\x00\x00")


@pytest.mark.parametrize("stored, reason", [
    (b"not a zstd frame at all", "does not inflate"),
    (zstandard.ZstdCompressor().compress(b"\0\0\0\2" + b"x" * 400)[:-3], "does not inflate"),  # cut short
    (zstandard.ZstdCompressor().compress(b"\0\0\0\0" + b"x" * 400) + b"tail", "does not inflate"),
    (_frame_without_size(b"x" * 400), "states -1 bytes"),
    (_frame_claiming(ZSTD_MAX_BODY + 1), f"states {ZSTD_MAX_BODY + 1} bytes"),
    (zstandard.ZstdCompressor().compress(b"\0\0\0\5" + b"x" * 400), "body"),  # inflates, does not parse
], ids=["not-a-frame", "cut-short", "bytes-after", "no-content-size", "over-the-limit", "does-not-parse"])
def test_a_compressed_body_that_does_not_inflate_to_a_batch_body_is_corrupt(stored, reason):
    """Its CRC is right (a writer's bug, or a hostile file): one CorruptRecord, at a bounded cost (a frame
    claiming more than ZSTD_MAX_BODY is refused before anything is allocated for it)."""
    raw = zstd_batch("b/t", stored, 5)
    assert check_frame(raw, 0, len(raw)) == (MAGIC_V1, len(raw))
    with pytest.raises(CorruptRecord, match=reason):
        decode_record(raw, 0, 0)


def test_the_zstd_flag_on_a_record_that_is_not_a_batch_is_corrupt():
    raw = bytearray(encode_record("a", b"payload"))
    raw[12] |= FLAG_ZSTD
    raw[4:8] = crc32c(bytes(raw[8:])).to_bytes(4, "big")
    with pytest.raises(CorruptRecord, match="not a batch"):
        decode_record(bytes(raw), 0, 0)


def test_a_compressed_batch_that_does_not_inflate_is_skipped_alone_by_a_scan(tmp_path):
    with CommitLog.open(tmp_path, CommitLogConfig()) as log:
        good = log.append(new_batch("b/t", [NewMessage("b/t", p) for p in readings(8)], 1, compress=True)[0])
        bad = log.append(zstd_batch("b/t", b"garbage", 2))
        after = log.append(new_batch("b/t", [NewMessage("b/t", p) for p in readings(8, 1)], 3, compress=True)[0])
        scan = log.scan(0)
    assert [r.offset for r in scan.records] == [good, after]
    assert [m.payload for r in scan.records for m in r.messages] == readings(8) + readings(8, 1)
    assert [(c.offset, c.end) for c in scan.corrupt] == [(bad, after)]
