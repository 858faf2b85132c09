"""The commitlog reader's options (spark_analytics.options), without Spark."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_analytics.options import ReaderOptions


def test_options_are_parsed_case_insensitively(tmp_path: Path) -> None:
    (tmp_path / "commitlog").mkdir()
    opts = ReaderOptions.parse({"path": str(tmp_path), "TOPICFILTER": "a/+", "fromTime": "1000",
                                "toTime": "1970-01-01T00:00:02Z", "verifyCrc": "false", "partitionBytes": "1024",
                                "failOnDataLoss": "false", "startingOffsets": "latest", "parse": "telemetry",
                                "telemetry.metrics": "t, h", "telemetry.device": "payload:d",
                                "admitUntil": "1970-01-01T00:00:03Z"})
    assert opts.directory == str(tmp_path / "commitlog")
    assert (opts.decode.topic_filters, opts.decode.from_ms, opts.decode.to_ms, opts.decode.verify_crc) == (
        ("a/+",), 1000, 2000, False)
    assert (opts.partition_bytes, opts.fail_on_data_loss, opts.starting) == (1024, False, "latest")
    assert opts.admit_until_ms == 3000
    assert opts.telemetry is not None and opts.telemetry.metrics == ("t", "h")
    assert ReaderOptions.parse({"path": str(tmp_path)}).telemetry is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"topicFilter": "a/#/b"}, "'#' must be the last level"),
        ({"fromTime": "soon"}, "option fromtime"),
        ({"verifyCrc": "maybe"}, "expected true or false"),
        ({"partitionBytes": "0"}, "must be positive"),
        ({"partitionBytes": "lots"}, "not an integer"),
        ({"startingOffsets": "middle"}, "earliest or latest"),
        ({"parse": "xml"}, "records or telemetry"),
        ({"telemetry.metrics": "t"}, "need parse=telemetry"),
        ({"topic": "a"}, "unknown commitlog option"),
        ({"store": "nohost"}, "option store"),
        ({"maxRecordsPerTrigger": "0"}, "must be positive"),
        ({"maxBytesPerTrigger": "x"}, "not an integer"),
        ({"admitUntil": "later"}, "option admituntil"),
        ({"endingOffsets": "soon"}, "option endingOffsets: not a CommitLog position"),
        ({"startingOffsets": '{"segment": 1}'}, "option startingOffsets: not a CommitLog position"),
        ({"startingOffsets": "5", "startingTimestamp": "0"}, "not both"),
        ({"topicFilters": "a/#"}, "not a JSON array"),
        ({"topicFilters": '["a/b", "a/#/b"]'}, "'#' must be the last level"),
    ],
)
def test_bad_options_name_the_option(tmp_path: Path, extra: dict, message: str) -> None:
    (tmp_path / "commitlog").mkdir()
    with pytest.raises(ValueError, match=message):
        ReaderOptions.parse({"path": str(tmp_path), **extra})


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a path"):
        ReaderOptions.parse({})
    with pytest.raises(FileNotFoundError):
        ReaderOptions.parse({"path": str(tmp_path / "absent")})
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(FileNotFoundError, match="no CommitLog"):  # an existing directory that holds no log
        ReaderOptions.parse({"path": str(tmp_path / "elsewhere")})


def test_the_store_option_needs_no_path() -> None:
    opts = ReaderOptions.parse({"store": "127.0.0.1:7883", "storeToken": "s", "tier": "s3://bucket/tier",
                                "maxRecordsPerTrigger": "1000"})
    assert (opts.directory, opts.store, opts.store_token, opts.tier, opts.max_records) == (
        None, "127.0.0.1:7883", "s", "s3://bucket/tier", 1000)


def test_positions_and_several_topic_filters(tmp_path: Path) -> None:
    (tmp_path / "commitlog").mkdir()
    opts = ReaderOptions.parse({"path": str(tmp_path), "startingOffsets": '{"segment": 65536, "position": 120}',
                                "endingOffsets": "200000", "topicFilter": "a/#", "topicFilters": '["b/+/t", "a/#"]'})
    assert (opts.starting, opts.start_offset, opts.end_offset) == ("offset", 65656, 200000)
    assert opts.decode.topic_filters == ("a/#", "b/+/t")  # the union, each filter once
    times = ReaderOptions.parse({"path": str(tmp_path), "startingTimestamp": "1970-01-01T00:00:01Z",
                                 "endingTimestamp": "5000"})
    assert (times.starting, times.start_offset, times.start_ms, times.end_ms) == ("earliest", None, 1000, 5000)
