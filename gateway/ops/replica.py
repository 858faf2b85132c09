"""The HTTP endpoint of one store replica (``store.metrics_port``): ``GET /metrics`` and ``GET /healthz``.

A follower serves no gateway, so its figures cannot reach an operator through a gateway's ``/metrics``: each replica
exports its own, read from its role loop (store/replica/figures.py) when scraped: role, epoch, confirm and written
offsets, its lag behind the leader, elections, truncations, and, while it leads, the in-sync set and each follower's
lag. The replication families are the gateway's (``replication_metrics``, gateway/ops/metrics.py), so a leader's
series have one name and shape whichever endpoint exports them. Served by ``serve_admin`` (h11, bounded
connections) from the composition root, gateway/app/store_node.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import final

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from gateway.ops.admin import Request, Response
from gateway.ops.metrics import CONTENT_TYPE, build_info, process_collectors, replication_metrics
from store.api import ReplicationStatistics

__all__ = ["ReplicaEndpoint"]


@final
class ReplicaEndpoint:
    """The routes of a replica's endpoint over ``figures`` (None before its role loop opened its log)."""

    def __init__(self, figures: Callable[[], ReplicationStatistics | None]) -> None:
        self._figures = figures
        self.registry = CollectorRegistry()
        self.registry.register(self)
        process_collectors(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The collector protocol of prometheus_client (called by ``generate_latest``)."""
        yield build_info()
        stats = self._figures()
        if stats is not None:
            yield from replication_metrics(stats)

    async def handle(self, request: Request) -> Response:
        """Answer one request (``serve_admin``'s ``Routes``)."""
        routes = {"/metrics": self._metrics, "/healthz": self._healthz}
        route = routes.get(request.path)
        if route is None:
            return Response(404, orjson.dumps({"error": f"no route {request.path}: /metrics, /healthz"}))
        if request.method not in ("GET", "HEAD"):
            return Response(405, orjson.dumps({"error": f"{request.method} is not allowed on {request.path}"}),
                            headers=(("allow", "GET"),))
        return route()

    def _metrics(self) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE)

    def _healthz(self) -> Response:
        return Response(200, orjson.dumps({"status": "ok"}))
