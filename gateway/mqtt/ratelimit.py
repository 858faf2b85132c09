"""A token bucket that can go into debt: the per-client publish rate limit, with time passed in.

A classic token bucket refills ``rate`` tokens per second up to ``burst`` and
lets a request through when it holds enough tokens. This one also *charges
refused requests*: a client that keeps sending while it is refused digs the
bucket below zero, and ``debt_s`` says how many seconds of refill it now owes.
That makes "sustained excess" one number (the channel disconnects a client
whose debt passes a threshold) and means a client that ignores refusals is
refused everything until it slows down, instead of getting a steady share.

No clock is read here: every call takes ``now`` (any monotonic seconds), so
the bucket is as testable as the sans-IO channel that owns it.
"""

from __future__ import annotations

from typing import final

__all__ = ["TokenBucket"]


@final
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked; starts full.

    Args:
        rate: tokens added per second (> 0).
        burst: the most tokens the bucket holds (> 0): how much may be spent at once after a pause.
        now: the current time in seconds.

    Raises:
        ValueError: ``rate`` or ``burst`` is not positive.
    """

    __slots__ = ("rate", "burst", "_tokens", "_at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be positive, not {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def tokens(self, now: float) -> float:
        """The balance at ``now``: negative while in debt. Time going backwards adds nothing."""
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
        return self._tokens

    def take(self, cost: float, now: float) -> bool:
        """Charge ``cost`` tokens, accepted or not; True when the bucket could pay for it.

        A request is accepted when the balance covers it, or, for a request
        larger than ``burst`` (which no balance can cover), when the bucket
        is full. Either way the cost is deducted, so refused requests deepen
        the debt.
        """
        balance = self.tokens(now)
        self._tokens = balance - cost
        return balance >= min(cost, self.burst)

    def debt_s(self, now: float) -> float:
        """Seconds of refill until the balance is back at zero (0 when not in debt)."""
        return max(0.0, -self.tokens(now)) / self.rate
