"""``lightgate bench hostile`` at tiny sizes: every attack runs beside the canary and reports its figures."""

import argparse

import pytest

from gateway.bench import hostile


@pytest.mark.slow
def test_every_attack_reports_the_canary_the_rss_and_what_the_attacker_saw():
    parser = argparse.ArgumentParser()
    hostile.add_arguments(parser)
    args = parser.parse_args(["--brokers", "lightgate", "--scale", "0.005", "--phase-s", "0.3", "--settle-s", "0.3"])
    result = hostile.run(args)
    assert set(result["attacks"]) == set(hostile.ATTACKS)
    for attack, per_broker in result["attacks"].items():
        run = per_broker["lightgate"]
        assert "error" not in run["attacker"] and "timed_out" not in run["attacker"], (attack, run["attacker"])
        assert run["canary"]["before"]["received"] > 0, attack
        assert run["rss_MiB"]["peak_during"] >= run["rss_MiB"]["before"] > 0
        assert run["client_cpu_s_during"] >= 0 and run["broker_cpu_s_during"] >= 0, attack
    seen = {attack: per_broker["lightgate"]["attacker"] for attack, per_broker in result["attacks"].items()}
    assert seen["big-topics"]["connections_closed_by_broker"] > 0  # 65 KB topics: over limits.max_topic_length
    assert seen["user-properties"]["refused_with_close"] == seen["user-properties"]["packets"]
    assert seen["churn-ws"]["failed"] == 0 and seen["churn-tcp"]["failed"] == 0
    assert seen["session-filters"]["granted"] == 50 * 5  # 50 sessions x 1,000 filters x 0.005, none refused
    assert isinstance(result["warnings"], list)


def test_a_client_busier_than_the_broker_is_warned_of():
    runs = {("session-filters", "mosquitto"): {"client_cpu_s_during": 1.87, "broker_cpu_s_during": 0.79},
            ("session-filters", "lightgate"): {"client_cpu_s_during": 0.2, "broker_cpu_s_during": 4.85},
            ("flood", "lightgate"): {"client_cpu_s_during": None, "broker_cpu_s_during": 1.0}}  # timed out
    assert hostile.client_warnings(runs) == [
        "mosquitto session-filters: the attack client used 1.87 CPU s, more than the broker's 0.79 s: "
        "the client may have set the pace"]
