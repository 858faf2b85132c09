"""``lightgate bench analytics``' pure-Python reference counts telemetry rows: the store's control records in the
same log (FLAG_CONTROL, store/control.py) are not telemetry and must not be read as such."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway.bench.analytics import _python_reference
from store.control import SessionEnded, encode_control
from store.log.commitlog import CommitLog, CommitLogConfig
from store.log.record import encode_record


def test_the_reference_counts_the_messages_and_skips_control_records(tmp_path: Path) -> None:
    config = CommitLogConfig(segment_bytes=16 * 1024, max_record_bytes=16 * 1024)
    with CommitLog.open(tmp_path / "commitlog", config) as log:
        for i in range(300):
            body = orjson.dumps({"temp": 20 + i % 5, "hum": 40.5, "bat": 3.7})
            log.append(encode_record(f"fleet/d{i % 3}/telemetry", body, store_ms=60_000 * (i // 100)))
            log.append(encode_control(SessionEnded(f"c{i}"), 60_000 * (i // 100), 1 << 20)[0])
    _seconds, totals = _python_reference(tmp_path, config)
    assert totals == {"groups": 9, "rows": 300}
