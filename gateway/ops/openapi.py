"""The OpenAPI 3.1 document of the admin endpoint, built from its route table and msgspec's JSON Schemas.

The schemas come from the very types the routes decode and answer with (the
request structs of gateway/ops/bodies.py, the node's records), through
``msgspec.json.schema_components``, so the document cannot drift from what the
endpoint validates; tests/gateway/ops/test_admin.py checks that its paths are
exactly the routes the endpoint answers. msgspec writes JSON Schema 2020-12,
which is OpenAPI 3.1's schema dialect.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from gateway.ops.bodies import ErrorBody

__all__ = ["OPENAPI_VERSION", "Operation", "openapi_document"]

OPENAPI_VERSION = "3.1.0"
"""3.1: its schemas are JSON Schema 2020-12, what msgspec generates (3.0 has a dialect of its own)."""

REF_TEMPLATE = "#/components/schemas/{name}"

_PARAMETER = re.compile(r"\{(\w+)\}")

SECURITY: dict[str, list[dict[str, list[str]]]] = {
    "token": [{"adminToken": []}],
    "basic": [{"mqttUser": []}, {}],  # anonymous when auth.allow_anonymous
    "none": [],
}

SECURITY_SCHEMES = {
    "adminToken": {"type": "http", "scheme": "bearer",
                   "description": "admin.token; needed only when one is set"},
    "mqttUser": {"type": "http", "scheme": "basic",
                 "description": "a user of the password file, checked like an MQTT CONNECT"},
}


@dataclass(frozen=True, slots=True)
class Operation:
    """One method of one route, as the document describes it.

    ``answer``: the type of the 200 answer's JSON (a msgspec struct, a dataclass, ``list[...]``), or None for a
    free-form JSON object; ``content_type`` other than JSON: the answer is that media type (a string).
    """

    summary: str
    auth: Literal["token", "basic", "none"] = "token"
    body: type | None = None
    answer: Any = None
    content_type: str = "application/json"
    query: tuple[tuple[str, str], ...] = ()  # optional query parameters: (name, description)


def openapi_document(operations: Mapping[tuple[str, str], Operation], *, title: str, version: str,
                     description: str = "") -> dict[str, Any]:
    """The OpenAPI document of ``operations``, keyed ``(path template, method)``; ``{name}`` in a path template is a
    path parameter."""
    types = [t for op in operations.values() for t in (op.body, op.answer) if t is not None]
    schemas, components = msgspec.json.schema_components([ErrorBody, *types], ref_template=REF_TEMPLATE)
    schema_of = dict(zip([ErrorBody, *types], schemas))
    paths: dict[str, dict[str, Any]] = {}
    for (path, method), op in sorted(operations.items()):
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"},
                       "description": "percent-encoded"} for name in _PARAMETER.findall(path)]
        parameters += [{"name": name, "in": "query", "required": False, "schema": {"type": "string"},
                        "description": text} for name, text in op.query]
        if op.content_type == "application/json":
            answer = schema_of[op.answer] if op.answer is not None else {"type": "object"}
        else:
            answer = {"type": "string"}
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path).rstrip('_')}",
            "security": SECURITY[op.auth],
            "responses": {
                "200": {"description": "OK", "content": {op.content_type: {"schema": answer}}},
                "default": {"description": "an error: the status says which kind",
                            "content": {"application/json": {"schema": schema_of[ErrorBody]}}},
            },
        }
        if parameters:
            entry["parameters"] = parameters
        if op.body is not None:
            entry["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema_of[op.body]}}}
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": SECURITY_SCHEMES},
    }
