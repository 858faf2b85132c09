"""The live tail over the store node's RPC: executors that do not have the segment files read the
log's newest bytes from the store (``ReadLog``, store/rpc/reader.py) and frame them themselves.

Spark tasks are blocking Python, so this is a small blocking client of the
RPC's wire format (store/rpc/wire.py: length-prefixed msgpack frames): a Hello as a log reader
(``$reader/<name>``) with the store's ``store.token`` (the call is for trusted peers: a raw log read
passes no topic ACL), then ``ReadLog`` requests, one at a time. The store
sends at most 16 MiB per answer and stops at its published offset (flushed, and confirmed by the replicas), so a
read sees durable records only, as the file reader does.

A replicated store's replicas all serve readers, each from its own copy of the log: the reader prefers a follower,
so analytics do not load the leader, and takes the leader only when no follower answers. The copies are the same
bytes below each one's published offset, so a reader that loses its replica goes on from another one at the same
offset; one that lags (its published offset below what the planner saw elsewhere) is waited for.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from store.api import MAIN_LOG, LogSpan, NotLeader, Position
from store.rpc import wire as rpc

from .framing import DecodeOptions, Frames, frames_in

__all__ = ["LiveRange", "LogReader", "NotPublished", "read_live"]

READ_BYTES = 8 * 1024 * 1024
"""Bytes asked for per ReadLog: big enough to amortise a round trip and the framing's numpy calls."""

TIMEOUT_S = 60.0
"""A store that answers nothing for this long is taken as gone (the task fails and Spark retries it)."""

HELLO_TIMEOUT_S = 5.0
"""A replica that does not answer the Hello within this is skipped (frozen, or not a store): the next one is tried."""

CATCH_UP_S = 30.0
"""How long a reader waits for its replica to publish an offset another replica already published (a follower
lags its leader by a fetch, and its flush); beyond, the task fails and Spark retries it."""

CATCH_UP_PAUSE_S = (0.01, 0.05, 0.1, 0.25)
"""Pauses between the asks while a replica catches up, the last repeated."""


class NotPublished(ValueError):
    """The offset is beyond the replica's published offset (``ErrorKind.INVALID_OFFSET``)."""


@dataclass(frozen=True, slots=True)
class LiveRange:
    """The records with offsets in ``[start, end)``, read from the store at ``address`` (HOST:PORT, or the
    replicas' HOST:PORT,HOST:PORT,...)."""

    address: str
    token: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class LogReader:
    """One connection to a store node, for ``ReadLog`` calls (blocking); with a replicated store's replicas, to a
    follower if one answers, and to another replica when it goes away.

    Resource handling: a context manager; leaving it closes the socket.
    """

    def __init__(self, address: str, token: str = "") -> None:
        """Connect to the store at ``address``: ``HOST:PORT``, or a replicated store's replicas
        ``HOST:PORT,HOST:PORT,...``: the first follower that welcomes the reader, else the leader.

        Raises:
            OSError: no replica could be reached (the last attempt's error), or the store refused the Hello.
        """
        self.address = address
        self.leads = False  # whether the replica read from leads its group
        self._token = token
        self._ids = 0
        # unique: a name is a connection
        self._node = f"{rpc.READER_PREFIX}spark-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._replicas = [f"{host}:{port}" for host, port in rpc.parse_addresses(address)]
        self._sock: socket.socket | None = None
        self._connect()

    def _connect(self, gone: str | None = None) -> None:
        """Connect to the first follower that welcomes the reader, else to a leader that did; ``gone`` (the replica
        that just went away) is tried last. A replica that refuses readers names its leader, tried too.

        Raises:
            OSError: no replica welcomed the reader (the last attempt's error).
        """
        candidates = [a for a in self._replicas if a != gone] + ([gone] if gone in self._replicas else [])
        tried: set[str] = set()
        fallback: tuple[socket.socket, rpc.FrameDecoder, str] | None = None
        error: OSError = ConnectionError(f"no store replica in {','.join(self._replicas)}")
        while candidates:
            address = candidates.pop(0)
            if address in tried:
                continue
            tried.add(address)
            try:
                sock, decoder, epoch = self._open(address)
            except NotLeader as exc:  # a replica between roles, or one that serves no readers: its leader does
                error = exc
                if exc.leader:
                    candidates.append(exc.leader)
                continue
            except OSError as exc:
                error = exc
                continue
            if epoch and fallback is None:  # the leader: kept in case no follower answers
                fallback = (sock, decoder, address)
                continue
            if epoch:
                sock.close()
                continue
            if fallback is not None:
                fallback[0].close()
            self._sock, self._decoder, self.address, self.leads = sock, decoder, address, False
            return
        if fallback is None:
            raise error
        (self._sock, self._decoder, self.address), self.leads = fallback, True

    def _open(self, address: str) -> tuple[socket.socket, rpc.FrameDecoder, int]:
        """Connect and shake hands with the replica at ``address``: the socket, its decoder, and the epoch the
        replica leads (0: it follows, or the store is not replicated).

        Raises:
            NotLeader: a replica that serves no reader now; OSError: no connection, or another refusal.
        """
        host, port = rpc.parse_address(address)
        sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S)
        decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        try:
            sock.sendall(rpc.encode(rpc.Hello(rpc.PROTOCOL_VERSION, self._node, self._token)))
            answer = _receive(sock, decoder, address)
            if type(answer) is rpc.Error and answer.kind is rpc.ErrorKind.NOT_LEADER:
                raise NotLeader(answer.message)
            if type(answer) is not rpc.Welcome:
                raise ConnectionError(f"the store at {address} refused the connection: {answer}")
            sock.settimeout(TIMEOUT_S)
        except BaseException:
            sock.close()
            raise
        return sock, decoder, answer.epoch

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()

    def read(self, offset: int, max_bytes: int) -> LogSpan:
        """One ``ReadLog``: the span of ``LogBytes``. A replica that goes away (or fails the read) is left for
        another one, each replica tried once.

        Raises:
            LookupError: the offset has expired (retention); NotPublished (a ValueError): beyond the published
            offset; ValueError: a bad request; ConnectionError: no replica could answer.
        """
        for attempt in range(len(self._replicas) + 1):
            try:
                return self._read(offset, max_bytes)
            except OSError:
                if attempt == len(self._replicas):
                    raise
                gone = self.address
                if self._sock is not None:
                    self._sock.close()
                self._sock = None
                self._connect(gone)
        raise AssertionError("unreachable")

    def read_published(self, offset: int, max_bytes: int, end: int) -> LogSpan:
        """:meth:`read`, waiting while the replica has not published ``offset`` yet though ``end`` (beyond it) was
        published by the store (a follower one fetch behind its leader).

        Raises:
            ConnectionError: the replica did not publish ``offset`` within ``CATCH_UP_S``; else as :meth:`read`.
        """
        deadline = time.monotonic() + CATCH_UP_S
        pauses = 0
        while True:
            try:
                span = self.read(offset, max_bytes)
                if span.data or not span.flushed <= span.start < end:
                    return span
            except NotPublished:
                pass
            if time.monotonic() >= deadline:
                raise ConnectionError(f"the store replica at {self.address} has not published offset {offset} "
                                      f"within {CATCH_UP_S} s")
            time.sleep(CATCH_UP_PAUSE_S[min(pauses, len(CATCH_UP_PAUSE_S) - 1)])
            pauses += 1

    def _read(self, offset: int, max_bytes: int) -> LogSpan:
        if self._sock is None:
            raise ConnectionError("no store replica connected")
        self._ids += 1
        self._sock.sendall(rpc.encode(rpc.ReadLog(self._ids, Position(MAIN_LOG, offset), max_bytes)))
        answer = _receive(self._sock, self._decoder, self.address)
        if type(answer) is rpc.Error:
            if answer.kind is rpc.ErrorKind.EXPIRED:
                raise LookupError(answer.message)
            if answer.kind is rpc.ErrorKind.INVALID_OFFSET:
                raise NotPublished(answer.message)
            if answer.kind is rpc.ErrorKind.VALUE:
                raise ValueError(answer.message)
            raise ConnectionError(f"the store at {self.address} failed the read: {answer.kind.value}: {answer.message}")
        return answer.span


def _receive(sock: socket.socket, decoder: rpc.FrameDecoder, address: str) -> Any:
    """The next answer on ``sock`` (heartbeats and events skipped).

    Raises:
        ConnectionError: the store closed the connection; OSError: the socket failed or timed out.
    """
    while True:
        message = decoder.next_message()
        if message is rpc.NEED_DATA:
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError(f"the store at {address} closed the connection")
            decoder.receive_data(data)
        elif type(message) not in (rpc.Heartbeat, rpc.Events):
            return message


def read_live(rng: LiveRange, opts: DecodeOptions) -> Iterator[Frames]:
    """The records of ``rng`` that pass the push-down, read over the RPC.

    Error handling: records deleted by retention before they were read raise
    FileNotFoundError, as a deleted segment file does (the caller decides).
    """
    source = f"store {rng.address}"
    with LogReader(rng.address, rng.token) as reader:
        offset, need = rng.start, 0
        while offset < rng.end:
            try:  # no more than the range (a micro-batch reads its own bytes), all of a record larger than that
                span = reader.read_published(offset, max(min(READ_BYTES, rng.end - offset), need), rng.end)
            except LookupError as exc:
                raise FileNotFoundError(str(exc)) from None
            offset = span.start
            if offset >= rng.end or not span.data:
                return
            frames, consumed = frames_in(span.data, offset, opts, source)
            if frames is not None:
                inside = frames.offset < rng.end
                if inside.any():
                    yield frames if inside.all() else frames.select(inside)
            if consumed == 0:  # a record larger than the read: ask for all of it
                need = int.from_bytes(span.data[:4], "big")
                if need <= len(span.data):
                    return
            offset += consumed
