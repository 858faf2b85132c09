"""``lightgate bench proportion`` at tiny sizes: each scenario runs beside the canary and is set against its target."""

import argparse

import pytest

from gateway.bench import proportion


def tiny(*argv: str) -> argparse.Namespace:
    """The benchmark's arguments, its own defaults under ``argv``."""
    parser = argparse.ArgumentParser()
    proportion.add_arguments(parser)
    return parser.parse_args(["--scale", "0.01", "--phase-s", "0.3", "--settle-s", "0.3", *argv])


@pytest.mark.slow
def test_every_scenario_reports_its_figures_against_the_targets():
    result = proportion.run(tiny("--brokers", "lightgate"))
    runs = result["runs"]["lightgate"]
    assert set(runs) == set(proportion.SCENARIOS)
    assert runs["session-filters"]["attacker"]["granted"] == 50 * 10  # 50 sessions x 1,000 filters x 0.01
    assert runs["never-reads"]["attacker"]["reader_received"] == runs["never-reads"]["attacker"]["published"] == 30
    figures = result["figures"]["lightgate"]
    assert set(figures) == set(proportion.TARGETS)
    for scenario, figure in figures.items():
        assert set(proportion.TARGETS[scenario]) <= set(figure) and figure["met"] in (True, False), scenario
    assert figures["session-filters"]["client_cpu_s"] >= 0 and figures["session-filters"]["broker_cpu_s"] >= 0
    assert isinstance(result["warnings"], list)
