"""Who may use a store node over the RPC, and for what: gateway nodes, back-end producers and consumers.

Two kinds of peers connect to a store node (store/rpc/server.py):

- **gateway nodes** run sessions for devices: they need every call (sessions,
  offsets of any owner, wills, watches) and check MQTT auth and ACLs for their
  own clients. They are *trusted*: they present the shared secret
  ``store.token`` in their Hello;
- **back-end clients** (store/clients/producer.py, store/clients/consumer.py) present a user
  name and password, checked like an MQTT CONNECT, and may only append (each
  topic checked for publish by the ACL), use consumer groups (each filter
  checked for subscribe), and read max offsets and statistics.

A store with neither a token nor authentication configured trusts every
connection (the store port is then as open as the data directory; bind it to a
private address). A store with authentication configured needs the token
too, or no gateway node could connect.

Two more kinds present the store token under a ``$`` name of their own: replicas fetching the log
(``$replica/<name>``) and log readers (``$reader/<name>``, the Spark live tail), which a follower replica admits
too (store/rpc/front.py). :func:`admit_hello` is the one admission both the server and a follower run.

The store does not import the gateway: the checks are callables injected by
the command-line wiring (gateway/app/cli.py), which builds them from the gateway's
password file (argon2) and ACL modules, so both sides decide alike.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import trio

from store.rpc import wire as rpc

__all__ = ["AccessDenied", "Authenticate", "Authorize", "Peer", "StoreAccess", "Verdict", "admit_hello"]

OWN_PREFIXES = (rpc.REPLICA_PREFIX, rpc.READER_PREFIX)
"""The ``$`` node names a Hello may use: the store's own peers, trusted by the store token only."""


class AccessDenied(Exception):
    """The store refused the credentials, or a call or topic the peer may not use (``ErrorKind.DENIED``)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer of an ``Authenticate`` callable.

    ``username`` is the verified identity (None: anonymous); on refusal the
    store waits ``delay_s`` before it answers (the brute-force delay), and
    logs ``why``, which never says which of user name and password was wrong.
    """

    accepted: bool
    username: str | None = None
    delay_s: float = 0.0
    why: str = ""


Authenticate = Callable[[str | None, bytes | None, str], Verdict]
"""``authenticate(username, password, source address)``; may be slow (argon2): the store calls it in a thread."""

Authorize = Callable[[str | None, str, str, str], bool]
"""``authorize(username, client id, "publish" | "subscribe", topic or filter)``: the ACL's decision."""


@dataclass(frozen=True, slots=True)
class Peer:
    """An admitted connection: trusted (a gateway node) or a back-end client with its identity."""

    trusted: bool
    username: str | None = None
    client_id: str = ""  # the connection's node name: ``%c`` in ACL rules


@final
class StoreAccess:
    """The store node's admission and ACL policy.

    Args:
        token: the shared secret of gateway nodes (``store.token``); empty: no peer is trusted by token.
        authenticate: decides back-end clients' credentials; None: only the token admits.
        authorize: the ACL for back-end clients' topics; None: any topic.

    With all three empty every connection is trusted (:attr:`open`).
    """

    def __init__(self, *, token: str = "", authenticate: Authenticate | None = None,
                 authorize: Authorize | None = None) -> None:
        self._token = token.encode()
        self._authenticate = authenticate
        self._authorize = authorize

    @property
    def open(self) -> bool:
        """No checks configured: every connection is a trusted one."""
        return not self._token and self._authenticate is None and self._authorize is None

    def admit(self, node: str, token: str, username: str | None, password: bytes | None, source: str) -> Verdict | Peer:
        """The peer a Hello admits, or the refusal (wait its ``delay_s`` before answering).

        May run an argon2 verification: call it in a worker thread.
        """
        if self.open:
            return Peer(True, client_id=node)
        if token:
            if self._token and hmac.compare_digest(token.encode(), self._token):
                return Peer(True, client_id=node)
            return Verdict(False, why="bad store token")
        if self._authenticate is None:
            return Verdict(False, why="no store token, and this store admits no back-end clients")
        verdict = self._authenticate(username, password, source)
        if not verdict.accepted:
            return verdict
        return Peer(False, verdict.username, node)

    def name_refusal(self, node: str, token: str) -> Verdict | None:
        """The refusal a Hello's node name earns before its credentials are checked; None: check them."""
        own = next((p for p in OWN_PREFIXES if node.startswith(p) and len(node) > len(p)), None)
        if node.startswith("$") and own is None:
            return Verdict(False, why="node names starting with '$' are the store's own")
        if own is not None and not self.open and not token:
            return Verdict(False, why=f"a {own.strip('$/')} presents the store token")
        return None

    def check(self, peer: Peer, access: str, topic: str) -> None:
        """Raise ``AccessDenied`` unless ``peer`` may ``access`` ("publish" or "subscribe") ``topic``."""
        if peer.trusted or self._authorize is None:
            return
        if not self._authorize(peer.username, peer.client_id, access, topic):
            raise AccessDenied(f"not allowed to {access} {topic!r}")


async def admit_hello(access: StoreAccess, stream: trio.abc.SendStream, hello: rpc.Hello, source: str,
                      refused: Callable[[Verdict], None]) -> Peer | None:
    """The peer ``hello`` admits; None after refusing it: ``refused(verdict)`` (the caller's log line), the
    authenticator's brute-force delay, then a ``DENIED`` Error frame on ``stream`` (which the caller closes)."""
    verdict = access.name_refusal(hello.node, hello.token)
    if verdict is None:
        if access.open:
            return Peer(True, client_id=hello.node)
        verdict = await trio.to_thread.run_sync(access.admit, hello.node, hello.token, hello.username,
                                                hello.password, source)
        if isinstance(verdict, Peer):
            return verdict
    refused(verdict)
    await trio.sleep(verdict.delay_s)
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(rpc.encode(rpc.Error(0, rpc.ErrorKind.DENIED, "not authorized")))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    return None
