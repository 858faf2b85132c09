"""`lightgate simulate` end to end: tiny fleets against a `lightgate serve` node started by the test."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.helpers.mqtt_fixtures import WAIT_S, wait_until
from tests.helpers.processes import ROOT

RUN_TIMEOUT_S = 120.0  # a 3-5 s run plus process start-up, drain and disconnects on 2 loaded cores


def simulate(node, tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "simulate", "--port", str(node.port), "--devices", "20",
         "--processes", "2", "--json", str(out), "--no-progress", *flags],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc, json.loads(out.read_text())


def assert_nothing_lost(report: dict) -> None:
    m = report["messages"]
    assert m["lost"] == 0 and m["publish_refused"] == 0
    assert m["received"] == m["acknowledged"] > 0
    assert report["latency_ms"]["count"] >= m["received"]
    assert 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["p90"] <= report["latency_ms"]["p99"] \
        <= report["latency_ms"]["max"]
    assert not report["drain"]["capped"]


@pytest.mark.slow
def test_a_small_fleet_loses_nothing_and_reports_every_field(node, tmp_path):
    proc, report = simulate(node, tmp_path, "--duration", "3", "--qos", "1")
    assert set(report) == {"settings", "devices", "messages", "throughput_msgs_s", "latency_ms", "ack_latency_ms",
                           "errors", "drain", "cpu_s", "commands"}
    assert report["settings"]["devices"] == 20 and report["settings"]["qos"] == 1
    assert report["devices"]["configured"] == report["devices"]["ever_connected"] == 20
    assert report["errors"]["total"] == 0
    assert_nothing_lost(report)
    m = report["messages"]
    assert m["sent"] == m["acknowledged"] and m["duplicates"] == 0
    # 20 devices at 1 msg/s for 3 s, jitter 10 %: about 60 messages
    assert 40 <= m["sent"] <= 80
    assert report["ack_latency_ms"]["count"] == m["acknowledged"]
    assert report["commands"] is None
    assert "lost" in proc.stdout and "end-to-end latency" in proc.stdout  # the table


@pytest.mark.slow
def test_commands_are_answered_with_their_correlation_data(node, tmp_path):
    _, report = simulate(node, tmp_path, "--duration", "3", "--protocol", "5", "--commands",
                         "--topic-template", "tele/{device}")
    c = report["commands"]
    assert c["requests_sent"] == 20 and c["broadcasts_sent"] == 1
    assert c["responses"] == 20 and c["unmatched"] == 0  # right correlation data, from the addressed device, once
    assert c["broadcast_responses"] == 20
    assert c["received_by_devices"] == c["responses_sent_by_devices"] == 40
    assert c["rtt_ms"]["count"] == 40
    assert_nothing_lost(report)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_churning_devices_resume_their_sessions_and_lose_nothing(node, tmp_path, protocol):
    _, report = simulate(node, tmp_path, "--duration", "4", "--qos", "1", "--protocol", protocol,
                         "--churn", "0.3", "--storm")
    d = report["devices"]
    assert d["churn_disconnects"] > 0
    # every churned device reconnected (one that churned just before the end may still be offline at the stop)
    assert d["configured"] < d["connects"] <= d["configured"] + d["churn_disconnects"]
    assert report["errors"]["total"] == 0
    assert_nothing_lost(report)


def retained_status(node) -> list[str]:
    """The topics of the retained messages under ``status/`` (the node's admin API)."""
    port = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/retained?filter=status/%23", timeout=WAIT_S) as answer:
        return [message["topic"] for message in json.load(answer)]


@pytest.mark.slow
def test_a_run_deletes_the_retained_status_messages_of_its_devices(node, tmp_path):
    """Each device publishes a retained `status/<device>` ("online", or its will's "offline"): the run deletes
    them when it ends, so a broker is left as it was."""
    before = set(retained_status(node))
    simulate(node, tmp_path, "--duration", "1")
    wait_until(lambda: set(retained_status(node)) <= before, what="the status messages deleted")  # once dispatched
    assert set(retained_status(node)) - before == set()  # none of the run's devices left one


def test_bad_options_are_refused_with_a_reason(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "simulate", "--devices", "2", "--processes", "3", "--no-progress"],
        capture_output=True, text=True, timeout=WAIT_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and "--processes must be between 1 and --devices" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.app.cli", "simulate", "--topic-template", "tele/{device}/+", "--no-progress"],
        capture_output=True, text=True, timeout=WAIT_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and "wildcards" in proc.stderr
