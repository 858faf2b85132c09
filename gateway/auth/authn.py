"""Authentication of CONNECTs: the password file, anonymous access, and a brute-force delay.

Sans-IO like the channel: :meth:`Authenticator.authenticate` returns a
decision, and on refusal the delay the node must wait before it sends the
CONNACK. Sleeping is the node's job; this module never sleeps or touches a
socket. One argon2 verification costs ~50 ms of CPU (see
``gateway.auth.passwords.HASHER``), and argon2 releases the GIL, so the node runs
``authenticate`` in a worker thread.

Anonymous access (``auth.allow_anonymous``): ``auto`` allows it exactly when no
password file is configured; ``true`` and ``false`` force it. Without a
password file nothing can verify a user name, so a claimed name is not an
identity: such clients are treated as anonymous (``username`` None in the
decision), and ACL ``user`` sections and ``%u`` patterns do not apply to them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar, final

from gateway.app.config import Config
from gateway.auth.passwords import PasswordFile
from gateway.mqtt.reasons import ReasonCode

__all__ = [
    "AuthDecision",
    "Authenticator",
    "ReloadError",
    "WatchedFile",
    "anonymous_allowed",
]

MAX_FAILURE_DELAY_S = 5.0
"""Backoff cap: a device with a stale password retries within seconds once fixed, while guessing stays slow."""

FAILURE_MEMORY_S = 60.0
"""A source's failure count starts over after this long without failures (a mistyped password is forgiven)."""

MAX_TRACKED_SOURCES = 65_536
"""Addresses whose failures are remembered; the oldest are forgotten first, so a spray of sources cannot eat memory."""

T = TypeVar("T")


class ReloadError(Exception):
    """A watched file changed but could not be loaded; the previously loaded version stays in effect."""


@final
class WatchedFile(Generic[T]):
    """A file loaded with ``load(path)``, reloaded by :meth:`refresh` when it changes on disk.

    A change is a different (mtime_ns, size, inode): atomic replaces (as
    ``PasswordFile.save``, ``sed -i`` and most editors do) always change the
    inode. An in-place rewrite of the same size within one coarse mtime tick
    (a few ms) of the previous write can go unseen; people and ``lightgate
    passwd`` are far slower. ``value`` is the last version that loaded; a
    broken edit is reported once and does not replace it.
    """

    def __init__(self, path: Path | str, load: Callable[[Path], T]) -> None:
        """Load the file now.

        Raises:
            whatever ``load`` raises for a missing or malformed file.
        """
        self.path = Path(path)
        self._load = load
        self._signature = self._stat()
        self.value: T = load(self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh(self) -> bool:
        """Reload if the file changed since the last look; True when a new version is now in effect.

        Cheap when nothing changed (one ``stat``), so it can run before every CONNECT.

        Raises:
            ReloadError: the file changed (or went away) and cannot be loaded;
                raised once per change, the old version stays in effect.
        """
        signature = self._stat()
        if signature == self._signature:
            return False
        self._signature = signature
        if signature is None:
            raise ReloadError(f"{self.path}: the file is gone; keeping the version loaded before")
        try:
            self.value = self._load(self.path)
        except (OSError, ValueError) as exc:
            raise ReloadError(f"{exc}; keeping the version loaded before") from exc
        return True


def anonymous_allowed(setting: str, has_password_file: bool) -> bool:
    """Resolve ``auth.allow_anonymous``, a tri-state because the safe default depends on the password file.

    ``auto`` means "only when there is no password file"; ``true`` and ``false`` force it.

    Raises:
        ValueError: ``setting`` is none of ``auto``, ``true``, ``false``.
    """
    if setting == "auto":
        return not has_password_file
    if setting in ("true", "false"):
        return setting == "true"
    raise ValueError(f"allow_anonymous must be auto, true or false, not {setting!r}")


@dataclass(frozen=True, slots=True)
class AuthDecision:
    """The answer to one CONNECT.

    ``username`` is the verified identity for ACL checks (None: anonymous).
    On refusal, ``reason`` goes into the CONNACK after waiting ``delay_s``;
    ``why`` is for the log and never says which of user name and password was wrong.
    """

    accepted: bool
    reason: ReasonCode
    username: str | None
    delay_s: float = 0.0
    why: str = ""


@final
class Authenticator:
    """Decides CONNECTs and tracks failures per source address for the brute-force delay.

    Thread-safe: ``authenticate`` may run in several worker threads at once.
    """

    def __init__(self, passwords: WatchedFile[PasswordFile] | None, *, allow_anonymous: bool,
                 failure_delay_s: float = 1.0, max_failure_delay_s: float = MAX_FAILURE_DELAY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Set the policy; failures start uncounted.

        Args:
            passwords: the watched password file, or None when none is configured.
            allow_anonymous: accept CONNECTs without a user name.
            failure_delay_s: the delay after a source's first failure; each
                further failure doubles it, up to ``max_failure_delay_s``
                (or ``failure_delay_s`` if larger). 0 disables delays.
            clock: monotonic seconds (tests pass their own).
        """
        if failure_delay_s < 0:
            raise ValueError(f"failure_delay_s must not be negative, not {failure_delay_s!r}")
        self.passwords = passwords
        self.allow_anonymous = allow_anonymous
        self.failure_delay_s = failure_delay_s
        self.max_failure_delay_s = max(max_failure_delay_s, failure_delay_s)
        self._clock = clock
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, conf: Config) -> Authenticator:
        """Build from the ``auth.*`` options.

        Raises:
            PasswordFileError: the configured password file is missing or malformed.
        """
        path = conf["auth.password_file"]
        passwords = WatchedFile(path, PasswordFile.load) if path else None
        return cls(passwords, allow_anonymous=anonymous_allowed(conf["auth.allow_anonymous"], bool(path)),
                   failure_delay_s=conf["auth.failure_delay_s"])

    def reload_if_changed(self) -> bool:
        """Pick up an edited password file; see :meth:`WatchedFile.refresh` (raises ReloadError)."""
        return self.passwords is not None and self.passwords.refresh()

    def authenticate(self, username: str | None, password: bytes | str | None, source: str) -> AuthDecision:
        """Decide one CONNECT.

        Args:
            username / password: as sent in the CONNECT (None when absent).
            source: the client's IP address without the port (per port, every
                new connection would start with a clean slate).

        Returns:
            Accepted with the verified user name (or None for anonymous), or
            refused with BAD_USER_NAME_OR_PASSWORD (credentials not accepted,
            whichever part was wrong) or NOT_AUTHORIZED (no user name while
            anonymous access is off), and the delay to wait before answering.
        """
        if username is None:
            if self.allow_anonymous:
                return AuthDecision(True, ReasonCode.SUCCESS, None)
            return self._refuse(source, ReasonCode.NOT_AUTHORIZED, "anonymous access is off")
        if self.passwords is None:
            if self.allow_anonymous:
                return AuthDecision(True, ReasonCode.SUCCESS, None, why="no password file: user name not verified")
            return self._refuse(source, ReasonCode.BAD_USER_NAME_OR_PASSWORD, "no password file configured")
        if self.passwords.value.verify(username, password):
            return AuthDecision(True, ReasonCode.SUCCESS, username)
        return self._refuse(source, ReasonCode.BAD_USER_NAME_OR_PASSWORD, "bad user name or password")

    def _refuse(self, source: str, reason: ReasonCode, why: str) -> AuthDecision:
        now = self._clock()
        with self._lock:
            count, last = self._failures.pop(source, (0, now))
            if now - last > FAILURE_MEMORY_S:
                count = 0
            count += 1
            self._failures[source] = (count, now)
            if len(self._failures) > MAX_TRACKED_SOURCES:
                self._failures.popitem(last=False)
        delay = min(self.failure_delay_s * 2 ** min(count - 1, 32), self.max_failure_delay_s)
        return AuthDecision(False, reason, None, delay, why)

    def failures(self, source: str) -> int:
        """Recent failures of ``source`` (0 once forgotten): for metrics and tests."""
        with self._lock:
            count, last = self._failures.get(source, (0, 0.0))
        return count if self._clock() - last <= FAILURE_MEMORY_S else 0
