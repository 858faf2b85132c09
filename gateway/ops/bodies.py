"""The request bodies of the admin HTTP API, as msgspec structs: one declaration validates, decodes and documents.

Unknown fields are refused (``forbid_unknown_fields``): a misspelt option such
as ``"retained": true`` is a 400 that names it, never a message published
without it. msgspec's error says which field and why (``at `$.qos```), and the
same structs give the OpenAPI schemas (gateway/ops/openapi.py).
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

__all__ = ["BodyError", "PublishBody", "decode_body"]

T = TypeVar("T")


class PublishBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One message to publish (``POST /api/v1/publish``)."""

    topic: str
    payload: str = ""  # text sent as UTF-8, or base64 with encoding "base64"
    encoding: Literal["utf-8", "base64"] = "utf-8"
    qos: Literal[0, 1, 2] = 0
    retain: bool = False


class BodyError(ValueError):
    """The body is not JSON, or not the struct; the message says which field and why."""


def decode_body(body: bytes, type: type[T]) -> T:
    """``body`` decoded as ``type``.

    Raises:
        BodyError: not JSON ("the body is not JSON: ..."), or a field missing, unknown or of the wrong type.
    """
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise BodyError(f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"the body is not JSON: {exc}") from None
