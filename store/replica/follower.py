"""The follower's side of the replication data path: fetch the leader's log and keep a byte-identical copy.

One connection to the leader's RPC listener (Hello as ``$replica/<name>`` with the store token), then a loop of
``Fetch`` (from its written end, saying what it holds, asking for many records a round: ``FETCH_MIN_BYTES``) and
``Frames``: the frames are appended at the same offsets (``CommitLog.append_frames`` checks every one, and decodes
it into the dispatcher's recent records, so dispatch indexes them from memory, as a leader's own appends, without
reading them back nor checking them twice), the leader's epoch entries they cover are added, the log is flushed as
its policy says (under ``sync`` the held offset is the fsynced one), and the confirm offset moves to
``min(leader's confirm, written)`` so its dispatch keeps the derived state warm. When the leader says the logs part
(``truncate_to``), the follower cuts its log and every derived part there (``Dispatcher.truncate``) first.
Retention follows the leader's: every answer carries the leader's ``min_offset``, below which the follower deletes
its sealed segments (``CommitLog.delete_before``: the leader's restatement is in the copied log, so nothing is
appended), and an empty follower joining after the leader's retention starts its log there (``Dispatcher.start_at``).

A lost connection is retried with backoff while the leader is the same epoch; a leader of another epoch ends the
loop with ``LeaderChanged`` (the role loop, which knows the group from the controller, decides what next).
"""

from __future__ import annotations

import logging
from typing import final

import trio

from store.dispatch import Dispatcher
from store.log.aio import AsyncCommitLog
from store.log.record import Record
from store.replica.figures import RoleFigures
from store.rpc import wire as rpc

__all__ = ["FETCH_BYTES", "FETCH_MAX_WAIT_S", "FETCH_MIN_BYTES", "LeaderChanged", "ReplicaExpired", "follow"]

LOGGER = logging.getLogger(__name__)

FETCH_BYTES = 4 * 1024 * 1024
"""A fetch asks for at most this much: a few large records, well under the frame limit; a follower catching up
takes many fetches, each a cheap ``read_frames`` and ``append_frames``."""

FETCH_MIN_BYTES = 64 * 1024
FETCH_MAX_WAIT_S = 0.02
"""A fetch asks the leader to answer once this much is past its offset, or after this long once there is anything
(Kafka's fetch.min.bytes and fetch.max.wait.ms): while the log grows fast a round carries many records, so the
per-round costs on both sides (a frame each way, a wake-up of dispatch) are paid per hundreds of messages, not per
few; an acknowledgement waiting for this replica (acks ``quorum``, ``all``) has the leader answer at once anyway.
This replica's confirm offset, and so its dispatch, lags the leader's by at most the wait."""

INLINE_BYTES = 256 * 1024
"""Frames up to this size are appended on the event loop (the leader's appends are too, store/log/aio.py); larger
ones, a follower catching up, in a worker thread."""

ANSWER_TIMEOUT_S = 5.0
"""A fetch unanswered for this long means the leader or the network is gone (the leader answers an idle fetch
within its long poll, half a second): the connection is dropped and made again."""

BACKOFF_S = (0.05, 0.1, 0.25, 0.5, 1.0)
"""Waits between reconnection attempts, the last repeated."""


@final
class LeaderChanged(Exception):
    """The leader answered for another epoch, or is not the leader (``NOT_LEADER``): this follower's leader is gone.

    ``epoch``: the epoch the answering store leads (None when it leads none); ``address``: the leader it named, if
    any (``host:port``).
    """

    def __init__(self, message: str, epoch: int | None = None, address: str = "") -> None:
        super().__init__(message)
        self.epoch = epoch
        self.address = address


@final
class ReplicaExpired(Exception):
    """This replica's log ends below the leader's first offset (the leader's retention deleted what it lacks): it
    cannot catch up by fetching, only by starting empty (an empty log starts at the leader's first offset)."""


class _Refused(Exception):
    """The leader refused the connection (credentials, protocol version): retrying will not help."""


async def follow(log: AsyncCommitLog, dispatcher: Dispatcher, leader: tuple[str, int], *, name: str, epoch: int,
                 token: str = "", figures: RoleFigures | None = None,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Follow the leader of ``epoch`` at ``leader`` (host, port) until cancelled.

    ``task_status.started()`` once the first connection is welcomed. ``figures``: the role loop's, given the
    leader's end and the truncations.

    Raises:
        LeaderChanged: the leader answers for another epoch, or is not the leader.
        ConnectionRefusedError: the leader refused this replica (its token, its name, the protocol version).
        OSError: the local log could not be written (a full disk...).
        CorruptRecord: a frame the leader sent does not check (damage in the leader's log: fetching it again
            would not help).
        ValueError: the leader's segments do not fit this log's (another ``segment_bytes``).
        ReplicaExpired: this log ends below the leader's first offset (its retention ran meanwhile).
    """
    started = False
    attempt = 0
    while True:
        try:
            stream = await trio.open_tcp_stream(*leader)
        except OSError as exc:
            LOGGER.info("replica cannot reach its leader; retrying", extra={"ctx": {"leader": leader,
                                                                                   "error": str(exc)}})
        else:
            async with stream:
                link = _Link(stream)
                try:
                    await link.hello(name, token, epoch)
                    if not started:
                        started = True
                        task_status.started()
                    attempt = 0
                    LOGGER.info("replica following its leader", extra={"ctx": {"leader": leader, "epoch": epoch}})
                    await _fetch_loop(link, log, dispatcher, epoch, figures or RoleFigures("", name))
                except _Refused as exc:
                    raise ConnectionRefusedError(str(exc)) from None
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                        rpc.RpcProtocolError, EOFError) as exc:
                    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
                        raise  # the local log's write failed: not the leader's business
                    LOGGER.warning("replica lost its leader connection; reconnecting",
                                   extra={"ctx": {"leader": leader, "error": repr(exc)}})
        await trio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        attempt += 1


async def _fetch_loop(link: _Link, alog: AsyncCommitLog, dispatcher: Dispatcher, epoch: int,
                      figures: RoleFigures) -> None:
    log = alog.log
    recent = dispatcher.recent
    sync = log.config.flush == "sync"
    next_id = 0
    while True:
        next_id += 1
        latest = log.epochs.latest
        written = log.written_offset
        held = log.flushed_offset if sync else written
        await link.send(rpc.Fetch(next_id, epoch, latest[0] if latest else -1, written, held, FETCH_BYTES,
                                  FETCH_MIN_BYTES, round(FETCH_MAX_WAIT_S * 1000)))
        answer = await link.answer()
        if answer.epoch != epoch:
            raise LeaderChanged(f"the leader at {link.peer} leads epoch {answer.epoch}, not {epoch}"
                                + ("; its frames are refused" if answer.epoch < epoch else ""), answer.epoch)
        cut = _parting(log.epochs.latest, answer)
        if cut >= 0:
            LOGGER.warning("replica log parts from its leader's: truncating",
                           extra={"ctx": {"offset": cut, "written": written, "epoch": epoch}})
            await trio.to_thread.run_sync(dispatcher.truncate, cut)
            figures.truncations += 1
            continue
        figures.leader_end = answer.end
        if written < answer.min_offset:
            if written > log.min_offset:
                raise ReplicaExpired(f"this replica's log ends at {written}, below the first offset its leader still"
                                     f" has ({answer.min_offset}): it cannot catch up by fetching; start it empty")
            await trio.to_thread.run_sync(dispatcher.start_at, answer.min_offset)
            written = answer.min_offset
        copied: list[Record] = []
        if len(answer.data) > INLINE_BYTES:
            written = await trio.to_thread.run_sync(log.append_frames, written, answer.data, copied)
        elif answer.data:  # a copy into the page cache: cheaper here than a hop to a worker thread and back
            written = log.append_frames(written, answer.data, copied)
        if copied and recent is not None:
            recent.add(copied)  # dispatch indexes them from memory, as the leader's does its own appends
        latest = log.epochs.latest
        new = [(e, start) for e, start in answer.epochs if (latest is None or e > latest[0]) and start <= written]
        for entry in new:
            await trio.to_thread.run_sync(log.epochs.append, *entry)
        if answer.min_offset > log.min_offset:  # the leader's retention deleted segments: so does this copy
            await trio.to_thread.run_sync(log.delete_before, answer.min_offset)
        if sync and answer.data:
            await alog.wait_flushed(written)
        confirm = min(answer.confirm, written)
        if confirm > log.confirm_offset:
            log.confirm(confirm)
            dispatcher.wake()


def _parting(latest: tuple[int, int] | None, answer: rpc.Frames) -> int:
    """Where this log stops agreeing with the leader's (-1: it agrees): the leader's ``truncate_to``, or the start
    of this log's last epoch if the leader has no such epoch (its leader never replicated a record of it, and the
    leader's answer counted it as the epoch before, which this log's records of it are not)."""
    cut = answer.truncate_to
    if latest is not None and latest[0] not in {e for e, _ in answer.epochs}:
        cut = latest[1] if cut < 0 else min(cut, latest[1])
    return cut


@final
class _Link:
    """One connection to the leader: frames out, answers in."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        try:
            self.peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            self.peer = "?"

    async def send(self, message: rpc.Fetch | rpc.Hello) -> None:
        await self._stream.send_all(rpc.encode(message))

    async def hello(self, name: str, token: str, epoch: int) -> None:
        await self.send(rpc.Hello(rpc.PROTOCOL_VERSION, rpc.REPLICA_PREFIX + name, token))
        welcome = await self._next()
        if type(welcome) is not rpc.Welcome:
            raise rpc.RpcProtocolError(f"the leader answered the Hello with {type(welcome).__name__}")

    async def answer(self) -> rpc.Frames:
        message = await self._next()
        if type(message) is not rpc.Frames:
            raise rpc.RpcProtocolError(f"the leader answered a Fetch with {type(message).__name__}")
        return message

    async def _next(self) -> object:
        with trio.fail_after(ANSWER_TIMEOUT_S):
            while True:
                message = self._decoder.next_message()
                if message is not rpc.NEED_DATA:
                    break
                if self._decoder.eof:
                    raise EOFError("the leader closed the connection")
                self._decoder.receive_data(await self._stream.receive_some(1 << 20))
        if type(message) is rpc.Error:
            if message.kind is rpc.ErrorKind.NOT_LEADER:
                raise LeaderChanged(f"{self.peer} is not the leader" + (f" ({message.message} is)"
                                                                       if message.message else ""),
                                    None, message.message)
            if message.kind in (rpc.ErrorKind.DENIED, rpc.ErrorKind.VERSION, rpc.ErrorKind.VALUE):
                raise _Refused(f"the leader at {self.peer} refused this replica: {message.message}")
            raise rpc.RpcProtocolError(f"the leader answered {message.kind}: {message.message}")
        return message
