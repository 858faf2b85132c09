"""Prometheus metrics of a gateway node, read from its counters when ``/metrics`` is scraped.

The per-message paths only add to plain ints (``Traffic``, ``AuthCounters``,
the limit and admission counters, the store's figures) and to fixed-bucket
``LatencyBuckets``; no prometheus object sits on them. ``NodeMetrics`` fetches
the store's figures (``StoreApi.statistics``, async), then lets a custom
collector turn everything into metric families. Each node has its own
``CollectorRegistry``: tests start many nodes in one process, and the global
registry would mix them up. The process's own figures (CPU seconds, resident
memory, open descriptors, garbage collections, the Python version) come from
prometheus_client's standard collectors, also read at scrape time only, under
their standard names (``process_*``, ``python_*``), which the usual dashboards
know. docs/operations.md lists every metric; packaging/grafana/lightgate.json
charts them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from itertools import accumulate
from typing import TYPE_CHECKING, final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gateway import __version__
from store.log.aio import LatencyBuckets

if TYPE_CHECKING:
    from gateway.node.admission import Admission
    from gateway.node.cache import QueueCache
    from gateway.ops.administration import Administration
    from store.api import ReplicationStatistics, StoreStatistics

__all__ = ["CONTENT_TYPE", "NodeMetrics", "build_info", "histogram", "process_collectors", "replication_metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Prometheus text exposition format's content type."""

PREFIX = "lightgate_"
"""Every metric's name starts with it, so one Prometheus can scrape LightGate next to other brokers."""


def histogram(name: str, documentation: str, buckets: LatencyBuckets) -> HistogramMetricFamily:
    """A Prometheus histogram (cumulative buckets, ``+Inf``, sum) from a ``LatencyBuckets``."""
    cumulative = list(accumulate(buckets.counts))
    pairs = [(floatToGoString(bound), float(count)) for bound, count in zip(buckets.bounds, cumulative)]
    pairs.append(("+Inf", float(cumulative[-1])))
    return HistogramMetricFamily(name, documentation, buckets=pairs, sum_value=buckets.sum_s)


@final
class NodeMetrics:
    """The metrics of one node: ``await exposition()`` renders them in the Prometheus text format.

    Args:
        admin: the administration of the node whose counters are read.
        flush_latency: the CommitLog's flush times, when the store runs in this process (None in cluster
            mode: the store node exports its own).
        admission: the node's connection admission (open connections, refusals), if it has one.
        cache: the node's queue cache (hits vs store reads), if it has one.
    """

    def __init__(self, admin: Administration, *, flush_latency: LatencyBuckets | None = None,
                 admission: Admission | None = None, cache: QueueCache | None = None) -> None:
        self._admin = admin
        self._node = admin.node
        self._flush_latency = flush_latency
        self._admission = admission
        self._cache = cache
        self._store: StoreStatistics | None = None
        self._sessions = (0, 0)  # online, offline
        self.registry = CollectorRegistry()
        self.registry.register(self)
        process_collectors(self.registry)

    async def exposition(self) -> bytes:
        """The current metrics, store figures fetched now."""
        self._store = await self._admin.store.statistics()
        self._sessions = await self._admin.session_counts()
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The collector protocol of prometheus_client (called by ``generate_latest``)."""
        node = self._node
        traffic = node.traffic
        online, offline = self._sessions
        admission = self._admission
        yield build_info()
        yield _gauge("connections", "open MQTT connections",
                     admission.connections if admission is not None else online)
        sessions = GaugeMetricFamily(PREFIX + "sessions", "sessions by state: online (connected to this node) and "
                                     "offline (stored, their client connected nowhere)", labels=["state"])
        sessions.add_metric(["online"], online)
        sessions.add_metric(["offline"], offline)
        yield sessions
        yield _by_qos("messages_received", "PUBLISH packets received from clients", traffic.messages_in_by_qos)
        yield _by_qos("messages_sent", "PUBLISH packets sent to clients", traffic.messages_out_by_qos)
        yield _by_qos("messages_refused", "messages the store did not take (a full data disk...): QoS 0 ones "
                      "dropped, QoS 1/2 ones answered with a failure", node.appends.refused_by_qos)
        yield _counter("bytes_received", "bytes read from client connections", traffic.bytes_in)
        yield _counter("bytes_sent", "bytes written to client connections", traffic.bytes_out)
        yield histogram(PREFIX + "delivery_latency_seconds", "queue messages from their store time to the write "
                        "of their PUBLISH to the subscriber (an upper bound per written batch)",
                        traffic.delivery_latency)
        counters = node.guard.counters
        yield _counter("auth_failures", "CONNECTs and HTTP publishes refused for their credentials",
                       counters.auth_failures)
        yield _counter("acl_denials", "messages dropped and subscriptions refused by the ACL", counters.acl_denials)
        yield from self._limits()
        yield from self._cache_metrics()
        yield from self._store_metrics()

    def _cache_metrics(self) -> Iterator[Metric]:
        if self._cache is None:
            return
        cache = self._cache.statistics()
        yield _counter("queue_cache_hits", "session reads answered from the queue cache", cache.hits)
        yield _counter("queue_cache_store_reads", "session reads that went to the store (behind or ahead of the "
                       "cache)", cache.store_reads)
        yield _counter("queue_cache_fills", "queue reads by the cache itself after notify events", cache.fills)
        yield _gauge("queue_cache_messages", "messages held by the queue cache", cache.messages)
        yield _gauge("queue_cache_bytes", "estimated bytes held by the queue cache", cache.bytes)

    def _limits(self) -> Iterator[Metric]:
        limits = self._node.limit_counters
        hits = CounterMetricFamily(PREFIX + "limit_hits", "times clients ran into a limit, by limit", labels=["limit"])
        for field in fields(limits):
            hits.add_metric([field.name], getattr(limits, field.name))
        yield hits
        if self._admission is not None:
            refused = CounterMetricFamily(PREFIX + "connections_refused", "connections refused at accept, by reason",
                                          labels=["reason"])
            counters = self._admission.counters
            for field in fields(counters):
                refused.add_metric([field.name.removeprefix("refused_")], getattr(counters, field.name))
            yield refused

    def _store_metrics(self) -> Iterator[Metric]:
        store = self._store
        if store is not None:
            yield _gauge("dispatch_lag_bytes", "CommitLog bytes appended and not indexed yet", store.dispatch_lag)
            yield _counter("commitlog_written_bytes", "bytes appended to the CommitLog since it began",
                           store.written_offset)
            yield _counter("commitlog_writes", "CommitLog writes since the store started, each of one or more records "
                           "(with commitlog_written_bytes: the bytes per write, what batching gains)", store.log_writes)
            yield _gauge("commitlog_bytes", "bytes of records the CommitLog holds (retention bounds it)",
                         store.log_bytes)
            yield _gauge("commitlog_unflushed_bytes", "CommitLog bytes written and not on disk yet",
                         store.written_offset - store.flushed_offset)
            yield _gauge("queues", "light queues created so far (queue ids allocated)", store.queue_ids)
            yield _gauge("active_filters", "wildcard filters being indexed", store.active_filters)
            yield _gauge("retained_messages", "retained messages", store.retained)
            yield _counter("notify_events_sent", "queue events routed to gateway nodes", store.notify_sent)
            yield _counter("notify_events_suppressed", "node events not sent: the node had no session on the queue",
                           store.notify_suppressed)
            yield _counter("corrupt_records", "corrupt CommitLog records found and skipped (each counted once; "
                           "the ERROR log line names its file and offset)", store.corrupt_records)
            yield _gauge("store_disk_full", "1 while the data disk is full and new QoS 1/2 messages are refused",
                         int(store.disk_full))
            yield from _timer_metrics(store)
            yield from _pop_metrics(store)
            if store.replication is not None:
                yield from replication_metrics(store.replication)
        if self._flush_latency is not None:
            yield histogram(PREFIX + "commitlog_flush_seconds", "time of each CommitLog flush (fsync) round",
                            self._flush_latency)


def _timer_metrics(store: StoreStatistics) -> Iterator[Metric]:
    """The delayed messages of the store (docs/operations.md, "Delayed delivery"); rates come from the counters."""
    timers = store.timers
    if timers is None:
        return
    yield _gauge("delayed_pending", "delayed messages stored and not delivered yet", timers.pending)
    yield _counter("delayed_scheduled", "delayed messages enqueued in the timer wheel", timers.scheduled)
    yield _counter("delayed_dequeued", "delayed messages delivered to their topic at their due time", timers.fired)
    yield _counter("delayed_rolled", "delayed messages due beyond the wheel's window, enqueued again", timers.rolled)
    yield _counter("delayed_cancelled", "delayed messages cancelled before their due time", timers.cancelled)
    late = LatencyBuckets(timers.lateness_bounds)
    late.counts = list(timers.lateness_counts)
    late.sum_s = timers.lateness_sum_s
    yield histogram(PREFIX + "delayed_lateness_seconds", "how late each delayed message went out after its due "
                    "time", late)


def _pop_metrics(store: StoreStatistics) -> Iterator[Metric]:
    """The POP groups of the store (docs/consumer-groups.md): what members hold now, and where messages went."""
    pops = store.pops
    if pops is None:
        return
    yield _gauge("pop_groups", "POP groups the store keeps (one per group and queue)", pops.groups)
    yield _gauge("pop_inflight", "POP messages handed out and not acknowledged, invisible to the other members",
                 pops.inflight)
    yield _gauge("pop_waiting", "POP messages whose invisible time passed, waiting for their next attempt",
                 pops.waiting)
    yield _counter("pop_popped", "POP messages handed out (first deliveries and retries)", pops.popped)
    yield _counter("pop_acked", "POP messages acknowledged (acks that counted)", pops.acked)
    yield _counter("pop_revived", "POP messages made visible again after their invisible time (redelivered)",
                   pops.revived)
    yield _counter("pop_dead_lettered", "POP messages moved to $dlq/<group> after their last attempt", pops.dead)


def replication_metrics(stats: ReplicationStatistics) -> Iterator[Metric]:
    """One replica of a replicated store group (docs/operations.md, "Replication metrics"): a gateway exports its
    leader's (``StoreStatistics.replication``), each replica's ``/metrics`` its own (gateway/ops/replica.py)."""
    yield InfoMetricFamily(PREFIX + "replication", "this replica's group, name and role (always 1)",
                           value={"group": stats.group, "replica": stats.name, "role": stats.role})
    yield _gauge("replication_leader", "1 while this replica leads its group, 0 while it follows",
                 int(stats.role == "leader"))
    yield _gauge("replication_epoch", "the leader epoch this replica leads or follows", stats.epoch)
    yield _gauge("replication_confirm_offset", "the confirm offset: what dispatch, pulls and readers may see",
                 stats.confirm_offset)
    yield _gauge("replication_written_offset", "this replica's log end", stats.written_offset)
    yield _gauge("replication_lag_bytes", "bytes this replica's log is behind the leader's end (a follower: as its"
                 " last fetch answer said; the leader: 0)", stats.lag_bytes)
    yield _counter("replication_elections", "elections this replica won since it started", stats.elections)
    yield _counter("replication_truncations", "times this replica cut its log back to agree with a new leader's",
                   stats.truncations)
    yield _counter("replication_leader_changes", "times this replica saw a new leader or epoch", stats.leader_changes)
    if stats.role != "leader":
        return
    yield _gauge("replication_isr_size", "replicas in the in-sync set, the leader included", len(stats.isr))
    yield _gauge("replication_fenced", "1 once this leader acknowledges nothing any more (its lease is gone, or a"
                 " newer leader exists)", int(stats.fenced))
    yield _counter("replication_isr_shrinks", "followers that left the in-sync set in this epoch", stats.shrinks)
    yield _counter("replication_isr_expands", "followers that joined the in-sync set in this epoch", stats.expands)
    held = GaugeMetricFamily(PREFIX + "replication_follower_held_offset", "what each follower holds (written, or"
                             " fsynced under its sync flush policy)", labels=["replica"])
    lag = GaugeMetricFamily(PREFIX + "replication_follower_lag_bytes", "bytes each follower holds less than the"
                            " leader's log end", labels=["replica"])
    in_isr = GaugeMetricFamily(PREFIX + "replication_follower_in_isr", "1 while the follower is in the in-sync set",
                               labels=["replica"])
    for follower in stats.followers:
        held.add_metric([follower.name], follower.held)
        lag.add_metric([follower.name], follower.lag_bytes)
        in_isr.add_metric([follower.name], int(follower.in_isr))
    yield held
    yield lag
    yield in_isr


def build_info() -> InfoMetricFamily:
    """``lightgate_build_info{version}``: every LightGate process's metrics start with it."""
    return InfoMetricFamily(PREFIX + "build", "the running LightGate's version (always 1)", value={"version": __version__})


def process_collectors(registry: CollectorRegistry) -> None:
    """Register the process collectors on ``registry``: ``process_cpu_seconds_total``,
    ``process_resident_memory_bytes``, ``process_open_fds`` (Linux ``/proc``), ``python_gc_collections_total``
    and the other GC counters, ``python_info``."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)


def _by_qos(name: str, documentation: str, counts: list[int]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, documentation + ", by QoS", labels=["qos"])
    for qos, count in enumerate(counts):
        family.add_metric([str(qos)], count)
    return family
