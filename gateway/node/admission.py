"""Connection admission: a node-wide cap on open connections and a connect-rate token bucket per source address.

Sans-IO, like the channel: :meth:`Admission.admit` decides one accepted
socket with the time passed in, and never sleeps or touches a socket. The
listeners (gateway/node/listeners.py) ask it right after the TCP accept, before any
TLS, WebSocket or MQTT work, and close the socket when it refuses (as
Mosquitto does): a refused connection costs one accept and one close, not a
TLS handshake, a CONNECT parse or an argon2 check. Docs: docs/security.md.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, final

__all__ = ["Admission", "AdmissionCounters", "Verdict", "source_key"]

MAX_TRACKED_SOURCES = 65_536
"""Source addresses whose buckets are remembered; the least recently seen are forgotten first (a forgotten
source starts again with a full bucket), so a spray of addresses cannot eat memory."""

IPV6_SOURCE_PREFIX = 64
"""IPv6 sources are limited per /64 network: one host usually owns a whole /64 and could rotate through it."""


class Verdict(enum.Enum):
    """What :meth:`Admission.admit` decided; the value is the reason for the log."""

    ADMITTED = "admitted"
    MAX_CONNECTIONS = "the node has its maximum number of connections"
    CONNECT_RATE = "the source address connects faster than its connect rate"


@dataclass(slots=True)
class AdmissionCounters:
    """Connections refused since the node started, for operators (``$SYS`` may publish them later)."""

    refused_max_connections: int = 0
    refused_connect_rate: int = 0


def source_key(host: str) -> str:
    """The bucket a source address counts against: an IPv4 address itself, an IPv6 address's /64 network.

    An IPv4-mapped IPv6 address (``::ffff:10.0.0.1``) counts as its IPv4
    address; anything that is not an IP address (a Unix socket path) is its own key.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False))
    return host


@final
class Admission:
    """Decides whether an accepted connection may proceed, and counts the open ones and the refusals.

    Not thread-safe: the listeners call it from the trio thread only.

    Every :meth:`admit` that returns ``ADMITTED`` must be paired with one
    :meth:`release` when that connection closes.
    """

    def __init__(self, *, max_connections: int = 0, connect_rate: float = 0.0, connect_burst: int = 1,
                 max_sources: int = MAX_TRACKED_SOURCES) -> None:
        """Set the limits; no connection is open yet.

        Args:
            max_connections: open connections allowed at once, over all listeners (0: no cap).
            connect_rate: connects per second a source address may make on average (0: no limit).
            connect_burst: connects a source may make at once after being quiet; a bucket holds at least one.
            max_sources: source addresses whose buckets are remembered.

        Raises:
            ValueError: a negative limit.
        """
        self.set_limits(max_connections=max_connections, connect_rate=connect_rate, connect_burst=connect_burst)
        self.connections = 0
        self.counters = AdmissionCounters()
        self._max_sources = max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, when counted)

    def set_limits(self, *, max_connections: int, connect_rate: float, connect_burst: int) -> None:
        """(Re)set the limits (see ``__init__``; SIGHUP changes them): every later accept is decided by them.

        Raises:
            ValueError: a negative limit.
        """
        if max_connections < 0 or connect_rate < 0:
            raise ValueError(f"limits must not be negative: max_connections={max_connections!r}, "
                             f"connect_rate={connect_rate!r}")
        self.max_connections = max_connections
        self.connect_rate = connect_rate
        self.connect_burst = float(max(1, connect_burst))

    @classmethod
    def from_config(cls, conf: Mapping[str, Any]) -> Admission:
        """Build from the ``limits.*`` options."""
        return cls(max_connections=conf["limits.max_connections"], connect_rate=conf["limits.connect_rate"],
                   connect_burst=conf["limits.connect_burst"])

    def admit(self, host: str, now: float) -> Verdict:
        """Decide one accepted connection from ``host`` (its address without the port) at ``now`` (monotonic s).

        The cap is checked first, so a connection refused for it does not use
        up a token of its source. A refusal is counted in :attr:`counters`.
        """
        if self.max_connections and self.connections >= self.max_connections:
            self.counters.refused_max_connections += 1
            return Verdict.MAX_CONNECTIONS
        if self.connect_rate and not self._take_token(source_key(host), now):
            self.counters.refused_connect_rate += 1
            return Verdict.CONNECT_RATE
        self.connections += 1
        return Verdict.ADMITTED

    def release(self) -> None:
        """An admitted connection closed."""
        if self.connections <= 0:
            raise RuntimeError("release() without an admitted connection")
        self.connections -= 1

    def _take_token(self, key: str, now: float) -> bool:
        burst = self.connect_burst
        tokens, counted = self._buckets.pop(key, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - counted) * self.connect_rate)
        admitted = tokens >= 1.0
        if admitted:
            tokens -= 1.0
        self._buckets[key] = (tokens, now)  # (re)inserted last: the most recently seen
        if len(self._buckets) > self._max_sources:
            self._buckets.popitem(last=False)
        return admitted

    def tracked_sources(self) -> int:
        """Source buckets held in memory (bounded by ``max_sources``): for tests and metrics."""
        return len(self._buckets)
