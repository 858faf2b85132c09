"""SIGHUP: a running node reloads its TLS certificates, password file, ACL and log level, and never exits.

Operators send SIGHUP after renewing a certificate or editing a file (``systemctl reload``). Each configured
item is reloaded and logged on one line: reloaded, unchanged, or not reloaded and why. A file that is gone or
broken never replaces the version in effect, and nothing here stops the node.

What is read again: the configuration file (``--config``, flags still win) for ``log.level`` and the ``tls.*``
files; the password file and the ACL from the paths the node started with (a node also picks up their edits on
its own within ``AUTH_RECHECK_S``, gateway/node/node.py; SIGHUP makes it happen now and says so). Other options
(ports, data directory, limits) need a restart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, final

from gateway.auth.authn import ReloadError, WatchedFile
from gateway.app.config import Config, ConfigError, reread
from gateway.node.listeners import ListenerError, TlsContext

__all__ = ["Reloader"]

LOGGER = logging.getLogger(__name__)


@final
@dataclass
class Reloader:
    """What one node process reloads on SIGHUP; ``None`` items are not configured there.

    A store node (``lightgate store``) has no TLS listener; a gateway node gets its items once its front is loaded.
    """

    conf: Config
    passwords: WatchedFile[Any] | None = None
    acl: WatchedFile[Any] | None = None
    tls: TlsContext | None = None

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
        self._log_level(conf)
        self.conf = conf

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
