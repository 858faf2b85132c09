"""The time syntax of the reader options and the CLI: instants and durations.

Kept apart from the Spark-facing modules so that the ``lightgate`` command
line can parse its flags without importing pyspark, pyarrow or numpy.
"""

from __future__ import annotations

import datetime as _dt
import re

__all__ = ["parse_duration", "parse_time", "window_label"]


def parse_time(text: str) -> int:
    """Epoch milliseconds from ``text``: an integer (epoch ms) or ISO-8601 (no offset = UTC).

    Raises:
        ValueError: neither form, with the text in the message.
    """
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        when = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither epoch milliseconds nor an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return int(when.timestamp() * 1000)


_UNITS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600,
          "d": 86400, "day": 86400}
_DURATION = re.compile(r"\s*(\d+)\s*([a-z]+?)s?\s*\Z")


def parse_duration(text: str) -> int:
    """Seconds in ``text``: ``90s``, ``1m``, ``5 minutes``, ``1h``, ``1 day``.

    Raises:
        ValueError: not a positive whole number of a known unit.
    """
    match = _DURATION.match(text.lower())
    if not match or match.group(2) not in _UNITS or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration like 90s, 1m, 5 minutes, 1h or 1d")
    return int(match.group(1)) * _UNITS[match.group(2)]


def window_label(seconds: int) -> str:
    """A short name for a window length, used in output table names: 60 -> ``1m``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
