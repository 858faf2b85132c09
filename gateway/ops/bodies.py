"""The request bodies of the admin HTTP API, as msgspec structs: one declaration validates, decodes and documents.

(The answers of the publish routes and the error body are declared here too, for the OpenAPI document only.)

Unknown fields are refused (``forbid_unknown_fields``): a misspelt option such
as ``"retained": true`` is a 400 that names it, never a message published
without it. msgspec's error says which field and why (``at `$.qos```), and the
same structs give the OpenAPI schemas (gateway/ops/openapi.py).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

__all__ = [
    "MAX_BULK_MESSAGES", "BodyError", "BulkOutcome", "BulkPublishBody", "BulkResult", "ErrorBody", "PublishBody",
    "PublishProperties", "Published", "decode_body",
]

T = TypeVar("T")


MAX_BULK_MESSAGES = 1000
"""Messages in one bulk publish: they go in one append, but one refused whole makes each go again alone (each
flushed under the sync flush policy), so a request this long still answers within seconds; the body limit
(2 x ``mqtt.max_packet_size``) bounds the bytes."""

MqttString = Annotated[str, msgspec.Meta(max_length=65535)]
"""An MQTT UTF-8 string (at most 65535 bytes: checked as characters here, as bytes when the message is built)."""


class PublishProperties(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The MQTT 5 PUBLISH properties an HTTP publish may set; MQTT 5 subscribers receive them as sent."""

    payload_format_indicator: Literal[0, 1] | None = None  # 1: the payload is UTF-8 text (checked)
    message_expiry_interval: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)] | None = None  # seconds
    content_type: MqttString | None = None
    response_topic: MqttString | None = None  # a topic name (no wildcards)
    correlation_data: str | None = None  # base64
    user_properties: list[tuple[MqttString, MqttString]] = []  # [name, value] pairs, in order; names may repeat


class PublishBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One message to publish (``POST /api/v1/publish``, or one of a bulk publish's)."""

    topic: str
    payload: str = ""  # text sent as UTF-8, or base64 with encoding "base64"
    encoding: Literal["utf-8", "base64"] = "utf-8"
    qos: Literal[0, 1, 2] = 0
    retain: bool = False
    properties: PublishProperties | None = None
    delay_s: Annotated[int, msgspec.Meta(ge=0)] | None = None  # deliver this many seconds from now (store/timer/)
    deliver_at: Annotated[int, msgspec.Meta(ge=0)] | None = None  # ... or at this time, ms since the epoch


class BulkPublishBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Many messages in one request (``POST /api/v1/publish/bulk``), published and answered in order."""

    messages: Annotated[list[PublishBody], msgspec.Meta(min_length=1, max_length=MAX_BULK_MESSAGES)]


class Published(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a publish stored (the answer of ``POST /api/v1/publish``)."""

    topic: str
    qos: int
    retain: bool
    bytes: int  # the payload's length
    deliver_at: int | None = None  # a delayed message: when it is due, ms since the epoch
    id: str | None = None  # a delayed message: its id (``DELETE /api/v1/delayed/{id}`` cancels it)


class BulkOutcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """One message's answer in a bulk publish: ``status`` 200 and what was stored, or the status and ``error``
    a single publish would have answered."""

    status: int
    topic: str
    qos: int | None = None
    retain: bool | None = None
    bytes: int | None = None
    error: str | None = None
    id: str | None = None  # a delayed message: its id


class BulkResult(msgspec.Struct, frozen=True):
    """The answer of ``POST /api/v1/publish/bulk``: one outcome per message, in the order sent."""

    results: list[BulkOutcome]


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error answer (4xx, 5xx) of the admin endpoint."""

    error: str


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
