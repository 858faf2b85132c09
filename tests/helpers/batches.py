"""Batch records for tests: one whose body does not parse although its CRC is right (a writer's bug)."""

from crc32c import crc32c

from store.api import NewMessage
from store.log.record import HEADER_SIZE, new_batch


def malformed_batch(topic: str, store_ms: int) -> bytes:
    """A batch record of one message whose body claims five: its frame and CRC are valid, its body is not."""
    raw, _ = new_batch(topic, [NewMessage(topic, b"x")], store_ms)
    at = HEADER_SIZE + len(topic.encode())
    raw = raw[:at] + (5).to_bytes(4, "big") + raw[at + 4:]
    return raw[:4] + crc32c(raw[8:]).to_bytes(4, "big") + raw[8:]
