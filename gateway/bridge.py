"""``lightgate bridge``: mirror topics between the local LightGate node and an external MQTT broker.

The bridge is a client of both brokers (two paho-mqtt clients, one per side)
driven by one thread and one ``select`` loop, so no paho state is ever touched
from two threads. Rules say what crosses and how topics are renamed, as in
Mosquitto's ``topic`` lines:

    DIRECTION PATTERN [REMOTE_PREFIX [LOCAL_PREFIX]]

``out`` bridges local -> remote, ``in`` remote -> local, ``both`` each way. A
message on local topic ``LOCAL_PREFIX + t`` (``t`` matching ``PATTERN``) becomes
remote topic ``REMOTE_PREFIX + t``, and the reverse for ``in``.

Guarantees (docs/bridge.md): QoS 1 messages are at-least-once. Both sessions
are persistent (MQTT 5 clean start off with a session expiry, 3.1.1 clean
session off), and a message is acknowledged to the broker it came from only
after the other broker has PUBACKed it, so a crash or a reconnect on either side
loses nothing that was acknowledged; it may duplicate. QoS 0 messages stay at
most once (dropped while the other side is down).

Loops: on MQTT 5 brokers the bridge subscribes with no-local, so nothing it
publishes on a side comes back to it. A 3.1.1 broker has no such option; the
bridge then refuses rules whose bridged-out topics its inbound rules would
bridge back (or the reverse), with an error that names the rules.

Resource handling: ``Bridge.run()`` owns both connections and closes them
before it returns; ``Bridge.stop()`` may be called from any thread or a signal
handler.
"""

from __future__ import annotations

import enum
import logging
import random
import select
import shlex
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from gateway.app import config as cfg
from lightqueue.topics import SHARE_PREFIX, TopicError, filters_overlap, matches, validate_filter, validate_topic

LOG = logging.getLogger(__name__)

KEEPALIVE_S = 30
"""Keep alive of both connections: a dead peer is noticed within 1.5 times this."""

RECEIVE_MAXIMUM = 100
"""Unacknowledged QoS 1 messages each broker may send us (MQTT 5 Receive Maximum). The bridge holds
each until the other side PUBACKs it, so this bounds its memory per direction."""

IN_FLIGHT_WINDOW = 64
"""Most QoS 1 messages the bridge hands to a side before its PUBACKs; lowered to the broker's own
Receive Maximum (Mosquitto's is 20). paho re-sends everything it holds after a reconnect, without
looking at any limit, so the bridge keeps the rest in its own queue."""

RECONNECT_MIN_S = 0.5
"""First reconnect delay; it doubles per failed attempt."""

RECONNECT_MAX_S = 30.0
"""Longest reconnect delay: a broker that comes back is found again within this."""

SELECT_MAX_S = 1.0
"""Longest wait in ``select``: paho's keep alive bookkeeping (``loop_misc``) must run about this often."""

CONNACK_TIMEOUT_S = 10.0
"""A broker that accepted the TCP connection but has not answered the CONNECT within this is given up on
(LightGate delays refusals of bad credentials by up to 5 s). Some 3.1.1 brokers never answer an MQTT 5
CONNECT, so an unanswered attempt also makes the next one use the other protocol version."""

SHUTDOWN_S = 2.0
"""At exit, how long the PUBACKs of messages in flight may take to arrive, and then the DISCONNECTs to be written."""

MAX_SESSION_EXPIRY_S = 0xFFFFFFFF
"""MQTT 5 encodes the session expiry interval in four bytes (this value means "never expires")."""

UNSUPPORTED_PROTOCOL = 0x84
"""CONNACK reason of a broker that does not speak MQTT 5 (paho also maps a 3.1.1 refusal to it)."""

PASSED_PROPERTIES = ("PayloadFormatIndicator", "MessageExpiryInterval", "ContentType", "ResponseTopic",
                     "CorrelationData", "UserProperty")
"""MQTT 5 PUBLISH properties the bridge copies across. Topic aliases and subscription identifiers
belong to one connection, so they are not copied."""


_SHELL_SPECIAL = set(" \t\n'\"\\")
"""Characters that need quoting for ``shlex.split`` (it does not treat ``#`` as a comment, so filters stay bare)."""


class BridgeConfigError(cfg.ConfigError):
    """The bridge's options or rules are unusable (or would loop); the message says which and why."""


class Direction(enum.Enum):
    OUT = "out"
    IN = "in"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class Rule:
    """One mapping between local and remote topics (see the module docstring)."""

    direction: Direction
    pattern: str
    remote_prefix: str = ""
    local_prefix: str = ""

    @property
    def sends_out(self) -> bool:
        return self.direction in (Direction.OUT, Direction.BOTH)

    @property
    def sends_in(self) -> bool:
        return self.direction in (Direction.IN, Direction.BOTH)

    @property
    def local_filter(self) -> str:
        return self.local_prefix + self.pattern

    @property
    def remote_filter(self) -> str:
        return self.remote_prefix + self.pattern

    def to_remote(self, topic: str) -> str | None:
        """The remote topic of a local ``topic`` this rule bridges out, or None."""
        if not self.sends_out:
            return None
        return _rename(topic, self.local_filter, self.local_prefix, self.remote_prefix)

    def to_local(self, topic: str) -> str | None:
        """The local topic of a remote ``topic`` this rule bridges in, or None."""
        if not self.sends_in:
            return None
        return _rename(topic, self.remote_filter, self.remote_prefix, self.local_prefix)

    def __str__(self) -> str:
        words = [self.direction.value, self.pattern, self.remote_prefix, self.local_prefix]
        while len(words) > 2 and not words[-1]:
            words.pop()
        return " ".join(w if w and not set(w) & _SHELL_SPECIAL else shlex.quote(w) for w in words)


def _rename(topic: str, filter: str, from_prefix: str, to_prefix: str) -> str | None:
    # `a/#` also matches the parent `a`, which does not start with the prefix `a/`: such a topic has no name across.
    if not matches(filter, topic) or not topic.startswith(from_prefix):
        return None
    try:
        return validate_topic(to_prefix + topic[len(from_prefix):])
    except TopicError:
        return None


def parse_rule(text: str) -> Rule:
    """Parse ``DIRECTION PATTERN [REMOTE_PREFIX [LOCAL_PREFIX]]`` (shell quoting: ``""`` is an empty prefix).

    Raises:
        BridgeConfigError: wrong field count, unknown direction, invalid pattern, or a prefix with wildcards.
    """
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise BridgeConfigError(f"rule {text!r}: {exc}") from None
    if not 2 <= len(words) <= 4:
        raise BridgeConfigError(f"rule {text!r}: expected 'DIRECTION PATTERN [REMOTE_PREFIX [LOCAL_PREFIX]]', "
                                f"got {len(words)} field(s)")
    try:
        direction = Direction(words[0].lower())
    except ValueError:
        raise BridgeConfigError(f"rule {text!r}: the direction {words[0]!r} is not out, in or both") from None
    rule = Rule(direction, *words[1:])
    if rule.pattern.startswith(SHARE_PREFIX):
        raise BridgeConfigError(f"rule {text!r}: a shared subscription cannot be bridged; use its filter")
    for name, prefix in (("remote prefix", rule.remote_prefix), ("local prefix", rule.local_prefix)):
        if "+" in prefix or "#" in prefix:
            raise BridgeConfigError(f"rule {text!r}: the {name} {prefix!r} must not contain '+' or '#'")
    try:
        validate_filter(rule.local_filter)
        validate_filter(rule.remote_filter)
    except TopicError as exc:
        raise BridgeConfigError(f"rule {text!r}: {exc}") from None
    return rule


def loop_conflicts(rules: Sequence[Rule], *, local_no_local: bool, remote_no_local: bool) -> list[str]:
    """Why these rules would bridge messages back to where they came from; empty when they cannot.

    Args:
        local_no_local: the local broker honours MQTT 5 no-local (it never sends the bridge its own messages).
        remote_no_local: the same for the remote broker.
    """
    problems = []
    for out in (r for r in rules if r.sends_out):
        for back in (r for r in rules if r.sends_in):
            if not remote_no_local and filters_overlap(out.remote_filter, back.remote_filter):
                problems.append(f"rule {str(out)!r} publishes remote topics {out.remote_filter!r} that rule "
                                f"{str(back)!r} subscribes to again ({back.remote_filter!r})")
            if not local_no_local and filters_overlap(back.local_filter, out.local_filter):
                problems.append(f"rule {str(back)!r} publishes local topics {back.local_filter!r} that rule "
                                f"{str(out)!r} subscribes to again ({out.local_filter!r})")
    return problems


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect to one broker."""

    host: str
    port: int
    username: str = ""
    password: str = field(default="", repr=False)  # a secret: no repr of an Endpoint in a log line shows it
    tls: bool = False
    cafile: str = ""

    def __str__(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class BridgeSettings:
    """Everything a Bridge needs; ``settings_from_config`` builds it from the options."""

    local: Endpoint
    remote: Endpoint
    rules: tuple[Rule, ...]
    client_id: str = "lightgate-bridge"
    session_expiry_s: int = 86400
    stats_interval_s: float = 60.0


def settings_from_config(conf: cfg.Config) -> BridgeSettings:
    """The bridge's settings: the local node at ``node.host:node.port``, the rest from ``bridge.*``.

    Raises:
        BridgeConfigError: no rules, a bad rule, no remote host, or inconsistent credentials or TLS files.
    """
    b = conf.section("bridge")
    rules = []
    for i, text in enumerate(b["rules"], 1):
        try:
            rules.append(parse_rule(text))
        except BridgeConfigError as exc:
            raise BridgeConfigError(f"bridge.rules #{i}: {exc}") from None
    if not rules:
        raise BridgeConfigError("no rules: give at least one --rule 'DIRECTION PATTERN [REMOTE_PREFIX "
                                "[LOCAL_PREFIX]]' (or bridge.rules in the configuration file)")
    if not b["remote_host"]:
        raise BridgeConfigError("bridge.remote_host is empty: name the broker to bridge to (--bridge-remote-host)")
    if not 1 <= b["remote_port"] <= 65535:
        raise BridgeConfigError(f"bridge.remote_port must be between 1 and 65535, not {b['remote_port']}")
    if not 1 <= conf["node.port"] <= 65535:
        raise BridgeConfigError(f"node.port must be the LightGate node's MQTT port (1..65535), not {conf['node.port']}")
    if b["remote_cafile"] and not b["remote_tls"]:
        raise BridgeConfigError("bridge.remote_cafile is set but bridge.remote_tls is off")
    if b["remote_cafile"] and not Path(b["remote_cafile"]).is_file():
        raise BridgeConfigError(f"bridge.remote_cafile {b['remote_cafile']!r} is not a file")
    for side in ("local", "remote"):
        if b[f"{side}_password"] and not b[f"{side}_username"]:
            raise BridgeConfigError(f"bridge.{side}_password is set without bridge.{side}_username "
                                    "(MQTT sends no password without a user name)")
    if b["session_expiry_s"] > MAX_SESSION_EXPIRY_S:
        raise BridgeConfigError(f"bridge.session_expiry_s must be at most {MAX_SESSION_EXPIRY_S}, "
                                f"not {b['session_expiry_s']}")
    if not b["client_id"]:
        raise BridgeConfigError("bridge.client_id must not be empty: the persistent sessions are found by it")
    local = Endpoint(conf["node.host"], conf["node.port"], b["local_username"], b["local_password"])
    remote = Endpoint(b["remote_host"], b["remote_port"], b["remote_username"], b["remote_password"],
                      b["remote_tls"], b["remote_cafile"])
    if (local.host, local.port) == (remote.host, remote.port):
        raise BridgeConfigError(f"the remote broker {remote} is the local node itself")
    return BridgeSettings(local, remote, tuple(rules), b["client_id"], b["session_expiry_s"], b["stats_interval_s"])


@dataclass(frozen=True, slots=True)
class BridgeStatistics:
    """Counters since the bridge started; ``in_flight`` and ``ready`` are the state now."""

    bridged_out: int = 0
    """Messages the remote broker accepted (QoS 1: PUBACKed; QoS 0: written)."""
    bridged_in: int = 0
    """Messages the local node accepted."""
    dropped: int = 0
    """Messages not bridged: no rule maps their topic, or QoS 0 while the other side was down."""
    refused: int = 0
    """QoS 1 messages the other side answered with a failure PUBACK (e.g. not authorised)."""
    errors: int = 0
    """Failed connection attempts, refused connections and subscriptions, refused messages."""
    local_reconnects: int = 0
    remote_reconnects: int = 0
    in_flight: int = 0
    """Messages received but not yet acknowledged by the other side."""
    ready: bool = False
    """Both sides are connected and their subscriptions acknowledged."""


@dataclass(slots=True)
class _Counters:
    bridged_out: int = 0
    bridged_in: int = 0
    dropped: int = 0
    refused: int = 0
    errors: int = 0


@dataclass(slots=True)
class _Forward:
    """A message on its way to the other side, and how to acknowledge it to its source."""

    topic: str
    payload: bytes
    retain: bool
    properties: Properties | None
    source: "_Side"
    generation: int
    mid: int


class _Side:
    """One broker connection: its paho client, its reconnect schedule and the messages queued for it."""

    def __init__(self, name: str, endpoint: Endpoint, settings: BridgeSettings, filters: list[str]) -> None:
        self.name = name
        self.endpoint = endpoint
        self.settings = settings
        self.filters = filters
        self.protocol = mqtt.MQTTv5
        self.settled = False  # the protocol is known (a CONNACK accepted us); the client is never replaced after
        self.switch_protocol = False
        self.connecting_since: float | None = None  # CONNECT sent, no CONNACK yet
        self.connected = False
        self.subscribed = False
        self.generation = 0  # counts accepted connections: a message is acknowledged on the one it came from
        self.connects = 0
        self.failures = 0
        self.next_attempt = 0.0
        self.window = IN_FLIGHT_WINDOW
        self.backlog: deque[_Forward] = deque()
        self.awaiting: dict[int, _Forward] = {}
        self.subscribing: dict[int, list[str]] = {}
        self.client = self._new_client()

    def _new_client(self) -> mqtt.Client:
        e = self.endpoint
        v5 = self.protocol == mqtt.MQTTv5
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.settings.client_id,
                             protocol=self.protocol, manual_ack=True, **({} if v5 else {"clean_session": False}))
        if e.username:
            client.username_pw_set(e.username, e.password or None)
        if e.tls:
            client.tls_set(ca_certs=e.cafile or None)
        client.max_inflight_messages_set(0)  # the bridge's own window applies (see IN_FLIGHT_WINDOW)
        if v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.settings.session_expiry_s
            props.ReceiveMaximum = RECEIVE_MAXIMUM
            client.connect_async(e.host, e.port, KEEPALIVE_S, clean_start=False, properties=props)
        else:
            client.connect_async(e.host, e.port, KEEPALIVE_S)
        return client

    def switch(self) -> None:
        """Replace the client by one of the other protocol version (only before the first accepted connection,
        so nothing is queued in it)."""
        self.protocol = mqtt.MQTTv311 if self.protocol == mqtt.MQTTv5 else mqtt.MQTTv5
        self.switch_protocol = False
        self.client = self._new_client()

    def retry_delay(self) -> float:
        """Exponential backoff with jitter: a fleet of bridges does not reconnect in lockstep."""
        base = min(RECONNECT_MAX_S, RECONNECT_MIN_S * 2 ** min(self.failures, 16))
        self.failures += 1
        return base / 2 + random.uniform(0, base / 2)

    @property
    def protocol_name(self) -> str:
        return "5" if self.protocol == mqtt.MQTTv5 else "3.1.1"


class Bridge:
    """Mirror messages between two brokers by the settings' rules until ``stop()``."""

    def __init__(self, settings: BridgeSettings) -> None:
        self.settings = settings
        rules = settings.rules
        self._local = _Side("local", settings.local, settings, _unique(r.local_filter for r in rules if r.sends_out))
        self._remote = _Side("remote", settings.remote, settings, _unique(r.remote_filter for r in rules if r.sends_in))
        self._sides = (self._local, self._remote)
        for side in self._sides:
            self._bind(side)
        self._counters = _Counters()
        self._loops_checked = False
        self._fatal: BridgeConfigError | None = None
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def statistics(self) -> BridgeStatistics:
        """A snapshot of the counters (safe to call from any thread)."""
        c = self._counters
        return BridgeStatistics(
            c.bridged_out, c.bridged_in, c.dropped, c.refused, c.errors,
            max(0, self._local.connects - 1), max(0, self._remote.connects - 1),
            sum(len(s.backlog) + len(s.awaiting) for s in self._sides),
            all(s.connected and s.subscribed for s in self._sides),
        )

    def stop(self) -> None:
        """Ask ``run()`` to disconnect and return (from any thread, or a signal handler)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the wake-up buffer is full (already woken) or run() has closed it
            pass

    def run(self) -> None:
        """Bridge until ``stop()``; connect, reconnect and subscribe as needed.

        Raises:
            BridgeConfigError: a broker turned out to speak 3.1.1 and the rules would loop through it.
        """
        LOG.info("bridge starting", extra={"ctx": {
            "local": str(self._local.endpoint), "remote": str(self._remote.endpoint),
            "rules": [str(r) for r in self.settings.rules]}})
        next_stats = time.monotonic() + self.settings.stats_interval_s
        try:
            while not self._stopping:
                now = time.monotonic()
                for side in self._sides:
                    if side.client.socket() is None and now >= side.next_attempt:
                        self._connect(side)
                    elif side.connecting_since is not None and now - side.connecting_since > CONNACK_TIMEOUT_S:
                        self._counters.errors += 1
                        LOG.warning("bridge got no CONNACK", extra={"ctx": {
                            "side": side.name, "broker": str(side.endpoint), "protocol": side.protocol_name,
                            "timeout_s": CONNACK_TIMEOUT_S}})
                        side.client.disconnect()
                if self.settings.stats_interval_s > 0 and now >= next_stats:
                    self._log_statistics("bridge statistics")
                    next_stats = now + self.settings.stats_interval_s
                self._poll(self._timeout(now, next_stats))
                for side in self._sides:
                    self._pump(side)
        finally:
            self._shutdown()
        if self._fatal is not None:
            raise self._fatal

    # --- the loop ---

    def _timeout(self, now: float, next_stats: float) -> float:
        deadlines = [side.next_attempt for side in self._sides if side.client.socket() is None]
        if self.settings.stats_interval_s > 0:
            deadlines.append(next_stats)
        return max(0.0, min([now + SELECT_MAX_S, *deadlines]) - now)

    def _poll(self, timeout: float) -> None:
        readers: list[Any] = [self._wake_r]
        writers: list[Any] = []
        for side in self._sides:
            sock = side.client.socket()
            if sock is None:
                continue
            readers.append(sock)
            if side.client.want_write():
                writers.append(sock)
            if getattr(sock, "pending", lambda: 0)() > 0:
                timeout = 0.0  # TLS bytes already decrypted: select() would not report them
        readable, writable, _ = select.select(readers, writers, [], timeout)
        if self._wake_r in readable:
            try:
                self._wake_r.recv(4096)
            except BlockingIOError:
                pass
        for side in self._sides:
            sock = side.client.socket()
            if sock is None:
                continue
            if sock in readable or getattr(sock, "pending", lambda: 0)() > 0:
                side.client.loop_read()
            if sock in writable and side.client.socket() is sock:
                side.client.loop_write()
            if side.client.socket() is sock:
                side.client.loop_misc()

    def _connect(self, side: _Side) -> None:
        if side.switch_protocol:
            side.switch()
            self._bind(side)
            LOG.info("bridge tries the other MQTT version", extra={"ctx": {
                "side": side.name, "broker": str(side.endpoint), "protocol": side.protocol_name}})
        try:
            side.client.reconnect()
            side.connecting_since = time.monotonic()
        except OSError as exc:  # refused, unreachable, timed out, TLS handshake failed
            self._counters.errors += 1
            delay = side.retry_delay()
            side.next_attempt = time.monotonic() + delay
            LOG.warning("bridge cannot connect", extra={"ctx": {
                "side": side.name, "broker": str(side.endpoint), "reason": str(exc) or type(exc).__name__,
                "retry_in_s": round(delay, 2)}})

    def _pump(self, side: _Side) -> None:
        """Hand queued messages to a connected side, up to its window (once the rules are known not to loop)."""
        while self._loops_checked and side.connected and side.backlog and len(side.awaiting) < side.window:
            fwd = side.backlog.popleft()
            props = fwd.properties if side.protocol == mqtt.MQTTv5 else None
            info = side.client.publish(fwd.topic, fwd.payload, 1, fwd.retain, props)
            side.awaiting[info.mid] = fwd

    def _shutdown(self) -> None:
        """Let the PUBACKs of what is in flight arrive (and reach the sources), then disconnect both sides.

        Whatever is still unacknowledged at the end stays with its source broker, which sends it again."""
        deadline = time.monotonic() + SHUTDOWN_S
        while time.monotonic() < deadline and any(s.awaiting and s.connected for s in self._sides):
            self._poll(min(0.1, max(0.0, deadline - time.monotonic())))
        for side in self._sides:
            if side.client.socket() is not None:
                side.client.disconnect()
        deadline = time.monotonic() + SHUTDOWN_S
        while any(s.client.socket() is not None for s in self._sides) and time.monotonic() < deadline:
            self._poll(min(0.1, max(0.0, deadline - time.monotonic())))
        self._wake_r.close()
        self._wake_w.close()
        self._log_statistics("bridge stopped")

    def _log_statistics(self, message: str) -> None:
        stats = self.statistics()
        LOG.info(message, extra={"ctx": {f.name: getattr(stats, f.name) for f in fields(stats)}})

    # --- paho callbacks (all run inside _poll, on the loop's thread) ---

    def _bind(self, side: _Side) -> None:
        client = side.client
        client.on_connect = lambda c, u, flags, reason, props: self._on_connect(side, flags, reason, props)
        client.on_disconnect = lambda c, u, flags, reason, props: self._on_disconnect(side, reason)
        client.on_subscribe = lambda c, u, mid, reasons, props: self._on_subscribe(side, mid, reasons)
        client.on_message = lambda c, u, msg: self._on_message(side, msg)
        client.on_publish = lambda c, u, mid, reason, props: self._on_publish(side, mid, reason)

    def _other(self, side: _Side) -> _Side:
        return self._remote if side is self._local else self._local

    def _on_connect(self, side: _Side, flags: mqtt.ConnectFlags, reason: Any, props: Properties) -> None:
        side.connecting_since = None
        if reason.is_failure:
            if reason.value == UNSUPPORTED_PROTOCOL and side.protocol == mqtt.MQTTv5 and not side.settled:
                side.switch_protocol = True
            else:
                self._counters.errors += 1
                LOG.error("bridge connection refused", extra={"ctx": {
                    "side": side.name, "broker": str(side.endpoint), "reason": str(reason)}})
            return
        side.settled = side.connected = True
        side.subscribed = False
        side.generation += 1
        side.connects += 1
        side.failures = 0
        side.window = min(IN_FLIGHT_WINDOW, getattr(props, "ReceiveMaximum", IN_FLIGHT_WINDOW))
        LOG.info("bridge connected", extra={"ctx": {
            "side": side.name, "broker": str(side.endpoint), "protocol": side.protocol_name,
            "session_present": flags.session_present}})
        if not self._loops_checked and all(s.settled for s in self._sides):
            self._check_loops()
        if self._loops_checked:
            for s in self._sides:
                if s.connected and not s.subscribed and not s.subscribing:
                    self._subscribe(s)

    def _check_loops(self) -> None:
        problems = loop_conflicts(self.settings.rules, local_no_local=self._local.protocol == mqtt.MQTTv5,
                                  remote_no_local=self._remote.protocol == mqtt.MQTTv5)
        if problems:
            old = [s.name for s in self._sides if s.protocol != mqtt.MQTTv5]
            self._fatal = BridgeConfigError(
                f"the {' and '.join(old)} broker speaks MQTT 3.1.1 (no no-local subscriptions), so these rules "
                f"would loop: {'; '.join(problems)}. Give the two directions topics that do not overlap "
                "(for example different prefixes).")
            LOG.error("bridge rules would loop", extra={"ctx": {"reason": str(self._fatal)}})
            self.stop()
            return
        self._loops_checked = True

    def _subscribe(self, side: _Side) -> None:
        if not side.filters:
            side.subscribed = True
            return
        if side.protocol == mqtt.MQTTv5:
            # no-local: never receive our own publications; retain-as-published: pass RETAIN through;
            # send retained messages only for a new subscription, not again on every reconnect.
            options = SubscribeOptions(qos=1, noLocal=True, retainAsPublished=True,
                                       retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)
            topics = [(f, options) for f in side.filters]
        else:
            topics = [(f, 1) for f in side.filters]
        _, mid = side.client.subscribe(topics)
        side.subscribing[mid] = side.filters

    def _on_subscribe(self, side: _Side, mid: int, reasons: list) -> None:
        filters = side.subscribing.pop(mid, [])
        for filter, reason in zip(filters, reasons):
            if reason.is_failure:
                self._counters.errors += 1
                LOG.error("bridge subscription refused", extra={"ctx": {
                    "side": side.name, "filter": filter, "reason": str(reason)}})
        side.subscribed = True
        LOG.info("bridge subscribed", extra={"ctx": {"side": side.name, "filters": filters}})

    def _on_disconnect(self, side: _Side, reason: Any) -> None:
        was_connected = side.connected
        side.connected = side.subscribed = False
        side.subscribing.clear()
        if side.connecting_since is not None and not side.settled:
            side.switch_protocol = True  # no answer at all: perhaps the broker cannot parse this version's CONNECT
        side.connecting_since = None
        if self._stopping:
            return
        delay = side.retry_delay()
        side.next_attempt = time.monotonic() + delay
        if was_connected:
            LOG.warning("bridge connection lost", extra={"ctx": {
                "side": side.name, "broker": str(side.endpoint), "reason": str(reason), "retry_in_s": round(delay, 2)}})

    def _on_message(self, source: _Side, msg: mqtt.MQTTMessage) -> None:
        target = self._other(source)
        mapped = self._rename(source, msg.topic)
        if mapped is None or (msg.qos == 0 and not (target.connected and self._loops_checked)):
            self._counters.dropped += 1
            if mapped is None:
                LOG.warning("bridge has no rule for a topic", extra={"ctx": {"side": source.name, "topic": msg.topic}})
            if msg.qos:
                source.client.ack(msg.mid, msg.qos)
            return
        props = _passed_properties(msg.properties)
        if msg.qos == 0:
            info = target.client.publish(mapped, msg.payload, 0, msg.retain, props if target.protocol == mqtt.MQTTv5
                                         else None)
            self._count(target, info.rc == mqtt.MQTT_ERR_SUCCESS)
            return
        target.backlog.append(_Forward(mapped, msg.payload, msg.retain, props, source, source.generation, msg.mid))

    def _rename(self, source: _Side, topic: str) -> str | None:
        """The topic's name on the other side, by the first rule that bridges it from ``source``."""
        rename = Rule.to_remote if source is self._local else Rule.to_local
        return next((name for rule in self.settings.rules if (name := rename(rule, topic)) is not None), None)

    def _on_publish(self, target: _Side, mid: int, reason: Any) -> None:
        fwd = target.awaiting.pop(mid, None)
        if fwd is None:
            return  # a QoS 0 message, counted when handed over
        if reason.is_failure:
            self._counters.refused += 1
            self._counters.errors += 1
            LOG.warning("bridge message refused", extra={"ctx": {
                "side": target.name, "topic": fwd.topic, "reason": str(reason)}})
        else:
            self._count(target, True)
        # A message received on an earlier connection is not acknowledged on this one: its broker sends it again.
        if fwd.source.generation == fwd.generation and fwd.source.connected:
            fwd.source.client.ack(fwd.mid, 1)

    def _count(self, target: _Side, delivered: bool) -> None:
        if not delivered:
            self._counters.dropped += 1
        elif target is self._remote:
            self._counters.bridged_out += 1
        else:
            self._counters.bridged_in += 1


def _unique(filters: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(filters))


def _passed_properties(received: Properties | None) -> Properties | None:
    """The PUBLISH properties to send on (see PASSED_PROPERTIES), or None when there are none."""
    names = [name for name in PASSED_PROPERTIES if hasattr(received, name)] if received is not None else []
    if not names:
        return None
    props = Properties(PacketTypes.PUBLISH)
    for name in names:
        setattr(props, name, getattr(received, name))
    return props


def run_bridge(conf: cfg.Config) -> int:
    """``lightgate bridge``: run until SIGINT/SIGTERM; exit 0, or 2 with the reason on a configuration error."""
    try:
        settings = settings_from_config(conf)
    except BridgeConfigError as exc:
        sys.stderr.write(f"lightgate bridge: configuration error: {exc}\n")
        return 2
    bridge = Bridge(settings)
    previous = {sig: signal.signal(sig, lambda *_: bridge.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        bridge.run()
    except BridgeConfigError as exc:
        sys.stderr.write(f"lightgate bridge: configuration error: {exc}\n")
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
