"""The durable ledger of client lifecycles: where each client was connected, since when it is gone, its will.

Presence, wills and expiry timers live in memory (store/leases.py); a restart loses them, and without this
ledger every session pending expiry would become permanent and every will waiting for its delay would be lost.
The leases write one entry per client at each step of its lifecycle, and re-arm their timers from the entries
when the store starts (``Leases.restore``):

- *connected* (``closed_ms`` 0): written when the client connects, before its CONNACK can go (its expiry and its
  will, which the restart must honour; a clean session's too: what it holds in the store must go after a crash).
- *closed* (``closed_ms`` the wall-clock time of the close): its session expires at ``closed_ms`` + expiry, its
  will (if still pending) is due at ``closed_ms`` + its delay; the will is dropped from the entry once published.
- gone: the entry is deleted when the session ends (expiry, clean start, a clean session's close, an operator's
  delete), or kept for the will alone (``expiry_s`` 0) until that is published.

Storage: the column family ``clients``, key the client id (UTF-8), value a msgpack ``ClientEntry``; written with
the WAL (a process crash keeps it) and not fsynced: a session whose entry a power loss took counts as closed at
the next start (``store.node.open_store``), later than the truth, never earlier. Times are wall-clock
(``time.time``): they must survive the process.
This is derived state kept beside the session blobs until the CommitLog carries control records for it.

Error handling: the entries are small and written within the data disk's margin (store/space.py), so a full disk
does not refuse them; a write RocksDB fails anyway is logged once (until one succeeds) and skipped: a restart
then counts the client's close from its start at the latest, and nothing else is refused for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import final

import msgspec
import rocksdict

from store.api import NewMessage
from store.rocks import open_family

__all__ = ["LEDGER_FAMILY", "ClientEntry", "ClientLedger"]

LOGGER = logging.getLogger(__name__)

LEDGER_FAMILY = "clients"
"""Its own column family: the light queues own every key of the default family, the session blobs ``sessions``."""


class ClientEntry(msgspec.Struct, frozen=True, array_like=True):
    """What the store must still do for one client after a restart (see the module docstring)."""

    node: str  # the node it connected to last
    expiry_s: int  # its Session Expiry Interval (0xFFFFFFFF: never)
    will: NewMessage | None = None  # held while connected; pending after a close that made it due
    will_delay_s: int = 0
    closed_ms: int = 0  # wall-clock ms of its close; 0: connected as far as the store knows


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ClientEntry)
_WAL = rocksdict.WriteOptions()


@final
class ClientLedger:
    """The ``clients`` column family of the store's RocksDB (see the module docstring).

    Resource handling: :meth:`close` closes the family handle (before the database is closed).
    """

    def __init__(self, db: rocksdict.Rdict) -> None:
        self._family = open_family(db, LEDGER_FAMILY)
        self._failing = False  # a write failed and none succeeded since: logged once

    def put(self, client_id: str, entry: ClientEntry) -> None:
        """Keep ``entry`` for ``client_id`` (a small WAL write: done in the caller's thread)."""
        self._write(self._family.put, client_id, _ENCODER.encode(entry))

    def forget(self, client_id: str) -> None:
        """Delete the entry of ``client_id``, if it has one (no write when it has none)."""
        if self._family.get(client_id.encode()) is not None:
            self._write(self._family.delete, client_id)

    def _write(self, write: Callable[..., None], client_id: str, *value: bytes) -> None:
        try:
            write(client_id.encode(), *value, _WAL)
        except Exception as exc:  # rocksdict raises plain Exceptions ("IO error: ...")
            if not self._failing:
                LOGGER.error("client ledger write failed: sessions may outlive their expiry across a restart: %s",
                             exc, extra={"ctx": {"client_id": client_id}})
            self._failing = True
            return
        if self._failing:
            LOGGER.info("client ledger writes succeed again")
            self._failing = False

    def entries(self) -> dict[str, ClientEntry]:
        """Every entry, by client id (blocking: a scan of the family, at start); an unreadable one is skipped."""
        found = {}
        for key, value in self._family.items():
            try:
                found[key.decode()] = _DECODER.decode(value)
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                LOGGER.warning("client ledger entry unreadable: skipped (its session is kept, without expiry): %s",
                               exc, extra={"ctx": {"key": key.hex()}})
        return found

    def close(self) -> None:
        self._family.close()
