"""The store node: one CommitLog, one RocksDB index, one dispatcher, and their tasks.

``open_store`` wires the parts in the order their ownership requires (the
CommitLog outlives the dispatcher that reads it; the database outlives the
light queues) and tears them down in reverse, flushing each, so a clean
shutdown leaves nothing to recover or re-dispatch. ``run_store_node`` is what
``lightgate store`` runs; ``lightgate serve`` embeds ``open_store`` (gateway/node/node.py).

The node also keeps the gateway's persistent session state as opaque blobs
(``save_session`` / ``load_session`` / ``drop_session``) in the column family
``sessions``: the store knows nothing of MQTT, it only makes the blobs durable.
The one piece of session state it derives itself is which inbound QoS 2 flows
await PUBREL (``awaiting``, store/awaiting.py): from the packet ids the records
carry, so that "stored" and "awaits PUBREL" are one durable fact.

Notify: after each dispatch batch the node routes ``{queue: max offset}``
through its ``NotifyRouter`` to the mailbox of every gateway node attached
(``attach``) with a session on the queue. The embedded gateway is the one node
``"local"``; in cluster mode each gateway connection is a node.
"""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import rocksdict
import trio

from lightqueue.queues import LightQueues, PullResult
from notify import EventMailbox, NotifyRouter
from retain.store import RetainedStore
from store.rpc.access import StoreAccess
from store.log.aio import AsyncCommitLog
from store.awaiting import AwaitingRelease, Flow
from store.log.commitlog import CommitLogConfig
from store.dispatch import MAX_LAG, Dispatcher, Listener
from store.log.errors import FULL_ERRNOS, LogFullError, StartupError
from store.process import freeze_startup_objects, return_freed_buffers
from store.log.recent import RecentRecords
from store.space import DiskSpace
from store.log.record import Record, decode_record, new_record, now_ms
from store.rocks import open_db, open_family
from store.rpc.wire import parse_address
from store.tasks import background

LOGGER = logging.getLogger(__name__)

__all__ = ["SESSIONS_FAMILY", "StoreNode", "on_hangup", "open_store", "run_store_node", "until_signalled"]

SESSIONS_FAMILY = "sessions"
"""Its own column family: the light queues own every key of the default family, and session
blobs are written with the WAL (they have no other source), unlike the index batches."""


@dataclass(eq=False)
class StoreNode:
    """The parts of a running store node, for the layers above to use.

    ``log`` appends and reads, ``queues`` activates filters and pulls,
    ``dispatcher`` indexes new records and says when they are indexed.
    """

    data: Path
    log: AsyncCommitLog
    queues: LightQueues
    dispatcher: Dispatcher
    sessions: rocksdict.Rdict  # the SESSIONS_FAMILY column family: client id (UTF-8) -> session blob
    retained: RetainedStore  # kept up to date by the dispatcher; looked up at subscribe time
    recent: RecentRecords  # the last appended records, decoded: dispatch and pulls at the head read them here
    space: DiskSpace  # free space on the data disk: appends and RocksDB writes are refused while it is short
    awaiting: AwaitingRelease  # inbound QoS 2 flows awaiting PUBREL, kept up to date by the dispatcher
    router: NotifyRouter = field(default_factory=NotifyRouter)
    mailboxes: dict[str, EventMailbox] = field(default_factory=dict)  # attached gateway node -> its events

    @property
    def disk_full(self) -> bool:
        """Whether new messages are refused because the data disk is full."""
        return self.space.full

    def attach(self, name: str) -> EventMailbox:
        """Start routing events to gateway node ``name`` (its ``watch``es say which queues it reads).

        Raises:
            ValueError: a node of that name is attached already.
        """
        if name in self.mailboxes:
            raise ValueError(f"a gateway node named {name!r} is attached already")
        mailbox = self.mailboxes[name] = EventMailbox()
        return mailbox

    def detach(self, name: str) -> None:
        """Stop routing to ``name``, forget its registrations and close its mailbox (idempotent)."""
        mailbox = self.mailboxes.pop(name, None)
        if mailbox is not None:
            mailbox.close()
        self.router.drop_node(name)

    def route(self, events: Mapping[str, int]) -> None:
        """The dispatcher's listener (trio thread): post each attached node the events of its queues."""
        for name, mine in self.router.route(events).items():
            mailbox = self.mailboxes.get(name)
            if mailbox is not None:
                mailbox.post(mine)

    async def append(self, topic: str, payload: bytes, *, durable: bool | None = None, **fields: Any) -> int:
        """Append one message with its target queues fixed now, and wake the dispatcher.

        ``fields`` are the optional fields of :func:`store.log.record.encode_record`.
        Returns the record's CommitLog offset once it is appended (and durable,
        if ``durable`` or the flush policy is sync).
        """
        (offset,) = await self.append_many([(topic, payload, fields)], durable=durable)
        return offset

    async def append_many(
        self, messages: Sequence[tuple[str, bytes, Mapping[str, Any]]], *, durable: bool | None = None
    ) -> list[int]:
        """Append many messages in one CommitLog write (see :meth:`append`)."""
        (result,) = await self.append_groups([messages], durable=durable)
        if isinstance(result, ValueError):
            raise result
        return result

    async def append_groups(
        self, groups: Sequence[Sequence[tuple[str, bytes, Mapping[str, Any]]]], *, durable: bool | None = None
    ) -> list[list[int] | ValueError]:
        """Append the messages of several callers in one CommitLog write: the RPC server's batches.

        Returns, per group, its offsets, or the ``ValueError`` (``RecordTooLarge``
        included) that one of its messages raised when encoded: such a group is
        not appended at all and its neighbours are (the all-or-nothing of
        :meth:`append_many`, per caller).

        Raises:
            OSError: the write failed; no group was appended.
        """
        now = now_ms()
        encoded: list[list[tuple[bytes, Record]] | ValueError] = []
        for messages in groups:
            try:
                encoded.append(self._encode(messages, now))
            except ValueError as exc:
                encoded.append(exc)
        return await self.append_encoded(encoded, durable=durable)

    async def append_encoded(
        self, encoded: Sequence[list[tuple[bytes, Record]] | ValueError], *, durable: bool | None = None
    ) -> list[list[int] | ValueError]:
        """Append groups of records made by ``store.log.record.new_record`` with this node's target queues
        (``queues.targets`` at encode time) in one CommitLog write; a group that failed to encode (a
        ``ValueError`` in its place) is passed through. The records are kept in ``recent`` for dispatch
        and pulls. Waits first while dispatch lags (``Dispatcher.wait_lag``).

        Raises:
            OSError: the write failed; no group was appended.
        """
        made = [pair for group in encoded if not isinstance(group, ValueError) for pair in group]
        await self.dispatcher.wait_lag()
        offsets = await self._write(self.log.append_batch, [raw for raw, _ in made], durable=durable) if made else []
        self._appended(made, offsets)
        results: list[list[int] | ValueError] = []
        start = 0
        for group in encoded:
            if isinstance(group, ValueError):
                results.append(group)
            else:
                results.append(offsets[start : start + len(group)])
                start += len(group)
        return results

    def append_now(self, messages: Sequence[tuple[str, bytes, Mapping[str, Any]]]) -> list[int] | None:
        """:meth:`append_many` without waiting, when nothing needs waiting for; else None (nothing appended).

        Under the async flush policy an append is a copy into the page cache;
        doing it in the caller's step saves a gateway connection a task switch
        per publish. It must wait (None) under the sync policy (the fsync) and
        while dispatch lags (``Dispatcher.wait_lag``).

        Raises:
            ValueError: a message does not encode (``RecordTooLarge`` included); nothing was appended.
            OSError: the write failed; nothing was appended.
        """
        if not self.can_append_now():
            return None
        now = now_ms()
        made = self._encode(messages, now)
        self.space.check(recent_ok=True)
        try:
            offsets = self.log.log.append_stamped([raw for raw, _ in made], now)
        except LogFullError as exc:
            self.space.refused(exc)
            raise
        self.space.cleared()
        self._appended(made, offsets)
        return offsets

    async def _write(self, append: Any, records: list[bytes], *, durable: bool | None) -> list[int]:
        """``append(records)`` unless the disk is short of space; either way the full-disk state follows.

        Raises:
            LogFullError: the disk is full (logged once per episode by ``space``).
        """
        self.space.check(recent_ok=True)
        try:
            offsets = await append(records, durable=durable)
        except LogFullError as exc:
            self.space.refused(exc)
            raise
        self.space.cleared()
        return offsets

    def can_append_now(self) -> bool:
        """Whether :meth:`append_now` appends (async flush policy, dispatch not lagging) rather than answer None."""
        return self.log.log.config.flush != "sync" and self.dispatcher.lag <= MAX_LAG

    def _encode(self, messages: Sequence[tuple[str, bytes, Mapping[str, Any]]], now: int) -> list[tuple[bytes, Record]]:
        """The records of ``messages`` with their target queues fixed now (raises ValueError as ``new_record``)."""
        max_size = self.log.log.config.max_record_bytes
        targets = self.queues.targets
        made = []
        for topic, payload, fields in messages:
            get = fields.get  # not **fields: unpacking keyword arguments cost as much as encoding the record
            made.append(new_record(topic, payload, now, get("client_id", ""), get("qos", 0), get("retain", False),
                                   get("properties", b""), targets(topic), get("born_ms"), max_size,
                                   get("packet_id", 0)))
        return made

    def _appended(self, made: list[tuple[bytes, Record]], offsets: list[int]) -> None:
        """Keep the appended records in memory with their offsets, and wake dispatch."""
        records = []
        for (_, record), offset in zip(made, offsets):
            record.offset = offset
            records.append(record)
        self.recent.add(records)
        self.dispatcher.wake()

    async def pull(
        self, queue: str, from_offset: int, max_count: int = 32, max_bytes: int = 1 << 20
    ) -> PullResult[Record]:
        """:meth:`read` in a worker thread."""
        return await trio.to_thread.run_sync(self.read, queue, from_offset, max_count, max_bytes)

    def read(self, queue: str, from_offset: int, max_count: int = 32, max_bytes: int = 1 << 20) -> PullResult[Record]:
        """Messages of a queue from a queue offset: an index scan, then the records kept in ``recent``, the rest
        read from the CommitLog (blocking: keep it out of the trio thread unless it is small)."""
        return self.queues.pull(queue, from_offset, max_count, max_bytes, self.log.log, _decode, self.recent.get)

    def in_memory(self, queue: str, from_offset: int) -> bool:
        """Whether a read of ``queue`` from ``from_offset`` finds its records in ``recent`` (an index lookup):
        such a read costs Python time only, which a worker thread would not take off the event loop."""
        oldest = self.recent.oldest
        if oldest is None:
            return False
        log_offset = self.queues.log_offset(queue, from_offset)
        return log_offset is not None and log_offset >= oldest

    def save_session(self, client_id: str, blob: bytes) -> None:
        """Keep a session blob durably (WAL write): it must survive a process crash as written, and under the
        ``sync`` flush policy a power loss too (fsynced): a QoS 2 subscriber's PUBREL waits for it.

        Raises:
            LogFullError: the data disk is short of space (RocksDB is not asked: ``store.space``).
        """
        self.space.check()
        self.sessions.put(client_id.encode(), blob, self._session_writes())

    def load_session(self, client_id: str) -> bytes | None:
        """The blob last saved for ``client_id``, or None."""
        return self.sessions.get(client_id.encode())

    def drop_session(self, client_id: str) -> None:
        """Forget the blob of ``client_id`` (a no-op if there is none: clean-start connects write nothing).

        Raises LogFullError as :meth:`save_session`.
        """
        key = client_id.encode()
        if self.sessions.get(key) is not None:
            self.space.check()
            self.sessions.delete(key, self._session_writes())

    def _session_writes(self) -> rocksdict.WriteOptions:
        return _SYNCED if self.log.log.config.flush == "sync" else _WAL

    async def awaiting_release(self, client_id: str) -> dict[int, int]:
        """``{packet id: CommitLog offset}`` of the client's inbound QoS 2 messages stored and not released,
        once dispatch has passed everything appended before the call."""
        await self.dispatcher.wait_dispatched(self.log.log.written_offset)
        return self.awaiting.awaiting(client_id)

    async def release_awaiting(self, flows: Sequence[Flow]) -> None:
        """Mark inbound QoS 2 flows released, durably (fsynced), in one write: their PUBCOMPs may go out.

        Raises LogFullError as :meth:`save_session`.
        """
        self.space.check()
        await trio.to_thread.run_sync(self.awaiting.release, flows)

    async def drop_awaiting(self, client_id: str) -> None:
        """Forget the client's inbound QoS 2 flows (its session ended), the ones being dispatched included."""
        await self.dispatcher.wait_dispatched(self.log.log.written_offset)
        if self.awaiting.awaiting(client_id):  # most clients (every clean start) have none: no thread, no write
            self.space.check()
            await trio.to_thread.run_sync(self.awaiting.drop, client_id)


STORE_SWITCH_INTERVAL_S = 0.0005
"""The GIL switch interval of a store node process (Python's default: 5 ms). Its pull threads release the GIL
around every CommitLog read and must get it back while the dispatcher thread runs Python: at 5 ms per hand-back
a gateway's pull of 256 messages waited milliseconds, at 0.5 ms the backlog drains ~10% faster (bench fanin)."""

_WAL = rocksdict.WriteOptions()  # session blobs have no other source: write them through the WAL
_SYNCED = rocksdict.WriteOptions()
_SYNCED.sync = True  # ... and under the sync flush policy fsync it


def _decode(raw: bytes, offset: int) -> Record:
    return decode_record(raw, 0, offset)


SessionFixer = Callable[[bytes, Callable[[str], int]], "bytes | None"]
"""``fix(blob, max_offset)``: the session blob with its queue positions pulled back to ``max_offset(queue)``, or
None when none is past it. Given by the layer that owns the blob format (gateway/mqtt/session.py)."""


@asynccontextmanager
async def open_store(
    data: Path, config: CommitLogConfig, listener: Listener | None = None, tier: Mapping[str, Any] | None = None, *,
    fix_session: SessionFixer | None = None
) -> AsyncIterator[StoreNode]:
    """Open the CommitLog and the index under ``data``, run flushing, retention and dispatch.

    ``listener``, if given, hears every dispatch batch's events too (after they are routed).
    ``tier``: the flat settings; when ``tier.uri`` is set, the Parquet tier converter of sealed segments runs too
    (store/tier.py; imported only then, as it loads pyarrow).
    ``fix_session``: after a power loss cost the log records that positions in RocksDB point past
    (``Dispatcher.recover``), every session blob is passed through it before anyone consumes.

    Resource handling: everything opened here is closed here, in reverse order,
    when the block exits (the index memtable and the CommitLog are flushed).
    """
    data.mkdir(parents=True, exist_ok=True)
    async with AsyncExitStack() as opened:
        try:
            alog = await opened.enter_async_context(AsyncCommitLog.open(data / "commitlog", config))
            db = await trio.to_thread.run_sync(open_db, data / "index")
        except Exception as exc:  # rocksdict raises plain Exceptions ("IO error: ...", "Corruption: ...")
            raise _startup_error(data, exc) from exc
        try:
            try:  # RocksDB opens a table whose blocks are damaged, and fails on the first read of one
                queues = LightQueues(db)
                retained = RetainedStore(db)
            except Exception as exc:
                raise _startup_error(data, exc) from exc
            nodes: list[StoreNode] = []

            def on_dispatched(events: dict[str, int]) -> None:
                nodes[0].route(events)
                if listener is not None:
                    listener(events)

            recent = RecentRecords()
            space = DiskSpace(data)
            awaiting = AwaitingRelease(db)
            dispatcher = Dispatcher(alog.log, queues, on_dispatched, retained=retained, recent=recent,
                                    awaiting=awaiting, room=space.has_room)
            sessions = open_family(db, SESSIONS_FAMILY)
            try:
                await trio.to_thread.run_sync(_recover, dispatcher, queues, sessions, fix_session)
            except Exception as exc:
                raise _startup_error(data, exc) from exc
            node = StoreNode(data, alog, queues, dispatcher, sessions, retained, recent, space, awaiting)
            nodes.append(node)
            try:
                async with background(dispatcher.run), background(partial(_watch_space, space)):
                    if tier is not None and tier.get("tier.uri"):
                        try:
                            from store.tier import TierConfig, TierConverter, run_tier
                        except ImportError as exc:  # the base install has no pyarrow
                            raise StartupError(f"cannot start: tier.uri is set, and the tier needs the tier extra "
                                               f"(pip install 'lightgate[tier]'): {exc}") from exc

                        converter = TierConverter(alog.log, TierConfig.from_settings(tier))
                        async with background(partial(run_tier, converter)):
                            yield node
                    else:
                        yield node
            finally:
                for name in tuple(node.mailboxes):
                    node.detach(name)
                with trio.CancelScope(shield=True):  # a cancelled node (SIGTERM) still shuts down cleanly
                    await trio.to_thread.run_sync(dispatcher.close)
                node.sessions.close()  # a family handle keeps the database open
                retained.close()
                awaiting.close()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(db.close)


SPACE_PROBE_S = 1.0
"""While the disk is full, its free space is looked at this often, so that the end of the episode is logged (and
the metric cleared) even when no client tries to publish."""


async def _watch_space(space: DiskSpace, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        await trio.sleep(SPACE_PROBE_S)
        if space.full:
            space.has_room()


def _recover(dispatcher: Dispatcher, queues: LightQueues, sessions: rocksdict.Rdict,
             fix_session: SessionFixer | None) -> None:
    """Before anyone consumes: index the whole log and pull back every position past its end (sessions
    included), so that nothing appended from now on is skipped; one WARNING line says what moved."""
    found = dispatcher.recover()
    if not found:
        return
    if fix_session is not None:
        fixed = 0
        for key, blob in sessions.items():
            new = fix_session(blob, queues.max_offset)
            if new is not None:
                sessions.put(key, new, _WAL)
                fixed += 1
        found["sessions"] = fixed
    LOGGER.warning("positions past the end of the recovered CommitLog were pulled back to it (records lost in a"
                   " power loss or OS crash under the async flush policy); nothing appended from now on is skipped",
                   extra={"ctx": found})


def _startup_error(data: Path, exc: Exception) -> Exception:
    """The one line an operator needs when the store cannot open its data (``StartupError``), or ``exc`` itself
    when it is something else (a bug, a locked directory: its own message says so)."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS) or "No space left" in text:
        return StartupError(f"cannot start: the data disk under {data} is full ({text}); free space there "
                            "(nothing stored is lost) and start again")
    if not isinstance(exc, OSError) and any(word in text for word in ("Corruption", "CURRENT", "MANIFEST")):
        return StartupError(f"cannot start: the index database {data / 'index'} is damaged ({text}); stop every "
                            f"process using {data}, run `lightgate repair --data {data}` and start again "
                            "(docs/storage.md, \"Repair\")")
    return exc


async def until_signalled(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Return on the first SIGINT or SIGTERM (logged): how node processes learn to shut down.

    ``task_status.started`` is called once the signals are caught, so a node
    started with ``nursery.start`` can log "ready" without a SIGTERM race.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            LOGGER.info("shutting down", extra={"ctx": {"signal": signal.Signals(signum).name}})
            return


async def on_hangup(reload: Callable[[], None] | None = None, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Call ``reload`` on every SIGHUP until cancelled, so that the signal never ends the process (its default).

    ``reload`` (None: nothing to reload, the signal is only logged) must not raise; it logs what it did. As with
    ``until_signalled``, ``task_status.started`` is called once the signal is caught.
    """
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            if reload is None:
                LOGGER.info("SIGHUP: nothing to reload here", extra={"ctx": {"signal": "SIGHUP"}})
            else:
                reload()


async def serve_store(settings: Mapping[str, Any], access: StoreAccess | None = None,
                      reload: Callable[[], None] | None = None, fix_session: SessionFixer | None = None) -> None:
    """Run a store node, serving gateway nodes over the RPC on ``store.listen``, until SIGINT or SIGTERM.

    ``access`` (store/rpc/access.py, built by the command line from ``auth.*`` and ``store.token``)
    decides who may connect; None: everyone. ``reload`` runs on each SIGHUP (``on_hangup``);
    ``fix_session``: see ``open_store``.

    Raises:
        ValueError: ``store.listen`` is not HOST:PORT (checked before the store opens).
        OSError: the RPC port cannot be bound.
    """
    from store.rpc.server import serve_rpc  # here, not at the top: the server imports this module

    sys.setswitchinterval(STORE_SWITCH_INTERVAL_S)

    host, port = parse_address(settings["store.listen"])
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings), tier=settings, fix_session=fix_session) as node:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
                await until_signalled(task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
            await nursery.start(on_hangup, reload)
            listeners = await nursery.start(partial(serve_rpc, node, host, port, access=access,
                                                    lease_s=settings["store.lease_s"]))
            bound_host, bound_port = listeners[0].socket.getsockname()[:2]
            LOGGER.info(
                "store node ready",
                extra={"ctx": {"data": str(data), "written_offset": node.log.log.written_offset,
                               "dispatched_offset": node.dispatcher.dispatched_offset,
                               "host": bound_host, "port": bound_port}},
            )
    LOGGER.info("store node stopped")


def run_store_node(conf: Any, access: StoreAccess | None = None, reload: Callable[[], None] | None = None,
                   fix_session: SessionFixer | None = None) -> int:
    """Entry point for ``lightgate store``/``serve``: returns the process exit status.

    ``access``, ``reload``, ``fix_session``: see ``serve_store``.
    """
    try:
        parse_address(conf.values["store.listen"])
    except ValueError as exc:
        LOGGER.error("store node not started: store.listen: %s", exc)
        return 1
    if conf.values["store.lease_s"] <= 0:
        LOGGER.error("store node not started: store.lease_s must be more than 0 (heartbeats go every lease / 5)")
        return 1
    freeze_startup_objects()
    return_freed_buffers()
    failed = False
    try:
        trio.run(serve_store, conf.values, access, reload, fix_session)
    except* OSError as group:  # e.g. the RPC port is taken; nurseries may wrap it in a group
        LOGGER.error("store node failed: %s", "; ".join(str(exc) for exc in group.exceptions))
        failed = True
    except* StartupError as group:  # the data cannot be opened: what happened and what to do
        LOGGER.error("%s", "; ".join(str(exc) for exc in group.exceptions))
        failed = True
    return 1 if failed else 0
