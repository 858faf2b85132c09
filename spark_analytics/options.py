"""The ``commitlog`` reader's options, parsed once into a frozen, picklable record.

Spark hands a data source its options as strings with case-insensitive keys.
They are parsed on the driver when the source is created, so a typo or a bad
value fails the query at ``load()`` with the option's name, not later in a
task; partitions then carry this record and segment paths, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .framing import DecodeOptions
from .layout import commitlog_dir
from .planning import PARTITION_BYTES
from .telemetry import OPTION_PREFIX, TelemetryMapping
from .times import parse_time
from lightqueue.topics import validate_filter
from store.rpc.wire import parse_addresses

__all__ = ["OPTIONS", "ReaderOptions"]

OPTIONS = {
    "path": "the data directory (with commitlog/ inside) or the CommitLog directory; optional with store",
    "tier": "the Parquet tier (tier.uri of the store): a directory or a pyarrow.fs URI; read with the local log",
    "store": "HOST:PORT of the store node, or a replicated store's replicas HOST:PORT,HOST:PORT,... (read from a "
             "follower): the live tail is read over its RPC (no segment files needed)",
    "storetoken": "the store's store.token, for the store option",
    "maxrecordspertrigger": "streaming: at most this many records per micro-batch (default: no limit)",
    "maxbytespertrigger": "streaming: about this many log bytes per micro-batch at most (default: no limit)",
    "admituntil": "streaming: ISO-8601 or epoch ms after which no micro-batch admits records (the running one "
                  "finishes; availableNow then ends): a stop that interrupts nothing",
    "topicfilter": "MQTT topic filter (+, #): only matching records are returned",
    "topicfilters": "a JSON array of MQTT topic filters: the records matching any of them (with topicFilter too)",
    "fromtime": "store time lower bound, inclusive: ISO-8601 or epoch ms",
    "totime": "store time upper bound, exclusive: ISO-8601 or epoch ms",
    "verifycrc": "true (default) or false: check each returned record's CRC32C",
    "partitionbytes": f"segment bytes per Spark partition (default {PARTITION_BYTES})",
    "failondataloss": "streaming/batch: true (default) fails when segments were deleted by "
                      "retention before they were read; false logs a warning and skips them",
    "startingoffsets": "earliest (default), latest (streaming), or a CommitLog position: the offset column's "
                       "value or a stream offset {\"segment\": S, \"position\": P}; the first record at or after it",
    "endingoffsets": "latest (default) or a CommitLog position (as startingOffsets): the read ends before it",
    "startingtimestamp": "ISO-8601 or epoch ms: start at the first record (in log order) stored at or after it",
    "endingtimestamp": "ISO-8601 or epoch ms: end before the first record (in log order) stored at or after it",
    "parse": "records (default: raw record columns) or telemetry (parsed JSON payloads)",
    OPTION_PREFIX + "metrics": "telemetry: comma-separated numeric payload fields",
    OPTION_PREFIX + "device": "telemetry: topic:<level> (default topic:1) or payload:<field>",
    OPTION_PREFIX + "time": "telemetry: store (default) or payload:<field>",
    OPTION_PREFIX + "timeunit": "telemetry: ms (default), s or iso for a payload time field",
    OPTION_PREFIX + "key": "telemetry: a payload field identifying a device's message (e.g. seq): the key "
                           "column, for de-duplication",
}
"""Every option the reader accepts (lower case), with its meaning; unknown ones are refused."""

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _bool(options: Mapping[str, str], key: str, default: bool) -> bool:
    value = options.get(key)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"option {key}: expected true or false, not {value!r}")


def _position(key: str, value: str) -> int:
    """A CommitLog position: a global offset (the ``offset`` column), or a stream offset's JSON."""
    text = value.strip()
    if text.isdigit():
        return int(text)
    try:
        offset: Any = json.loads(text)
    except ValueError:
        offset = None
    if (isinstance(offset, dict) and set(offset) == {"segment", "position"}
            and all(type(v) is int and v >= 0 for v in offset.values())):
        return offset["segment"] + offset["position"]
    raise ValueError(f"option {key}: not a CommitLog position (an offset, or {{\"segment\": S, \"position\": P}}): "
                     f"{value!r}")


def _topic_filters(low: Mapping[str, str]) -> tuple[str, ...]:
    """``topicFilter`` and the filters of ``topicFilters`` (a JSON array), validated, without repeats."""
    filters = [low["topicfilter"]] if low.get("topicfilter") else []
    if low.get("topicfilters"):
        try:
            more = json.loads(low["topicfilters"])
        except ValueError:
            more = None
        if not isinstance(more, list) or not all(isinstance(f, str) for f in more):
            raise ValueError(f"option topicFilters: not a JSON array of strings: {low['topicfilters']!r}")
        filters += more
    for topic_filter in filters:
        validate_filter(topic_filter)
    return tuple(dict.fromkeys(filters))


@dataclass(frozen=True, slots=True)
class ReaderOptions:
    """Everything a reader needs besides the segment paths of its partition."""

    directory: str | None
    decode: DecodeOptions
    partition_bytes: int = PARTITION_BYTES
    fail_on_data_loss: bool = True
    starting: str = "earliest"
    start_offset: int | None = None
    end_offset: int | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    telemetry: TelemetryMapping | None = None
    tier: str | None = None
    store: str | None = None
    store_token: str = ""
    max_records: int | None = None
    max_bytes: int | None = None
    admit_until_ms: int | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReaderOptions:
        """Parse Spark's string options.

        Raises:
            ValueError: an unknown option or a bad value, naming the option.
            FileNotFoundError: the path holds no CommitLog directory.
        """
        low = {k.lower(): v for k, v in options.items()}
        unknown = sorted(set(low) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown commitlog option(s) {', '.join(unknown)}; known: {', '.join(sorted(OPTIONS))}")
        if "path" not in low and not low.get("store"):
            raise ValueError("the commitlog source needs a path: spark.read.format('commitlog').load(DIR), "
                             "or the store option (HOST:PORT of the store node)")
        store = low.get("store") or None
        if store is not None:
            try:
                parse_addresses(store)
            except ValueError as exc:
                raise ValueError(f"option store: {exc}") from None
        limits = {}
        for key in ("maxrecordspertrigger", "maxbytespertrigger"):
            if low.get(key):
                try:
                    limits[key] = int(low[key])
                except ValueError:
                    raise ValueError(f"option {key}: not an integer: {low[key]!r}") from None
                if limits[key] <= 0:
                    raise ValueError(f"option {key} must be positive, not {limits[key]}")
        topic_filters = _topic_filters(low)
        bounds = {}
        for key in ("fromtime", "totime", "admituntil", "startingtimestamp", "endingtimestamp"):
            if low.get(key):
                try:
                    bounds[key] = parse_time(low[key])
                except ValueError as exc:
                    raise ValueError(f"option {key}: {exc}") from None
        try:
            partition_bytes = int(low.get("partitionbytes", PARTITION_BYTES))
        except ValueError:
            raise ValueError(f"option partitionBytes: not an integer: {low['partitionbytes']!r}") from None
        if partition_bytes <= 0:
            raise ValueError(f"option partitionBytes must be positive, not {partition_bytes}")
        starting = low.get("startingoffsets", "earliest").lower()
        start_offset = None
        if starting not in ("earliest", "latest"):
            try:
                start_offset = _position("startingOffsets", starting)
            except ValueError as exc:
                raise ValueError(f"{exc}; or earliest or latest") from None
            starting = "offset"
        ending = low.get("endingoffsets", "latest").lower()
        end_offset = None if ending == "latest" else _position("endingOffsets", ending)
        if "startingtimestamp" in bounds and "startingoffsets" in low:
            raise ValueError("give startingOffsets or startingTimestamp, not both")
        if "endingtimestamp" in bounds and end_offset is not None:
            raise ValueError("give endingOffsets or endingTimestamp, not both")
        parse = low.get("parse", "records").lower()
        if parse not in ("records", "telemetry"):
            raise ValueError(f"option parse: records or telemetry, not {parse!r}")
        telemetry = TelemetryMapping.from_options(low) if parse == "telemetry" else None
        if telemetry is None and any(k.startswith(OPTION_PREFIX) for k in low):
            raise ValueError("telemetry.* options need parse=telemetry")
        return cls(
            directory=str(commitlog_dir(low["path"])) if low.get("path") and store is None else None,
            decode=DecodeOptions(
                verify_crc=_bool(low, "verifycrc", True),
                topic_filters=topic_filters,
                from_ms=bounds.get("fromtime"),
                to_ms=bounds.get("totime"),
            ),
            partition_bytes=partition_bytes,
            fail_on_data_loss=_bool(low, "failondataloss", True),
            starting=starting,
            start_offset=start_offset,
            end_offset=end_offset,
            start_ms=bounds.get("startingtimestamp"),
            end_ms=bounds.get("endingtimestamp"),
            telemetry=telemetry,
            tier=low.get("tier") or None,
            store=store,
            store_token=low.get("storetoken", ""),
            max_records=limits.get("maxrecordspertrigger"),
            max_bytes=limits.get("maxbytespertrigger"),
            admit_until_ms=bounds.get("admituntil"),
        )
