"""QoS 1 and QoS 2 through SIGKILLs (tests/helpers/crashkit.py): nothing acknowledged is lost, QoS 2 is exactly once.

Publishers reuse packet ids 1..100; under ``--commitlog-flush sync`` a PUBREC
or PUBACK promises the message is on disk, and after any number of kills
every acknowledged message reaches a persistent QoS 2 subscriber exactly once
([MQTT-4.3.3-2]) and a QoS 1 one at least once; every resend to a subscriber
carries DUP=1 and its first packet id ([MQTT-3.3.1-1], [MQTT-4.4.0-1]). Under
``async`` a process crash costs the same (the page cache keeps the log; what
a power loss costs is tested in tests/store/test_awaiting.py and stated in
docs/storage.md).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.crashkit import ClusterNodes, CrashReport, EmbeddedNode, Node, run_crashes

pytestmark = pytest.mark.slow

KILLS = 4


def check_nothing_acknowledged_lost(report: CrashReport) -> None:
    """Every flow acknowledged something; nothing acknowledged was lost; QoS 2 arrived exactly once; every resend
    carried DUP=1 and its first packet id; no session was lost."""
    summary = json.dumps(report.as_dict())
    for acc in report.flows.values():
        assert acc.acknowledged > 0, summary
    assert report.total("lost") == 0, summary
    assert report.total("dropped_held") == 0, summary
    assert report.flows[(2, 2)].duplicates == 0, summary  # exactly once from QoS 2 publisher to QoS 2 subscriber
    for subscriber_qos in (1, 2):  # a QoS 2 message is stored once: every receipt after the first is a resend
        resends = report.flows[(2, subscriber_qos)]
        assert resends.resends_without_dup == 0 and resends.resends_with_new_id == 0, summary
    assert all(p["sessions_lost"] == 0 and p["unfinished"] == 0 for p in report.publishers.values()), summary
    assert all(s["sessions_lost"] == 0 for s in report.subscribers.values()), summary


def sigkilled(node: Node) -> CrashReport:
    """Run the scenario against ``node`` (``KILLS`` SIGKILLs), stop it: the report."""
    try:
        report = run_crashes(node, KILLS)
    finally:
        node.stop()
    print(json.dumps(report.as_dict()))
    return report


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_embedded_node_sigkills(tmp_path, flush):
    check_nothing_acknowledged_lost(sigkilled(EmbeddedNode(tmp_path / "data", flush)))


def test_cluster_gateway_sigkills(tmp_path):
    check_nothing_acknowledged_lost(sigkilled(ClusterNodes(tmp_path / "data")))
