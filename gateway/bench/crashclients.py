"""MQTT clients that follow the QoS 1/2 flows to the letter through broker crashes, and count what came through.

The durability benchmark (``lightgate bench durability --qos 2``) and the crash
test kit (tests/helpers/crashkit.py) kill a broker under load again and again. What
they measure is only as good as their clients: a client that gives up its
in-flight messages at a reconnect, or delivers a QoS 2 message twice, hides the
faults the kills are meant to show. These clients do what the specification
says, keep their session state across connections (MQTT 3.1.1, clean session
0), and record every acknowledgement and delivery:

- ``Publisher``: packet ids cycle through ``1..id_range`` (ids are 16-bit and
  recycled by every real client: a broker that forgets a QoS 2 flow takes a
  new message with a recycled id for a resend). After a reconnect it resends
  every PUBLISH not yet acknowledged with DUP=1 and its packet id, and every
  PUBREL it owes ([MQTT-4.4.0-1]). A message counts as acknowledged on PUBACK
  (QoS 1) or PUBREC (QoS 2): from then on the broker owns it.
- ``Subscriber``: a QoS 2 message is delivered when its PUBLISH first
  arrives and its packet id is held until the PUBREL (MQTT 3.1.1 section
  4.3.3, method A); a PUBLISH with a held id is not delivered again
  ([MQTT-4.3.3-2]), so a broker that sends a new message with an id the
  subscriber still holds loses that message (``dropped_held``). Every receipt
  of a message already received is a resend and must carry DUP=1 and the
  packet id of the first receipt ([MQTT-3.3.1-1]).

Messages carry (publisher number, sequence number) in the first 8 bytes of
their payload. Everything runs in one trio task per client; ``connect``
callables choose the broker address of each attempt (a cluster client moves
to another gateway when its own dies).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import (
    MQTT_311, Connack, Connect, Disconnect, Puback, Pubcomp, Publish, Pubrec, Pubrel, Suback, Subscribe,
    SubscriptionOptions,
)
from gateway.mqtt.reasons import ReasonCode

__all__ = ["Accounting", "Address", "Publisher", "Subscriber", "account", "address_cycle", "exchange", "message_key",
           "wait_delivered"]

STAMP = struct.Struct(">II")
"""Payload prefix: publisher number, sequence number."""

LEVEL = MQTT_311
"""Persistent sessions and QoS flows are the same in 3.1.1 and 5.0; 3.1.1 runs against every broker."""

RECONNECT_S = 0.05
"""Pause between connection attempts while the broker is down: short next to its restart time."""

ATTEMPT_S = 5.0
"""One connection attempt (TCP + CONNECT/CONNACK + SUBSCRIBE) that takes longer is abandoned and retried."""

TICK_S = 0.005
"""A publisher sends what its rate allows every tick: fine enough for hundreds of messages/s per client."""

RECEIVE_BYTES = 64 * 1024

_LOST = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, EOFError)
"""What a broker that dies does to a connection: a reset, a refused connection, EOF, no CONNACK in time."""

Address = tuple[str, int]


def message_key(publisher: int, seq: int) -> int:
    """One int per message: sets of them stay small and fast for tens of thousands of messages."""
    return publisher << 32 | seq


def address_cycle(addresses: Sequence[Address]) -> Callable[[], Address]:
    """The addresses in turn, one per connection attempt (a client of a killed gateway tries the next)."""
    state = {"next": 0}

    def pick() -> Address:
        address = addresses[state["next"] % len(addresses)]
        state["next"] += 1
        return address

    return pick


class _Link:
    """One connection: a trio stream and a CLIENT-role decoder."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = MqttDecoder(role=Role.CLIENT, protocol_level=LEVEL)
        self.sending = trio.StrictFIFOLock()  # the reader's acknowledgements and the sender's PUBLISHes share it

    async def send(self, *packets: Any) -> None:
        async with self.sending:
            await self.stream.send_all(b"".join(encode(p, LEVEL) for p in packets))

    async def receive(self) -> Any:
        while (packet := self.decoder.next_packet()) is NEED_DATA:
            data = await self.stream.receive_some(RECEIVE_BYTES)
            if not data:
                raise EOFError("the broker closed the connection")
            self.decoder.feed(data)
        return packet

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


async def _connect(address: Callable[[], Address], client_id: str, subscribe: tuple[str, int] | None,
                   stop: trio.Event | None) -> tuple[_Link, bool] | None:
    """A connection with a persistent session (and the subscription, when the session is new), retrying while
    the broker is down; returns it and Session Present, or None once ``stop`` is set."""
    while stop is None or not stop.is_set():
        host, port = address()
        link: _Link | None = None
        try:
            with trio.fail_after(ATTEMPT_S):
                link = _Link(await trio.open_tcp_stream(host, port))
                sock = link.stream.socket
                if sock.getsockname() == sock.getpeername():
                    raise OSError("connected to itself while the broker was down")  # Linux loopback quirk
                await link.send(Connect(protocol_level=LEVEL, client_id=client_id, clean_start=False, keep_alive=0))
                connack = await link.receive()
                if not isinstance(connack, Connack) or connack.reason_code is not ReasonCode.SUCCESS:
                    raise OSError(f"{client_id}: CONNECT refused: {connack!r}")
                if subscribe is not None and not connack.session_present:
                    await link.send(Subscribe(1, ((subscribe[0], SubscriptionOptions(qos=subscribe[1])),)))
                    while not isinstance(suback := await link.receive(), Suback):
                        pass  # nothing but the SUBACK can come before it on a new session
                    if int(suback.reason_codes[0]) > 2:
                        raise OSError(f"{client_id}: SUBSCRIBE refused: {suback!r}")
                return link, connack.session_present
        except _LOST:
            if link is not None:
                await link.close()
            await trio.sleep(RECONNECT_S)  # back-off while the broker restarts
    return None


class Publisher:
    """One publishing client: QoS ``qos`` messages to ``topic`` at ``rate``/s, ids cycling ``1..id_range``."""

    def __init__(self, number: int, qos: int, topic: str, *, rate: float, id_range: int = 100,
                 payload_bytes: int = 32, prefix: str = "cpub-") -> None:
        if qos not in (1, 2) or not 1 <= id_range <= 65535:
            raise ValueError("publishers send QoS 1 or 2 with ids 1..65535")
        self.number = number
        self.qos = qos
        self.topic = topic
        self.rate = rate
        self.id_range = id_range
        self.client_id = f"{prefix}{number}"
        self.padding = bytes(max(0, payload_bytes - STAMP.size))
        self.seq = 0  # messages sent so far (the next sequence number)
        # packet id -> [sequence, released (PUBREC got, PUBREL sent), trio time of its first PUBLISH]
        self.inflight: dict[int, list[Any]] = {}
        self.acked: set[int] = set()  # message keys acknowledged (PUBACK / PUBREC)
        # (first sent, acknowledged) trio times of every acknowledgement, in the order they came: when a broker
        # that went away serves again is the first acknowledgement of a message first sent after it went away
        self.ack_times: list[tuple[float, float]] = []
        self.next_pid = 1
        self.connects = 0
        self.sessions_lost = 0  # reconnects that found no session (Session Present 0)
        self.resent = 0  # PUBLISHes and PUBRELs resent after reconnects
        self._room = trio.Event()

    async def run(self, address: Callable[[], Address], stop: trio.Event, *, finish_s: float = 60.0) -> None:
        """Publish until ``stop``; then finish the flows in flight (for up to ``finish_s``), through reconnects."""
        async with trio.open_nursery() as nursery:
            async def deadline() -> None:
                await stop.wait()
                await trio.sleep(finish_s)  # the longest the flows in flight may take to finish
                nursery.cancel_scope.cancel()

            nursery.start_soon(deadline)
            while True:
                connected = await _connect(address, self.client_id, None, None)
                assert connected is not None
                link, present = connected
                self.connects += 1
                self.sessions_lost += self.connects > 1 and not present
                lost = False
                try:
                    await self._session(link, stop)
                except* _LOST:
                    lost = True  # the broker went away: reconnect and resend
                finally:
                    await link.close()
                if not lost:
                    break
            nursery.cancel_scope.cancel()

    async def _session(self, link: _Link, stop: trio.Event) -> None:
        """One connection: resend what is owed, then publish; returns when stopped and nothing is in flight."""
        owed = [Pubrel(pid) if released else self._publish(pid, seq, dup=True)
                for pid, (seq, released, _) in self.inflight.items()]
        if owed:
            self.resent += len(owed)
            await link.send(*owed)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, link)
            start, base = trio.current_time(), self.seq
            while not stop.is_set():
                due = int(self.rate * (trio.current_time() - start)) + 1 - (self.seq - base)
                packets = []
                while due > 0 and self.next_pid not in self.inflight:
                    pid = self.next_pid
                    self.next_pid = pid % self.id_range + 1
                    self.inflight[pid] = [self.seq, 0, trio.current_time()]
                    packets.append(self._publish(pid, self.seq))
                    self.seq += 1
                    due -= 1
                if packets:
                    await link.send(*packets)
                await trio.sleep(TICK_S)
            while self.inflight:
                self._room = trio.Event()
                await self._room.wait()
            nursery.cancel_scope.cancel()
        await link.send(Disconnect())

    def _publish(self, pid: int, seq: int, *, dup: bool = False) -> Publish:
        payload = STAMP.pack(self.number, seq) + self.padding
        return Publish(self.topic, payload, self.qos, dup=dup, packet_id=pid)

    async def _read(self, link: _Link) -> None:
        while True:
            packet = await link.receive()
            kind = type(packet)
            entry = self.inflight.get(packet.packet_id) if kind in (Puback, Pubrec, Pubcomp) else None
            if kind is Puback and entry is not None and self.qos == 1:
                self._acknowledged(entry)
                del self.inflight[packet.packet_id]
            elif kind is Pubrec:
                if entry is not None and not entry[1]:
                    self._acknowledged(entry)
                    entry[1] = 1
                await link.send(Pubrel(packet.packet_id))  # also for an unknown id: the broker holds it
            elif kind is Pubcomp and entry is not None and entry[1]:
                del self.inflight[packet.packet_id]
            self._room.set()

    def _acknowledged(self, entry: list[Any]) -> None:
        self.acked.add(message_key(self.number, entry[0]))
        self.ack_times.append((entry[2], trio.current_time()))


class Subscriber:
    """One persistent subscriber of ``filter`` at ``qos``: what it got, how often, and how resends looked."""

    def __init__(self, number: int, qos: int, filter: str, *, prefix: str = "csub-") -> None:
        self.number = number
        self.qos = qos
        self.filter = filter
        self.client_id = f"{prefix}{number}"
        self.counts: dict[int, int] = {}  # message key -> times delivered to the application
        self.first_pid: dict[int, int | None] = {}  # message key -> packet id of its first receipt
        self.held: dict[int, int] = {}  # QoS 2: packet id -> message key, from its PUBLISH to its PUBREL
        self.received = 0  # PUBLISH packets received
        # Per publisher number: receipts of a message received before, those without DUP=1 or with another id
        # than the first receipt's, and new messages that came with a packet id still held (not delivered: spec).
        self.resends: dict[int, int] = {}
        self.resends_without_dup: dict[int, int] = {}
        self.resends_with_new_id: dict[int, int] = {}
        self.dropped_held: dict[int, int] = {}
        self.connects = 0
        self.sessions_lost = 0
        self.last_receipt = 0.0  # trio.current_time() of the latest PUBLISH

    async def run(self, address: Callable[[], Address], stop: trio.Event) -> None:
        """Receive (reconnecting whenever the broker goes away) until ``stop``."""
        while not stop.is_set():
            connected = await _connect(address, self.client_id, (self.filter, self.qos), stop)
            if connected is None:
                return
            link, present = connected
            self.connects += 1
            self.sessions_lost += self.connects > 1 and not present
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read, link)
                    await stop.wait()
                    nursery.cancel_scope.cancel()
            except* _LOST:
                pass  # the broker went away: reconnect
            finally:
                await link.close()

    def has(self, keys: set[int]) -> bool:
        """Every message of ``keys`` was delivered at least once."""
        return all(key in self.counts for key in keys)

    async def _read(self, link: _Link) -> None:
        while True:
            packet = await link.receive()
            kind = type(packet)
            if kind is Publish:
                await link.send(*self._on_publish(packet))
            elif kind is Pubrel:
                self.held.pop(packet.packet_id, None)
                await link.send(Pubcomp(packet.packet_id))

    def _on_publish(self, packet: Publish) -> list[Any]:
        self.received += 1
        self.last_receipt = trio.current_time()
        publisher, seq = STAMP.unpack_from(packet.payload)
        key = message_key(publisher, seq)
        pid = packet.packet_id
        if key in self.first_pid:
            _count(self.resends, publisher)
            if not packet.dup:
                _count(self.resends_without_dup, publisher)
            if pid != self.first_pid[key]:
                _count(self.resends_with_new_id, publisher)
        else:
            self.first_pid[key] = pid
        if packet.qos == 0:
            self._deliver(key)
            return []
        if packet.qos == 1:
            self._deliver(key)
            return [Puback(pid)]
        holder = self.held.get(pid)  # type: ignore[arg-type]
        if holder is None:
            self.held[pid] = key  # type: ignore[index]
            self._deliver(key)
        elif holder != key:
            _count(self.dropped_held, publisher)  # a new message sent with an id this client still holds
        return [Pubrec(pid)]  # type: ignore[arg-type]

    def _deliver(self, key: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1


def _count(counts: dict[int, int], publisher: int) -> None:
    counts[publisher] = counts.get(publisher, 0) + 1


@dataclass(frozen=True, slots=True)
class Accounting:
    """What one subscriber got of the messages acknowledged to the publishers it hears."""

    acknowledged: int  # messages acknowledged to their publishers (PUBACK / PUBREC)
    lost: int  # acknowledged and never delivered
    duplicates: int  # deliveries beyond the first, of acknowledged messages
    unacknowledged_delivered: int  # delivered although no acknowledgement reached the publisher (in flight at a kill)
    resends: int  # receipts of a message received before
    resends_without_dup: int  # of those, without DUP=1: exact only for messages stored once (QoS 2 publishers)
    resends_with_new_id: int  # with another packet id than the first receipt's: idem
    dropped_held: int  # new messages not delivered because they came with a packet id the subscriber held

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def account(publishers: Sequence[Publisher], subscriber: Subscriber) -> Accounting:
    """Compare what ``publishers`` had acknowledged with what ``subscriber`` got."""
    acked: set[int] = set().union(*(p.acked for p in publishers))
    mine = {p.number for p in publishers}
    counts = {key: n for key, n in subscriber.counts.items() if key >> 32 in mine}
    return Accounting(
        acknowledged=len(acked),
        lost=sum(1 for key in acked if key not in counts),
        duplicates=sum(n - 1 for key, n in counts.items() if key in acked),
        unacknowledged_delivered=sum(1 for key in counts if key not in acked),
        resends=sum(subscriber.resends.get(n, 0) for n in mine),
        resends_without_dup=sum(subscriber.resends_without_dup.get(n, 0) for n in mine),
        resends_with_new_id=sum(subscriber.resends_with_new_id.get(n, 0) for n in mine),
        dropped_held=sum(subscriber.dropped_held.get(n, 0) for n in mine),
    )


async def wait_delivered(subscribers: Sequence[Subscriber], publishers: Sequence[Publisher], quiet_s: float,
                         poll_s: float = 0.05) -> None:
    """Return once every subscriber has every acknowledged message, or none got a PUBLISH for ``quiet_s``."""
    acked: set[int] = set().union(*(p.acked for p in publishers))
    since = trio.current_time()
    while not all(s.has(acked) for s in subscribers):
        latest = max([since, *(s.last_receipt for s in subscribers)])
        if trio.current_time() - latest >= quiet_s:
            return
        await trio.sleep(poll_s)  # polling counters the reader tasks update: nothing to wait on


async def exchange(publishers: Sequence[Publisher], subscribers: Sequence[Subscriber],
                   address: Callable[[Publisher | Subscriber], Callable[[], Address]],
                   during: Callable[[], Awaitable[None]], *, drain_s: float, quiet_s: float,
                   poll_s: float = 0.05) -> None:
    """Connect the subscribers, then publish while ``during()`` runs (it kills brokers); then stop the publishers
    (they finish their flows) and let the subscribers read until ``wait_delivered`` or ``drain_s`` ends.

    ``address(client)`` is the address callable of each client's connection attempts.
    """
    stop_publishing, stop_receiving = trio.Event(), trio.Event()
    async with trio.open_nursery() as receiving:
        for sub in subscribers:
            receiving.start_soon(sub.run, address(sub), stop_receiving)
        while not all(sub.connects for sub in subscribers):
            await trio.sleep(poll_s)  # polling the subscribers' counters: all subscribed before anything is published
        async with trio.open_nursery() as publishing:
            for pub in publishers:
                publishing.start_soon(pub.run, address(pub), stop_publishing)
            await during()
            stop_publishing.set()
        with trio.move_on_after(drain_s):
            await wait_delivered(subscribers, publishers, quiet_s, poll_s)
        stop_receiving.set()
