"""gateway/bench/report.py: loss and duplicate accounting, histogram merging across processes, percentiles, the
report."""

from rich.console import Console

from gateway.bench.report import (
    CheckerTotals, CommandTotals, WorkerTotals, account, build_report, latency_ms, merge_histograms, new_histogram,
    record_us, report_table,
)


def _bits(*seqs: int) -> int:
    return sum(1 << s for s in set(seqs))


def test_lost_is_acknowledged_but_never_received():
    acked = {"a": _bits(0, 1, 2, 3), "b": _bits(0, 1)}
    received = {"a": _bits(0, 2, 3), "b": _bits(0, 1, 2), "c": _bits(5)}  # b/2 and c/5 arrived unacknowledged
    loss = account(acked, received)
    assert (loss.acknowledged, loss.received, loss.lost, loss.unacknowledged) == (6, 7, 1, 2)


def test_nothing_lost_when_everything_arrived():
    acked = {f"d{i}": _bits(*range(i, 40)) for i in range(10)}
    loss = account(acked, dict(acked))
    assert loss.lost == 0 and loss.unacknowledged == 0 and loss.received == loss.acknowledged == sum(
        40 - i for i in range(10))


def test_a_device_the_checker_never_heard_of_loses_everything():
    assert account({"silent": _bits(0, 1, 2)}, {}).lost == 3


def _encoded(*latencies_us: int) -> bytes:
    h = new_histogram()
    for us in latencies_us:
        record_us(h, us * 1000)
    return h.encode()


def test_histograms_of_several_processes_add_up_before_percentiles():
    # process A is fast, process B is slow: the merged p50 is in between, which averaging percentiles would not give
    merged = merge_histograms([_encoded(*[1000] * 90), _encoded(*[50_000] * 10), b""])
    summary = latency_ms(merged)
    assert summary["count"] == 100
    assert abs(summary["p50"] - 1.0) < 0.01 and abs(summary["p90"] - 1.0) < 0.01
    assert abs(summary["p99"] - 50.0) < 0.1 and abs(summary["max"] - 50.0) < 0.1


def test_percentiles_of_a_uniform_spread():
    summary = latency_ms(merge_histograms([_encoded(*range(1, 1001)), _encoded(*range(1001, 2001))]))
    assert summary["count"] == 2000
    for p, expected_ms in (("p50", 1.0), ("p90", 1.8), ("p99", 1.98), ("max", 2.0)):
        assert abs(summary[p] - expected_ms) / expected_ms < 0.005, (p, summary[p])


def test_latencies_are_clamped_into_the_histogram():
    h = new_histogram()
    record_us(h, -5_000)  # a clock stepping back a little
    record_us(h, 10**15)  # absurdly late
    assert h.get_total_count() == 2 and h.get_min_value() == 1


def test_empty_latency_summary_has_no_numbers():
    assert latency_ms(new_histogram()) == {"count": 0, "p50": None, "p90": None, "p99": None, "max": None,
                                           "mean": None}


def test_build_report_sums_workers_and_accounts_loss():
    w1 = WorkerTotals(devices=2, sent=5, acknowledged={"d0": _bits(0, 1, 2), "d1": _bits(0)}, connects=3,
                      ever_connected=2, errors={"connection_lost": 1}, ack_histogram=_encoded(2000, 3000),
                      all_online_s=0.5, commands_received=4, responses_sent=4)
    w2 = WorkerTotals(devices=1, sent=2, acknowledged={"d2": _bits(0, 1)}, connects=1, ever_connected=1,
                      errors={"connection_lost": 2, "connect_timeout": 1}, ack_histogram=_encoded(1000),
                      all_online_s=1.5, commands_received=2, responses_sent=2)
    checker = CheckerTotals(received={"d0": _bits(0, 1, 2), "d1": _bits(0), "d2": _bits(1)}, deliveries=6,
                            duplicates=1, histogram=_encoded(5000, 6000, 7000, 8000, 9000),
                            commands=CommandTotals(requests_sent=3, responses=3, broadcasts_sent=1,
                                                   broadcast_responses=3, rtt_histogram=_encoded(4000)))
    report = build_report({"devices": 3}, [w1, w2], checker, duration_s=2.0)
    assert report["devices"] == {"configured": 3, "ever_connected": 3, "connects": 4, "churn_disconnects": 0,
                                 "all_online_s": 1.5}
    m = report["messages"]
    assert (m["sent"], m["acknowledged"], m["received"], m["lost"], m["duplicates"]) == (7, 6, 5, 1, 1)
    assert report["throughput_msgs_s"] == {"sent": 3.5, "acknowledged": 3.0, "received": 2.5}
    assert report["latency_ms"]["count"] == 5 and abs(report["latency_ms"]["p50"] - 7.0) < 0.01
    assert report["ack_latency_ms"]["count"] == 3 and abs(report["ack_latency_ms"]["max"] - 3.0) < 0.01
    assert report["errors"] == {"connection_lost": 3, "connect_timeout": 1, "total": 4}
    assert report["commands"]["responses"] == 3 and report["commands"]["received_by_devices"] == 6
    assert report["commands"]["rtt_ms"]["count"] == 1


def test_a_worker_that_never_had_every_device_online_has_no_all_online_time():
    report = build_report({}, [WorkerTotals(devices=1, all_online_s=None), WorkerTotals(devices=1, all_online_s=1.0)],
                          CheckerTotals(), duration_s=1.0)
    assert report["devices"]["all_online_s"] is None and report["commands"] is None


def test_the_table_shows_the_headline_numbers():
    report = build_report({}, [WorkerTotals(devices=1, sent=3, acknowledged={"d": _bits(0, 1, 2)}, ever_connected=1,
                                            all_online_s=0.1)],
                          CheckerTotals(received={"d": _bits(0, 2)}, histogram=_encoded(1500)), duration_s=1.0)
    console = Console(width=120, record=True)
    console.print(report_table(report))
    text = console.export_text()
    assert "lost" in text and "3 / 3" in text and "1.50 / 1.50 / 1.50 / 1.50" in text
