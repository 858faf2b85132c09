"""The CommitLog record format, version 1: encoding, framing checks and decoding.

This module is the single definition of the bytes on disk. The CommitLog writes
what it encodes, the dispatcher and the Spark reader decode with it, and
``docs/storage.md`` documents it. It knows nothing of files or MQTT sessions.

Layout (all integers big-endian)::

    offset size field
    0      4    total length of the record, this field included
    4      4    CRC32C over bytes [8, total length)
    8      4    magic: MAGIC_V1 for a message, MAGIC_EOS for the end-of-segment marker
    12     1    flags: bits 0-1 QoS, bit 2 retain, bit 3 packet id, bit 4 control, bit 5 batch, bit 6 zstd; bit 7 zero
    13     8    born timestamp, ms since the epoch (when the producer created it)
    21     8    store timestamp, ms since the epoch (when the store accepted it)
    29     2    producer id (client id) length, then the UTF-8 bytes follow the header
    31     2    topic length
    33     2    target-queues length (the whole section, a multiple of 4, see below)
    35     4    properties length (MQTT 5 properties, wire encoding without the length prefix)
    39     4    payload length
    43          producer id | topic | target queues | properties | payload

The target-queues section lists the extra light queues (active wildcard filters)
the record was matched to when it was appended, as repeated u32 queue id, sorted
ascending, without duplicates (lightqueue.targets is the codec). The exact-topic
and first-level queues are implied by the topic. With flag bit 3
(``FLAG_PACKET_ID``) the section ends with one more u32 that is not a queue id:
the publisher's QoS 2 packet id, from which the store derives the flows awaiting
PUBREL (store/awaiting.py). Readers that skip the section by its length (Spark)
need not know; records without the flag, every record before it existed
included, are unchanged.

With flag bit 4 (``FLAG_CONTROL``) the record is not a message but a control
record of the store (store/control.py): the topic names its kind, the payload
is its body. Dispatch applies it instead of indexing it; message readers skip it.

With flag bit 5 (``FLAG_BATCH``) the record holds N messages of its one topic (a batch record: one frame,
one CRC, one index entry per queue). Its header has QoS 0, no retain, the store timestamp of all of them, an
empty producer id and properties; its payload is the batch body::

    4    message count N (at least 1)
    N x  19-byte message header: u8 flags (QoS, retain), u64 born ms, u16 client id length,
         u32 properties length, u32 payload length; then client id | properties | payload

With flag bit 6 (``FLAG_ZSTD``, on batch records only) the batch body is stored as one zstd frame that holds its
content size: the writer compresses a body of at least ``ZSTD_MIN_BODY`` bytes when that saves at least an eighth
of it (``commitlog.batch_compression``), and :func:`open_batch`, the one way into a batch body, inflates it. The
CRC covers the stored (compressed) bytes, so a frame is checked without inflating it.

Message i of a batch record at offset O is at *position* O + i (a batch is longer than its count, so no other
record starts there): what an append returns for it, its ``Record.offset`` and what an index points at.

The end-of-segment marker is a 12-byte header (length = bytes left in the
segment, CRC32C over the magic only, MAGIC_EOS). When fewer than 12 bytes are
left in a segment no marker is written: readers move to the next segment.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Protocol, Sequence

import msgspec
import zstandard
from crc32c import crc32c

from lightqueue.targets import QUEUE_ID_SIZE, CorruptTargets, decode_queues, encode_queues

__all__ = [
    "EOS_SIZE",
    "FLAG_BATCH",
    "FLAG_CONTROL",
    "FLAG_PACKET_ID",
    "FLAG_RETAIN",
    "FLAG_ZSTD",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC_EOS",
    "MAGIC_V1",
    "PEEK",
    "STORE_MS",
    "STORE_MS_AT",
    "ZSTD_MAX_BODY",
    "ZSTD_MIN_BODY",
    "QOS_MASK",
    "CorruptRecord",
    "Record",
    "RecordTooLarge",
    "BatchItem",
    "batch_fields",
    "batch_part",
    "check_frame",
    "open_batch",
    "decode_record",
    "encode_eos",
    "encode_message",
    "encode_record",
    "fit_batches",
    "new_batch",
    "new_batch_of",
    "new_control",
    "new_record",
    "now_ms",
]

MAGIC_V1 = 0x4C470001
"""'LG' + format version 1. A new layout gets a new magic; readers refuse unknown ones."""

MAGIC_EOS = 0x4C47FFFF
"""The end-of-segment marker: the rest of the segment holds no records."""

HEADER = struct.Struct(">IIIBQQHHHII")
HEADER_SIZE = HEADER.size  # 43
_FRAME = struct.Struct(">II")  # length and CRC32C: the header's first 8 bytes
_BODY_HEADER = struct.Struct(">IBQQHHHII")  # the rest of the header, which the CRC covers
PEEK = struct.Struct(">I4xI9xQ")
"""A record's total length, magic and store timestamp in one unpack (the CommitLog checks a batch with it)."""
STORE_MS = struct.Struct(">Q")
STORE_MS_AT = 21
"""Where the store timestamp is in the header (the CommitLog's recovery reads it without decoding the record)."""
EOS = struct.Struct(">III")
EOS_SIZE = EOS.size  # 12

QOS_MASK = 0x03
FLAG_RETAIN = 0x04
FLAG_PACKET_ID = 0x08
"""The last u32 of the target-queues section is the publisher's packet id (QoS 2 records), not a queue id."""
FLAG_CONTROL = 0x10
"""A control record of the store (store/control.py), not a message: dispatch applies it, message readers skip it."""
FLAG_BATCH = 0x20
"""A batch record: the payload holds the messages of the topic (module docstring); dispatch indexes it once."""
FLAG_ZSTD = 0x40
"""A batch record whose body is one zstd frame (module docstring); never set without ``FLAG_BATCH``."""
ZSTD_LEVEL = 1
"""zstd's fastest positive level: on telemetry JSON its ratio is level 3's (better at 1 KiB: 0.16 against 0.17 of
the raw body), at two thirds of its CPU (docs/storage.md, "Compressed batch bodies")."""
ZSTD_MIN_BODY = 256
"""Bodies shorter than this stay raw without a try: a zstd call costs ~3 us however short its input, for a saving
under 100 bytes here (one 64-byte JSON message, a 96-byte body, grows by the frame's overhead; measured)."""
ZSTD_MAX_BODY = 64 << 20
"""The largest body compressed, and the largest content size a reader inflates: a damaged or hostile frame header
cannot make a reader allocate more (a record's body is at most ``commitlog.max_record_bytes``, 1 MiB by default)."""
_PACKET_ID = struct.Struct(">I")
_COUNT = struct.Struct(">I")
_MESSAGE = struct.Struct(">BQHII")
"""A batch message's header: flags (QoS, retain), born ms, client id, properties and payload lengths."""

_MAX_U16 = 0xFFFF
_MAX_U32 = 0xFFFFFFFF


class CorruptRecord(Exception):
    """The bytes at a position are not a valid record (bad length, magic or CRC)."""


class RecordTooLarge(ValueError):
    """A record would exceed the configured maximum record size."""


class Record(msgspec.Struct, gc=False):
    """One decoded message record. ``offset`` is its global CommitLog offset.

    A msgspec struct that the cyclic garbage collector does not track (its
    fields are plain values: it can never be part of a cycle). The store
    keeps the last 65,536 in memory (``store/log/recent.py``); as tracked objects
    they made every young-generation collection longer and brought full
    collections of tens of milliseconds under load. Building one costs a
    third of a slotted dataclass.
    """

    offset: int
    size: int
    flags: int
    born_ms: int
    store_ms: int
    client_id: str
    topic: str
    queues: tuple[int, ...]  # queue ids of the target-queues section
    properties: bytes
    payload: bytes
    packet_id: int = 0  # the publisher's QoS 2 packet id (FLAG_PACKET_ID), 0 for other records
    messages: tuple[Record, ...] = ()  # a batch record's messages (FLAG_BATCH), each at its position; () otherwise

    @property
    def qos(self) -> int:
        return self.flags & QOS_MASK

    @property
    def retain(self) -> bool:
        return bool(self.flags & FLAG_RETAIN)

    @property
    def control(self) -> bool:
        """A control record of the store (``FLAG_CONTROL``), not a message."""
        return bool(self.flags & FLAG_CONTROL)

    @property
    def batch_count(self) -> int:
        """The messages of a batch record (``FLAG_BATCH``), each a queue offset of its own; 0 for any other."""
        return len(self.messages) if self.flags & FLAG_BATCH else 0

    def place(self, offset: int) -> None:
        """Set the CommitLog offset of a record just appended, and its messages' positions if it is a batch."""
        self.offset = offset
        for i, message in enumerate(self.messages):
            message.offset = offset + i


def encode_record(
    topic: str,
    payload: bytes,
    *,
    client_id: str = "",
    qos: int = 0,
    retain: bool = False,
    properties: bytes = b"",
    queues: bytes = b"",
    born_ms: int | None = None,
    store_ms: int | None = None,
    max_size: int = _MAX_U32,
    packet_id: int = 0,
) -> bytes:
    """Encode one message record.

    Encoding happens outside the CommitLog's write lock (it is the expensive
    part: UTF-8, packing, CRC), so the lock only covers the copy into the file.

    Args:
        queues: an already encoded target-queues section (lightqueue.targets.encode_queues).
        born_ms / store_ms: default to now.
        max_size: the configured maximum record size.
        packet_id: the publisher's packet id of a QoS 2 message (0: none), kept after the target queues.

    Raises:
        RecordTooLarge: the record would be larger than ``max_size``.
        ValueError: a field does not fit its length field, QoS is not 0-2,
            ``queues`` is not a whole number of queue ids, or ``packet_id`` is
            not 1..65535 on a QoS 2 message.
    """
    now = None
    if store_ms is None:
        now = store_ms = now_ms()
    if born_ms is None:
        born_ms = now if now is not None else store_ms
    return _encode(topic, payload, client_id, qos, retain, properties, queues, born_ms, store_ms, max_size, packet_id)


def _encode(topic: str, payload: bytes, client_id: str, qos: int, retain: bool, properties: bytes, queues: bytes,
            born_ms: int, store_ms: int, max_size: int, packet_id: int = 0, control: int = 0) -> bytes:
    """:func:`encode_record` with every field given, positionally: an append encodes each message once, and
    a call with ten keyword arguments cost as much as the packing. ``control``: the flags of a record that is not
    a message (``FLAG_CONTROL``, ``FLAG_BATCH`` with or without ``FLAG_ZSTD``) or 0."""
    if qos not in (0, 1, 2):
        raise ValueError(f"QoS must be 0, 1 or 2, not {qos!r}")
    flags = qos | (FLAG_RETAIN if retain else 0) | control
    if packet_id:
        if qos != 2 or not 0 < packet_id <= _MAX_U16:
            raise ValueError(f"a packet id (1..65535) is kept for QoS 2 messages only, not {packet_id!r} at QoS {qos}")
        queues += _PACKET_ID.pack(packet_id)
        flags |= FLAG_PACKET_ID
    cid = client_id.encode()
    tpc = topic.encode()
    n_cid, n_tpc, n_queues, n_props, n_payload = len(cid), len(tpc), len(queues), len(properties), len(payload)
    if n_cid > _MAX_U16 or n_tpc > _MAX_U16 or n_queues > _MAX_U16:
        raise ValueError("client id, topic and target queues are limited to 65535 bytes each")
    if n_queues % QUEUE_ID_SIZE:
        raise ValueError(f"a target-queues section of {n_queues} bytes is not a whole number of queue ids")
    size = HEADER_SIZE + n_cid + n_tpc + n_queues + n_props + n_payload
    if size > max_size:
        raise RecordTooLarge(f"record of {size} bytes exceeds the maximum record size of {max_size} bytes")
    body = b"".join((
        _BODY_HEADER.pack(MAGIC_V1, flags, born_ms, store_ms, n_cid, n_tpc, n_queues, n_props, n_payload),
        cid, tpc, queues, properties, payload,
    ))
    return _FRAME.pack(size, crc32c(body)) + body


def now_ms() -> int:
    """The store timestamp of a record appended now: ms since the epoch."""
    return int(time.time() * 1000)


def new_record(
    topic: str,
    payload: bytes,
    store_ms: int,
    client_id: str = "",
    qos: int = 0,
    retain: bool = False,
    properties: bytes = b"",
    queues: bytes = b"",
    born_ms: int | None = None,
    max_size: int = _MAX_U32,
    packet_id: int = 0,
) -> tuple[bytes, Record]:
    """:func:`encode_record`, and the ``Record`` those bytes decode to, made from the fields (no decode).

    The record's ``offset`` is 0 until the caller appends the bytes and sets it. Every parameter may be
    given positionally: an append makes one record per message, and keyword arguments cost a microsecond.
    Raises what :func:`encode_record` raises.
    """
    if type(payload) is not bytes:  # the kept record must not change with a caller's buffer
        payload = bytes(payload)
    born = store_ms if born_ms is None else born_ms
    raw = _encode(topic, payload, client_id, qos, retain, properties, queues, born, store_ms, max_size, packet_id)
    ids = decode_queues(queues) if queues else ()
    flags = qos | (FLAG_RETAIN if retain else 0) | (FLAG_PACKET_ID if packet_id else 0)
    return raw, Record(0, len(raw), flags, born, store_ms, client_id, topic, ids, properties, payload, packet_id)


def new_control(kind: str, body: bytes, store_ms: int, client_id: str = "",
                max_size: int = _MAX_U32, packet_id: int = 0) -> tuple[bytes, Record]:
    """A control record (``FLAG_CONTROL``): ``kind`` in the topic field, ``body`` in the payload, ``client_id`` the
    client or owner it concerns (store/control.py encodes the kinds). ``packet_id``: the QoS 2 packet id of the
    publisher whose delayed message this record is (QoS 2 and ``FLAG_PACKET_ID`` in its frame, as its message
    record would have: the flow awaits PUBREL from the same fact, store/awaiting.py). Raises what
    :func:`encode_record` raises."""
    qos = 2 if packet_id else 0
    raw = _encode(kind, body, client_id, qos, False, b"", b"", store_ms, store_ms, max_size, packet_id, FLAG_CONTROL)
    flags = FLAG_CONTROL | (qos | FLAG_PACKET_ID if packet_id else 0)
    return raw, Record(0, len(raw), flags, store_ms, store_ms, client_id, kind, (), b"", body, packet_id)


class BatchItem(Protocol):
    """What a batch record keeps of each message (store.api.NewMessage has it)."""

    payload: bytes
    client_id: str
    qos: int
    retain: bool
    properties: bytes
    born_ms: int  # 0: the store timestamp
    packet_id: int  # must be 0: a QoS 2 flow keeps its packet id in a record of its own


def new_batch(topic: str, items: Sequence[BatchItem], store_ms: int, queues: bytes = b"",
              max_size: int = _MAX_U32, *, compress: bool = False) -> tuple[bytes, Record]:
    """One batch record (``FLAG_BATCH``) holding ``items``, all on ``topic``, and the ``Record`` it decodes to
    (its ``messages`` at offsets 0..N-1 until :meth:`Record.place` puts it).

    ``compress``: store the body as a zstd frame (``FLAG_ZSTD``) when that saves space (:func:`_deflate`). Whether
    a batch fits ``max_size`` is decided on its raw body: what is accepted never depends on how well it compresses.

    Raises:
        RecordTooLarge: the record would be larger than ``max_size``.
        ValueError: no items, a QoS not 0-2, a packet id, or a field too long for its length field.
    """
    if not items:
        raise ValueError("a batch record holds at least one message")
    parts = [_COUNT.pack(len(items))]
    messages = []
    client_id: str | None = None
    cid = b""
    for i, m in enumerate(items):
        if m.qos not in (0, 1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, not {m.qos!r}")
        if m.packet_id:
            raise ValueError("a QoS 2 message with a packet id cannot be in a batch record")
        payload = m.payload if type(m.payload) is bytes else bytes(m.payload)
        if m.client_id is not client_id:  # a run is mostly one publisher's: its id encoded once
            client_id = m.client_id
            cid = client_id.encode()
            if len(cid) > _MAX_U16:
                raise ValueError("a client id is limited to 65535 bytes")
        flags = m.qos | (FLAG_RETAIN if m.retain else 0)
        born = m.born_ms or store_ms
        parts += (_MESSAGE.pack(flags, born, len(cid), len(m.properties), len(payload)), cid, m.properties, payload)
        size = _MESSAGE.size + len(cid) + len(m.properties) + len(payload)
        messages.append(Record(i, size, flags, born, store_ms, m.client_id, topic, (), m.properties, payload))
    ids = decode_queues(queues) if queues else ()
    for message in messages:
        message.queues = ids
    return _sealed(topic, b"".join(parts), tuple(messages), store_ms, queues, ids, max_size, compress)


def new_batch_of(topic: str, like: BatchItem, payloads: Sequence[bytes], store_ms: int, queues: bytes = b"",
                 max_size: int = _MAX_U32, *, compress: bool = False,
                 borns: Sequence[int] | None = None) -> tuple[bytes, Record]:
    """:func:`new_batch` of messages alike but for their payloads (``like``'s fields, its payload unused) and,
    with ``borns``, their born times: every message header but those is the same, so the body is packed in one
    pass and one join (a third of ``new_batch``'s cost per message, measured). ``payloads`` must be ``bytes``
    (kept as they are).

    Raises:
        RecordTooLarge: the one record would be larger than ``max_size`` (:func:`fit_batches` cuts runs).
        ValueError: as :func:`new_batch`.
    """
    if not payloads:
        raise ValueError("a batch record holds at least one message")
    if like.qos not in (0, 1, 2):
        raise ValueError(f"QoS must be 0, 1 or 2, not {like.qos!r}")
    if like.packet_id:
        raise ValueError("a QoS 2 message with a packet id cannot be in a batch record")
    client_id, properties = like.client_id, like.properties
    cid = client_id.encode()
    if len(cid) > _MAX_U16:
        raise ValueError("a client id is limited to 65535 bytes")
    count = len(payloads)
    tail = cid + properties
    each = _MESSAGE.size + len(tail)
    size = HEADER_SIZE + len(topic.encode()) + len(queues) + _COUNT.size + count * each + sum(map(len, payloads))
    if size > max_size:
        raise RecordTooLarge(f"record of {size} bytes exceeds the maximum record size of {max_size} bytes")
    flags = like.qos | (FLAG_RETAIN if like.retain else 0)
    born = like.born_ms or store_ms
    pack, n_cid, n_props = _MESSAGE.pack, len(cid), len(properties)
    parts: list[bytes] = [b""] * (2 * count)
    ids = decode_queues(queues) if queues else ()
    if borns is None:
        parts[0::2] = [pack(flags, born, n_cid, n_props, len(p)) + tail for p in payloads]
        messages = tuple(Record(i, each + len(p), flags, born, store_ms, client_id, topic, ids, properties, p)
                         for i, p in enumerate(payloads))
    else:
        times = borns if 0 not in borns else [b or store_ms for b in borns]
        parts[0::2] = [pack(flags, b, n_cid, n_props, len(p)) + tail for b, p in zip(times, payloads)]
        messages = tuple(Record(i, each + len(p), flags, b, store_ms, client_id, topic, ids, properties, p)
                         for i, (b, p) in enumerate(zip(times, payloads)))
    parts[1::2] = payloads
    return _sealed(topic, _COUNT.pack(count) + b"".join(parts), messages, store_ms, queues, ids, max_size, compress)


def _sealed(topic: str, body: bytes, messages: tuple[Record, ...], store_ms: int, queues: bytes,
            ids: tuple[int, ...], max_size: int, compress: bool) -> tuple[bytes, Record]:
    """The batch record of a raw ``body`` and its ``Record``, the body compressed when ``compress`` and it saves
    space (:func:`new_batch`)."""
    flags = FLAG_BATCH
    if compress and HEADER_SIZE + len(topic.encode()) + len(queues) + len(body) <= max_size:
        deflated = _deflate(body)
        if deflated is not None:
            body, flags = deflated, FLAG_BATCH | FLAG_ZSTD
    raw = _encode(topic, body, "", 0, False, b"", queues, store_ms, store_ms, max_size, 0, flags)
    return raw, Record(0, len(raw), flags, store_ms, store_ms, "", topic, ids, b"", b"", 0, messages)


_ZSTD = threading.local()
"""A thread's zstd contexts: one may not be used by two threads at once, and making one costs ~20 us (measured)."""


def _deflate(body: bytes) -> bytes | None:
    """``body`` as one zstd frame (its content size in the header), or None when it is to stay raw: shorter than
    ``ZSTD_MIN_BODY`` or longer than ``ZSTD_MAX_BODY``, or it would save less than an eighth of its bytes (random
    bytes: a 1 KiB message saves 2%, its header's; every read would inflate it for that)."""
    if not ZSTD_MIN_BODY <= len(body) <= ZSTD_MAX_BODY:
        return None
    compressor = getattr(_ZSTD, "compressor", None)
    if compressor is None:
        compressor = _ZSTD.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    deflated = compressor.compress(body)
    return deflated if len(deflated) <= len(body) - len(body) // 8 else None


def _inflate(frame: bytes | memoryview) -> bytes:
    """The body a zstd frame holds.

    Raises:
        CorruptRecord: the frame does not state its content size, states more than ``ZSTD_MAX_BODY``, does not
            inflate to exactly it, or has bytes after it (it passed its CRC: a writer's bug, or a hostile file).
    """
    try:
        size = zstandard.frame_content_size(frame)
        if not 0 <= size <= ZSTD_MAX_BODY:
            raise CorruptRecord(f"a compressed batch body states {size} bytes (at most {ZSTD_MAX_BODY}, -1: none)")
        decompressor = getattr(_ZSTD, "decompressor", None)
        if decompressor is None:
            decompressor = _ZSTD.decompressor = zstandard.ZstdDecompressor()
        return decompressor.decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptRecord(f"a compressed batch body does not inflate: {exc}") from None


def fit_batches(topic: str, items: Sequence[BatchItem], queues: bytes, max_size: int) -> list[Sequence[BatchItem]]:
    """``items`` cut, in order, into the fewest runs whose batch records (:func:`new_batch` with ``queues``) are
    each at most ``max_size`` bytes: greedy, each run as long as fits.

    Raises:
        RecordTooLarge: one item is too large for a batch record of its own.
    """
    room = max_size - (HEADER_SIZE + len(topic.encode()) + len(queues) + _COUNT.size)
    runs: list[Sequence[BatchItem]] = []
    start = used = 0
    for i, m in enumerate(items):
        size = _MESSAGE.size + len(m.client_id.encode()) + len(m.properties) + len(m.payload)
        if size > room:
            raise RecordTooLarge(f"a message of {size} bytes does not fit a batch record of at most {max_size}"
                                 f" bytes (the maximum record size)")
        if used + size > room:
            runs.append(items[start:i])
            start, used = i, 0
        used += size
    runs.append(items[start:])
    return runs


def encode_message(record: Record) -> bytes:
    """A message of a batch record as a record of its own, at its position (a v1 single record with the same
    fields): for readers that take one record per message (POPs over the RPC, the retained store)."""
    return _encode(record.topic, record.payload, record.client_id, record.qos, record.retain, record.properties,
                   encode_queues(record.queues), record.born_ms, record.store_ms, _MAX_U32)


def encode_eos(remaining: int) -> bytes:
    """The end-of-segment marker for a segment with ``remaining`` bytes left (>= EOS_SIZE)."""
    magic = MAGIC_EOS.to_bytes(4, "big")
    return EOS.pack(remaining, crc32c(magic), MAGIC_EOS)


def check_frame(buf: bytes | memoryview, pos: int, limit: int, *, verify_crc: bool = True) -> tuple[int, int]:
    """Validate the framing of the record at ``pos`` without decoding its fields.

    Returns ``(magic, size)``: the record's magic (MAGIC_V1 or MAGIC_EOS) and its
    length. ``(0, 0)`` means the bytes at ``pos`` are zero: nothing was written
    there yet (segments are pre-sized with zeros).

    Raises:
        CorruptRecord: with the reason, when the record overruns ``limit``, has
            an unknown magic, an impossible length or a CRC mismatch. A record
            that overruns ``limit`` at the tail of the log is a torn write.
    """
    if pos + EOS_SIZE > limit:
        if pos + 4 <= limit and bytes(buf[pos : pos + 4]) == b"\0\0\0\0":
            return 0, 0
        raise CorruptRecord(f"{limit - pos} bytes at the end are too short for a record header")
    size, crc, magic = EOS.unpack_from(buf, pos)
    if size == 0:
        return 0, 0
    if magic == MAGIC_EOS:
        if size < EOS_SIZE or pos + size > limit:
            raise CorruptRecord(f"end-of-segment marker claims {size} bytes")
        if verify_crc and crc != crc32c(bytes(buf[pos + 8 : pos + 12])):
            raise CorruptRecord("CRC mismatch in end-of-segment marker")
        return magic, size
    if magic != MAGIC_V1:
        raise CorruptRecord(f"unknown magic 0x{magic:08x}")
    if size < HEADER_SIZE:
        raise CorruptRecord(f"length {size} is shorter than the record header")
    if pos + size > limit:
        raise CorruptRecord(f"record of {size} bytes overruns the readable end by {pos + size - limit} bytes")
    fields = HEADER.unpack_from(buf, pos)
    if HEADER_SIZE + sum(fields[6:]) != size:
        raise CorruptRecord(f"field lengths do not add up to the record length {size}")
    if fields[8] % QUEUE_ID_SIZE or (fields[3] & FLAG_PACKET_ID and not fields[8]):
        raise CorruptRecord(f"target-queues length {fields[8]} is not a whole number of queue ids"
                            + (" and a packet id" if fields[3] & FLAG_PACKET_ID else ""))
    if verify_crc and crc != crc32c(bytes(buf[pos + 8 : pos + size])):
        raise CorruptRecord("CRC mismatch")
    return magic, size


def decode_record(buf: bytes | memoryview, pos: int, offset: int, first: int = 0, stop: int | None = None) -> Record:
    """Decode the (already framed and checked) message record at ``pos``.

    ``offset`` is the record's global CommitLog offset, stored in the result. Of a batch record only the messages
    ``first`` to ``stop - 1`` are made (``messages`` holds those, each at its position): a reader served part of
    a large record (the RPC's claims and pulls) builds no object for the rest, whose bytes are still checked.

    Raises:
        CorruptRecord: the target-queues section or a batch body does not parse (:func:`open_batch`), or
            ``FLAG_ZSTD`` is set on a record that is not a batch.
    """
    (size, _crc, _magic, flags, born_ms, store_ms,
     cid_len, topic_len, queues_len, props_len, payload_len) = HEADER.unpack_from(buf, pos)
    if flags & (FLAG_ZSTD | FLAG_BATCH) == FLAG_ZSTD:
        raise CorruptRecord("the zstd flag is set on a record that is not a batch")
    p = pos + HEADER_SIZE
    cid = bytes(buf[p : p + cid_len]).decode()
    p += cid_len
    topic = bytes(buf[p : p + topic_len]).decode()
    p += topic_len
    ids_len = queues_len
    packet_id = 0
    if flags & FLAG_PACKET_ID:
        if queues_len < _PACKET_ID.size:
            raise CorruptRecord("the packet-id flag is set but the target-queues section is empty")
        ids_len -= _PACKET_ID.size
        (packet_id,) = _PACKET_ID.unpack_from(buf, p + ids_len)
    try:
        queues = decode_queues(bytes(buf[p : p + ids_len])) if ids_len else ()
    except CorruptTargets as exc:
        raise CorruptRecord(str(exc)) from None
    p += queues_len
    props = bytes(buf[p : p + props_len])
    p += props_len
    if flags & FLAG_BATCH:
        messages = _decode_batch(buf, p, payload_len, flags, offset, store_ms, topic, queues, first, stop)
        return Record(offset, size, flags, born_ms, store_ms, cid, topic, queues, props, b"", packet_id, messages)
    payload = bytes(buf[p : p + payload_len])
    return Record(offset, size, flags, born_ms, store_ms, cid, topic, queues, props, payload, packet_id)


def batch_fields(buf: bytes | memoryview, p: int, length: int) -> list[tuple[int, int, int, int, int, int, int, int]]:
    """Where each message of the raw (inflated) batch body of ``length`` bytes at ``p`` is in ``buf``: ``(flags,
    born ms, client id start, its length, properties start, length, payload start, length)`` (the Spark reader takes
    columns so). A stored body may be compressed: readers go through :func:`open_batch`.

    Raises:
        CorruptRecord: the body does not parse to exactly its length (it passed its CRC: a writer's bug).
    """
    end = p + length
    if length < _COUNT.size:
        raise CorruptRecord("a batch record's body is shorter than its message count")
    (count,) = _COUNT.unpack_from(buf, p)
    p += _COUNT.size
    found = []
    unpack = _MESSAGE.unpack_from
    for i in range(count):
        if p + _MESSAGE.size > end:
            raise CorruptRecord(f"a batch record's body ends inside message {i} of {count}")
        flags, born, n_cid, n_props, n_payload = unpack(buf, p)
        q = p + _MESSAGE.size
        p = q + n_cid + n_props + n_payload
        if p > end or flags & ~(QOS_MASK | FLAG_RETAIN) or flags & QOS_MASK == 3:
            raise CorruptRecord(f"message {i} of a batch record overruns its body or has flags 0x{flags:02x}")
        found.append((flags, born, q, n_cid, q + n_cid, n_props, q + n_cid + n_props, n_payload))
    if p != end or not count:
        raise CorruptRecord(f"a batch record's body has {end - p} bytes past its {count} messages")
    return found


def open_batch(buf: bytes | memoryview, p: int, length: int,
               flags: int) -> tuple[bytes | memoryview, list[tuple[int, int, int, int, int, int, int, int]]]:
    """The one way into the stored batch body of ``length`` bytes at ``p`` of a record with ``flags``: the buffer
    its messages are in (``buf``, or the body inflated when ``FLAG_ZSTD`` is set) and their :func:`batch_fields`
    in that buffer. Every reader of batch records comes here (``decode_record``, the Spark reader).

    Raises:
        CorruptRecord: the body does not inflate (:func:`_inflate`) or does not parse (:func:`batch_fields`).
    """
    if flags & FLAG_ZSTD:
        buf = _inflate(memoryview(buf)[p : p + length])
        p, length = 0, len(buf)
    return buf, batch_fields(buf, p, length)


def batch_part(raw: bytes, first: int, stop: int) -> bytes | None:
    """A batch record of messages ``first`` to ``stop - 1`` of the batch record ``raw`` (its topic, target queues
    and store timestamp, its messages' bytes copied as they are, nothing re-encoded), for a reader served fewer
    than half of its messages: a consumer claiming 256 at a time from a record of 11,000 would otherwise get the
    whole MiB each time. None when they are half or more (the record whole costs less than the copy), or when
    its body is compressed (its messages' bytes are not in it, and it is small: what compression is for).

    Raises:
        CorruptRecord: the body does not parse (:func:`batch_fields`).
    """
    (_size, _crc, _magic, flags, _born, store_ms,
     cid_len, topic_len, queues_len, props_len, payload_len) = HEADER.unpack_from(raw, 0)
    p = HEADER_SIZE + cid_len + topic_len + queues_len + props_len
    if flags & FLAG_ZSTD or 2 * (stop - first) >= _COUNT.unpack_from(raw, p)[0]:
        return None
    fields = batch_fields(raw, p, payload_len)
    start = fields[first][2] - _MESSAGE.size
    last = fields[stop - 1]
    topic = bytes(raw[HEADER_SIZE + cid_len : HEADER_SIZE + cid_len + topic_len]).decode()
    queues = bytes(raw[HEADER_SIZE + cid_len + topic_len : p - props_len])
    return _encode(topic, _COUNT.pack(stop - first) + raw[start : last[6] + last[7]], "", 0, False, b"", queues,
                   store_ms, store_ms, _MAX_U32, 0, FLAG_BATCH)


def _decode_batch(buf: bytes | memoryview, p: int, length: int, record_flags: int, offset: int, store_ms: int,
                  topic: str, queues: tuple[int, ...], first: int = 0, stop: int | None = None) -> tuple[Record, ...]:
    """The messages ``first`` to ``stop - 1`` of a stored batch body of ``length`` bytes at ``p`` of a record with
    ``record_flags``, at positions ``offset`` + i (raises as :func:`open_batch`, which parses the whole body)."""
    buf, fields = open_batch(buf, p, length, record_flags)
    served = fields[first:stop]
    if not served:
        return ()
    low = served[0][2]
    body = bytes(buf[low : served[-1][6] + served[-1][7]])  # the served messages' bytes: each slice of it is bytes
    names: dict[bytes, str] = {}  # a batch's messages mostly share one client id: decoded once
    header = _MESSAGE.size
    records: list[Record] = []
    append = records.append
    for i, (flags, born, c, n_cid, q, n_props, d, n_payload) in enumerate(served, first):
        c -= low
        cid = body[c : c + n_cid]
        name = names.get(cid)
        if name is None:
            name = names[cid] = cid.decode()
        q -= low
        d -= low
        append(Record(offset + i, header + n_cid + n_props + n_payload, flags, born, store_ms, name, topic, queues,
                      body[q : q + n_props], body[d : d + n_payload]))
    return tuple(records)
