"""A session's ``Link`` owner for tests that drive a Session without a channel (gateway/mqtt/session.py
``LinkOwner``): a fixed clock, and limit hits as the plain actions a channel would return."""

from gateway.mqtt.actions import LimitHit


class Owner:
    """A link's channel as far as delivery asks: the clock at ``now_ms``, limit hits as plain actions."""

    def __init__(self, now_ms: int = 0) -> None:
        self._now_ms = now_ms

    def now_ms(self) -> int:
        return self._now_ms

    def limit_hit(self, limit, count, detail):
        return LimitHit(limit, count, detail)
