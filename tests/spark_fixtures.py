"""Shared helpers of the spark_analytics tests: CommitLogs written with the real
CommitLog, generated telemetry, and one SparkSession per test session.

Import the fixture into a test module with ``from spark_fixtures import spark_session_fixture``
(it is named ``spark`` for the tests)
(pytest puts tests/ on sys.path); the session is created once per process and
stopped at exit, however many modules import the fixture.
"""

from __future__ import annotations

import atexit
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

from store.commitlog import CommitLog, CommitLogConfig
from store.record import encode_record

T0_MS = 1_699_999_980_000
"""2023-11-14T22:13:00Z, a whole minute: generated times line up with windows."""

SEGMENT_BYTES = 64 * 1024
"""Small segments, so a few thousand records span many of them."""


@dataclass(frozen=True)
class Msg:
    """One generated message: what a pure-Python reference needs to know."""

    topic: str
    payload: bytes
    store_ms: int
    client_id: str = ""
    qos: int = 0
    retain: bool = False
    properties: bytes = b""


def encode(msg: Msg) -> bytes:
    return encode_record(msg.topic, msg.payload, client_id=msg.client_id, qos=msg.qos, retain=msg.retain,
                         properties=msg.properties, born_ms=max(0, msg.store_ms - 3), store_ms=msg.store_ms)


def write_log(data: Path, msgs: Iterable[Msg], *, segment_bytes: int = SEGMENT_BYTES, batch: int = 500) -> list[int]:
    """Append ``msgs`` to the CommitLog under ``data/commitlog`` (created or
    continued), flush and close it. Returns the offsets of the appended records."""
    offsets: list[int] = []
    config = CommitLogConfig(segment_bytes=segment_bytes, max_record_bytes=min(segment_bytes, 1 << 20), flush="async")
    log = CommitLog.open(data / "commitlog", config)
    try:
        chunk: list[bytes] = []
        for msg in msgs:
            chunk.append(encode(msg))
            if len(chunk) == batch:
                offsets += log.append_batch(chunk)
                chunk = []
        if chunk:
            offsets += log.append_batch(chunk)
        log.flush()
    finally:
        log.close()
    return offsets


def telemetry(n: int, *, devices: int = 7, start_ms: int = T0_MS, step_ms: int = 1_000, seed: int = 7,
              bad_every: int = 0) -> list[Msg]:
    """``n`` telemetry messages on ``fleet/<device>/telemetry`` with temp/hum
    payloads and store times ``step_ms`` apart; every ``bad_every``-th payload
    is malformed in one of several ways (for the quarantine)."""
    rnd = random.Random(seed)
    bad = [b"{not json", b"[1, 2, 3]", b'{"temp": "warm", "hum": 1}', b'{"other": 1}', b""]
    out = []
    for i in range(n):
        device = f"dev{i % devices}"
        if bad_every and i % bad_every == bad_every - 1:
            payload = bad[(i // bad_every) % len(bad)]
        else:
            body: dict[str, Any] = {"temp": round(rnd.uniform(-20, 40), 3), "hum": rnd.randint(0, 100)}
            if i % 11 == 5:
                del body["hum"]  # partial metrics are still telemetry
            payload = json.dumps(body).encode()
        out.append(Msg(f"fleet/{device}/telemetry", payload, start_ms + i * step_ms, client_id=device, qos=i % 3))
    return out


_SESSION: list[Any] = []


def _session() -> Any:
    if not _SESSION:
        from spark_analytics.session import spark_session

        spark = spark_session("local[2]", app_name="lightgate-tests")
        _SESSION.append(spark)
        atexit.register(spark.stop)
    return _SESSION[0]


@pytest.fixture(scope="session", name="spark")
def spark_session_fixture() -> Iterator[Any]:
    """The test process's one local SparkSession (``commitlog`` registered)."""
    yield _session()
