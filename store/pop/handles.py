"""Receipt handles: what a POP gives with each message, opaque to the client, naming the message and its hand-out.

A handle is ``(group, queue, queue offset, checkpoint)``, the checkpoint being the CommitLog offset of the
``PopCheckpoint`` record that handed the message out: an ack or a change of invisible time by a handle whose
checkpoint no longer holds the message (it was revived and handed out again, or its invisible time changed) is
stale, and answered so. Encoded as URL-safe base64 of a msgpack array, so it travels as text (an HTTP header, a
JSON field).
"""

from __future__ import annotations

import base64
import binascii
from typing import NamedTuple

import msgspec

__all__ = ["Handle", "decode_handle", "encode_handle"]

MAX_HANDLE = 4096
"""A longer text is not a handle (group and queue are topic-sized): decoding stays bounded."""


class Handle(NamedTuple):
    group: str
    queue: str
    offset: int
    ck: int


_DECODER = msgspec.msgpack.Decoder(tuple[str, str, int, int])


def encode_handle(handle: Handle) -> str:
    return base64.urlsafe_b64encode(msgspec.msgpack.encode(tuple(handle))).rstrip(b"=").decode()


def decode_handle(text: str) -> Handle:
    """The handle ``text`` encodes.

    Raises:
        ValueError: not a receipt handle.
    """
    try:
        if len(text) > MAX_HANDLE:
            raise ValueError
        return Handle(*_DECODER.decode(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))))
    except (ValueError, binascii.Error, msgspec.DecodeError):
        raise ValueError(f"not a receipt handle: {text[:40]!r}") from None
