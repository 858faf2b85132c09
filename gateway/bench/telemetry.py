"""Simulated device telemetry: metric random walks, topic templates and JSON payloads.

Pure functions and small value objects, no I/O: the device workers call them
once per message, the checking subscriber decodes what they encoded, and the
unit tests pin both ends. A payload is one flat JSON object::

    {"device": "sim1a2b3c-00007", "seq": 41, "ts": 1767225600123, "sent_ns": 1767225600123456789,
     "temperature": 21.37, "humidity": 48.2}

``ts`` (ms since the epoch) is the event time a real device would send, and the
metrics are top-level numbers, so ``lightgate analytics`` can aggregate a
simulated fleet as is (``telemetry.time=payload:ts``, device from topic level 1).
``seq`` (per device, from 0) and ``sent_ns`` (``time.time_ns()`` at publish: the
clock every process on the machine shares) are what loss and latency accounting
read.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson

__all__ = [
    "METRICS", "Metric", "RandomWalk", "Stamp", "TemplateError", "TopicTemplate", "decode_stamp", "encode_payload",
    "metrics_by_name", "next_interval",
]

PRECISION = 2
"""Decimals a metric is rounded to in the payload: what real sensors report, and it keeps payloads short."""


@dataclass(frozen=True, slots=True)
class Metric:
    """One sensor: where it starts, its bounds, and how far it moves per reading.

    ``step`` is the standard deviation of a reading-to-reading change and
    ``drift`` its mean (a battery drains: negative drift).
    """

    name: str
    start: float
    low: float
    high: float
    step: float
    drift: float = 0.0

    def __post_init__(self) -> None:
        if not self.low <= self.start <= self.high:
            raise ValueError(f"metric {self.name}: start {self.start} outside [{self.low}, {self.high}]")


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("temperature", 21.0, -40.0, 85.0, 0.2),
    Metric("humidity", 45.0, 0.0, 100.0, 0.5),
    Metric("battery", 100.0, 0.0, 100.0, 0.02, drift=-0.01),
    Metric("pressure", 1013.0, 870.0, 1085.0, 0.3),
    Metric("co2", 420.0, 250.0, 5000.0, 5.0),
    Metric("rssi", -60.0, -120.0, -20.0, 1.0),
)}
"""The sensors a simulated device can carry (``--metrics``); bounds are those of common IoT sensor datasheets."""


def metrics_by_name(names: Iterable[str]) -> tuple[Metric, ...]:
    """``("temperature", "battery")`` -> their Metric specs.

    Raises:
        ValueError: an unknown or repeated name (the message lists the known ones).
    """
    chosen = tuple(names)
    unknown = [n for n in chosen if n not in METRICS]
    if unknown or not chosen:
        raise ValueError(f"unknown metric(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(METRICS)}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"metrics listed twice: {', '.join(chosen)}")
    return tuple(METRICS[n] for n in chosen)


class RandomWalk:
    """The current readings of one device; ``step`` moves every metric and returns the new values.

    A step that would leave ``[low, high]`` is reflected back inside, so values
    stay in bounds for ever and do not pile up at a bound as clamping would.
    """

    __slots__ = ("metrics", "values")

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = tuple(metrics)
        self.values = [m.start for m in self.metrics]

    def step(self, rng: random.Random) -> dict[str, float]:
        out = {}
        for i, m in enumerate(self.metrics):
            value = _reflect(self.values[i] + rng.gauss(m.drift, m.step), m.low, m.high)
            self.values[i] = value
            out[m.name] = round(value, PRECISION)
        return out


def _reflect(value: float, low: float, high: float) -> float:
    span = high - low
    if span == 0:
        return low
    offset = (value - low) % (2 * span)
    return low + (offset if offset <= span else 2 * span - offset)


def next_interval(rate: float, jitter: float, rng: random.Random) -> float:
    """Seconds to the next message of a device publishing ``rate`` times a second, +- ``jitter`` (a fraction)."""
    return (1.0 + rng.uniform(-jitter, jitter)) / rate


class TemplateError(ValueError):
    """A topic template that cannot name device topics; the message says why."""


_PLACEHOLDERS = frozenset({"device", "metric"})


@dataclass(frozen=True, slots=True)
class TopicTemplate:
    """``tele/{device}/{metric}`` (one topic per metric) or ``tele/{device}`` (all metrics in one message).

    ``filter`` is the subscription that matches every topic the template makes:
    each level holding a placeholder becomes ``+``.
    """

    text: str
    per_metric: bool
    filter: str

    @classmethod
    def parse(cls, text: str) -> "TopicTemplate":
        """Check ``text`` and derive its filter.

        Raises:
            TemplateError: no ``{device}``, an unknown placeholder, a wildcard,
                ``$`` at the start, or an empty level.
        """
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
        except ValueError as exc:
            raise TemplateError(f"topic template {text!r}: {exc}") from None
        unknown = set(fields) - _PLACEHOLDERS
        if unknown:
            raise TemplateError(f"topic template {text!r}: unknown placeholder(s) {sorted(unknown)}; "
                                "use {device} and optionally {metric}")
        if "device" not in fields:
            raise TemplateError(f"topic template {text!r} must contain {{device}}, so devices publish apart")
        if "+" in text or "#" in text or text.startswith("$"):
            raise TemplateError(f"topic template {text!r} must not contain wildcards or start with '$'")
        levels = text.split("/")
        if "" in levels:
            raise TemplateError(f"topic template {text!r} has an empty level")
        filter_ = "/".join("+" if "{" in level else level for level in levels)
        return cls(text, "metric" in fields, filter_)

    def topic(self, device: str, metric: str = "") -> str:
        return self.text.format(device=device, metric=metric)


@dataclass(frozen=True, slots=True)
class Stamp:
    """What the checking subscriber reads from a payload."""

    device: str
    seq: int
    sent_ns: int


def encode_payload(device: str, seq: int, sent_ns: int, readings: dict[str, float]) -> bytes:
    """The JSON payload of one telemetry message (see the module docstring)."""
    return orjson.dumps({"device": device, "seq": seq, "ts": sent_ns // 1_000_000, "sent_ns": sent_ns, **readings})


def decode_stamp(payload: bytes) -> Stamp | None:
    """The stamp of a simulator payload, or None for anything else (other traffic on a shared broker)."""
    try:
        doc = orjson.loads(payload)
        stamp = Stamp(doc["device"], doc["seq"], doc["sent_ns"])
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    if not (isinstance(stamp.device, str) and type(stamp.seq) is int and type(stamp.sent_ns) is int):
        return None
    return stamp
