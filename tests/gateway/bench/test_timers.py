"""``lightgate bench timers`` at tiny counts: the delayed messages fire, then the control phase (``busy``) appends as
many undelayed ones to the same topics in the dequeue's writes, and the probe reports each phase apart."""

import argparse

from gateway.bench import timers

MESSAGES = 2000


def _run(tmp_path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    timers.add_arguments(parser)
    return timers.run(parser.parse_args(["--messages", str(MESSAGES), "--due-rate", "1000", "--lead", "2",
                                         "--payload", "16", "--topics", "10", "--dir", str(tmp_path), *extra]))


def test_the_busy_phase_appends_as_many_undelayed_messages_as_fired_and_the_probe_times_it_apart(tmp_path):
    result = _run(tmp_path)
    assert result["delivered"] == MESSAGES  # the busy messages, on the same topics, are not counted as fired
    busy = result["busy"]
    assert busy["messages"] == MESSAGES
    assert busy["indexed_on_topics"] == 2 * MESSAGES  # the fired ones and the busy ones, all indexed
    assert 1 <= busy["writes"] <= MESSAGES and busy["per_s"] > 0 and busy["cpu_us_per_message"] > 0
    probe = result["probe_round_trip_ms"]
    assert set(probe) == {"idle", "firing", "busy"}
    assert probe["busy"]["n"] >= 1 and probe["busy"]["p99"] <= probe["busy"]["max"]
    assert result["probe_hz"] == timers.PROBE_HZ


def test_the_control_phase_can_be_left_out_and_runs_without_the_probe(tmp_path):
    skipped = _run(tmp_path, "--no-busy")
    assert skipped["busy"] is None and skipped["probe_round_trip_ms"]["busy"] is None
    assert skipped["delivered"] == MESSAGES
    unprobed = _run(tmp_path, "--probe-hz", "0")
    assert unprobed["probe_round_trip_ms"] is None
    assert unprobed["busy"]["messages"] == MESSAGES and unprobed["busy"]["indexed_on_topics"] == 2 * MESSAGES
