"""The admin HTTP endpoint of a gateway node: metrics, health, the admin JSON API, HTTP publish, the dashboard.

HTTP/1.1 is h11's (sans-IO, as our MQTT codec is): this module owns the
sockets (trio), the routes and the JSON. Connections are kept alive; request
heads are bounded by h11 (``MAX_HEAD_BYTES``), bodies by ``max_body`` (413);
every error is a JSON ``{"error": ...}`` with the status saying what kind.

What a connection may cost is bounded: at most ``max_connections`` are open
at once, and when a new one comes at the limit the one waiting longest on its
client is closed to make room (gateway/ops/slots.py): only as many requests
being answered at once make a new connection get 503, so idle connections never
make a healthy node's ``/healthz`` and ``/metrics`` fail. A new connection must
send its request head within ``header_timeout_s`` (``admin.header_timeout_s``)
of being accepted; a kept-alive one with no byte of a new request for
``IDLE_TIMEOUT_S`` is closed, and its next head must arrive within
``header_timeout_s`` of its first byte; a body within ``REQUEST_TIMEOUT_S``
of its head, and a response must be taken within ``SEND_TIMEOUT_S``,
so slow clients (slowloris) cannot hold connections, descriptors and buffers.
A connection buffers at most one read (``RECEIVE_BYTES``) beyond a head of
``MAX_HEAD_BYTES``, and a body of ``max_body``.

Routes (docs/operations.md has the reference with curl examples):

- ``GET /metrics`` (Prometheus text), ``GET /healthz`` (the process answers),
  ``GET /readyz`` (the store answers and the MQTT listener is up; else 503 and
  why): never need a token, so probes and scrapers need no secret.
- ``GET /api/openapi.json``: the OpenAPI 3.1 document of these routes (gateway/ops/openapi.py), open like the probes.
- ``GET /`` the dashboard page (it holds no data; its polls of
  ``/api/v1/overview`` and the views' endpoints carry the token).
- ``/api/v1/...`` clients, sessions, queues, nodes, retained messages, overview:
  the bearer token ``admin.token`` when one is set. In a cluster, the calls
  about one client (``/clients/{id}``, ``/sessions/{id}``) reach the node it
  is connected to, whichever gateway node is asked (through the store), and
  the lists (``/clients``, ``/sessions``, ``/queues``) are the whole cluster's
  (gateway/ops/clusterlists.py); ``/nodes`` lists the deployment's nodes with
  their CPU and memory (gateway/ops/nodes.py). ``/delayed`` pages through the store's pending delayed messages
  (by topic, by client id) and ``DELETE /delayed/{id}`` cancels one: the store holds them, so any node answers.
- ``POST /api/v1/publish`` (one message, MQTT 5 properties included) and
  ``POST /api/v1/publish/bulk`` (many, in one append, answered in order): authenticated like
  an MQTT client (HTTP Basic with the password file's users, or anonymous when
  allowed) and checked against the ACL's publish rules; it is not an admin
  action, so the token plays no part. Bodies are gateway/ops/bodies.py's structs.

The node's ``Administration`` (gateway/ops/administration.py) answers with the records of
gateway/ops/records.py: frozen dataclasses that orjson writes as JSON objects.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, final
from urllib.parse import parse_qsl, unquote

import h11
import msgspec
import orjson
import trio

from gateway.node.accept import CapacityLog, serve_accepting
from gateway.mqtt.properties import PacketType, Properties, encode_properties
from gateway.mqtt.reasons import LocalProtocolError
from gateway import __version__
from gateway.ops.bodies import (
    BodyError,
    BulkOutcome,
    BulkPublishBody,
    BulkResult,
    PublishBody,
    Published,
    decode_body,
)
from gateway.node.binding import naming_the_address
from gateway.ops.clusterlists import cluster_clients, cluster_queues, cluster_sessions
from gateway.ops.listing import ClientQuery, QueryError
from gateway.ops.metrics import CONTENT_TYPE
from gateway.ops.openapi import Operation, openapi_document
from gateway.ops.nodes import CpuShares, cluster_nodes
from gateway.ops.administration import HttpPublish
from gateway.ops.records import (ClientInfo, DeadLetters, DelayedInfo, DelayedList, NodeInfo, QueueInfo, Redriven,
                                 SessionInfo)
from gateway.ops.slots import Slot, Slots
from gateway.mqtt.reasons import ReasonCode
from lightqueue.topics import TopicError, validate_topic
from store.api import Position

if TYPE_CHECKING:
    from gateway.ops.administration import Administration
    from gateway.ops.metrics import NodeMetrics
    from store.api import ReplicationStatistics

__all__ = [
    "AdminApi",
    "HttpError",
    "Request",
    "Routes",
    "Response",
    "serve_admin",
]

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers together: an admin call needs a few hundred bytes; h11 answers more with 431."""

RECEIVE_BYTES = 64 * 1024
"""One ``receive_some`` reads up to this much."""

IDLE_TIMEOUT_S = 60.0
"""A kept-alive connection with no byte of a new request for this long is closed (Prometheus scrapes every 15-60 s)."""

HEADER_TIMEOUT_S = 5.0
"""The default of ``admin.header_timeout_s``: a new connection's request line and headers must arrive within this
of the accept, a kept-alive one's within this of their first byte (a few hundred bytes that a probe or a scraper
sends at once; a connection that sends nothing, or slowloris one byte at a time, is closed)."""

REQUEST_TIMEOUT_S = 30.0
"""A request's body must arrive whole within this of its head, so a slow sender cannot hold a connection and its
buffer forever."""

SEND_TIMEOUT_S = 30.0
"""A response must be taken by the client within this: one that never reads would hold the connection forever."""

REFUSAL_LOG_INTERVAL_S = 10.0
"""Connections at ``max_connections`` (idle ones closed to make room, new ones refused) are logged at most once
per this (with the counts since the last line)."""

LINGER_S = 2.0
"""After an error answer that leaves the request unread (413, 400) the rest is read and dropped for up to this long
before the close: closing with unread bytes makes the kernel reset the connection, and the client loses the answer."""

READY_TIMEOUT_S = 2.0
"""``/readyz``: a store that has not answered ``statistics()`` within this is not ready."""

OVERVIEW_CLIENTS = 100
"""Connected clients listed in ``/api/v1/overview`` (the dashboard's table); ``/api/v1/clients`` lists all."""

OVERVIEW_TOP = 10
"""Sessions and queues in the dashboard's "top lagging" tables."""

TOTAL_HEADER = "x-total-count"
"""The header of ``GET /api/v1/clients`` that counts every client the search matched (the body is one page)."""

MISSING_HEADER = "x-missing-nodes"
"""The header of a cluster-wide list that names the gateway nodes that did not answer (the list lacks theirs)."""

DELAYED_PAGE = 100
"""Pending delayed messages one page of ``GET /api/v1/delayed`` holds unless ``limit`` says otherwise."""

MAX_DELAYED_PAGE = 1000
"""The largest ``limit`` of ``GET /api/v1/delayed``: each message's record is read for the page."""

JSON = "application/json"
DASHBOARD = Path(__file__).with_name("dashboard.html")


# --- HTTP -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request as the routes see it; header names are lower case."""

    method: str
    path: str  # percent-encoded, as sent
    query: Mapping[str, str]
    headers: Mapping[str, str]
    body: bytes
    peer_host: str


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = JSON
    headers: tuple[tuple[str, str], ...] = ()


class Routes(Protocol):
    """What ``serve_admin`` serves: the admin endpoint (``AdminApi``), or a store replica's (gateway/ops/replica.py)."""

    async def handle(self, request: Request) -> Response:
        """Answer one request; never raises for a bad request."""


class HttpError(Exception):
    """Answer the request with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status, orjson.dumps(value))


Handler = Callable[[Request, str], Awaitable[Response]]
"""A route's method handler: the request and the percent-decoded rest of the path (empty for exact routes)."""


PATH_PARAMETERS = {"/api/v1/clients/": "client_id", "/api/v1/sessions/": "client_id", "/api/v1/retained/": "topic",
                   "/api/v1/delayed/": "id", "/api/v1/dlq/": "group"}
"""The name of what follows each prefixed route (its path parameter in the OpenAPI document)."""

OPENAPI_PATH = "/api/openapi.json"

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/", "GET"): Operation("the dashboard page", "none", content_type="text/html; charset=utf-8"),
    ("/metrics", "GET"): Operation("Prometheus metrics (text exposition format)", "none", content_type=CONTENT_TYPE),
    ("/healthz", "GET"): Operation("the process answers", "none"),
    ("/readyz", "GET"): Operation("the store answers and the MQTT listener is up (else 503 and why)", "none"),
    (OPENAPI_PATH, "GET"): Operation("this document", "none"),
    ("/api/v1/overview", "GET"): Operation("what the dashboard polls: counts, traffic, store, its replicated group, lag,"
                                           " auth failures"),
    ("/api/v1/clients", "GET"): Operation("the connected clients", answer=list[ClientInfo]),
    ("/api/v1/clients/{client_id}", "GET"): Operation("one connected client, on whichever node it is connected to",
                                                      answer=ClientInfo),
    ("/api/v1/clients/{client_id}", "DELETE"): Operation("disconnect a client (MQTT 5: DISCONNECT 0x98)"),
    ("/api/v1/sessions", "GET"): Operation("the sessions this node knows, with their lag", answer=list[SessionInfo]),
    ("/api/v1/sessions/{client_id}", "GET"): Operation("one session", answer=SessionInfo),
    ("/api/v1/sessions/{client_id}", "DELETE"): Operation("end a session now (its client is disconnected first)"),
    ("/api/v1/queues", "GET"): Operation("the queues this node's sessions read, with their lag",
                                         answer=list[QueueInfo]),
    ("/api/v1/nodes", "GET"): Operation("the nodes of the deployment: role, pid, CPU share, resident memory",
                                        answer=list[NodeInfo]),
    ("/api/v1/retained", "GET"): Operation("retained messages matching a filter", answer=list[dict[str, Any]],
                                           query=(("filter", "a topic filter, default #"),)),
    ("/api/v1/retained/{topic}", "GET"): Operation("the retained message of a topic ('/' may stay unencoded)"),
    ("/api/v1/retained/{topic}", "DELETE"): Operation("delete the retained message of a topic"),
    ("/api/v1/delayed", "GET"): Operation(
        "a page of the pending delayed messages, oldest scheduled first", answer=DelayedList,
        query=(("topic", "only those going to this topic"), ("client_id", "only those of this publisher"),
               ("limit", f"at most this many (1..{MAX_DELAYED_PAGE}, default {DELAYED_PAGE})"),
               ("cursor", "the previous page's cursor: the page after it"))),
    ("/api/v1/delayed/{id}", "DELETE"): Operation("cancel a pending delayed message: it is never delivered"),
    ("/api/v1/dlq/{group}", "GET"): Operation("the dead letters of a POP group ($dlq/<group>), with where each came "
                                              "from", answer=DeadLetters,
                                              query=(("from", "queue offset to start at, default 0"),
                                                     ("limit", "at most this many, default 100"))),
    ("/api/v1/dlq/{group}", "POST"): Operation("re-drive a POP group's dead letters not re-driven yet: appended back to "
                                               "their original topics", answer=Redriven,
                                               query=(("limit", "at most this many, default 1000"),)),
    ("/api/v1/publish", "POST"): Operation("publish one message, as the HTTP Basic user (or anonymous)", "basic",
                                           body=PublishBody, answer=Published),
    ("/api/v1/publish/bulk", "POST"): Operation("publish many messages in order, each answered", "basic",
                                                body=BulkPublishBody, answer=BulkResult),
}
"""What the OpenAPI document says of each route (path template, method); AdminApi.routes() must match it."""


@final
class AdminApi:
    """The routes of the admin endpoint over one node.

    Args:
        admin: the node's administration, which answers.
        metrics: renders ``/metrics``.
        token: the bearer token ``/api/v1`` requires (empty: none).

    ``mqtt_ready`` is set by whoever starts the MQTT listener, once it listens.
    """

    def __init__(self, admin: Administration, metrics: NodeMetrics, *, token: str = "") -> None:
        self.admin = admin
        self.metrics = metrics
        self.mqtt_ready = False
        self._token = token.encode()
        self._dashboard = DASHBOARD.read_bytes()
        self._cpu_shares = CpuShares()  # the cluster view's previous look at each node's CPU time
        self._openapi = orjson.dumps(openapi_document(OPERATIONS, title="LightGate admin API", version=__version__,
                                                      description="docs/operations.md has the reference"))
        self._exact: dict[str, dict[str, Handler]] = {
            "/": {"GET": self._dashboard_page},
            "/metrics": {"GET": self._metrics},
            "/healthz": {"GET": self._healthz},
            "/readyz": {"GET": self._readyz},
            OPENAPI_PATH: {"GET": self._openapi_document},
            "/api/v1/overview": {"GET": self._overview},
            "/api/v1/clients": {"GET": self._clients},
            "/api/v1/sessions": {"GET": self._sessions},
            "/api/v1/queues": {"GET": self._queues},
            "/api/v1/nodes": {"GET": self._nodes},
            "/api/v1/retained": {"GET": self._retained},
            "/api/v1/delayed": {"GET": self._delayed},
            "/api/v1/publish": {"POST": self._publish},
            "/api/v1/publish/bulk": {"POST": self._publish_bulk},
        }
        self._prefixed: dict[str, dict[str, Handler]] = {
            "/api/v1/clients/": {"GET": self._client, "DELETE": self._disconnect},
            "/api/v1/sessions/": {"GET": self._session, "DELETE": self._delete_session},
            "/api/v1/retained/": {"GET": self._retained_one, "DELETE": self._delete_retained},
            "/api/v1/delayed/": {"DELETE": self._cancel_delayed},
            "/api/v1/dlq/": {"GET": self._dead_letters, "POST": self._redrive},
        }
        self._open = {"/", "/metrics", "/healthz", "/readyz", OPENAPI_PATH,  # no admin token needed
                      "/api/v1/publish", "/api/v1/publish/bulk"}

    def routes(self) -> set[tuple[str, str]]:
        """(path template, method) of every route this endpoint answers: what ``OPERATIONS`` must describe."""
        exact = {(path, method) for path, handlers in self._exact.items() for method in handlers}
        return exact | {(prefix + "{" + PATH_PARAMETERS[prefix] + "}", method)
                        for prefix, handlers in self._prefixed.items() for method in handlers}

    async def handle(self, request: Request) -> Response:
        """Answer one request; never raises for a bad request (errors become 4xx/5xx JSON responses)."""
        try:
            handlers, rest, route = self._route(request.path)
            handler = handlers.get(request.method)
            if handler is None:
                raise HttpError(405, f"{request.method} is not allowed on {request.path}",
                                (("allow", ", ".join(handlers)),))
            if route not in self._open:
                self._check_token(request)
            return await handler(request, rest)
        except HttpError as err:
            return Response(err.status, orjson.dumps({"error": err.message}), headers=err.headers)
        except OSError as exc:  # the store (or, in a cluster, the node that has the client) did not answer
            LOGGER.warning("admin request failed: %s", exc, extra={"ctx": {"method": request.method,
                                                                             "path": request.path}})
            return Response(503, orjson.dumps({"error": f"the store did not answer: {exc}"}))
        except Exception as exc:  # a failing route must not take the endpoint down; the client gets the reason
            LOGGER.error("admin request failed: %r", exc, exc_info=exc,
                         extra={"ctx": {"method": request.method, "path": request.path}})
            return Response(500, orjson.dumps({"error": f"internal error: {exc!r}"}))

    def _route(self, path: str) -> tuple[dict[str, Handler], str, str]:
        handlers = self._exact.get(path)
        if handlers is not None:
            return handlers, "", path
        for prefix, handlers in self._prefixed.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                try:
                    return handlers, unquote(path[len(prefix):], errors="strict"), prefix
                except UnicodeDecodeError:
                    raise HttpError(400, f"the path is not percent-encoded UTF-8: {path}") from None
        raise HttpError(404, f"no such resource: {path}")

    def _check_token(self, request: Request) -> None:
        if not self._token:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.strip().encode(), self._token):
            raise HttpError(401, "this admin API needs its bearer token (admin.token)",
                            (("www-authenticate", 'Bearer realm="lightgate"'),))

    # --- open routes --------------------------------------------------------------------

    async def _dashboard_page(self, request: Request, rest: str) -> Response:
        return Response(200, self._dashboard, "text/html; charset=utf-8")

    async def _metrics(self, request: Request, rest: str) -> Response:
        return Response(200, await self.metrics.exposition(), CONTENT_TYPE)

    async def _openapi_document(self, request: Request, rest: str) -> Response:
        return Response(200, self._openapi)

    async def _healthz(self, request: Request, rest: str) -> Response:
        return json_response({"status": "ok"})

    async def _readyz(self, request: Request, rest: str) -> Response:
        if not self.mqtt_ready:
            return json_response({"status": "not ready", "reason": "the MQTT listener is not up yet"}, 503)
        with trio.move_on_after(READY_TIMEOUT_S):
            try:
                await self.admin.store.statistics()
            except Exception as exc:  # any failure of the store is "not ready", with its reason
                return json_response({"status": "not ready", "reason": f"the store failed: {exc!r}"}, 503)
            return json_response({"status": "ready"})
        return json_response({"status": "not ready",
                              "reason": f"the store did not answer within {READY_TIMEOUT_S} s"}, 503)

    async def _publish(self, request: Request, rest: str) -> Response:
        username, password = _basic_credentials(request)
        body = _decode(request.body, PublishBody)
        message = _message(body)
        username = await self._publisher(username, password, request.peer_host)
        [outcome] = await self._publish_all([body], [message], username, request.peer_host)
        if isinstance(outcome, HttpError):
            raise outcome
        return Response(200, msgspec.json.encode(outcome))

    async def _publish_bulk(self, request: Request, rest: str) -> Response:
        """Every message of the body, in one append, each answered in order (``status`` 200 and what was stored,
        or its error); a body that does not decode whole publishes nothing."""
        username, password = _basic_credentials(request)
        bodies = _decode(request.body, BulkPublishBody).messages
        messages = [_message(body, f"messages[{index}].") for index, body in enumerate(bodies)]
        username = await self._publisher(username, password, request.peer_host)
        outcomes = await self._publish_all(bodies, messages, username, request.peer_host)
        results = [BulkOutcome(outcome.status, body.topic, error=outcome.message) if isinstance(outcome, HttpError)
                   else BulkOutcome(200, outcome.topic, outcome.qos, outcome.retain, outcome.bytes, id=outcome.id)
                   for body, outcome in zip(bodies, outcomes)]
        return Response(200, msgspec.json.encode(BulkResult(results)))

    async def _publisher(self, username: str | None, password: bytes | None, peer_host: str) -> str | None:
        """The authenticated publisher's user name (None: anonymous), or a 401."""
        decision = await self.admin.authenticate_http(username, password, peer_host)
        if not decision.accepted:
            raise HttpError(401, "credentials not accepted", (("www-authenticate", 'Basic realm="lightgate"'),))
        return decision.username

    async def _publish_all(self, bodies: list[PublishBody], messages: list[tuple[bytes, bytes]],
                           username: str | None, peer_host: str) -> list[Published | HttpError]:
        """Publish the messages (payload and properties of each body) through the node, in one append; per
        message what was stored, or an HttpError saying why not."""
        max_delay_s = self.admin.node.channel_config.max_delay_s
        outcomes: list[Published | HttpError] = []
        publishes: list[HttpPublish] = []
        published: list[int] = []  # the index of each of ``publishes``
        for index, (body, (payload, properties)) in enumerate(zip(bodies, messages)):
            try:
                deliver_at = _deliver_at(body, max_delay_s)
            except HttpError as err:
                outcomes.append(err)
                continue
            outcomes.append(Published(body.topic, body.qos, body.retain, len(payload), deliver_at))
            publishes.append(HttpPublish(body.topic, payload, body.qos, body.retain, properties, deliver_at or 0))
            published.append(index)
        for index, stored in zip(published, await self.admin.publish(publishes, username, peer_host)):
            if not isinstance(stored, Position):
                outcomes[index] = _refusal(bodies[index].topic, stored)
            elif (done := outcomes[index]).deliver_at:  # type: ignore[union-attr]
                outcomes[index] = msgspec.structs.replace(done, id=stored.id)
        return outcomes

    # --- admin routes -------------------------------------------------------------------

    async def _overview(self, request: Request, rest: str) -> Response:
        admin = self.admin
        node = admin.node
        traffic = node.traffic
        sessions = await admin.sessions()
        queues = await admin.queues()
        store = await admin.store.statistics()
        clients = admin.clients()
        online, offline = await admin.session_counts()
        counters = node.guard.counters
        return json_response({
            "time_ms": int(time.time() * 1000),
            "uptime_s": admin.uptime_s(),
            "connections": len(clients),
            "sessions": {"online": online, "offline": offline},
            "messages": {"received": traffic.messages_in, "sent": traffic.messages_out,
                         "received_by_qos": traffic.messages_in_by_qos, "sent_by_qos": traffic.messages_out_by_qos},
            "bytes": {"received": traffic.bytes_in, "sent": traffic.bytes_out},
            "store": {"dispatch_lag": store.dispatch_lag, "log_bytes": store.log_bytes, "queue_ids": store.queue_ids,
                      "active_filters": store.active_filters, "retained": store.retained,
                      "notify_sent": store.notify_sent, "notify_suppressed": store.notify_suppressed},
            "replication": _group_view(store.replication),
            "auth": {"failures": counters.auth_failures, "acl_denials": counters.acl_denials,
                     "recent": list(reversed(counters.recent))},
            "clients": clients[:OVERVIEW_CLIENTS],
            "top_sessions": sorted((s for s in sessions if s.lag), key=lambda s: -s.lag)[:OVERVIEW_TOP],
            "top_queues": sorted((q for q in queues if q.lag), key=lambda q: -q.lag)[:OVERVIEW_TOP],
        })

    async def _clients(self, request: Request, rest: str) -> Response:
        try:
            query = ClientQuery.from_params(request.query)
        except QueryError as exc:
            raise HttpError(400, str(exc)) from None
        total, page, missing = await cluster_clients(self.admin, query)
        return Response(200, orjson.dumps(page), headers=((TOTAL_HEADER, str(total)), *_missing_header(missing)))

    async def _client(self, request: Request, rest: str) -> Response:
        info = await self.admin.client_info(rest)
        if info is None:
            raise HttpError(404, f"no connected client {rest!r}")
        return json_response(info)

    async def _disconnect(self, request: Request, rest: str) -> Response:
        if not await self.admin.disconnect(rest):
            raise HttpError(404, f"no connected client {rest!r}")
        return json_response({"disconnected": rest})

    async def _sessions(self, request: Request, rest: str) -> Response:
        sessions, missing = await cluster_sessions(self.admin)
        return Response(200, orjson.dumps(sessions), headers=_missing_header(missing))

    async def _session(self, request: Request, rest: str) -> Response:
        info = await self.admin.session_info(rest)
        if info is None:
            raise HttpError(404, f"no session {rest!r}")
        return json_response(info)

    async def _delete_session(self, request: Request, rest: str) -> Response:
        if not await self.admin.delete_session(rest):
            raise HttpError(404, f"no session {rest!r}")
        return json_response({"deleted": rest})

    async def _queues(self, request: Request, rest: str) -> Response:
        queues, missing = await cluster_queues(self.admin)
        return Response(200, orjson.dumps(queues), headers=_missing_header(missing))

    async def _nodes(self, request: Request, rest: str) -> Response:
        nodes, missing = await cluster_nodes(self.admin, self._cpu_shares)
        return Response(200, orjson.dumps(nodes), headers=_missing_header(missing))

    async def _retained(self, request: Request, rest: str) -> Response:
        filter = request.query.get("filter", "#")
        try:
            messages = await self.admin.retained(filter)
        except TopicError as exc:
            raise HttpError(400, f"filter: {exc}") from None
        return json_response([_message_json(m) for m in messages])

    async def _retained_one(self, request: Request, rest: str) -> Response:
        try:
            messages = await self.admin.retained(rest)
        except TopicError as exc:
            raise HttpError(400, f"topic: {exc}") from None
        found = [m for m in messages if m.topic == rest]
        if not found:
            raise HttpError(404, f"no retained message on {rest!r}")
        return json_response(_message_json(found[0]))

    async def _dead_letters(self, request: Request, rest: str) -> Response:
        try:
            letters, next_offset, redriven = await self.admin.dead_letters(rest, _count(request, "from", 0),
                                                                           _count(request, "limit", 100))
        except TopicError as exc:
            raise HttpError(400, f"group: {exc}") from None
        return json_response(DeadLetters(rest, letters, next_offset, redriven))

    async def _redrive(self, request: Request, rest: str) -> Response:
        try:
            count, below = await self.admin.redrive(rest, _count(request, "limit", 1000))
        except TopicError as exc:
            raise HttpError(400, f"group: {exc}") from None
        return json_response(Redriven(rest, count, below))

    async def _delete_retained(self, request: Request, rest: str) -> Response:
        try:
            existed = await self.admin.delete_retained(rest)
        except TopicError as exc:
            raise HttpError(400, f"topic: {exc}") from None
        if not existed:
            raise HttpError(404, f"no retained message on {rest!r}")
        return json_response({"deleted": rest})


    async def _delayed(self, request: Request, rest: str) -> Response:
        query = request.query
        try:
            limit = int(query.get("limit", DELAYED_PAGE))
            after = int(query.get("cursor") or "0", 16)
        except ValueError:
            raise HttpError(400, "limit must be a number, and cursor a page's cursor") from None
        if not 1 <= limit <= MAX_DELAYED_PAGE or after < 0:
            raise HttpError(400, f"limit must be 1..{MAX_DELAYED_PAGE}, and cursor a page's cursor")
        page = await self.admin.store.delayed_list(topic=query.get("topic", ""), client_id=query.get("client_id", ""),
                                                   after=after, limit=limit)
        return json_response(DelayedList(
            tuple(DelayedInfo(m.position.id, m.topic, m.client_id, m.due_ms, m.qos, m.retain, m.payload_bytes)
                  for m in page.messages), f"{page.next:x}" if page.next else None))

    async def _cancel_delayed(self, request: Request, rest: str) -> Response:
        try:
            position = Position.parse(rest)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        if not await self.admin.store.delayed_cancel(position):
            raise HttpError(404, f"no pending delayed message {rest!r} (unknown, delivered, or cancelled)")
        return json_response({"cancelled": rest})


def _count(request: Request, name: str, default: int) -> int:
    """A non-negative integer query parameter."""
    text = request.query.get(name, str(default))
    if not text.isdigit():
        raise HttpError(400, f"{name}: a non-negative integer, not {text[:40]!r}")
    return int(text)


def _group_view(stats: ReplicationStatistics | None) -> dict[str, Any] | None:
    """The store group as the dashboard shows it (its leader's view), or None for an unreplicated store."""
    if stats is None:
        return None
    return {"group": stats.group, "leader": stats.name, "epoch": stats.epoch, "acks": stats.acks,
            "fenced": stats.fenced, "isr": stats.isr, "confirm_offset": stats.confirm_offset,
            "written_offset": stats.written_offset,
            "followers": [{"name": f.name, "held": f.held, "lag_bytes": f.lag_bytes, "in_isr": f.in_isr}
                          for f in stats.followers]}


def _missing_header(missing: list[str]) -> tuple[tuple[str, str], ...]:
    """The header that names the cluster's nodes a list lacks (they did not answer in time); none when complete."""
    return ((MISSING_HEADER, ", ".join(missing)),) if missing else ()


def _decode(body: bytes, type: type[T]) -> T:
    """The request body as ``type`` (gateway/ops/bodies.py), or a 400 naming the field at fault."""
    try:
        return decode_body(body, type)
    except BodyError as exc:
        raise HttpError(400, str(exc)) from None


def _refusal(topic: str, reason: ReasonCode | TopicError) -> HttpError:
    """The HTTP error of a message the node did not publish (``Administration.publish``'s outcome)."""
    if isinstance(reason, TopicError):
        return HttpError(400, f"topic: {reason}")
    if reason is ReasonCode.NOT_AUTHORIZED:
        return HttpError(403, f"the ACL does not allow publishing to {topic!r}")
    if reason is ReasonCode.PACKET_TOO_LARGE:
        return HttpError(413, "the message exceeds commitlog.max_record_bytes")
    return HttpError(503, f"the store did not take the message: {reason.name}")


def _deliver_at(body: PublishBody, max_delay_s: int) -> int | None:
    """When a delayed message (``delay_s`` or ``deliver_at``) is due, ms since the epoch; None: publish now.

    Raises:
        HttpError: 400, both are given, or the delay exceeds ``delayed.max_delay_s``.
    """
    if body.delay_s is None and body.deliver_at is None:
        return None
    if body.delay_s is not None and body.deliver_at is not None:
        raise HttpError(400, "give delay_s or deliver_at, not both")
    now = int(time.time() * 1000)
    due = now + body.delay_s * 1000 if body.delay_s is not None else body.deliver_at
    if due - now > max_delay_s * 1000:
        raise HttpError(400, f"the delay exceeds delayed.max_delay_s ({max_delay_s} s)")
    return max(due, now)


def _message(body: PublishBody, where: str = "") -> tuple[bytes, bytes]:
    """The payload and MQTT 5 property block (as a record keeps it) of ``body``, or a 400 naming the field
    (``where`` prefixes its path).

    Raises:
        HttpError: bad base64, a non-UTF-8 payload marked as UTF-8 (payload_format_indicator 1), a response topic
            that is no topic name, or a string MQTT cannot carry (U+0000, over 65535 bytes).
    """
    payload = _base64(body.payload, f"{where}payload") if body.encoding == "base64" else body.payload.encode()
    given = body.properties
    if given is None:
        return payload, b""
    if given.payload_format_indicator == 1:
        try:
            payload.decode()
        except UnicodeDecodeError:
            raise HttpError(400, f"'{where}payload' is not UTF-8 but properties.payload_format_indicator is 1") \
                from None
    if given.response_topic is not None:
        try:
            validate_topic(given.response_topic)
        except TopicError as exc:
            raise HttpError(400, f"'{where}properties.response_topic': {exc}") from None
    correlation = given.correlation_data
    properties = Properties(
        payload_format_indicator=given.payload_format_indicator,
        message_expiry_interval=given.message_expiry_interval,
        content_type=given.content_type,
        response_topic=given.response_topic,
        correlation_data=None if correlation is None else _base64(correlation, f"{where}properties.correlation_data"),
        user_properties=tuple(given.user_properties),
    )
    try:
        return payload, encode_properties(properties, PacketType.PUBLISH)
    except LocalProtocolError as exc:
        raise HttpError(400, f"'{where}properties': {exc}") from None


def _base64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise HttpError(400, f"'{field}' is not valid base64: {exc}") from None


def _basic_credentials(request: Request) -> tuple[str | None, bytes | None]:
    """(user name, password) of HTTP Basic authentication, or (None, None) when the request has none."""
    header = request.headers.get("authorization")
    if header is None:
        return None, None
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        raise HttpError(401, "publishing takes HTTP Basic credentials",
                        (("www-authenticate", 'Basic realm="lightgate"'),))
    try:
        username, colon, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        if not colon:
            raise ValueError("no ':' between user name and password")
        return username.decode(), password
    except (binascii.Error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"malformed Basic credentials: {exc}") from None


def _message_json(message: Any) -> dict[str, Any]:
    """A retained message (``store.log.record.Record``) as JSON: the payload as text when it is UTF-8, else base64."""
    try:
        payload, encoding = message.payload.decode(), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(message.payload).decode(), "base64"
    return {"topic": message.topic, "qos": message.qos, "payload": payload, "encoding": encoding,
            "bytes": len(message.payload), "store_ms": message.store_ms, "client_id": message.client_id}


# --- serving ----------------------------------------------------------------------------------


async def serve_admin(
    api: Routes,
    host: str,
    port: int,
    *,
    max_body: int,
    max_connections: int = 32,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    kind: str = "admin",
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoint (or another ``api``: ``kind`` names it in a bind error, gateway/node/binding.py)
    on ``host:port`` until cancelled.

    ``task_status.started`` receives the listeners (port 0 picks a free port: read it from them).
    Bodies larger than ``max_body`` bytes are refused with 413 (and the connection closed). At most
    ``max_connections`` are open at once: a new one closes the one waiting longest on its client, and gets 503
    (then closed) only when the node is answering a request on every other (gateway/ops/slots.py). A new
    connection has ``header_timeout_s`` to send its request head.

    Raises:
        BindError: the port is taken (or the host not local): the message names the address and ``admin.port``.

    Error handling: a failing connection is logged and closed; the listener keeps serving.
    """
    slots = Slots(max_connections)
    logged = slots.statistics()
    quiet_until = 0.0

    def log_crowding(peer_host: str) -> None:
        """One line per ``REFUSAL_LOG_INTERVAL_S`` while connections come at the limit, with what it cost."""
        nonlocal logged, quiet_until
        if time.monotonic() < quiet_until:
            return
        quiet_until = time.monotonic() + REFUSAL_LOG_INTERVAL_S
        now = slots.statistics()
        LOGGER.warning("admin connections at the limit (admin.max_connections): %d idle closed to make room,"
                       " %d refused while all were busy", now.reclaimed - logged.reclaimed,
                       now.refused - logged.refused, extra={"ctx": {"peer": peer_host, "open": now.open,
                                                                    "busy": now.busy}})
        logged = now

    async def handler(stream: trio.SocketStream) -> None:
        try:
            peer_host = stream.socket.getpeername()[0]
        except OSError:
            peer_host = "?"
        with trio.CancelScope() as scope:  # cancelled when the slot is taken back: the stream is then closed
            full = slots.full()
            slot = slots.take(scope.cancel)
            if full:
                log_crowding(peer_host)
            if slot is None:
                with trio.move_on_after(SEND_TIMEOUT_S), contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(_BUSY)
                return
            try:
                await _serve_connection(stream, api, peer_host, max_body, slot, header_timeout_s)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; nothing to answer
            except Exception as exc:  # one connection's failure must not stop the listener
                LOGGER.error("admin connection failed: %r", exc, exc_info=exc, extra={"ctx": {"peer": peer_host}})
            finally:
                slot.release()

    with naming_the_address(kind, host, port):
        listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_accepting, listeners, handler, CapacityLog("admin"))
        task_status.started(listeners)


def _busy_response() -> bytes:
    """The 503 a connection over ``max_connections`` gets, whole, before its request is read."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.next_event()
    body = orjson.dumps({"error": "too many admin connections; try again later"})
    return conn.send(h11.Response(status_code=503, reason=b"Service Unavailable", headers=[
        ("content-type", JSON), ("content-length", str(len(body))), ("connection", "close")])) \
        + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())


_BUSY = _busy_response()


class _BodyTooLarge(Exception):
    """The request announced or sent a body over the limit."""


async def _serve_connection(stream: trio.SocketStream, api: Routes, peer_host: str, max_body: int, slot: Slot,
                            header_timeout_s: float) -> None:
    """Answer requests on one kept-alive connection until either side closes it or it idles out.

    ``slot`` is busy while a request is answered, idle while the connection waits on its client.

    Resource handling: the caller (``serve_accepting``) closes ``stream``.
    """
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    head_by: float | None = trio.current_time() + header_timeout_s  # a new connection's head: from the accept
    while True:
        try:
            request = await _receive_request(stream, conn, peer_host, max_body, head_by, header_timeout_s)
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _send(stream, conn, _closing(exc.error_status_hint, f"bad request: {exc}"), head=False)
                await _linger(stream)
            return
        except _BodyTooLarge:
            await _send(stream, conn, _closing(413, f"the body exceeds {max_body} bytes"), head=False)
            await _linger(stream)
            return
        except trio.TooSlowError:
            return  # a request that does not arrive whole in time, or an answer not taken in time
        if request is None:
            return  # closed by the client, or idle
        slot.busy()
        with trio.fail_after(SEND_TIMEOUT_S):
            await _send(stream, conn, await api.handle(request), head=request.method == "HEAD")
        slot.idle()
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return  # "Connection: close", HTTP/1.0, or an unread body
        conn.start_next_cycle()
        head_by = None  # kept alive: the next head is due ``header_timeout_s`` after its first byte


async def _receive_request(stream: trio.abc.Stream, conn: h11.Connection, peer_host: str, max_body: int,
                           head_by: float | None, header_timeout_s: float) -> Request | None:
    """The next request with its whole body, or None when the client closed or stayed idle.

    ``head_by``: when the head must have arrived (trio time); None: within ``IDLE_TIMEOUT_S`` comes its first byte
    (or the connection is idle), then the head within ``header_timeout_s``.

    Raises:
        h11.RemoteProtocolError: not HTTP/1.1 as h11 understands it (the hint says which status).
        _BodyTooLarge: the body exceeds ``max_body``.
        trio.TooSlowError: the head did not arrive by its deadline, or the body within ``REQUEST_TIMEOUT_S`` of
            the head.
    """
    event = conn.next_event()  # a pipelined request may be buffered already
    if event is h11.NEED_DATA:
        data = None
        with trio.move_on_at(trio.current_time() + IDLE_TIMEOUT_S if head_by is None else head_by):
            data = await stream.receive_some(RECEIVE_BYTES)  # the first bytes of the next request, or the end
        if data is None:
            return None  # idle, or no head in time
        conn.receive_data(data)
        with trio.fail_at(trio.current_time() + header_timeout_s if head_by is None else head_by):
            event = await _next_event(stream, conn)
    with trio.fail_after(REQUEST_TIMEOUT_S):
        if not isinstance(event, h11.Request):
            return None  # h11.ConnectionClosed
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        length = headers.get("content-length")
        if length is not None and int(length) > max_body:  # h11 checked that it is a number
            raise _BodyTooLarge
        if conn.they_are_waiting_for_100_continue:
            await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        body = bytearray()
        while not isinstance(part := await _next_event(stream, conn), h11.EndOfMessage):
            body += part.data  # h11.Data: nothing else comes between a request and its end
            if len(body) > max_body:
                raise _BodyTooLarge
        path, _, query = event.target.decode("latin-1").partition("?")
        return Request(event.method.decode("latin-1"), path, dict(parse_qsl(query)), headers, bytes(body), peer_host)
    return None


async def _next_event(stream: trio.abc.Stream, conn: h11.Connection) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(RECEIVE_BYTES))


async def _linger(stream: trio.SocketStream) -> None:
    """Half-close, then drop what the client still sends until it closes too (at most ``LINGER_S``)."""
    with trio.move_on_after(LINGER_S):
        await stream.send_eof()
        while await stream.receive_some(RECEIVE_BYTES):
            pass


def _closing(status: int, message: str) -> Response:
    return Response(status, orjson.dumps({"error": message}), headers=(("connection", "close"),))


async def _send(stream: trio.abc.Stream, conn: h11.Connection, response: Response, *, head: bool) -> None:
    """Write one whole response (a HEAD request gets the headers only)."""
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               ("cache-control", "no-store"), *response.headers]
    data = conn.send(h11.Response(status_code=response.status, headers=headers,
                                  reason=HTTPStatus(response.status).phrase.encode()))
    if not head:
        data += conn.send(h11.Data(data=response.body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
