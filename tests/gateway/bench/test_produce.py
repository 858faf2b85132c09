"""``lightgate bench produce`` at tiny counts: a line per mode with every figure, embedded and over the RPC."""

import argparse
import json

import pytest

from gateway.bench import produce

FIGURES = {"produced_per_s", "consumed_per_s", "consume_produce_ratio", "p99_send_ms", "disk_bytes_per_message",
           "cpu_ms_per_1000", "acked", "sent", "consumed", "catch_up_s"}


def test_every_mode_reports_its_figures_and_the_consumer_gets_every_message(tmp_path):
    parser = argparse.ArgumentParser()
    produce.add_arguments(parser)
    args = parser.parse_args(["--seconds", "30", "--messages", "300", "--sizes", "64", "--batch", "50",
                              "--dir", str(tmp_path), "--results", str(tmp_path / "results")])
    summary = produce.run(args)
    [results] = (tmp_path / "results").glob("*.jsonl")
    rows = [json.loads(line)["result"] for line in results.read_text().splitlines()]
    assert [(r["target"], r["mode"]) for r in rows] == [(t, m) for t in produce.TARGETS for m in produce.MODES]
    for row in rows:
        assert FIGURES <= set(row), row
        assert row["acked"] == row["sent"] == row["consumed"] == 300, row  # a count: all acknowledged in the time
        assert row["produced_per_s"] > 0 and row["p99_send_ms"] >= 0 and row["cpu_ms_per_1000"] > 0
        assert row["log_bytes_per_message"] > 64  # the payload and the record around it
    assert row["store_cpu_ms_per_1000"] is not None  # over the RPC, the store process's CPU too
    assert {(s["target"], s["payload"]) for s in summary["summary"]} == {("embedded", 64), ("rpc", 64)}
    assert all(s["auto_vs_single"] > 0 for s in summary["summary"])


def test_the_back_end_consumer_may_be_the_group_member_over_the_rpc(tmp_path):
    """``--reader consumer``: the back-end ``Consumer`` (its defaults, auto-commit) reads instead of the claims; it
    gets every message; the ratio after the warm-up and the whole window's are both reported."""
    parser = argparse.ArgumentParser()
    produce.add_arguments(parser)
    args = parser.parse_args(["--seconds", "30", "--messages", "300", "--sizes", "64", "--batch", "50",
                              "--modes", "batch", "--targets", "rpc", "--reader", "consumer",
                              "--dir", str(tmp_path), "--results", str(tmp_path / "results")])
    produce.run(args)
    [results] = (tmp_path / "results").glob("*.jsonl")
    [row] = [json.loads(line)["result"] for line in results.read_text().splitlines()]
    assert FIGURES | {"consume_produce_in_window", "produced_after_warm_up_per_s"} <= set(row), row
    assert row["acked"] == row["sent"] == row["consumed"] == 300, row
    assert row["settings"]["reader"] == "consumer"
    embedded = parser.parse_args(["--reader", "consumer", "--targets", "embedded"])
    with pytest.raises(SystemExit, match="over the RPC"):
        produce.run(embedded)
