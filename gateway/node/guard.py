"""Who may connect and what they may do, as a node applies it: authentication, ACL checks, their counters.

The rules are gateway/auth/'s (password file, ACL, authenticator); this is where a node asks them, counts the
refusals and logs each once: a CONNECT is authenticated before it can take a session over (argon2 in a worker
thread, a refusal delayed against brute force), a will the client may not publish refuses the CONNECT, and
each connection's channel gets the ACL as pure checks of that client (``ClientAcl``): its PUBLISHes and
SUBSCRIBEs are checked before they reach the node, and a wildcard granted over a deny rule never delivers a
denied topic. The denials the channels report are counted and logged here (``denied``).
The files are looked at (one ``stat`` each) at most every ``AUTH_RECHECK_S`` when a check needs them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, final

import trio

from gateway.auth.acl import Access, Acl, ClientAcl
from gateway.auth.authn import AuthDecision, Authenticator, ReloadError, WatchedFile
from gateway.mqtt.actions import OpenSession
from gateway.mqtt.reasons import ReasonCode

if TYPE_CHECKING:
    from gateway.node.connection import Connection

__all__ = ["AUTH_RECHECK_S", "AuthCounters", "AuthFailure", "Guard", "RECENT_AUTH_FAILURES"]

LOGGER = logging.getLogger(__name__)

AUTH_RECHECK_S = 1.0
"""The password and ACL files are looked at (one ``stat`` each) at most this often, when a CONNECT, PUBLISH or
SUBSCRIBE needs them: an edit takes effect within a second without a ``stat`` per message."""

AUTH_THREADS = 4
"""argon2 verifications running at once: each takes one core and 19 MiB, so a CONNECT storm on a 2-core machine
gains nothing from more, and queued CONNECTs wait without holding memory."""

RECENT_AUTH_FAILURES = 50
"""Refused CONNECTs and HTTP publishes a node remembers for the dashboard: a screenful; the log has them all."""


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """One refused CONNECT or HTTP publish, for the dashboard (never the password)."""

    time_ms: int
    client_id: str | None  # None for HTTP publishes
    peer: str
    username: str | None
    reason: str  # the refusal's reason code name


@dataclass(slots=True)
class AuthCounters:
    """Refusals since the node started, for operators."""

    auth_failures: int = 0  # CONNECTs refused: bad credentials, anonymous access off, a will it may not publish
    acl_denials: int = 0  # PUBLISHes dropped and subscriptions refused (or suspended on resume) by the ACL
    recent: deque[AuthFailure] = field(default_factory=lambda: deque(maxlen=RECENT_AUTH_FAILURES))  # newest last

    def refused(self, client_id: str | None, peer: str, username: str | None, reason: ReasonCode) -> None:
        """Count a refused CONNECT or HTTP publish and keep it among the recent ones (the dashboard's)."""
        self.auth_failures += 1
        self.recent.append(AuthFailure(int(time.time() * 1000), client_id, peer, username, reason.name))


@final
class Guard:
    """A node's authentication and ACL checks.

    Args:
        authenticator: decides CONNECTs (password file, anonymous access, brute-force delay).
        acl: the watched ACL file, or None when every client may publish and subscribe anywhere.
        identity_as_username: the CN of a connection's verified client certificate is its user name
            (``auth.use_identity_as_username``); connections without one are refused.
    """

    def __init__(self, authenticator: Authenticator, acl: WatchedFile[Acl] | None = None, *,
                 identity_as_username: bool = False) -> None:
        self.authenticator = authenticator
        self.acl_file = acl
        self.counters = AuthCounters()
        self._identity_as_username = identity_as_username
        self._checked = time.monotonic()  # the files were loaded just now
        self._threads = trio.CapacityLimiter(AUTH_THREADS)

    # --- authentication -------------------------------------------------------------------

    async def connect(self, connection: Connection, action: OpenSession) -> AuthDecision:
        """Decide a CONNECT; a refusal is counted, logged (never with the password) and delayed (brute force).

        The delay sleeps in this connection's worker, so it holds back only this client.
        """
        self.refresh()
        if self._identity_as_username:  # mTLS: the verified certificate is the credential, nothing to guess
            identity = connection.cert_identity
            decision = AuthDecision(True, ReasonCode.SUCCESS, identity) if identity else AuthDecision(
                False, ReasonCode.NOT_AUTHORIZED, None, why="no verified client certificate with a CN")
        else:
            decision = await self._authenticate(action.username, action.password, connection.host)
        acl = self.acl()
        will = action.will_topic
        if decision.accepted and will is not None and acl is not None \
                and not acl.check(decision.username, action.client_id, Access.PUBLISH, will):
            decision = AuthDecision(False, ReasonCode.NOT_AUTHORIZED, decision.username,
                                    why=f"the will topic {will!r} is not allowed by the ACL")
        if decision.accepted:
            return decision
        self.counters.refused(action.client_id, connection.peer, action.username, decision.reason)
        LOGGER.warning("connection refused: %s", decision.why,
                       extra={"ctx": {"client_id": action.client_id, "peer": connection.peer,
                                      "reason": decision.reason.name, "delay_s": decision.delay_s,
                                      "auth_failures": self.counters.auth_failures}})
        await trio.sleep(decision.delay_s)
        return decision

    async def http(self, username: str | None, password: bytes | None, source: str) -> AuthDecision:
        """Decide the credentials of an HTTP publish as a CONNECT's: counted, logged and delayed when refused."""
        self.refresh()
        decision = await self._authenticate(username, password, source)
        if decision.accepted:
            return decision
        self.counters.refused(None, source, username, decision.reason)
        LOGGER.warning("HTTP publish refused: %s", decision.why,
                       extra={"ctx": {"peer": source, "reason": decision.reason.name, "delay_s": decision.delay_s,
                                      "auth_failures": self.counters.auth_failures}})
        await trio.sleep(decision.delay_s)
        return decision

    async def _authenticate(self, username: str | None, password: bytes | None, source: str) -> AuthDecision:
        authenticator = self.authenticator
        if username is not None and authenticator.passwords is not None:  # argon2: ~50 ms of CPU
            return await trio.to_thread.run_sync(authenticator.authenticate, username, password, source,
                                                 limiter=self._threads)
        return authenticator.authenticate(username, password, source)

    def refresh(self) -> None:
        """Reload the password and ACL files if they changed, looking at most every ``AUTH_RECHECK_S``.

        A broken edit is logged once and the version loaded before stays in effect.
        """
        now = time.monotonic()
        if now - self._checked < AUTH_RECHECK_S:
            return
        self._checked = now
        for watched in (self.authenticator.passwords, self.acl_file):
            if watched is None:
                continue
            try:
                if watched.refresh():
                    LOGGER.info("reloaded %s", watched.path)
            except ReloadError as exc:  # the message names the file (and line)
                LOGGER.error("not reloaded: %s", exc)

    # --- the ACL ------------------------------------------------------------------------------

    def acl(self) -> Acl | None:
        """The ACL in effect (None: no restrictions), reloaded first if its file changed."""
        if self.acl_file is None:
            return None
        self.refresh()
        return self.acl_file.value

    def _acl_now(self) -> Acl:
        """The ACL in effect, for delivery checks (per message: no file look; checks of CONNECTs, PUBLISHes,
        SUBSCRIBEs and SIGHUP reload it)."""
        assert self.acl_file is not None
        return self.acl_file.value

    def client_acl(self, username: str | None, client_id: str) -> ClientAcl | None:
        """The ACL for one connection, as its channel asks it; None when it may do anything."""
        return None if self.acl_file is None else ClientAcl(self._acl_checked, self._acl_now, username, client_id)

    def _acl_checked(self) -> Acl:
        acl = self.acl()
        assert acl is not None
        return acl

    def denied(self, connection: Connection, access: Access, topic: str, why: str) -> None:
        """Count and log one ACL denial."""
        self.counters.acl_denials += 1
        LOGGER.warning("%s denied by the ACL: %s", access.value, why,
                       extra={"ctx": {"client_id": connection.client_id, "username": connection.username,
                                      "topic": topic, "acl_denials": self.counters.acl_denials}})

    def may_subscribe(self, connection: Connection, client_id: str, filter: str, why: str) -> bool:
        """May the client subscribe to ``filter``? A denial is counted and logged with ``why``."""
        acl = self.acl()
        if acl is None or acl.check(connection.username, client_id, Access.SUBSCRIBE, filter):
            return True
        self.denied(connection, Access.SUBSCRIBE, filter, why)
        return False

    def may_publish_http(self, username: str | None, topic: str, source: str) -> bool:
        """May an HTTP publisher of ``username`` publish to ``topic`` (no client id: ``client`` rules and ``%c``
        never match)? A denial is counted and logged."""
        acl = self.acl()
        if acl is None or acl.check(username, None, Access.PUBLISH, topic):
            return True
        self.counters.acl_denials += 1
        LOGGER.warning("publish denied by the ACL: HTTP publish refused",
                       extra={"ctx": {"peer": source, "username": username, "topic": topic,
                                      "acl_denials": self.counters.acl_denials}})
        return False
