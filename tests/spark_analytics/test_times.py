"""Instants and durations as the reader options and the CLI write them (spark_analytics.times)."""

from __future__ import annotations

import pytest

from spark_analytics.times import parse_duration, parse_time, window_label


def test_parse_time_accepts_epoch_ms_and_iso() -> None:
    assert parse_time("1700000000000") == 1_700_000_000_000
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_time("2023-11-14T23:13:20+01:00") == 1_700_000_000_000
    assert parse_time("2023-11-14 22:13:20") == 1_700_000_000_000  # no offset: UTC
    with pytest.raises(ValueError, match="neither epoch"):
        parse_time("yesterday")


def test_durations_and_labels() -> None:
    assert [parse_duration(t) for t in ("90s", "1m", "5 minutes", "1h", "2 hours", "1d")] == [90, 60, 300, 3600, 7200, 86400]
    assert [window_label(s) for s in (60, 3600, 90, 86400, 7200)] == ["1m", "1h", "90s", "1d", "2h"]
    for bad in ("", "0m", "5 parsecs", "m"):
        with pytest.raises(ValueError):
            parse_duration(bad)
