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

Storage: each step is a control record (store/control.py: ``ClientConnected``, ``ClientClosed``,
``WillPublished``, ``ClientForgotten``), appended by the leases like any write (under the ``sync`` flush policy the
CONNACK waits for its fsync) and applied by dispatch into the column family ``clients`` (store/derived.py: key the
client id, value a msgpack ``ClientEntry``, no WAL), which ``open_store`` reads at start. A session whose entry a
power loss took (``async``) counts as closed at the next start (``store.node.open_store``), later than the truth,
never earlier. Times are wall-clock (``time.time``): they must survive the process.

Error handling: an append the disk refuses is logged once (until one succeeds) and skipped (store/leases.py): a
restart then counts the client's close from its start at the latest, and nothing else is refused for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import final

import msgspec
import rocksdict
from msgspec.structs import replace

from store.api import NewMessage
from store.control import ClientClosed, ClientConnected, ClientForgotten, Control, WillPublished
from store.derived import DerivedApplier
from store.log.record import Record

__all__ = ["LEDGER_FAMILY", "ClientEntry", "ClientLedger", "entry_control"]

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


def entry_control(client_id: str, entry: ClientEntry) -> ClientConnected | ClientClosed:
    """The control record that makes ``entry`` the ledger's entry of ``client_id``."""
    if not entry.closed_ms:
        return ClientConnected(client_id, entry.node, entry.expiry_s, entry.will, entry.will_delay_s)
    return ClientClosed(client_id, entry.node, entry.expiry_s, entry.will, entry.will_delay_s, entry.closed_ms)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ClientEntry)


@final
class ClientLedger(DerivedApplier):
    """The ``clients`` column family, derived from the client control records (a ``ControlApplier``).

    Concurrency: dispatch applies in its thread; :meth:`entries` runs at start, before dispatch does.

    Resource handling: :meth:`close` closes the family handle (before the database is closed).
    """

    def __init__(self, db: rocksdict.Rdict) -> None:
        super().__init__(db, LEDGER_FAMILY)

    def apply(self, record: Record, control: Control) -> None:
        family = self._family
        if isinstance(control, ClientConnected):
            entry = ClientEntry(control.node, control.expiry_s, control.will, control.will_delay_s)
        elif isinstance(control, ClientClosed):
            entry = ClientEntry(control.node, control.expiry_s, control.will, control.will_delay_s, control.closed_ms)
        elif isinstance(control, WillPublished):
            old = self._entry(control.client)
            if old is None or not old.closed_ms:  # connected again since: its will is held, not pending
                family.applied(record.offset)
                return
            if not old.expiry_s:  # the session ended already: only the will kept the entry
                family.delete(control.client, record.offset)
                return
            entry = replace(old, will=None)
        elif isinstance(control, ClientForgotten):
            family.delete(control.client, record.offset)
            return
        else:
            return
        family.put(control.client, _ENCODER.encode(entry), record.offset)

    def _entry(self, client_id: str) -> ClientEntry | None:
        raw = self._family.get(client_id)
        return _DECODER.decode(raw) if raw is not None else None

    def restate(self) -> Iterable[Control]:
        """Every client's entry, as the record that makes it."""
        return [entry_control(client_id, entry) for client_id, entry in self.entries().items()]

    def entries(self) -> dict[str, ClientEntry]:
        """Every entry, by client id (blocking: a scan of the family, at start); an unreadable one is skipped."""
        found = {}
        for client_id, value in self._family.items():
            try:
                found[client_id] = _DECODER.decode(value)
            except msgspec.DecodeError as exc:
                LOGGER.warning("client ledger entry unreadable: skipped (its session is kept, without expiry): %s",
                               exc, extra={"ctx": {"client_id": client_id}})
        return found
