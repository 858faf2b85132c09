"""``lightgate bench pop`` at tiny sizes: a line per mode with every figure, no message lost in either mode."""

import argparse
import json

from gateway.bench import pop

FIGURES = {"published", "acked", "lost", "delivered_per_s", "deliveries", "redelivered", "dead_lettered", "p50_ms",
           "p99_ms", "p999_ms", "max_ms", "late", "drain_s"}


def tiny_run(tmp_path) -> tuple[dict, list[dict]]:
    """The bench at 100 messages/s for 2 s, three members (one hangs, one crashes), invisible 1 s: its summary and
    its result lines."""
    parser = argparse.ArgumentParser()
    pop.add_arguments(parser)
    summary = pop.run(parser.parse_args(["--seconds", "2", "--rate", "100", "--consumers", "3", "--invisible-s", "1",
                                         "--dir", str(tmp_path), "--results", str(tmp_path / "results")]))
    lines = next((tmp_path / "results").glob("*.jsonl")).read_text().splitlines()
    return summary, [json.loads(line)["result"] for line in lines]


def test_both_modes_report_their_figures_and_lose_nothing_to_hung_and_crashed_members(tmp_path):
    summary, rows = tiny_run(tmp_path)
    assert [r["mode"] for r in rows] == list(pop.MODES)
    for row in rows:
        assert FIGURES <= set(row), row
        assert row["published"] == 200 and row["acked"] == 200 and row["lost"] == 0, row
        assert row["deliveries"] >= 200 and row["redelivered"] >= 0 and row["p99_ms"] > 0
    assert rows[0]["dead_lettered"] == 0  # POP: far from 16 attempts in 2 s
    assert rows[1]["dead_lettered"] is None  # a claim/ack group has no dead-letter queue
    assert set(summary["summary"]["p99_ms"]) == {"pop", "claim"}
