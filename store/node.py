"""The store node: one CommitLog, one RocksDB index, one dispatcher, and their tasks.

``open_store`` wires the parts in the order their ownership requires (the
CommitLog outlives the dispatcher that reads it; the database outlives the
light queues) and tears them down in reverse, flushing each, so a clean
shutdown leaves nothing to recover or re-dispatch. ``run_store_node`` is what
``lightgate store`` runs; ``lightgate serve`` embeds ``open_store`` (gateway/node.py).

The node also keeps the gateway's persistent session state as opaque blobs
(``save_session`` / ``load_session`` / ``drop_session``) in the column family
``sessions``: the store knows nothing of MQTT, it only makes the blobs durable.
"""

from __future__ import annotations

import logging
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

import rocksdict
import trio

from lightqueue.queues import LightQueues, PullResult
from retain.store import RetainedStore
from store.aio import AsyncCommitLog
from store.commitlog import CommitLogConfig
from store.dispatch import Dispatcher, Listener
from store.record import Record, decode_record, encode_record
from store.rocks import open_db
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
        max_size = self.log.log.config.max_record_bytes
        targets = self.queues.targets
        records = [
            encode_record(topic, payload, queues=targets(topic), max_size=max_size, **fields)
            for topic, payload, fields in messages
        ]
        offsets = await self.log.append_batch(records, durable=durable)
        self.dispatcher.wake()
        return offsets

    async def pull(
        self, queue: str, from_offset: int, max_count: int = 32, max_bytes: int = 1 << 20
    ) -> PullResult[Record]:
        """Read messages of a queue from a queue offset (index scan + CommitLog reads, in a thread)."""
        return await trio.to_thread.run_sync(
            self.queues.pull, queue, from_offset, max_count, max_bytes, self.log.log, _decode
        )

    def save_session(self, client_id: str, blob: bytes) -> None:
        """Keep a session blob durably (WAL write): it must survive a process crash as written."""
        self.sessions.put(client_id.encode(), blob, _WAL)

    def load_session(self, client_id: str) -> bytes | None:
        """The blob last saved for ``client_id``, or None."""
        return self.sessions.get(client_id.encode())

    def drop_session(self, client_id: str) -> None:
        """Forget the blob of ``client_id`` (a no-op if there is none)."""
        self.sessions.delete(client_id.encode(), _WAL)


_WAL = rocksdict.WriteOptions()  # session blobs have no other source: write them through the WAL


def _decode(raw: bytes, offset: int) -> Record:
    return decode_record(raw, 0, offset)


@asynccontextmanager
async def open_store(
    data: Path, config: CommitLogConfig, listener: Listener | None = None
) -> AsyncIterator[StoreNode]:
    """Open the CommitLog and the index under ``data``, run flushing, retention and dispatch.

    Resource handling: everything opened here is closed here, in reverse order,
    when the block exits (the index memtable and the CommitLog are flushed).
    """
    data.mkdir(parents=True, exist_ok=True)
    async with AsyncCommitLog.open(data / "commitlog", config) as alog:
        db = await trio.to_thread.run_sync(open_db, data / "index")
        try:
            queues = LightQueues(db)
            retained = RetainedStore(db)
            dispatcher = Dispatcher(alog.log, queues, listener, retained=retained)
            node = StoreNode(data, alog, queues, dispatcher, _open_family(db, SESSIONS_FAMILY), retained)
            try:
                async with background(dispatcher.run):
                    yield node
            finally:
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


async def serve_store(settings: Mapping[str, Any]) -> None:
    """Run a store node until SIGINT or SIGTERM, then shut down cleanly."""
    data = Path(settings["node.data"])
    async with open_store(data, CommitLogConfig.from_settings(settings)) as node:
        async with trio.open_nursery() as nursery:
            await nursery.start(until_signalled)
            LOGGER.info(
                "store node ready",
                extra={"ctx": {"data": str(data), "written_offset": node.log.log.written_offset,
                               "dispatched_offset": node.dispatcher.dispatched_offset}},
            )
    LOGGER.info("store node stopped")


def run_store_node(conf: Any) -> int:
    """Entry point for ``lightgate store``/``serve``: returns the process exit status."""
    try:
        trio.run(serve_store, conf.values)
    except OSError as exc:
        LOGGER.error("store node failed: %s", exc)
        return 1
    return 0
