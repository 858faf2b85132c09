"""Many persistent sessions SUBSCRIBE at once over raw sockets, at little client CPU per packet.

The ``session-filters`` attack (``lightgate bench hostile`` / ``proportion``)
measures what 50 sessions x 1,000 filters cost a broker. Mosquitto answers
them in well under a second of its CPU, so a client that spends more than that
sets the attack's time and takes the cores the broker would use: a trio task
per session, each SUBSCRIBE encoded by the codec and sent alone and each SUBACK
decoded into a packet cost about 2 CPU s (three times Mosquitto's). Here every
SUBSCRIBE is encoded before the first is sent (one buffer per session), a
session's window is refilled in one write once half of it is answered, and
SUBACKs are read as raw frames (type nibble, packet id, reason code) from every
socket in one epoll set. What the attack is stays the same: the sessions
subscribe at once, each its own distinct filters (half wildcards), one filter
per packet, at most ``in_flight`` unanswered per session, and every SUBACK must
answer a packet id in flight.

MQTT 3.1.1 only: its SUBACK carries one reason code per filter and no properties.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

from gateway.mqtt.codec import decode_varint, encode, encode_varint
from gateway.mqtt.packets import MQTT_311, Connect
from gateway.mqtt.reasons import RemoteProtocolError

RECEIVE_BYTES = 256 * 1024
"""One read takes up to this much: a burst of SUBACKs is parsed in one wake-up."""

_CONNACK = 2
_SUBACK = 9
_FAILURE = 0x80  # a SUBACK reason code at or above it refuses the filter [MQTT-3.9.3-2]
_LENGTHS = struct.Struct(">HH")  # packet id, filter length


class StormError(RuntimeError):
    """The broker answered something the storm did not ask for (a SUBACK for a packet id not in flight)."""


def filter_for(session: int, n: int) -> str:
    """Session ``session``'s ``n``-th filter (from 1): distinct per session, every other one a wildcard."""
    return f"fleet/{session}/{n}" if n % 2 else f"fleet/{session}/+/{n}"


def packet_id(n: int) -> int:
    """The ``n``-th SUBSCRIBE's packet id (from 1): ids wrap past 65,535, far beyond any window."""
    return (n - 1) % 65535 + 1


def subscribe_packet(n: int, topic_filter: str, qos: int) -> bytes:
    """An MQTT 3.1.1 SUBSCRIBE of one filter, packet id ``packet_id(n)`` (what the codec encodes, built directly:
    50,000 of them through the codec's objects cost the attack client more than Mosquitto spends answering them)."""
    raw = topic_filter.encode()
    return b"\x82" + encode_varint(len(raw) + 5) + _LENGTHS.pack(packet_id(n), len(raw)) + raw + bytes((qos,))


class _Session:
    """One session's connection: its SUBSCRIBEs in one buffer, how far it sent and was answered, and what is in
    flight."""

    __slots__ = ("number", "sock", "packets", "ends", "sent", "answered", "in_flight", "connected", "rest", "unsent",
                 "began", "took_s")

    def __init__(self, number: int, filters: int, qos: int) -> None:
        self.number = number
        self.sock: socket.socket | None = None
        packets = [subscribe_packet(n, filter_for(number, n), qos) for n in range(1, filters + 1)]
        self.packets = b"".join(packets)
        self.ends = [0]  # ends[n]: the end of the n-th SUBSCRIBE in ``packets``
        for packet in packets:
            self.ends.append(self.ends[-1] + len(packet))
        self.sent = 0
        self.answered = 0
        self.in_flight: set[int] = set()
        self.connected = False
        self.rest = b""  # the start of a frame whose end has not arrived
        self.unsent = b""  # what the socket did not take yet
        self.began = 0.0
        self.took_s = 0.0


def _receive(session: _Session) -> bytes:
    """What the socket holds (nothing if it had nothing after all).

    Raises:
        ConnectionError: the broker closed the connection.
    """
    assert session.sock is not None
    try:
        data = session.sock.recv(RECEIVE_BYTES)
    except BlockingIOError:
        return b""
    if not data:
        raise ConnectionError(f"session {session.number}: closed by the broker")
    return data


class SubscribeStorm:
    """``sessions`` persistent sessions, each SUBSCRIBing ``filters`` distinct filters with ``in_flight`` unanswered.

    ``granted`` and ``refused`` count the SUBACKs' reason codes as they arrive (another thread may read them).
    """

    def __init__(self, sessions: int, filters: int, in_flight: int, *, client_id: str = "hostile-session-{}",
                 qos: int = 1, timeout_s: float = 600.0) -> None:
        self.filters = filters
        self.window = in_flight
        self.refill = max(1, in_flight // 2)
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.granted = 0
        self.refused = 0
        self._sessions = [_Session(number, filters, qos) for number in range(sessions)]

    def run(self, host: str, port: int) -> dict[str, Any]:
        """Connect every session, SUBSCRIBE until each filter is answered; what the broker granted and refused.

        The storm stops at the first connection the broker closes or refuses, a SUBACK that answers no packet in
        flight, or ``timeout_s`` without a single answer; ``ended`` then says which.
        """
        poller = select.epoll()
        try:
            slowest = self._storm(poller, host, port)
        except (OSError, StormError, RemoteProtocolError) as exc:
            return {"granted": self.granted, "refused": self.refused, "ended": f"{type(exc).__name__}: {exc}"}
        finally:
            poller.close()
            for session in self._sessions:
                if session.sock is not None:
                    session.sock.close()
        return {"granted": self.granted, "refused": self.refused, "slowest_session_s": round(slowest, 2)}

    def _storm(self, poller: select.epoll, host: str, port: int) -> float:
        by_fd: dict[int, _Session] = {}
        for session in self._sessions:
            session.began = time.perf_counter()
            sock = session.sock = socket.create_connection((host, port), timeout=self.timeout_s)
            sock.sendall(encode(Connect(MQTT_311, self.client_id.format(session.number), False, keep_alive=0),
                                MQTT_311))
            sock.setblocking(False)
            by_fd[sock.fileno()] = session
            poller.register(sock.fileno(), select.EPOLLIN)
        left = len(by_fd)
        progress = time.monotonic()
        while left:
            events = poller.poll(1.0)
            if not events and time.monotonic() - progress > self.timeout_s:
                raise TimeoutError(f"no answer in {self.timeout_s} s ({left} sessions not done)")
            for fd, mask in events:
                session = by_fd[fd]
                if mask & select.EPOLLOUT:
                    self._write(poller, session, b"")
                data = _receive(session) if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) else b""
                if not data:
                    continue
                progress = time.monotonic()
                if self._take(session, data):
                    self._open_window(poller, session)
                if session.answered == self.filters:
                    session.took_s = time.perf_counter() - session.began
                    poller.unregister(fd)
                    left -= 1
        return max(session.took_s for session in self._sessions)

    def _take(self, session: _Session, data: bytes) -> bool:
        """Read the CONNACK and SUBACK frames ``data`` completes (other packets are skipped); whether any came."""
        buf = session.rest + data if session.rest else data
        end = len(buf)
        pos = 0
        came = False
        in_flight = session.in_flight
        while end - pos >= 2:
            first, length, body = buf[pos], buf[pos + 1], pos + 2
            if length & 0x80:  # longer than any answer the storm asks for (a delivery): a multi-byte length
                head = buf[pos + 1:pos + 5]
                if len(head) < 4 and all(byte & 0x80 for byte in head):
                    break  # the length's own end has not arrived
                length, body = decode_varint(buf, pos + 1, end)
            stop = body + length
            if stop > end:
                break
            kind = first >> 4
            if kind == _SUBACK and length >= 3:
                pid = (buf[body] << 8) | buf[body + 1]
                if pid not in in_flight:
                    raise StormError(f"session {session.number}: a SUBACK for packet id {pid}, not in flight")
                in_flight.remove(pid)
                session.answered += 1
                if buf[body + 2] >= _FAILURE:
                    self.refused += 1
                else:
                    self.granted += 1
                came = True
            elif kind == _CONNACK and not session.connected:
                if length < 2 or buf[body + 1]:
                    raise ConnectionError(f"session {session.number}: CONNECT refused: {buf[pos:stop]!r}")
                session.connected = came = True
            pos = stop
        session.rest = buf[pos:] if pos < end else b""
        return came

    def _open_window(self, poller: select.epoll, session: _Session) -> None:
        """Send, in one write, the SUBSCRIBEs the answers made room for, once they are half the window (or the last).

        Mosquitto writes each SUBACK alone: refilled at every answer, the client's epoll wake-ups, reads and writes
        were one per SUBACK and cost as much CPU as the broker's answers; by halves they cost half of it.
        """
        first = session.sent
        last = min(self.filters, session.answered + self.window)
        if last <= first or last - first < self.refill and last < self.filters:
            return
        for n in range(first + 1, last + 1):
            session.in_flight.add(packet_id(n))
        session.sent = last
        self._write(poller, session, session.packets[session.ends[first]:session.ends[last]])

    def _write(self, poller: select.epoll, session: _Session, data: bytes) -> None:
        """Write ``data`` behind what the socket did not take before; watch for room while some is left."""
        assert session.sock is not None
        data = session.unsent + data if session.unsent else data
        try:
            sent = session.sock.send(data) if data else 0
        except BlockingIOError:
            sent = 0
        waiting = bool(session.unsent)
        session.unsent = data[sent:]
        if bool(session.unsent) != waiting:
            poller.modify(session.sock.fileno(), select.EPOLLIN | (select.EPOLLOUT if session.unsent else 0))
