"""Batch records for tests: ones whose body does not parse although their CRC is right (a writer's bug), and
payloads that compress or do not (docs/storage.md, "Compressed batch bodies")."""

import random

import orjson
from crc32c import crc32c

from store.api import NewMessage
from store.log.record import FLAG_BATCH, FLAG_ZSTD, HEADER_SIZE, encode_record, new_batch


def malformed_batch(topic: str, store_ms: int) -> bytes:
    """A batch record of one message whose body claims five: its frame and CRC are valid, its body is not."""
    raw, _ = new_batch(topic, [NewMessage(topic, b"x")], store_ms)
    at = HEADER_SIZE + len(topic.encode())
    raw = raw[:at] + (5).to_bytes(4, "big") + raw[at + 4:]
    return raw[:4] + crc32c(raw[8:]).to_bytes(4, "big") + raw[8:]


def zstd_batch(topic: str, body: bytes, store_ms: int) -> bytes:
    """A record flagged as a compressed batch (``FLAG_ZSTD``) whose stored body is ``body`` as given (a frame that
    does not inflate, or not to a batch body), with a valid frame and CRC."""
    raw = bytearray(encode_record(topic, body, store_ms=store_ms))
    raw[12] = FLAG_BATCH | FLAG_ZSTD
    raw[4:8] = crc32c(bytes(raw[8:])).to_bytes(4, "big")
    return bytes(raw)


def readings(count: int, seed: int = 0) -> list[bytes]:
    """Telemetry JSON payloads of a few devices, about 80 bytes each: a batch of a few compresses to a fraction."""
    rng = random.Random(seed)
    return [orjson.dumps({"device": f"dev-{i % 7:03d}", "seq": i, "ts": 1_767_225_600_000 + i * 10,
                          "temperature": round(rng.gauss(21, 0.5), 2), "humidity": round(rng.gauss(45, 2), 1)})
            for i in range(count)]


def noise(count: int, size: int, seed: int = 0) -> list[bytes]:
    """Random payloads of ``size`` bytes: a batch of them stays raw (it would save less than an eighth)."""
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(count)]
