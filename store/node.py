"""The store node: one CommitLog, one RocksDB index, one dispatcher, and their tasks.

``open_store`` wires the parts in the order their ownership requires (the
CommitLog outlives the dispatcher that reads it; the database outlives the
light queues) and tears them down in reverse, flushing each, so a clean
shutdown leaves nothing to recover or re-dispatch. ``run_store_node`` is what
``lightgate store`` runs; ``lightgate serve`` embeds ``open_store`` (gateway/node.py).

The node also keeps the gateway's persistent session state as opaque blobs
(``save_session`` / ``load_session`` / ``drop_session``) in the column family
``sessions``: the store knows nothing of MQTT, it only makes the blobs durable.

Notify: after each dispatch batch the node routes ``{queue: max offset}``
through its ``NotifyRouter`` to the mailbox of every gateway node attached
(``attach``) with a session on the queue. The embedded gateway is the one node
``"local"``; in cluster mode each gateway connection is a node.
"""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import asynccontextmanager
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

import rocksdict
import trio

from lightqueue.queues import LightQueues, PullResult
from notify import EventMailbox, NotifyRouter
from retain.store import RetainedStore
from store.access import StoreAccess
from store.aio import AsyncCommitLog
from store.commitlog import CommitLogConfig
from store.dispatch import MAX_LAG, Dispatcher, Listener
from store.process import freeze_startup_objects
from store.recent import RecentRecords
from store.record import Record, decode_record, new_record, now_ms
from store.rocks import open_db
from store.rpc import parse_address
from store.tasks import background

LOGGER = logging.getLogger(__name__)

__all__ = ["SESSIONS_FAMILY", "StoreNode", "open_store", "run_store_node", "until_signalled"]

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
    router: NotifyRouter = field(default_factory=NotifyRouter)
    mailboxes: dict[str, EventMailbox] = field(default_factory=dict)  # attached gateway node -> its events

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

        ``fields`` are the optional fields of :func:`store.record.encode_record`.
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
        """Append groups of records made by ``store.record.new_record`` with this node's target queues
        (``queues.targets`` at encode time) in one CommitLog write; a group that failed to encode (a
        ``ValueError`` in its place) is passed through. The records are kept in ``recent`` for dispatch
        and pulls. Waits first while dispatch lags (``Dispatcher.wait_lag``).

        Raises:
            OSError: the write failed; no group was appended.
        """
        made = [pair for group in encoded if not isinstance(group, ValueError) for pair in group]
        await self.dispatcher.wait_lag()
        offsets = await self.log.append_batch([raw for raw, _ in made], durable=durable) if made else []
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
        offsets = self.log.log.append_stamped([raw for raw, _ in made], now)
        self._appended(made, offsets)
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
                                   get("properties", b""), targets(topic), get("born_ms"), max_size))
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
        """Keep a session blob durably (WAL write): it must survive a process crash as written."""
        self.sessions.put(client_id.encode(), blob, _WAL)

    def load_session(self, client_id: str) -> bytes | None:
        """The blob last saved for ``client_id``, or None."""
        return self.sessions.get(client_id.encode())

    def drop_session(self, client_id: str) -> None:
        """Forget the blob of ``client_id`` (a no-op if there is none)."""
        self.sessions.delete(client_id.encode(), _WAL)


STORE_SWITCH_INTERVAL_S = 0.0005
"""The GIL switch interval of a store node process (Python's default: 5 ms). Its pull threads release the GIL
around every CommitLog read and must get it back while the dispatcher thread runs Python: at 5 ms per hand-back
a gateway's pull of 256 messages waited milliseconds, at 0.5 ms the backlog drains ~10% faster (bench fanin)."""

_WAL = rocksdict.WriteOptions()  # session blobs have no other source: write them through the WAL


def _decode(raw: bytes, offset: int) -> Record:
    return decode_record(raw, 0, offset)


@asynccontextmanager
async def open_store(
    data: Path, config: CommitLogConfig, listener: Listener | None = None, tier: Mapping[str, Any] | None = None
) -> AsyncIterator[StoreNode]:
    """Open the CommitLog and the index under ``data``, run flushing, retention and dispatch.

    ``listener``, if given, hears every dispatch batch's events too (after they are routed).
    ``tier``: the flat settings; when ``tier.uri`` is set, the Parquet tier converter of sealed segments runs too
    (store/tier.py; imported only then, as it loads pyarrow).

    Resource handling: everything opened here is closed here, in reverse order,
    when the block exits (the index memtable and the CommitLog are flushed).
    """
    data.mkdir(parents=True, exist_ok=True)
    async with AsyncCommitLog.open(data / "commitlog", config) as alog:
        db = await trio.to_thread.run_sync(open_db, data / "index")
        try:
            queues = LightQueues(db)
            retained = RetainedStore(db)
            nodes: list[StoreNode] = []

            def on_dispatched(events: dict[str, int]) -> None:
                nodes[0].route(events)
                if listener is not None:
                    listener(events)

            recent = RecentRecords()
            dispatcher = Dispatcher(alog.log, queues, on_dispatched, retained=retained, recent=recent)
            node = StoreNode(data, alog, queues, dispatcher, _open_family(db, SESSIONS_FAMILY), retained, recent)
            nodes.append(node)
            try:
                async with background(dispatcher.run):
                    if tier is not None and tier.get("tier.uri"):
                        from store.tier import TierConfig, TierConverter, run_tier

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
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(db.close)


def _open_family(db: rocksdict.Rdict, name: str) -> rocksdict.Rdict:
    """The column family ``name`` of ``db``, created on first use."""
    if name in rocksdict.Rdict.list_cf(db.path()):
        return db.get_column_family(name)
    return db.create_column_family(name, rocksdict.Options(raw_mode=True))


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


async def serve_store(settings: Mapping[str, Any], access: StoreAccess | None = None) -> None:
    """Run a store node, serving gateway nodes over the RPC on ``store.listen``, until SIGINT or SIGTERM.

    ``access`` (store/access.py, built by the command line from ``auth.*`` and ``store.token``)
    decides who may connect; None: everyone.

    Raises:
        ValueError: ``store.listen`` is not HOST:PORT (checked before the store opens).
        OSError: the RPC port cannot be bound.
    """
    from store.server import serve_rpc  # here, not at the top: the server imports this module

    sys.setswitchinterval(STORE_SWITCH_INTERVAL_S)

    host, port = parse_address(settings["store.listen"])
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings), tier=settings) as node:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
                await until_signalled(task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
            listeners = await nursery.start(partial(serve_rpc, node, host, port, access=access))
            bound_host, bound_port = listeners[0].socket.getsockname()[:2]
            LOGGER.info(
                "store node ready",
                extra={"ctx": {"data": str(data), "written_offset": node.log.log.written_offset,
                               "dispatched_offset": node.dispatcher.dispatched_offset,
                               "host": bound_host, "port": bound_port}},
            )
    LOGGER.info("store node stopped")


def run_store_node(conf: Any, access: StoreAccess | None = None) -> int:
    """Entry point for ``lightgate store``/``serve``: returns the process exit status.

    ``access``: see ``serve_store``.
    """
    try:
        parse_address(conf.values["store.listen"])
    except ValueError as exc:
        LOGGER.error("store node not started: store.listen: %s", exc)
        return 1
    freeze_startup_objects()
    failed = False
    try:
        trio.run(serve_store, conf.values, access)
    except* OSError as group:  # e.g. the RPC port is taken; nurseries may wrap it in a group
        LOGGER.error("store node failed: %s", "; ".join(str(exc) for exc in group.exceptions))
        failed = True
    return 1 if failed else 0
