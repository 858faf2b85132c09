"""An etcd v3 client over its JSON gateway (``/v3/...``, etcd 3.4), for trio, through httpx.

The gateway speaks JSON with base64 keys and values; this client hides both: keys are ``str``, values ``bytes``.
It is given every member's client URL and moves to the next one when one does not answer (refused, reset, timed
out, or answering 5xx / gRPC UNAVAILABLE), so an etcd of 3 members serves it through the loss of one. Every call
has a timeout: an etcd that hangs (a frozen process, a member without quorum) costs a timeout per member, never a
hung store.

Resource handling: :meth:`EtcdClient.open` owns one ``httpx.AsyncClient`` and closes it on exit; a watch owns its
streaming response and closes it when the iterator is closed or left.

Error handling: no member answering raises :class:`EtcdUnavailable`, naming each endpoint and why it failed; an
answer that is an error (a bad request, a lease that is gone) raises :class:`EtcdError` with etcd's message and
gRPC code.

httpx is imported when a client opens, not with this module: ``import httpx`` also loads its command line's
click, rich and pygments when they are installed (the bench extra has rich), which a process that never talks
to etcd (an embedded node, the base-dependency test walking every module) should not load.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import httpx

CALL_TIMEOUT_S = 2.0
"""The default budget of one call to one member: above a healthy etcd's commit (fsync + a network round trip),
below the 3 s etcd lease a replica holds, so a hung member is left for the next while the lease still holds."""

GRPC_UNAVAILABLE = 14  # gRPC's code for "try again elsewhere" (no leader, shutting down): the next member may answer
GRPC_NOT_FOUND = 5

CompareTarget = Literal["value", "version", "mod", "create", "lease"]
_TARGETS = {"value": ("VALUE", "value"), "version": ("VERSION", "version"), "mod": ("MOD", "mod_revision"),
            "create": ("CREATE", "create_revision"), "lease": ("LEASE", "lease")}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", ">": "GREATER", "<": "LESS"}


class EtcdError(Exception):
    """etcd answered with an error (``code`` is its gRPC status code)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered; the message lists each endpoint tried and its failure."""


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: ``key``'s ``target`` compared (``op``) with ``value``.

    A key that does not exist has version, create and mod revision 0 (``Compare(key, "create", "==", 0)`` is
    "absent"); ``value`` is bytes for the ``value`` target and an int (a lease id for ``lease``) otherwise.
    """

    key: str
    target: CompareTarget
    op: Literal["==", "!=", ">", "<"]
    value: bytes | int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change of one key: ``value`` is the new value (``b""`` for a delete)."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` that makes a range of every key starting with ``prefix`` (the prefix's last byte + 1)."""
    end = bytearray(prefix.encode())
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def _range(key: str, prefix: bool) -> dict[str, str]:
    return {"key": _b64(key), **({"range_end": _b64(prefix_end(key))} if prefix else {})}


def _compare(compare: Compare) -> dict[str, Any]:
    target, field = _TARGETS[compare.target]
    value = _b64(compare.value) if compare.target == "value" else str(compare.value)
    return {"target": target, "key": _b64(compare.key), "result": _RESULTS[compare.op], field: value}


def _op(op: Put | Delete) -> dict[str, Any]:
    if isinstance(op, Put):
        return {"request_put": {"key": _b64(op.key), "value": _b64(op.value), "lease": str(op.lease)}}
    return {"request_delete_range": _range(op.key, op.prefix)}


class EtcdClient:
    """The calls LightGate makes of etcd, over ``endpoints`` (``http://host:port``), failing over between them."""

    def __init__(self, http: httpx.AsyncClient, endpoints: Sequence[str], timeout_s: float) -> None:
        import httpx  # here, not at the top: see the module docstring

        if not endpoints:
            raise ValueError("etcd: no endpoints given")
        self._http = http
        self._httpx = httpx
        self.endpoints = tuple(url.rstrip("/") for url in endpoints)
        self.timeout_s = timeout_s
        self._current = 0  # the member that answered last: asked first

    @classmethod
    @asynccontextmanager
    async def open(cls, endpoints: Sequence[str], timeout_s: float = CALL_TIMEOUT_S) -> AsyncIterator[EtcdClient]:
        import httpx  # here, not at the top: see the module docstring

        async with httpx.AsyncClient(timeout=timeout_s) as http:
            yield cls(http, endpoints, timeout_s)

    def _order(self) -> list[int]:
        count = len(self.endpoints)
        return [(self._current + step) % count for step in range(count)]

    async def call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/kv/range``...) on the first member that answers; its JSON answer."""
        failures = []
        for index in self._order():
            url = self.endpoints[index] + path
            try:
                response = await self._http.post(url, json=body, timeout=timeout_s or self.timeout_s)
            except self._httpx.HTTPError as exc:
                failures.append(f"{self.endpoints[index]}: {type(exc).__name__} {exc}".rstrip())
                continue
            answer = _json(response)
            code = int(answer.get("code", 0))
            if response.status_code >= 500 or code == GRPC_UNAVAILABLE:
                failures.append(f"{self.endpoints[index]}: HTTP {response.status_code} {answer.get('message', '')}")
                continue
            self._current = index
            if response.status_code != 200 or "error" in answer:
                raise EtcdError(f"etcd {path}: {answer.get('message') or answer.get('error') or response.text}", code)
            return answer
        raise EtcdUnavailable(f"etcd {path}: no endpoint answered ({'; '.join(failures)})")

    async def get(self, key: str) -> tuple[bytes | None, int]:
        """``key``'s value (None when absent) and its mod revision (0 when absent)."""
        answer = await self.call("/v3/kv/range", _range(key, False))
        kvs = answer.get("kvs") or []
        if not kvs:
            return None, 0
        return _unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"])

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` with its value, and the store's revision they were read at."""
        answer = await self.call("/v3/kv/range", _range(prefix, True))
        values = {_unb64(kv["key"]).decode(): _unb64(kv.get("value")) for kv in answer.get("kvs") or []}
        return values, int(answer["header"]["revision"])

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key`` (attached to ``lease`` when not 0); the revision of the write."""
        answer = await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})
        return int(answer["header"]["revision"])

    async def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (every key under it with ``prefix``); how many keys were deleted."""
        answer = await self.call("/v3/kv/deleterange", _range(key, prefix))
        return int(answer.get("deleted", 0))

    async def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
                  failure: Sequence[Put | Delete] = ()) -> tuple[bool, list[dict[str, Any]]]:
        """If every compare holds run ``success``, else ``failure``, atomically; whether they held, and the
        answers of the operations run (etcd's ``response_put`` / ``response_delete_range`` objects)."""
        answer = await self.call("/v3/kv/txn", {"compare": [_compare(c) for c in compares],
                                                "success": [_op(op) for op in success],
                                                "failure": [_op(op) for op in failure]})
        return bool(answer.get("succeeded", False)), list(answer.get("responses") or [])

    async def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of ``ttl_s`` seconds: its id and the TTL etcd granted."""
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"]), int(answer["TTL"])

    async def lease_keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        """Renew ``lease``; its TTL now (0 when etcd no longer has it: the lease ended)."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s)
        return int(answer.get("result", {}).get("TTL", 0))

    async def lease_revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting every key attached to it; a lease already gone is not an error."""
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.code != GRPC_NOT_FOUND:
                raise

    async def watch(self, key: str, start_revision: int, prefix: bool = False) -> AsyncIterator[WatchEvent]:
        """Every change of ``key`` (of every key under it with ``prefix``) from ``start_revision`` on, as it comes.

        A member that fails mid-watch is left for the next one, resuming after the last revision seen; the watch
        raises :class:`EtcdUnavailable` when no member serves it, and :class:`EtcdError` when the revisions asked
        for were compacted away (read the state again, then watch from its revision).
        """
        failures: list[str] = []
        while len(failures) < len(self.endpoints):
            index = self._order()[0]
            request = {"create_request": {**_range(key, prefix), "start_revision": str(start_revision)}}
            try:
                async with self._http.stream("POST", self.endpoints[index] + "/v3/watch", json=request,
                                             timeout=self._httpx.Timeout(self.timeout_s, read=None)) as response:
                    async for line in response.aiter_lines():
                        result = _json_line(line).get("result", {})
                        if int(result.get("compact_revision", 0)):
                            raise EtcdError(f"etcd watch of {key}: revision {start_revision} was compacted")
                        for event in result.get("events") or []:
                            change = _event(event)
                            start_revision = change.mod_revision + 1
                            failures.clear()
                            yield change
            except self._httpx.HTTPError as exc:
                failures.append(f"{self.endpoints[index]}: {type(exc).__name__} {exc}".rstrip())
            else:
                failures.append(f"{self.endpoints[index]}: the watch stream ended")
            self._current = (index + 1) % len(self.endpoints)
        raise EtcdUnavailable(f"etcd watch of {key}: no endpoint answered ({'; '.join(failures)})")


def _event(event: dict[str, Any]) -> WatchEvent:
    kv = event["kv"]
    return WatchEvent("delete" if event.get("type") == "DELETE" else "put", _unb64(kv["key"]).decode(),
                      _unb64(kv.get("value")), int(kv["mod_revision"]))


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = response.json()
    except ValueError:
        return {"message": response.text[:200]}
    return answer if isinstance(answer, dict) else {"message": str(answer)[:200]}


def _json_line(line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line) if line.strip() else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
