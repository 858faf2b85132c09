"""SIGHUP: a running node reloads its TLS certificates, password file, ACL, limits and log level, and never exits.

Operators send SIGHUP after renewing a certificate or editing a file (``systemctl reload``). Each configured
item is reloaded and logged on one line: reloaded, unchanged, or not reloaded and why. A file that is gone or
broken never replaces the version in effect, and nothing here stops the node.

What is read again: the configuration file (``--config``; the environment and the flags still win) for
``log.level``, ``limits.*`` and the ``tls.*`` files; the password file and the ACL from the paths the node started
with (a node also picks up their edits on its own within ``AUTH_RECHECK_S``, gateway/node/guard.py; SIGHUP makes it
happen now and says so). New limits apply to the connections accepted from then on (the channel's limits are fixed
when it starts; the admission limits, ``max_connections`` and the connect rate, apply to every accept at once).
Other options (ports, data directory, ``mqtt.*``) need a restart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, final

from gateway.auth.authn import ReloadError, WatchedFile
from gateway.app.config import OPTIONS, Config, ConfigError, reread
from gateway.mqtt.channel import ChannelConfig
from gateway.node.listeners import ListenerError, TlsContext

if TYPE_CHECKING:
    from gateway.node.admission import Admission
    from gateway.node.node import GatewayNode

__all__ = ["Reloader"]

LOGGER = logging.getLogger(__name__)

LIMIT_KEYS = tuple(o.key for o in OPTIONS if o.section == "limits")
"""The ``limits.*`` keys: each is a ``ChannelConfig`` field or an ``Admission`` attribute of the same name."""

CHANNEL_LIMITS = frozenset(f.name for f in fields(ChannelConfig)) & {key.partition(".")[2] for key in LIMIT_KEYS}
"""The limits a connection's channel takes when it starts; the others (``max_connections``, ``connect_rate``,
``connect_burst``) are the admission's, checked at each accept."""


@final
@dataclass
class Reloader:
    """What one node process reloads on SIGHUP; ``None`` items are not configured there.

    A store node (``lightgate store``) has no TLS listener and no limits; a gateway node gets its items once its
    front is loaded (``node``: whose ``channel_config`` new connections take; ``admission``: the accept limits).
    """

    conf: Config
    passwords: WatchedFile[Any] | None = None
    acl: WatchedFile[Any] | None = None
    tls: TlsContext | None = None
    node: GatewayNode | None = None
    admission: Admission | None = None

    def reload(self) -> None:
        """Reload every item, one log line each. Never raises for a bad file or option."""
        try:
            conf = reread(self.conf)
        except ConfigError as exc:
            LOGGER.error("SIGHUP: configuration file not read again, keeping the options in effect: %s", exc,
                         extra={"ctx": {"item": "config", "change": "failed"}})
            conf = self.conf
        if self.tls is not None:
            self._tls(conf)
        for item, watched in (("password file", self.passwords), ("ACL", self.acl)):
            if watched is not None:
                self._file(item, watched)
        if self.node is not None:
            conf = self._limits(conf)
        self._log_level(conf)
        self.conf = conf

    def _limits(self, conf: Config) -> Config:
        """Apply the ``limits.*`` of ``conf``; returns ``conf``, or it with the limits in effect if they fail."""
        changes = {key: (self.conf[key], conf[key]) for key in LIMIT_KEYS if conf[key] != self.conf[key]}
        ctx: dict[str, Any] = {"item": "limits", **{key: new for key, (_, new) in changes.items()}}
        if not changes:
            LOGGER.info("SIGHUP: limits unchanged", extra={"ctx": {**ctx, "change": "unchanged"}})
            return conf
        node = self.node
        assert node is not None
        named = {key.partition(".")[2]: new for key, (_, new) in changes.items()}
        try:
            channel = replace(node.channel_config,
                              **{name: new for name, new in named.items() if name in CHANNEL_LIMITS})
        except ValueError as exc:  # a value out of its range (e.g. limits.max_topic_levels above 128)
            LOGGER.error("SIGHUP: limits not reloaded, keeping the ones in effect: %s", exc,
                         extra={"ctx": {**ctx, "change": "failed"}})
            return replace(conf, values={**conf.values, **{key: self.conf[key] for key in LIMIT_KEYS}})
        node.channel_config = channel
        if self.admission is not None:
            self.admission.set_limits(max_connections=conf["limits.max_connections"],
                                      connect_rate=conf["limits.connect_rate"],
                                      connect_burst=conf["limits.connect_burst"])
        LOGGER.info("SIGHUP: limits reloaded: %s; new connections get them",
                    ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items()),
                    extra={"ctx": {**ctx, "change": "reloaded"}})
        return conf

    def _tls(self, conf: Config) -> None:
        options = (conf["tls.certfile"], conf["tls.keyfile"], conf["tls.cafile"], conf["tls.require_client_cert"])
        ctx = {"item": "tls", "certfile": options[0], "keyfile": options[1], "cafile": options[2] or None}
        try:
            changed = self.tls.reload(*options)  # type: ignore[union-attr]
        except ListenerError as exc:
            LOGGER.error("SIGHUP: TLS certificates not reloaded, keeping the ones in effect: %s", exc,
                         extra={"ctx": {**ctx, "change": "failed"}})
            return
        LOGGER.info("SIGHUP: TLS certificates %s", "reloaded: new handshakes use them" if changed else "unchanged",
                    extra={"ctx": {**ctx, "change": "reloaded" if changed else "unchanged"}})

    @staticmethod
    def _file(item: str, watched: WatchedFile[Any]) -> None:
        ctx = {"item": item.replace(" ", "_").lower(), "path": str(watched.path)}
        try:
            changed = watched.refresh()
        except ReloadError as exc:  # the message names the file (and line)
            LOGGER.error("SIGHUP: %s not reloaded: %s", item, exc, extra={"ctx": {**ctx, "change": "failed"}})
            return
        LOGGER.info("SIGHUP: %s %s", item, "reloaded" if changed else "unchanged (the version in effect is current)",
                    extra={"ctx": {**ctx, "change": "reloaded" if changed else "unchanged"}})

    def _log_level(self, conf: Config) -> None:
        old, new = self.conf["log.level"], conf["log.level"]
        root = logging.getLogger()
        if logging.getLevelName(new.upper()) < root.level:  # more verbose: apply first, so the line shows
            root.setLevel(new.upper())
        LOGGER.log(max(logging.INFO, root.level), "SIGHUP: log level %s",
                   f"{old} -> {new}" if new != old else f"{new} (unchanged)",
                   extra={"ctx": {"item": "log_level", "change": "reloaded" if new != old else "unchanged",
                                  "log_level": new}})
        root.setLevel(new.upper())
