"""The HTTP endpoint of one store replica (``store.metrics_port``): ``GET /metrics`` and ``GET /healthz``.

A follower serves no gateway, so its figures cannot reach an operator through a gateway's ``/metrics``: each replica
exports its own, read from its role loop (store/replica/figures.py) when scraped: role, epoch, confirm and written
offsets, its lag behind the leader, elections, truncations, and, while it leads, the in-sync set and each follower's
lag. The replication families are the gateway's (``replication_metrics``, gateway/ops/metrics.py), so a leader's
series have one name and shape whichever endpoint exports them. Served by ``serve_admin`` (h11, bounded
connections) from the composition root, gateway/app/store_node.py; ``read_figures`` reads one back for
``lightgate store status`` (each replica registers its endpoint's address in etcd).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, final

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.ops.admin import Request, Response
from gateway.ops.metrics import CONTENT_TYPE, PREFIX, build_info, process_collectors, replication_metrics
from store.api import ReplicationStatistics

__all__ = ["ReplicaEndpoint", "read_figures"]

FIGURES = PREFIX + "replication_"


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


def read_figures(address: str, timeout_s: float) -> dict[str, Any]:
    """The replication figures of the replica whose endpoint is at ``address`` (``host:port``), as a JSON-able
    dict: ``role``, ``epoch``, the offsets and counters by their metric names (``confirm_offset``, ``elections``...)
    and, for a leader, ``followers`` (name -> ``held_offset``, ``lag_bytes``, ``in_isr``).

    Raises:
        OSError: the endpoint did not answer (the replica is gone or stalled).
    """
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as answer:
        text = answer.read().decode()
    figures: dict[str, Any] = {}
    followers: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FIGURES + "info":
                figures["role"] = sample.labels["role"]
            elif sample.name.startswith(FIGURES + "follower_"):
                name = sample.name.removeprefix(FIGURES + "follower_")
                followers.setdefault(sample.labels["replica"], {})[name] = int(sample.value)
            elif sample.name.startswith(FIGURES):
                figures[sample.name.removeprefix(FIGURES).removesuffix("_total")] = int(sample.value)
    if followers:
        figures["followers"] = followers
    return figures
