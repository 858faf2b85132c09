"""``lightgate bench compression`` at tiny counts: a line per run with every figure; the bytes are facts (the same
payloads every run), so they are checked; the CPU figures are not."""

import argparse
import json

import orjson

from gateway.bench import compression

FIGURES = {"messages", "log_bytes_per_message", "compressed_share", "append_cpu_ms_per_1000",
           "read_cpu_ms_per_1000", "cpu_ms_per_1000", "codec_encode_ms_per_1000", "codec_decode_ms_per_1000",
           "mean_payload_bytes"}


def test_zstd_shrinks_telemetry_batches_and_leaves_random_kilobytes_raw(tmp_path):
    parser = argparse.ArgumentParser()
    compression.add_arguments(parser)
    args = parser.parse_args(["--messages", "256", "--batches", "1", "32", "--dir", str(tmp_path),
                              "--results", str(tmp_path / "results")])
    summary = compression.run(args)
    [results] = (tmp_path / "results").glob("*.jsonl")
    rows = {(r["kind"], r["payload"], r["batch"], r["compression"]): r
            for r in (json.loads(line)["result"] for line in results.read_text().splitlines())}
    assert len(rows) == 2 * 2 * 2 * 2 and all(FIGURES <= set(r) for r in rows.values())
    assert all(r["messages"] == 256 and r["cpu_ms_per_1000"] > 0 for r in rows.values())
    telemetry_off, telemetry_zstd = rows["telemetry", 64, 32, "off"], rows["telemetry", 64, 32, "zstd"]
    assert telemetry_zstd["compressed_share"] == 1 and telemetry_off["compressed_share"] == 0
    assert telemetry_zstd["log_bytes_per_message"] < telemetry_off["log_bytes_per_message"] / 3
    # one small message stays raw; random kilobytes save too little to be compressed
    assert rows["telemetry", 64, 1, "zstd"]["log_bytes_per_message"] == rows[
        "telemetry", 64, 1, "off"]["log_bytes_per_message"]
    assert rows["random", 1024, 32, "zstd"]["compressed_share"] == 0
    assert rows["telemetry", 1024, 1, "zstd"]["compressed_share"] == 1  # one JSON kilobyte alone already pays
    assert {(s["kind"], s["payload"], s["batch"]) for s in summary["summary"]} == {
        (k, p, b) for k in compression.KINDS for p in (64, 1024) for b in (1, 32)}


def test_telemetry_payloads_are_json_readings_of_about_the_size_asked():
    for size in (64, 1024):
        payloads = compression.make_payloads("telemetry", size, 200)
        assert all({"device", "seq", "ts", "temperature"} <= set(orjson.loads(p)) for p in payloads)
        assert abs(sum(map(len, payloads)) / len(payloads) - size) < size * 0.1
    assert {len(p) for p in compression.make_payloads("random", 100, 10)} == {100}
