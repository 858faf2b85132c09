"""The channel as its packet handlers see it: the one face of ``Channel`` they may use.

``Channel`` (gateway/mqtt/channel.py) imports the handlers for its dispatch table; they type their first parameter
with this Protocol instead of importing it back. It lists what a handler reads and changes (the configuration, the
connection's protocol state ``conn``, the clock) and the channel's own operations a handler calls (closing,
settling the session, counting a limit hit, the keep alive timer, processing held or queued packets). The
channel's private names are not part of it (tests/gateway/mqtt/test_structure.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.mqtt.actions import Action, ArmTimer, LimitHit
from gateway.mqtt.config import ChannelConfig
from gateway.mqtt.limits import Limit
from gateway.mqtt.packets import Packet
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.state import ConnectionState, State

__all__ = ["ChannelView"]


class ChannelView(Protocol):
    """What a handler may use of the channel whose packet or node event it handles."""

    config: ChannelConfig
    conn: ConnectionState
    now: Callable[[], float]

    @property
    def state(self) -> State:
        """The connection's state (moved by the channel only, through ``state.TRANSITIONS``)."""

    def now_ms(self) -> int:
        """The clock in milliseconds, as the store's times are."""

    def handle_in(self, packet: Packet) -> list[Action]:
        """Process a packet (one queued before the CONNACK, or held under the in-flight limit)."""

    def input_done(self) -> list[Action]:
        """Deliver what acknowledgements made room for."""

    def close(self, reason: ReasonCode, log: str, *, packet: Packet | None = None, will: bool = False,
              handover: bool = False) -> list[Action]:
        """Leave the connection (``packet`` first, the will if ``will`` and due)."""

    def settle(self) -> list[Action]:
        """Hand over, save or end the session once no store result is outstanding."""

    def save(self) -> list[Action]:
        """Save the session."""

    def will_delay_s(self) -> int:
        """The delay the will is published after."""

    def explained(self, packet: Packet | None, level: int | None, text: str) -> Packet | None:
        """An error packet with ``text`` as its Reason String, if configured."""

    def limit_hit(self, limit: Limit, count: int, detail: str | None) -> LimitHit:
        """The action counting hits of a limit (and its rate-limited log line)."""

    def topic_over(self, text: str, what: str) -> tuple[Limit, str] | None:
        """The topic limit ``text`` is over, and why, or None."""

    def hold(self, packet: Packet) -> list[Action]:
        """Keep a packet until the in-flight limit makes room."""

    def release_held(self) -> list[Action]:
        """Process the held packets."""

    def arm_keepalive(self, delay_s: float) -> ArmTimer:
        """(Re)arm the keep alive timer."""
