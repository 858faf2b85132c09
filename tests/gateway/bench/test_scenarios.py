"""Churn, offline fan-out and durability at tiny sizes; the results table and charts of gateway/bench/history.py."""

import argparse
import json
import os
import struct
import subprocess
import sys

import pytest
from rich.console import Console

from gateway.bench import churn, common, compare, durability, history, offline_fanout, peers
from tests.helpers.processes import ROOT

BROKERS = [
    "lightgate",
    pytest.param("mosquitto", marks=pytest.mark.skipif(bool(peers.missing("mosquitto")),
                                                       reason=peers.missing("mosquitto") or "")),
]


def _args(module, broker: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(["--brokers", broker, *argv])


# --- the scenarios, against brokers started by the tests ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("broker", BROKERS)
def test_churn_resumes_every_session_and_loses_nothing(broker):
    result = churn.run(_args(churn, broker, "--clients", "8", "--cycles", "3", "--messages", "4"))
    run = result["brokers"][broker]
    assert run["clients"] == 8
    assert run["reconnects"] == 24 and run["resumed"] == 24 and run["not_resumed"] == 0
    assert run["sent"] == run["acked"] == 8 * 3 * 4
    assert run["received"] >= run["acked"] and run["lost"] == 0 and not run["drain_capped"]
    assert run["connects_per_s"] > 0 and run["cycling_s"] > 0
    assert set(run["reconnect_ms"]) == {"p50", "p90", "p99", "p999", "max"}
    assert run["broker"]["cpu_s"] >= 0
    if broker == "lightgate":
        assert result["targets"]["lightgate_lost"]["met"] and result["targets"]["lightgate_not_resumed"]["met"]
    assert result["ratios"] == {"connects_per_s": {}}  # one broker measured: no ratio


@pytest.mark.slow
@pytest.mark.parametrize("broker", BROKERS)
def test_offline_fanout_delivers_every_broadcast_after_the_reconnect(broker):
    result = offline_fanout.run(_args(offline_fanout, broker, "--sessions", "10", "--messages", "30",
                                      "--workers", "2", "--drain", "60"))
    run = result["brokers"][broker]
    assert run["broadcasts_acked"] == 30 and run["sessions_resumed"] == 10
    assert run["expected"] == run["delivered"] == 300 and run["delivered_share"] == 1.0
    assert run["lost"] == 0 and not run["drain_capped"] and run["drain_s"] > 0
    assert run["broadcast_payload_bytes"] == 30 * 256
    assert run["rss_growth_MiB"] == pytest.approx(run["rss_MiB_after_broadcasts"] - run["rss_MiB_offline"], abs=0.02)
    if broker == "lightgate":
        # The broadcasts are in the CommitLog (delivered after the reconnect, above), counted in allocated blocks: a
        # read round's QoS 1 run is one batch record, and its zstd body of 30 stamped, zero-filled payloads can fit
        # in the segment block already allocated, so the growth may be 0, never negative nor over the target.
        assert 0 <= run["disk_growth_bytes"] <= 2 * 30 * 256
        assert run["disk_per_payload_byte"] == pytest.approx(run["disk_growth_bytes"] / (30 * 256), abs=0.001)
        assert set(result["targets"]) == {"lightgate_delivered_share", "lightgate_rss_growth_MiB",
                                          "lightgate_disk_per_payload_byte"}
    else:
        assert run["disk_growth_bytes"] == 0  # Mosquitto without persistence queues in RAM


@pytest.mark.slow
def test_durability_loses_no_acknowledged_message_on_lightgate_and_says_why_amqtt_is_skipped():
    args = _args(durability, "lightgate", "--cycles", "2", "--load", "0.5", "--publishers", "2", "--rate", "100")
    args.brokers = ["lightgate", "amqtt"]
    result = durability.run(args)
    assert set(result["brokers"]) == {"lightgate"}
    assert "no persistence" in result["skipped"]["amqtt"]
    run = result["brokers"]["lightgate"]
    assert run["cycles"] == 2 and len(run["restart_s"]["runs"]) == 2 and run["restart_s"]["median"] > 0
    assert run["reconnect_s"]["not_reconnected"] == 0
    assert run["acked"] > 0 and run["lost"] == 0 and not run["drain_capped"]
    assert run["received"] >= run["acked"]
    assert run["publisher_reconnects"] >= 2 * 2  # both publishers came back after both kills
    assert run["subscriber_sessions_lost"] == 0
    assert result["targets"]["lightgate_lost"]["met"]


@pytest.mark.slow
def test_durability_qos2_is_exactly_once_on_lightgate_with_resends_by_the_spec():
    args = _args(durability, "lightgate", "--qos", "2", "--cycles", "1", "--load", "1", "--publishers", "1",
                 "--rate", "100")
    section = durability.run(args)["qos2"]
    run = section["brokers"]["lightgate"]
    assert run["cycles"] == 1 and run["acked"] > 0 and run["publisher_resent"] >= 0
    assert run["lost"] == 0 and run["duplicates"] == 0 and run["qos1_subscriber"]["lost"] == 0
    assert run["resends"]["without_dup"] == 0 and run["resends"]["with_new_id"] == 0 and run["dropped_held"] == 0
    assert run["subscriber_sessions_lost"] == 0 and run["publisher_sessions_lost"] == 0
    assert section["targets"]["lightgate_duplicates"]["met"] and section["targets"]["lightgate_lost"]["met"]


@pytest.mark.slow
@pytest.mark.skipif(bool(peers.missing("mosquitto")), reason=peers.missing("mosquitto") or "")
def test_durability_reports_what_mosquitto_loses():
    result = durability.run(_args(durability, "mosquitto", "--cycles", "1", "--load", "3", "--publishers", "1",
                                  "--rate", "100"))
    run = result["brokers"]["mosquitto"]
    assert run["cycles"] == 1 and len(run["restart_s"]["runs"]) == 1
    assert run["acked"] > 0 and run["received"] > 0 and run["lost"] >= 0 and not run["drain_capped"]
    assert run["publisher_reconnects"] >= 1
    # Its persistence file is written (as root it must not switch to a user that cannot write it):
    # the subscriber's session, older than one save (every two seconds at autosave_interval 1:
    # Mosquitto 2.0 compares whole seconds), survives the kill. At --load 1.5 it was lost when
    # the kill came before the first save after the SUBSCRIBE.
    assert run["subscriber_sessions_lost"] == 0
    assert "targets" not in result


@pytest.mark.slow
def test_a_restarted_broker_keeps_its_port_and_its_data(tmp_path):
    broker = peers.start("lightgate", tmp_path, durable=True)
    try:
        port, pid = broker.port, broker.process.pid
        assert broker.disk_bytes() > 0  # CommitLog and RocksDB files under <workdir>/data
        broker.kill()
        assert broker.process.returncode == -9
        broker = peers.restart(broker)  # returns once the new process accepts connections
        assert broker.port == port and broker.process.pid != pid and broker.durable
        assert broker.process.args[-2:] == ["--commitlog-flush", "sync"]
        assert str(tmp_path / peers.DATA_DIR) in broker.process.args
    finally:
        broker.stop()


def test_a_broker_without_persistence_cannot_run_durable(tmp_path):
    with pytest.raises(peers.PeerError, match="amqtt cannot run durable: .*anonymous"):
        peers.start("amqtt", tmp_path, durable=True)
    assert not (tmp_path / "amqtt.log").exists()  # refused before anything was started


def test_disk_bytes_counts_allocated_blocks_not_the_sparse_size(tmp_path):
    data = tmp_path / peers.DATA_DIR / "segments"
    data.mkdir(parents=True)
    with open(data / "00000000000000000000", "wb") as fh:
        fh.truncate(256 * 2**20)  # pre-sized like a CommitLog segment
        fh.write(b"x" * 8192)
        fh.flush()
        os.fsync(fh.fileno())
    broker = peers.Broker("lightgate", 1, process=None, log=None, workdir=tmp_path)
    assert 8192 <= broker.disk_bytes() < 2**20


# --- the results table and the charts ------------------------------------------------------


def _doc(bench: str, at: str, result: dict) -> str:
    return json.dumps({"bench": bench, "at": at, "machine": {}, "result": result})


def _churn(at: str, lightgate_rate: float, mosquitto_rate: float) -> str:
    def broker(rate: float, lost: int) -> dict:
        return {"connects_per_s": rate, "reconnects": 40, "resumed": 40, "lost": lost}
    brokers = {"mosquitto": broker(mosquitto_rate, 3), "lightgate": broker(lightgate_rate, 0), "amqtt": broker(0, 1)}
    return _doc("churn", at, {"brokers": brokers})


@pytest.fixture
def results(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    (directory / "2026-11-21.jsonl").write_text("\n".join([
        _churn("2026-11-21T10:00:00+00:00", 200.0, 800.0),
        _doc("store", "2026-11-21T10:05:00+00:00", {"rows": []}),  # no brokers: not in the table
        "{not json",
    ]) + "\n")
    (directory / "2026-11-22.jsonl").write_text("\n".join([
        _churn("2026-11-22T09:00:00+00:00", 300.0, 600.0),
        _doc("fanin", "2026-11-22T09:10:00+00:00", {
            "qos1": {"brokers": {"lightgate": {"delivered_per_s": 9000, "lost": 0, "expected": 90_000,
                                               "latency_ms": {"p50": 4.0, "p99": 11.0}},
                                 "mosquitto": {"delivered_per_s": 1000, "lost": 81_000, "expected": 90_000,
                                               "latency_ms": {"p50": 30.0, "p99": 60.0}}}}}),
    ]) + "\n")
    return directory


def test_from_a_checkout_results_go_to_its_bench_results_where_the_run_history_is():
    """The code is gateway/bench/, the data stays bench/results/ of the repository (the wheel's case: the working
    directory, tests/test_packaging.py)."""
    assert common.RESULTS_DIR == ROOT / "bench" / "results"
    assert (common.RESULTS_DIR / "history.md").is_file() and any(common.RESULTS_DIR.glob("*.jsonl"))
    parser = argparse.ArgumentParser()
    history.add_arguments(parser)
    assert parser.parse_args([]).results == common.RESULTS_DIR


def test_history_skips_bad_lines_and_keeps_the_runs_in_time_order(results, capsys):
    docs = history.load(results)
    assert [d["bench"] for d in docs] == ["churn", "store", "churn", "fanin"]
    assert "2026-11-21.jsonl:3: not JSON" in capsys.readouterr().err


def test_rows_carry_the_headline_figures_and_lightgates_ratio_to_each_peer(results):
    table_rows = history.rows(history.load(results))
    assert [(r.scenario, r.broker) for r in table_rows] == [
        ("churn", "lightgate"), ("churn", "mosquitto"), ("churn", "amqtt"),
        ("churn", "lightgate"), ("churn", "mosquitto"), ("churn", "amqtt"),
        ("fanin qos1", "lightgate"), ("fanin qos1", "mosquitto"),
    ]
    latest = table_rows[3]
    assert latest.figures == {"connects/s": 300.0, "resumed %": 100.0, "lost": 0}
    assert latest.ratios == {"mosquitto": 0.5, "amqtt": None}  # amqtt's 0 connects/s gives no ratio
    assert table_rows[4].ratios == {}  # ratios are LightGate's, on its own rows
    assert table_rows[6].figures == {"delivered/s": 9000, "lost": 0, "p50 ms": 4.0, "p99 ms": 11.0}
    assert [r.scenario for r in history.rows(history.load(results), ["fanin"])] == ["fanin qos1"] * 2


def test_a_ratio_against_a_peer_that_dropped_most_of_its_messages_says_so():
    """9x Mosquitto's delivered/s is no like-for-like figure when Mosquitto dropped 90% of the messages."""
    lightgate = {"delivered_per_s": 9000, "lost": 0, "expected": 90_000}
    brokers = {"lightgate": lightgate, "mosquitto": {"delivered_per_s": 1000, "lost": 81_000, "expected": 90_000},
               "amqtt": {"delivered_per_s": 4500, "lost": 45_000, "expected": 90_000}}  # half: not most
    assert compare.caveats(brokers) == {"lightgate/mosquitto": "dropped 90%"}
    assert compare.caveats({"mosquitto": brokers["mosquitto"]}) == {}  # no LightGate, no ratio
    row = history.rows([json.loads(_doc("fanin", "2026-11-22T09:10:00+00:00", {"qos1": {"brokers": brokers}}))])[0]
    assert row.ratios == {"mosquitto": 9.0, "amqtt": 2.0} and row.caveats == {"mosquitto": "dropped 90%"}


def test_the_table_shows_one_line_per_run_and_broker(results):
    console = Console(width=200, record=True)
    console.print(history.results_table(history.rows(history.load(results))))
    lines = console.export_text().splitlines()
    starts = [n for n, line in enumerate(lines) if "churn" in line or "fanin" in line]
    assert len(starts) == 8  # a row's first line names its scenario; its figures follow, one per line
    latest = lines[starts[3]:starts[4]]
    cells = [cell.strip() for cell in latest[0].split("│")[1:-1]]
    assert cells == ["2026-11-22 09:00", "churn", "lightgate", "connects/s 300", "0.5", "-"]  # 300/600; amqtt: 0
    assert "resumed % 100" in latest[1] and "lost 0" in latest[2]
    assert "fanin qos1" in lines[starts[6]] and "delivered/s 9,000" in lines[starts[6]]
    assert "9 (dropped 90%)" in lines[starts[6]]  # on the ratio's own line


def test_a_run_shows_its_rows_on_stderr_and_other_benchmarks_show_nothing(capsys):
    history.show(json.loads(_churn("2026-11-22T09:00:00+00:00", 300.0, 600.0)))
    history.show(json.loads(_doc("store", "2026-11-22T09:05:00+00:00", {"rows": []})))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("churn") == 3 and "store" not in captured.err


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[16:20])[0]  # IHDR width


def test_charts_are_pngs_with_a_trend_once_a_scenario_has_history(results, tmp_path):
    written = history.write_charts(history.rows(history.load(results)), tmp_path / "charts")
    assert sorted(p.name for p in written) == ["churn.png", "fanin-qos1.png"]
    # Two runs of churn: latest bars and the trend side by side; fanin has one run: bars only.
    assert _png_width(tmp_path / "charts" / "churn.png") > 1.5 * _png_width(tmp_path / "charts" / "fanin-qos1.png")


@pytest.mark.slow
def test_bench_report_prints_the_table_and_writes_the_charts(results, tmp_path):
    charts = tmp_path / "charts"
    done = subprocess.run([sys.executable, "-m", "gateway.app.cli", "bench", "report", "--results", str(results),
                           "--charts", str(charts), "--last", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2026-11-22 09:00" in done.stdout and "2026-11-21 10:00" not in done.stdout  # --last 1
    assert (charts / "churn.png").exists() and f"wrote {charts / 'churn.png'}" in done.stdout


def test_bench_report_without_results_says_so(tmp_path):
    args = argparse.Namespace(results=tmp_path, charts=tmp_path / "charts", scenario=[], last=0)
    assert history.main(args) == 1
    assert not (tmp_path / "charts").exists()
