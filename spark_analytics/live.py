"""The live tail over the store node's RPC: executors that do not have the segment files read the
log's newest bytes from the store (``ReadLog``, store/rpc/server.py) and frame them themselves.

Spark tasks are blocking Python, so this is a small blocking client of the
RPC's wire format (store/rpc/wire.py: length-prefixed msgpack frames): a Hello with
the store's ``store.token`` (the call is for trusted peers: a raw log read
passes no topic ACL), then ``ReadLog`` requests, one at a time. The store
sends at most 16 MiB per answer and stops at its flushed offset, so a read
sees durable records only, as the file reader does.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from store.api import MAIN_LOG, LogSpan, NotLeader, Position
from store.rpc import wire as rpc

from .framing import DecodeOptions, Frames, frames_in

__all__ = ["LiveRange", "LogReader", "read_live"]

READ_BYTES = 8 * 1024 * 1024
"""Bytes asked for per ReadLog: big enough to amortise a round trip and the framing's numpy calls."""

TIMEOUT_S = 60.0
"""A store that answers nothing for this long is taken as gone (the task fails and Spark retries it)."""


@dataclass(frozen=True, slots=True)
class LiveRange:
    """The records with offsets in ``[start, end)``, read from the store at ``address`` (HOST:PORT)."""

    address: str
    token: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class LogReader:
    """One connection to a store node, for ``ReadLog`` calls (blocking).

    Resource handling: a context manager; leaving it closes the socket.
    """

    def __init__(self, address: str, token: str = "") -> None:
        """Connect to the store at ``address``: ``HOST:PORT``, or a replicated store's replicas
        ``HOST:PORT,HOST:PORT,...``, tried in turn; a replica that does not lead names the leader, tried next.

        Raises:
            OSError: no replica could be reached (the last attempt's error), or the store refused the Hello.
        """
        self.address = address
        self._ids = 0
        node = f"spark-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # unique: a name is a connection
        candidates = rpc.parse_addresses(address)
        redirects = len(candidates)  # each replica may name a leader once: replicas naming each other end
        while True:
            host, port = candidates.pop(0)
            try:
                self._open(host, port, node, token)
                return
            except NotLeader as exc:
                if exc.leader and redirects:
                    redirects -= 1
                    candidates.insert(0, rpc.parse_address(exc.leader))
                if not candidates:
                    raise
            except OSError:
                if not candidates:
                    raise

    def _open(self, host: str, port: int, node: str, token: str) -> None:
        """Connect and shake hands with the store at ``host:port``.

        Raises:
            NotLeader: a replica that does not lead; OSError: no connection, or another refusal.
        """
        self.address = f"{host}:{port}"
        self._sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
        self._decoder = rpc.FrameDecoder(rpc.SERVER_MESSAGES)
        try:
            self._sock.sendall(rpc.encode(rpc.Hello(rpc.PROTOCOL_VERSION, node, token)))
            answer = self._receive()
            if type(answer) is rpc.Error and answer.kind is rpc.ErrorKind.NOT_LEADER:
                raise NotLeader(answer.message)
            if type(answer) is not rpc.Welcome:
                raise ConnectionError(f"the store at {self.address} refused the connection: {answer}")
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def _receive(self) -> Any:
        while True:
            message = self._decoder.next_message()
            if message is rpc.NEED_DATA:
                data = self._sock.recv(1 << 20)
                if not data:
                    raise ConnectionError(f"the store at {self.address} closed the connection")
                self._decoder.receive_data(data)
            elif type(message) not in (rpc.Heartbeat, rpc.Events):
                return message

    def read(self, offset: int, max_bytes: int) -> LogSpan:
        """One ``ReadLog``: the span of ``LogBytes``.

        Raises:
            LookupError: the offset has expired (retention); ValueError: beyond the flushed offset;
            ConnectionError: the store refused or closed the connection.
        """
        self._ids += 1
        self._sock.sendall(rpc.encode(rpc.ReadLog(self._ids, Position(MAIN_LOG, offset), max_bytes)))
        answer = self._receive()
        if type(answer) is rpc.Error:
            if answer.kind is rpc.ErrorKind.EXPIRED:
                raise LookupError(answer.message)
            if answer.kind is rpc.ErrorKind.VALUE or answer.kind is rpc.ErrorKind.INVALID_OFFSET:
                raise ValueError(answer.message)
            raise ConnectionError(f"the store at {self.address} failed the read: {answer.kind.value}: {answer.message}")
        return answer.span


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
                span = reader.read(offset, max(min(READ_BYTES, rng.end - offset), need))
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
