"""One epoll set for the plain TCP connections of a node, read by one task.

A reader task per connection that waits for readability costs a trio task
switch, an epoll re-arm (``epoll_ctl``) and the waiting machinery per read.
At a device's pace every PUBLISH is a read of its own, and this was a tenth of
the node's CPU at 5,000 msg/s. Here each socket is registered once in an epoll
set of our own; trio waits on that set's descriptor, and one task step reads
every socket that has bytes, one read each: a ``ReadRound``. Reads may leave
work for the round's end (the node's appends, gathered for one CommitLog
write: gateway/node/appends.py); the poller ends each round by handing it to
its ``round_done`` hook before any other task runs.

Who is read: a ``Readable`` (a connection's transport, gateway/node/transports.py), called in the poller's step,
needs no task of its own; when the poller stops (the node stops) it calls each one's ``gone``, so a connection that
waits for bytes learns that none will be read any more and closes. The set keeps the object itself: no callback
objects per socket (``lightgate bench conns``).

Read order: sockets are read in the order their bytes arrived, because the
node applies packets in the order it reads them (gateway/node/order.py). The
set is edge-triggered for that: the kernel queues a socket when bytes arrive
for it. A level-triggered set also re-queues every socket it reports at the
end of its ready list, where it stays until the kernel next checks it; bytes
arriving for it meanwhile were then read before bytes that had arrived
earlier on another socket (a SUBSCRIBE and a PUBLISH sent back to back from
two connections were read publish first about once in 1,500 tries).
Edge-triggered, the kernel does not report a socket again for bytes it already
reported, so a read that filled its buffer (``read_size``) may have left some:
that socket is read again in the next round, after the others.

Fairness: a round handles at most ``MAX_EVENTS`` sockets and reads about
``ROUND_BYTES`` at most, or one flooding socket's read (``FLOOD_READ_BYTES``),
then yields to the other tasks; a socket with more bytes than one read, or not
reached in a round, is read in the next one, before sockets reported since and
after its neighbours.

A reader must not block. An exception it raises is logged and its socket
is dropped from the set (its ``gone`` called): one connection's bug must not stop everyone's reads.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable
from typing import Protocol, final

import trio

__all__ = ["Poller", "ReadRound", "Readable"]

LOGGER = logging.getLogger(__name__)

MAX_EVENTS = 64
"""Sockets read per round before the other tasks get a turn."""

ROUND_BYTES = 64 * 1024
"""A round ends once its reads add up to this (one full read, ``RECEIVE_BYTES`` in gateway/node/connection.py)."""

FLOOD_READ_BYTES = 8 * 1024
"""A read this large ends its round: the socket is flooding (a device at its own pace sends a PUBLISH or a few
per read, a subscriber a few PUBACKs), so deliveries, dispatch and the other tasks get a turn between any two
such reads. At up to 256 KiB a round, a QoS 0 fan-in subscriber fell seconds behind the flood, past the records
kept in memory, and drained from disk afterwards. Small reads still fill a round up to ``MAX_EVENTS`` sockets
(or ``ROUND_BYTES``): cut at 8 KiB, a round read the PUBACKs of 8 resuming sessions where it had read 64."""


HANG_UP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
"""Reported with bytes the end came too: the kernel will not report the socket again for it, so it is read until
a read returns nothing (the end), even after reads shorter than ``read_size``."""


WATCH = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
"""What the set watches a socket for: bytes and the end, edge-triggered (see "Read order")."""

Events = list[tuple[int, int]]
"""Sockets as epoll reports them: (descriptor, events)."""


class Readable(Protocol):
    """A socket's reader in the poller's set."""

    read_size: int
    """The most :meth:`readable` reads at once; a read of that many is taken to leave bytes behind."""

    def readable(self) -> int:
        """The socket has bytes (or the end): read once, in the poller's step, without blocking; returns the bytes
        read (the round's budget counts them)."""
        ...

    def gone(self) -> None:
        """The poller stopped reading the socket by itself (it stops, or :meth:`readable` raised)."""
        ...


@final
class ReadRound:
    """One round of the poller: the sockets it reads, one read each.

    A round is made by the poller's task in one step, so nothing else runs between its reads and its end
    (``round_done``): what the reads gathered (the node's appends, gateway/node/appends.py) is done there at once.
    """

    __slots__ = ("sockets",)

    def __init__(self, sockets: Events) -> None:
        self.sockets = sockets  # to read in this order: those carried from the round before, then the new ones


@final
class Poller:
    """Calls a socket's ``Readable`` from one task (:meth:`run`) whenever the socket is readable."""

    __slots__ = ("_epoll", "_readers", "_round_done", "round")

    def __init__(self, round_done: Callable[[ReadRound], None] = lambda _: None) -> None:
        """``round_done`` ends each round, after its reads (the readable sockets of one ``epoll_wait``)."""
        self._epoll = select.epoll()
        self._readers: dict[int, Readable] = {}
        self._round_done = round_done
        self.round: ReadRound | None = None  # the round whose reads run now: it ends before anything else runs

    def __len__(self) -> int:
        """Sockets in the set."""
        return len(self._readers)

    def register(self, fd: int, reader: Readable) -> None:
        """Call ``reader.readable()`` from the poller task while ``fd`` has bytes (at most once per round).

        A socket registered with bytes waiting is read in the next round. ``reader.gone()`` is called if the poller
        stops reading ``fd`` by itself; not after :meth:`unregister`.
        """
        self._epoll.register(fd, WATCH)
        self._readers[fd] = reader

    def rearm(self, fd: int) -> None:
        """Report ``fd`` again if it has bytes now: a reader that did not read what the set reported (its
        connection paused) asks for it once it can read."""
        if fd in self._readers:
            self._epoll.modify(fd, WATCH)

    def unregister(self, fd: int) -> Readable | None:
        """Stop watching ``fd``; call it before the descriptor is closed (its number is reused). Idempotent.

        Returns its reader (None: it was not in the set), whose ``gone`` is not called.
        """
        reader = self._readers.pop(fd, None)
        if reader is None:
            return None
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # closed already (the socket, or the set at shutdown)
            pass
        return reader

    def _drop(self, fd: int) -> None:
        """Stop reading ``fd`` and tell its reader (``gone``); a failure there is logged."""
        reader = self.unregister(fd)
        if reader is not None:
            try:
                reader.gone()
            except Exception as exc:
                LOGGER.error("socket's end failed: %r", exc, exc_info=exc, extra={"ctx": {"fd": fd}})

    def alone(self, read: Callable[[], bool]) -> bool:
        """Run ``read`` (a connection decoding bytes outside the poller's reads: a stream's task, or a polled
        socket's backlog after a pause) as a round of its own, unless a round is on: what it gathers ends with
        it in one step, as a round's (a paused publisher's backlog was appended message by message)."""
        if self.round is not None:
            return read()
        current = self.round = ReadRound([])
        try:
            return read()
        finally:
            self.round = None
            self._end(current)

    async def run(self) -> None:
        """Serve the set until cancelled; then close it.

        The sockets a round did not reach, then those it left bytes in, are
        read in the next round before the sockets the kernel reports since.
        """
        epoll = self._epoll
        carried: Events = []  # (socket, events) with bytes to read, oldest first
        try:
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                while True:
                    reported = epoll.poll(0, MAX_EVENTS)
                    current = self.round = ReadRound(_merged(carried, reported) if carried else reported)
                    carried = self._read(current)
                    self.round = None
                    self._end(current)
                    if not carried and len(reported) < MAX_EVENTS:
                        break
                    await trio.lowlevel.checkpoint()
        finally:
            for fd in list(self._readers):  # their connections wait for reads no one will make
                self._drop(fd)
            epoll.close()

    def _end(self, current: ReadRound) -> None:
        """End a round (``round_done``); a failure there is logged."""
        try:
            self._round_done(current)
        except Exception as exc:
            LOGGER.error("end of a read round failed: %r", exc, exc_info=exc)

    def _read(self, current: ReadRound) -> Events:
        """Call the readers of the round's sockets in order, within its budget; returns the sockets to read in
        the next round: those it did not reach, then those it left bytes in."""
        readers = self._readers
        queue = current.sockets
        carried: Events = []
        more: Events = []
        budget = ROUND_BYTES
        for index, (fd, events) in enumerate(queue):
            reader = readers.get(fd)
            if reader is None:
                continue
            try:
                count = reader.readable()
            except Exception as exc:
                count = 0
                LOGGER.error("socket reader failed; the socket is no longer read: %r", exc,
                             exc_info=exc, extra={"ctx": {"fd": fd}})
                self._drop(fd)
            if count >= reader.read_size or (count and events & HANG_UP):
                more.append((fd, events))
            budget -= count
            if budget <= 0 or count >= FLOOD_READ_BYTES:
                carried = queue[index + 1:]
                break
        carried += more
        return carried


def _merged(carried: Events, reported: Events) -> Events:
    """The carried sockets, then those reported anew; a socket in both keeps its place, with both events."""
    place = {fd: index for index, (fd, _) in enumerate(carried)}
    for fd, events in reported:
        index = place.get(fd)
        if index is None:
            carried.append((fd, events))
        else:
            carried[index] = (fd, carried[index][1] | events)
    return carried
