"""Delayed publish: a PUBLISH to ``$delayed/<seconds>/<topic>`` is delivered to ``<topic>`` after ``<seconds>``.

EMQX's convention. The name is parsed here (sans-IO); the message is stored once, as a delayed message of the
store (``NewMessage.deliver_at_ms``, store/timer/), and nothing is ever delivered on the ``$delayed/...`` name
itself. The publisher must be allowed to publish to ``<topic>`` (asked at publish time, by the caller).
"""

from __future__ import annotations

__all__ = ["DELAYED_PREFIX", "parse_delayed"]

DELAYED_PREFIX = "$delayed/"


def parse_delayed(name: str, max_delay_s: int) -> tuple[str, int]:
    """``(topic, delay in seconds)`` of a ``$delayed/<seconds>/<topic>`` topic name.

    Raises:
        ValueError: the seconds are not a decimal integer, exceed ``max_delay_s``, or the topic is empty or a
            ``$`` topic (a delayed message to ``$delayed/...`` or ``$SYS/...`` is refused, not nested).
    """
    seconds, _, topic = name[len(DELAYED_PREFIX):].partition("/")
    if not (seconds.isascii() and seconds.isdigit()) or len(seconds) > 10:
        raise ValueError(f"{DELAYED_PREFIX}<seconds>/<topic>: {seconds!r} is not a number of seconds")
    delay_s = int(seconds)
    if delay_s > max_delay_s:
        raise ValueError(f"a delay of {delay_s} s exceeds the longest allowed, {max_delay_s} s")
    if not topic or topic.startswith("$"):
        raise ValueError(f"{DELAYED_PREFIX}<seconds>/<topic> needs a topic that does not start with '$', "
                         f"not {topic!r}")
    return topic, delay_s
