"""Prometheus metrics of a gateway node (gateway/ops/metrics.py): the exposition parses, and the figures move with
traffic, refusals and limit hits; each node of a process has its own registry."""

import http.client
import json
import logging
import re
import uuid

import paho.mqtt.client as mqtt
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.app.config import OPTIONS
from gateway.app.embedded import serve_gateway
from gateway.auth.passwords import PasswordFile
from gateway.ops.metrics import histogram
from store.log.aio import LatencyBuckets
from tests.helpers.mqtt_fixtures import WAIT_S, Client, connected, running_node, wait_until
from tests.helpers.processes import ROOT

DEFAULTS = {o.key: o.default for o in OPTIONS}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one ``GET /metrics``, parsed by prometheus_client."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("content-type").startswith("text/plain")
        text = response.read().decode()
    finally:
        conn.close()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_latency_buckets_become_a_cumulative_prometheus_histogram():
    buckets = LatencyBuckets((0.01, 0.1))
    buckets.observe(0.005)
    buckets.observe(0.01)  # on a bound: counted in that bucket (le = less or equal)
    buckets.observe(0.05, count=3)
    buckets.observe(7.0)
    family = histogram("x_seconds", "test", buckets)
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("x_seconds_bucket", "0.01")] == 2
    assert samples[("x_seconds_bucket", "0.1")] == 5
    assert samples[("x_seconds_bucket", "+Inf")] == 6
    assert samples[("x_seconds_count", None)] == 6
    assert samples[("x_seconds_sum", None)] == pytest.approx(0.005 + 0.01 + 0.15 + 7.0)


@pytest.fixture(scope="module")
def node_with_passwords(tmp_path_factory):
    directory = tmp_path_factory.mktemp("metrics")
    passwords = PasswordFile.load_or_empty(directory / "users.txt")
    passwords.set_password("alice", "alice-pw")
    passwords.save()
    with running_node(directory / "data", "--commitlog-flush", "sync", "--mqtt-sys-interval-s", "0",
                      "--auth-password-file", str(passwords.path), "--auth-allow-anonymous", "true",
                      "--auth-failure-delay-s", "0", "--limits-max-topic-levels", "4") as node:
        node.admin_port = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        yield node
    assert node.proc.returncode == 0


def test_metrics_move_with_traffic(node_with_passwords):
    run = uuid.uuid4().hex[:6]
    before = scrape(node_with_passwords.admin_port)
    with connected(node_with_passwords.port, protocol=mqtt.MQTTv5) as sub, connected(node_with_passwords.port) as pub:
        sub.subscribe(f"m{run}/+", 2)  # a wildcard below the first level: an active filter
        for qos in (0, 1, 1, 2):
            pub.publish(f"m{run}/t", b"x" * 100, qos)
        sub.receive(4)
        wait_until(lambda: value(scrape(node_with_passwords.admin_port), "lightgate_messages_sent_total", qos="1")
                   >= value(before, "lightgate_messages_sent_total", qos="1") + 2, what="sent QoS 1 counted")
        during = scrape(node_with_passwords.admin_port)
    assert value(during, "lightgate_connections") == value(before, "lightgate_connections") + 2
    assert value(during, "lightgate_sessions", state="online") \
        == value(before, "lightgate_sessions", state="online") + 2
    for qos, count in (("0", 1), ("1", 2), ("2", 1)):
        assert value(during, "lightgate_messages_received_total", qos=qos) \
            == value(before, "lightgate_messages_received_total", qos=qos) + count
        assert value(during, "lightgate_messages_sent_total", qos=qos) \
            == value(before, "lightgate_messages_sent_total", qos=qos) + count
    assert value(during, "lightgate_bytes_received_total") >= value(before, "lightgate_bytes_received_total") + 400
    assert value(during, "lightgate_bytes_sent_total") >= value(before, "lightgate_bytes_sent_total") + 400
    latency = value(during, "lightgate_delivery_latency_seconds_count")
    assert latency >= value(before, "lightgate_delivery_latency_seconds_count") + 4
    assert value(during, "lightgate_delivery_latency_seconds_bucket", le="+Inf") == latency
    assert value(during, "lightgate_delivery_latency_seconds_bucket", le="60.0") == latency  # none took a minute
    for grown in ("lightgate_commitlog_written_bytes_total", "lightgate_commitlog_flush_seconds_count"):
        assert value(during, grown) > value(before, grown), grown
    assert value(during, "lightgate_notify_events_sent_total") > value(before, "lightgate_notify_events_sent_total")
    assert value(during, "lightgate_queues") > value(before, "lightgate_queues")
    assert value(during, "lightgate_active_filters") >= 1
    assert value(during, "lightgate_dispatch_lag_bytes") >= 0
    reads = ("lightgate_queue_cache_hits_total", "lightgate_queue_cache_store_reads_total")
    assert sum(value(during, name) for name in reads) > sum(value(before, name) for name in reads)


def test_build_info_names_the_running_version(node_with_passwords):
    samples = scrape(node_with_passwords.admin_port)
    builds = {labels: v for (name, labels), v in samples.items() if name == "lightgate_build_info"}
    assert builds == {(("version", __version__),): 1.0}


def test_process_cpu_memory_fds_and_gc_are_exported(node_with_passwords):
    samples = scrape(node_with_passwords.admin_port)
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 10 * 1024 * 1024  # a Python node with trio and RocksDB
    assert 3 <= value(samples, "process_open_fds") < value(samples, "process_max_fds")
    assert value(samples, "python_gc_collections_total", generation="0") >= 0
    assert {labels for (name, labels) in samples if name == "python_info"}  # the interpreter's version


DASHBOARD = ROOT / "packaging" / "grafana" / "lightgate.json"

PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                          "unless", "offset"})
"""PromQL keywords that look like names but are not metrics."""


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, label matchers,
    label lists, ranges or strings."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if not expr[match.end():].lstrip().startswith("(") and match.group() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def test_promql_metrics_finds_the_metrics_only():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(lightgate_x_bucket{instance=~"$instance", a="b{c}"}'
            '[$__rate_interval]))) / on (instance) group_left process_y - time()')
    assert promql_metrics(expr) == {"lightgate_x_bucket", "process_y"}


def test_the_grafana_dashboard_only_queries_metrics_a_running_node_exports(node_with_passwords):
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {name for name, _ in scrape(node_with_passwords.admin_port)}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = promql_metrics(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= exported, (panel["title"], names - exported)
            queried |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"])[1]
            assert metric in exported
    for needed in ("lightgate_connections", "lightgate_messages_received_total", "lightgate_dispatch_lag_bytes",
                   "lightgate_delivery_latency_seconds_bucket", "lightgate_auth_failures_total",
                   "lightgate_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes",
                   "process_open_fds", "python_gc_collections_total"):
        assert needed in queried, needed


def test_auth_failures_and_limit_hits_are_counted(node_with_passwords):
    before = scrape(node_with_passwords.admin_port)
    refused = Client(node_with_passwords.port, protocol=mqtt.MQTTv5)
    refused.paho.username_pw_set("alice", "wrong")
    refused.paho.connect("127.0.0.1", node_with_passwords.port)
    refused.paho.loop_start()
    try:
        _, reason = refused.connacks.get(timeout=WAIT_S)
        assert reason.is_failure
    finally:
        refused.paho.loop_stop()
    hits = value(before, "lightgate_limit_hits_total", limit="topic_levels")
    with connected(node_with_passwords.port, protocol=mqtt.MQTTv5) as deep:
        deep.paho.publish("a/b/c/d/e", b"too deep", 1)  # 5 levels; the node allows 4 (MQTT 5: PUBACK 0x90)
        wait_until(lambda: value(scrape(node_with_passwords.admin_port), "lightgate_limit_hits_total",
                                 limit="topic_levels") == hits + 1, what="the limit hit counted")
    after = scrape(node_with_passwords.admin_port)
    assert value(after, "lightgate_auth_failures_total") == value(before, "lightgate_auth_failures_total") + 1


async def test_each_node_of_a_process_has_its_own_registry(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gateway.app.serve")

    def admin_ports() -> list[int]:
        return [r.ctx["port"] for r in caplog.records if r.getMessage() == "admin API ready"]

    async with trio.open_nursery() as nursery:
        ports = []
        for name in ("one", "two"):
            settings = {**DEFAULTS, "node.data": str(tmp_path / name), "node.port": 0, "mqtt.sys_interval_s": 0}
            ports.append(await nursery.start(serve_gateway, settings))
        first_admin, second_admin = admin_ports()

        def traffic() -> tuple[float, float]:
            with connected(ports[0][1]) as client:
                client.publish("only/the/first", b"x", 1)
            return (value(scrape(first_admin), "lightgate_messages_received_total", qos="1"),
                    value(scrape(second_admin), "lightgate_messages_received_total", qos="1"))

        assert await trio.to_thread.run_sync(traffic) == (1, 0)
        nursery.cancel_scope.cancel()
