"""The client-keyed part of a store node: session blobs, presence, wills, expiry, inbound QoS 2 flows.

The node keeps the gateway's persistent session state as opaque blobs: the store knows nothing of MQTT, it only
makes them durable. A save is a ``SessionSaved`` control record, a change of some parts of it (a SUBSCRIBE's
filters) a ``SessionPatched`` of those parts alone, and the end of a session one ``SessionEnded``
(store/control.py), appended to the CommitLog like a message (a save's acknowledgement means what a message's
means under the flush policy); dispatch applies them into the column family ``sessions`` (``SessionBlobs``, store/
derived.py), which is only derived from the log. The store owns the sessions' lifecycle all the same
(store/leases.py): where each client is connected, its will, its expiry, and ending a session (blob, offsets,
held filters, QoS 2 flows, shared subscriptions); the client ledger (store/ledger.py) keeps that lifecycle across
restarts. Which inbound QoS 2 flows await PUBREL is derived from the packet ids the records carry and the
releases (``FlowsReleased``, appended and fsynced before the PUBCOMP) in store/awaiting.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import final

import rocksdict
import trio

from store.api import Flow, NewMessage, session_image
from store.awaiting import AwaitingRelease
from store.control import Control, FlowsReleased, SessionEnded, SessionPatched, SessionSaved
from store.derived import DerivedApplier
from store.dispatch import Dispatcher
from store.leases import Leases
from store.log.commitlog import CommitLog
from store.log.errors import LogFullError
from store.log.record import Record

__all__ = ["PART", "SESSIONS_FAMILY", "SessionBlobs", "Sessions"]

LOGGER = logging.getLogger(__name__)

SESSIONS_FAMILY = "sessions"
"""Its own column family: the light queues own every key of the default family."""


PART = "\x00"
"""Between a client id and a part's key in the family: MQTT strings never hold U+0000 [MQTT-1.5.4-2], so no client
id has it and a client's parts sort right after its blob."""


@final
class SessionBlobs(DerivedApplier):
    """The ``sessions`` column family (client id -> blob; client id, ``PART``, key -> part), derived from
    ``SessionSaved``, ``SessionPatched`` and ``SessionEnded`` records: a ``ControlApplier``.

    A save replaces the blob and drops the parts patched before it (the blob holds them: the gateway writes a
    client's saves and patches in the order it makes them); a patch keeps its parts beside the blob.

    Resource handling: :meth:`close` closes the family handle (before the database is closed).
    """

    def __init__(self, db: rocksdict.Rdict) -> None:
        super().__init__(db, SESSIONS_FAMILY)

    def apply(self, record: Record, control: Control) -> None:
        family = self._family
        offset = record.offset
        if isinstance(control, SessionSaved):
            if control.only_existing and family.get(control.client) is None:  # its session ended before it
                family.applied(offset)
                return
            family.put(control.client, control.blob, offset)
            family.delete_under(control.client + PART, offset)
        elif isinstance(control, SessionPatched):
            if family.get(control.client) is None:  # its session ended before it
                family.applied(offset)
                return
            prefix = control.client + PART
            family.patch({prefix + key: part for key, part in control.parts.items()}, offset)
        elif isinstance(control, SessionEnded):
            family.delete(control.client, offset)
            family.delete_under(control.client + PART, offset)

    def _parts(self, client_id: str) -> dict[str, bytes]:
        skip = len(client_id) + 1
        return {key[skip:]: part for key, part in self._family.under(client_id + PART)}

    def restate(self) -> Iterable[Control]:
        """Every session, as the save (and the patch) that make it (blocking: a scan of the family)."""
        controls: list[Control] = []
        for client_id in self.ids():
            blob = self._family.get(client_id)
            assert blob is not None
            controls.append(SessionSaved(client_id, blob))
            parts = self._parts(client_id)
            if parts:
                controls.append(SessionPatched(client_id, parts))
        return controls

    def get(self, client_id: str) -> bytes | None:
        """The session of ``client_id`` (``session_image``: its blob with its parts), or None (point reads)."""
        blob = self._family.get(client_id)
        return None if blob is None else session_image(blob, self._parts(client_id))

    def items(self) -> Iterable[tuple[str, bytes]]:
        """Every session (as :meth:`get`), by client id (blocking: a scan of the family)."""
        for client_id in self.ids():
            stored = self.get(client_id)
            if stored is not None:
                yield client_id, stored

    def ids(self) -> list[str]:
        """The client ids of the stored sessions (blocking: a scan of the keys)."""
        return [key for key in self._family.keys() if PART not in key]


@final
class Sessions:
    """The sessions of a store node's clients: ``StoreApi``'s session calls for the attached nodes.

    Args:
        blobs: the derived session blobs.
        awaiting: the inbound QoS 2 flows, derived by dispatch.
        log, dispatcher: the node's CommitLog and dispatcher (a read waits for dispatch to pass the log's end).
        append: ``StoreNode.append`` (wills); append_control: ``StoreNode.append_control``.
        owns: whether an owner holds filters or has offsets (blocking), which its ``SessionEnded`` drops too.
        on_moved, nursery, lease_s: as ``Leases`` (store/leases.py).
    """

    def __init__(self, blobs: SessionBlobs, awaiting: AwaitingRelease, log: CommitLog, dispatcher: Dispatcher,
                 *, append: Callable[[Sequence[NewMessage]], Awaitable[object]],
                 append_control: Callable[..., Awaitable[int]], owns: Callable[[str], bool],
                 on_moved: Callable[[str, str], None], nursery: trio.Nursery, lease_s: float) -> None:
        self.blobs = blobs
        self._awaiting = awaiting
        self._log = log
        self._dispatcher = dispatcher
        self._append = append
        self._append_control = append_control
        self._owns = owns
        self.leases = Leases(nursery, lease_s, append=append, end_session=self._end_session, on_moved=on_moved,
                             write=partial(append_control, applied=False))

    async def open_session(self, node: str, client_id: str, *, clean_start: bool, expiry_s: int,
                           will: NewMessage | None, will_delay_s: int) -> bytes | None:
        """``StoreApi.open_session`` for ``node``: place the client there (stored before this returns: the CONNACK
        waits for it), then its stored session (None: new).

        Raises:
            LogFullError: a clean start meets a full data disk (nothing was deleted).
        """
        leases = self.leases
        due = leases.open(node, client_id, expiry_s=expiry_s, will=will, will_delay_s=will_delay_s,
                          clean_start=clean_start)
        if due is not None:  # the old session's delayed will, due as the clean start ends its session
            await self._publish_due(client_id, due)
        blob = None if clean_start else await self.load_session(client_id)
        if blob is None:  # whatever a session that is gone left (offsets, QoS 2 flows) goes, or the clean start's
            await self._end_session(client_id)
        await leases.written()
        return blob

    async def close_session(self, node: str, client_id: str, *, expiry_s: int, will_delay_s: int | None) -> None:
        """``StoreApi.close_session`` for ``node``: ignored once the client is present elsewhere."""
        leases = self.leases
        if leases.close(node, client_id, expiry_s=expiry_s, will_delay_s=will_delay_s) and not expiry_s:
            try:
                await self._end_session(client_id)
            except LogFullError:  # the client is not present any more: a retried close would find nothing to end
                leases.end_when_room(client_id)
            else:
                leases.session_ended(client_id)
        await leases.written()

    async def end_session(self, client_id: str) -> bool:
        """``StoreApi.end_session``: an operator ends a session now; False when there was none."""
        due = self.leases.ended(client_id)
        if due is not None:
            await self._publish_due(client_id, due)
        ended = await self._end_session(client_id) or due is not None
        await self.leases.written()
        return ended

    async def _publish_due(self, client_id: str, will: NewMessage) -> None:
        try:
            await self._append([will])
        except (OSError, ValueError) as exc:  # a full disk included: the session's end must not wait for room
            LOGGER.error("will not published: %r", exc, extra={"ctx": {"client_id": client_id}})
        else:
            LOGGER.info("will published: its session ended", extra={"ctx": {"client_id": client_id}})

    async def _end_session(self, client_id: str) -> bool:
        """Forget a session: one ``SessionEnded`` record for its blob, its inbound QoS 2 flows, its offsets and held
        filters (refused on a full disk: ``LogFullError``, and the session stays whole), then its shared
        subscriptions. True if anything of it was stored. A session with nothing stored writes no record."""
        await self._dispatcher.wait_dispatched(self._log.written_offset)
        existed = bool(self._awaiting.awaiting(client_id)) or await trio.to_thread.run_sync(self._stored, client_id)
        if existed:
            await self._append_control([SessionEnded(client_id)])
        return existed

    def _stored(self, client_id: str) -> bool:
        """Whether a blob, held filters or offsets of ``client_id`` are stored (blocking)."""
        return self.blobs.get(client_id) is not None or self._owns(client_id)

    async def save_session(self, client_id: str, blob: bytes, *, only_existing: bool = False) -> bool:
        """Keep a session blob (a ``SessionSaved`` record): returns once it is stored as the flush policy promises
        (under ``sync`` a power loss keeps it: a QoS 2 subscriber's PUBREL waits for it), before dispatch applies
        it (a subscriber saves while its messages stream in: it must not wait for them to be indexed); the next
        :meth:`load_session` waits for that and returns it.

        ``only_existing``: only over a blob kept now (the save of a client no longer connected, which a full disk
        delayed, must not bring back a session that ended meanwhile). False when there was none.

        Raises:
            LogFullError: the data disk is short of space.
            ValueError: the blob is over the record size limit (``RecordTooLarge``).
        """
        if only_existing and await self.load_session(client_id) is None:
            return False
        await self._append_control([SessionSaved(client_id, blob, only_existing)], applied=False)
        return True

    async def patch_session(self, client_id: str, parts: dict[str, bytes]) -> None:
        """Keep ``parts`` beside the session's blob (a ``SessionPatched`` record), stored as :meth:`save_session`
        stores; applied only over a blob kept then.

        Raises:
            LogFullError: the data disk is short of space.
            ValueError: the parts are over the record size limit (``RecordTooLarge``).
        """
        await self._append_control([SessionPatched(client_id, parts)], applied=False)

    async def load_session(self, client_id: str) -> bytes | None:
        """The session (``session_image``) last saved for ``client_id``, or None, once dispatch has passed everything
        appended before."""
        await self._dispatcher.wait_dispatched(self._log.written_offset)
        return await trio.to_thread.run_sync(self.blobs.get, client_id)

    async def session_ids(self) -> list[str]:
        """The client ids of the stored session blobs, once dispatch has passed everything appended before."""
        await self._dispatcher.wait_dispatched(self._log.written_offset)
        return await trio.to_thread.run_sync(self.blobs.ids)

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        """``{packet id: CommitLog offset}`` of the client's inbound QoS 2 messages stored and not released,
        once dispatch has passed everything appended before the call."""
        await self._dispatcher.wait_dispatched(self._log.written_offset)
        return self._awaiting.awaiting(client_id)

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """Mark inbound QoS 2 flows released in one ``FlowsReleased`` record, fsynced under every flush policy: their
        PUBCOMPs may go out.

        Raises:
            ValueError: a packet id is out of 1..65535.
            LogFullError: the data disk is short of space.
        """
        if not all(1 <= pid <= 0xFFFF for _, pid, _ in flows):
            raise ValueError("packet ids are 1..65535")
        await self._append_control([FlowsReleased([tuple(flow) for flow in flows])], durable=True)
