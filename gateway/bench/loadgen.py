"""The raw-socket MQTT load generator: worker processes, pre-encoded PUBLISHes, loss and latency per message.

The generator must never be the bottleneck, so it does as little Python per
message as it can and spreads the clients over processes (multiprocessing,
spawn), each running trio with many TCP connections:

- publishers render one PUBLISH per topic with the project's codec
  (``PublishTemplate``) and per message only join the packet id and a
  16-byte stamp (publisher index, sequence number, ``time.time_ns()`` at send:
  the one clock every process on the machine shares) in front of a fixed
  padding; many messages go out in one ``send_all``. Fixed-rate runs use one
  token bucket per worker, refilled every ``TICK_S``, never a sleep per message;
- subscribers read PUBLISH frames straight from the bytes received (the
  decoder only for CONNACK and SUBACK), all of a worker's sockets in one epoll
  set polled by one thread; they acknowledge QoS 1 deliveries (one write per
  read), count the latency of every message (HDR histogram, in 16 us steps) and
  set a bit per (publisher, sequence) received;
- idle workers only hold connections open (the connection-memory scenario);
  with ``filters`` and ``clean_start=False`` they leave persistent sessions
  behind when they disconnect (the offline fan-out scenario);
- churn workers cycle persistent sessions: publish a few QoS 1 messages to
  their own topic, disconnect, resume, and at the end read until every message
  they had acknowledged came back (the churn scenario);
- with ``reconnect`` publishers and subscribers outlive the broker: when it
  goes away they reconnect (retrying) and carry on, publishers until told to
  stop (the durability scenario, which kills the broker under load).

A client subscribes only when the broker did not resume its session
(session present = 0): re-subscribing would be a new subscription.

Loss is exact: publishers report which sequence numbers the broker acknowledged
(QoS 1) or that were sent (QoS 0) as bitmaps, subscribers report what they got,
and ``account`` compares them. Every worker reports its own CPU time, so the
caller can tell when the generator, not the broker, set the pace.

Resource handling: ``run_load`` and ``hold_connections`` start their worker
processes and always join (or kill) them before returning.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import select
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import trio
from hdrh.histogram import HdrHistogram

from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.app.logs import leaves
from gateway.mqtt.packets import (
    MQTT_311, Connack, Connect, Disconnect, Puback, Publish, Suback, Subscribe, SubscriptionOptions,
)
from gateway.mqtt.reasons import ReasonCode
from gateway.mqtt.template import PublishTemplate

STAMP = struct.Struct(">IIQ")
"""Payload prefix: publisher index, sequence number, send time in ns (time.time_ns, shared by all processes)."""

PROTOCOL_LEVEL = MQTT_311
"""Every peer speaks 3.1.1 (amqtt speaks nothing else), so all brokers get the same packets."""

BURST = 64
"""Messages joined into one ``send_all`` when publishing as fast as possible: amortises the per-call cost."""

TICK_S = 0.002
"""Token-bucket refill period of fixed-rate publishers: small next to a 10 ms latency target."""

WINDOW = 64
"""QoS 1 PUBLISHes a publisher keeps unacknowledged: under LightGate's receive maximum (128) and like a real client."""

CONNECT_CONCURRENCY = 64
"""Connections a worker opens at once: thousands of simultaneous SYNs overflow a broker's accept backlog."""

RECEIVE_BYTES = 256 * 1024
"""One ``receive_some`` reads up to this much, so a burst of deliveries is decoded in one wake-up."""

LATENCY_MAX_US = 120_000_000
"""Largest latency the histogram holds (2 minutes): a broker that queues for longer is lost anyway."""

ACK_WAIT_S = 15.0
"""How long publishers wait for their outstanding PUBACKs after the last send."""

POLL_S = 0.05
"""How often a draining worker checks its subscribers' counts (the drain's resolution)."""

DRAIN_S = 60.0
"""Default longest drain: a broker still delivering after this is reported with ``drain_capped``."""

QUIET_S = 10.0
"""Subscribers stop draining after this long without a single delivery: long enough for a broker that
stores a flood first and delivers it afterwards (LightGate) to start delivering."""

RECONNECT_S = 0.05
"""Pause between connection attempts to a broker that is down (restarting): short next to its restart time."""

CONNECT_ALL_TIMEOUT_S = 600.0
"""A worker's clients must all be connected within this: 10,000 persistent sessions resuming at once, each with
1,000 queued messages, are served while the first ones drain (offline-fanout); a broker slower than this has failed.
"""

RECONNECT_TIMEOUT_S = 5.0
"""One connection attempt (TCP + CONNECT/CONNACK) that takes longer is abandoned and retried."""

LATENCY_SHIFT = 14
"""Subscribers count latencies in steps of 2**14 ns (16.4 us), recorded at each step's middle (``_Latencies``)."""

LATENCY_STEP_NS = 1 << LATENCY_SHIFT

LATENCY_STEPS_MAX = 100_000
"""Distinct steps a worker counts before it adds them to its histogram: bounds the dict of a long drain."""

_PACKET_IDS = [pid.to_bytes(2, "big") for pid in range(65536)]
"""Every packet id's two bytes, shared by all publishers of a process (thousands of churn clients each publish)."""

_CONTEXT = multiprocessing.get_context("spawn")  # fork would copy the parent's trio/RocksDB state


class LoadError(RuntimeError):
    """A worker could not do its job (refused connection, broker error); the message says which and why."""


_CONNECTION_LOST = (LoadError, OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError)
"""What a broker that dies or restarts does to a client: a reset, a refused connection, EOF, no CONNACK."""


@dataclass(frozen=True, slots=True)
class Job:
    """What one worker process does.

    ``kind`` is ``publish``, ``subscribe``, ``idle`` or ``churn``. Client ``first + k``
    (k < ``count``) is named ``{prefix}{first + k}``; a publisher's index in the
    stamp is the same number. ``topic`` is formatted with ``i`` (the client
    number) for publishers; client ``i`` subscribes to ``filters[i % len(filters)]``,
    formatted with ``i`` too. Churn clients publish ``messages`` per cycle for
    ``cycles`` cycles.
    """

    kind: str
    host: str
    port: int
    first: int
    count: int
    prefix: str = "lg-"
    qos: int = 0
    topic: str = ""
    filters: tuple[str, ...] = ()
    payload_bytes: int = 64
    rate: float = 0.0  # messages/s per publisher; 0 publishes as fast as possible
    duration_s: float = 10.0
    messages: int = 0  # per publisher; 0 publishes until duration_s
    clean_start: bool = True  # False: persistent sessions (MQTT 3.1.1 clean session 0)
    reconnect: bool = False  # survive the broker going away (publishers then publish until "stop")
    cycles: int = 0  # churn: publish, disconnect, resume this many times


@dataclass(slots=True)
class WorkerReport:
    """What one worker measured. Bitmaps are ints (bit n = sequence n), keyed by publisher index."""

    kind: str
    clients: int
    sent: int = 0
    published: dict[int, int] = field(default_factory=dict)  # publisher -> bits acked (QoS 1) or sent (QoS 0)
    sent_bits: dict[int, int] = field(default_factory=dict)
    received: list[dict[int, int]] = field(default_factory=list)  # per subscriber: publisher -> bits received
    received_count: int = 0
    duplicates: int = 0
    drain_capped: bool = False  # the subscriber stopped at the drain limit while deliveries still arrived
    histogram: bytes = b""
    first_ns: int = 0
    last_ns: int = 0
    publish_s: float = 0.0
    cpu_s: float = 0.0  # during the load phase (after "go"; idle workers: their whole life)
    wall_s: float = 0.0
    connect_ns: int = 0  # time.time_ns() when the worker began connecting its clients
    connects: int = 0  # successful CONNACKs, reconnects included
    sessions_present: int = 0  # CONNACKs that resumed a session (session present = 1)
    connection_losses: int = 0  # connections the broker broke (reconnect jobs)


@dataclass(frozen=True, slots=True)
class Accounting:
    """Messages the subscribers should have got (``expected``), did not get (``lost``), got twice."""

    expected: int
    received: int
    lost: int
    duplicates: int


def account(published: dict[int, int], received: Sequence[dict[int, int]], duplicates: int = 0) -> Accounting:
    """Compare what the broker accepted with what every subscriber got.

    Every subscriber is expected to receive every message in ``published``
    (publisher -> bitmap of sequence numbers), as in fan-in and fan-out.
    Messages received but absent from ``published`` (a QoS 1 delivery whose
    PUBACK had not arrived) count as received, not as lost.
    """
    per_subscriber = sum(bits.bit_count() for bits in published.values())
    lost = sum((bits & ~got.get(p, 0)).bit_count() for got in received for p, bits in published.items())
    total = sum(bits.bit_count() for got in received for bits in got.values())
    return Accounting(per_subscriber * len(received), total, lost, duplicates)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A whole run: per-kind sums, loss accounting, latency percentiles (ms) and generator CPU."""

    sent: int
    acked: int
    publish_rate: float
    delivery_rate: float
    qos0_undelivered: Accounting
    lost: Accounting
    latency_ms: dict[str, float]
    generator: dict[str, Any]
    drain_capped: bool = False
    published: dict[int, int] = field(default_factory=dict)  # publisher -> bits the broker accepted
    connected_ns: int = 0  # when the first subscriber worker began connecting (time.time_ns)
    last_delivery_ns: int = 0
    clients: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> connects, sessions_present, losses

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent, "acked": self.acked, "publish_per_s": round(self.publish_rate),
            "delivered_per_s": round(self.delivery_rate), "received": self.lost.received,
            "expected": self.lost.expected, "lost": self.lost.lost, "duplicates": self.lost.duplicates,
            "not_delivered_of_sent": self.qos0_undelivered.lost, "drain_capped": self.drain_capped,
            "latency_ms": self.latency_ms,
            "generator": self.generator,
        }


def split(total: int, workers: int) -> list[tuple[int, int]]:
    """(first, count) of each worker's share of ``total`` clients, as even as possible, no empty shares."""
    workers = max(1, min(workers, total))
    base, extra = divmod(total, workers)
    shares, first = [], 0
    for w in range(workers):
        count = base + (1 if w < extra else 0)
        shares.append((first, count))
        first += count
    return shares


def run_load(publish: Sequence[Job], subscribe: Sequence[Job], drain_s: float = DRAIN_S, *,
             published: dict[int, int] | None = None, during: Callable[[], Any] | None = None,
             quiet_s: float = QUIET_S) -> LoadResult:
    """Connect the subscribers, then the publishers; publish; drain; account.

    Args:
        publish: one job per publisher worker process.
        subscribe: one job per subscriber worker process.
        drain_s: the longest the subscribers keep reading after the publishers finished;
            they stop earlier once every message arrived or after ``quiet_s`` without one.
        published: messages the broker accepted before this run (``LoadResult.published`` of an
            earlier one) that the subscribers (resuming persistent sessions) should receive too.
        during: called once the load started; the publishers (``reconnect`` jobs, which publish
            until told to stop) are stopped when it returns. The durability scenario kills and
            restarts the broker in it.
        quiet_s: how long a subscriber worker waits for the next delivery before it stops draining.

    Raises:
        LoadError: a worker failed (its reason is in the message).
    """
    with _Workers() as workers:
        subs = [workers.start(job) for job in subscribe]
        workers.expect_ready(subs)
        pubs = [workers.start(job) for job in publish]
        workers.expect_ready(pubs)
        go_ns = time.time_ns()
        for pipe in [*subs, *pubs]:
            pipe.send(("go", None))
        if during is not None:
            during()
            for pipe in pubs:
                pipe.send(("stop", None))
        pub_reports = workers.collect(pubs)
        wanted: dict[int, int] = {}  # publisher -> bitmap of the sequence numbers the broker accepted
        for accepted in [published or {}, *(r.published for r in pub_reports)]:
            for number, bits in accepted.items():
                wanted[number] = wanted.get(number, 0) | bits
        for pipe in subs:
            pipe.send(("drain", (wanted, drain_s, quiet_s)))
        sub_reports = workers.collect(subs)
    return summarise(go_ns, pub_reports, sub_reports, published)


def run_clients(jobs: Sequence[Job]) -> list[WorkerReport]:
    """Run self-contained jobs (``churn``): connect every worker's clients, start them together, collect reports.

    Raises:
        LoadError: a worker failed (its reason is in the message).
    """
    with _Workers() as workers:
        pipes = [workers.start(job) for job in jobs]
        workers.expect_ready(pipes)
        for pipe in pipes:
            pipe.send(("go", None))
        return workers.collect(pipes)


def hold_connections(jobs: Sequence[Job], measure: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Open every job's idle connections, call ``measure`` while they are all open, close them.

    Returns ``measure``'s result and the generator's CPU summary.
    """
    with _Workers() as workers:
        pipes = [workers.start(job) for job in jobs]
        workers.expect_ready(pipes)
        measured = measure()
        for pipe in pipes:
            pipe.send(("close", None))
        reports = workers.collect(pipes)
    return measured, generator_summary(reports)


def summarise(go_ns: int, pubs: Sequence[WorkerReport], subs: Sequence[WorkerReport],
              earlier: dict[int, int] | None = None) -> LoadResult:
    """Merge the workers' reports of a run whose publishers started at ``go_ns`` (time.time_ns).

    ``earlier``: messages accepted before this run that the subscribers should also have received.
    """
    published = dict(earlier or {}) | {p: bits for report in pubs for p, bits in report.published.items()}
    sent_bits = {p: bits for report in pubs for p, bits in report.sent_bits.items()}
    received = [got for report in subs for got in report.received]
    duplicates = sum(r.duplicates for r in subs)
    last_ns = max((r.last_ns for r in subs if r.received_count), default=go_ns)
    count = sum(r.received_count for r in subs)
    sent = sum(r.sent for r in pubs)
    publish_s = max((r.publish_s for r in pubs), default=0.0)
    return LoadResult(
        sent=sent,
        acked=sum(bits.bit_count() for bits in published.values()),
        publish_rate=sent / publish_s if publish_s else 0.0,
        delivery_rate=count / ((last_ns - go_ns) / 1e9) if last_ns > go_ns else 0.0,
        qos0_undelivered=account(sent_bits, received),
        lost=account(published, received, duplicates),
        latency_ms=latency_ms([r.histogram for r in subs]),
        generator=generator_summary([*pubs, *subs]),
        drain_capped=any(r.drain_capped for r in subs),
        published=published,
        connected_ns=min((r.connect_ns for r in subs), default=0),
        last_delivery_ns=max((r.last_ns for r in subs if r.received_count), default=0),
        clients={kind: client_counts(reports) for kind, reports in (("publish", pubs), ("subscribe", subs))},
    )


def client_counts(reports: Sequence[WorkerReport]) -> dict[str, int]:
    """Connections of the reports' clients: CONNACKs, resumed sessions, connections the broker broke."""
    return {"clients": sum(r.clients for r in reports), "connects": sum(r.connects for r in reports),
            "sessions_present": sum(r.sessions_present for r in reports),
            "connection_losses": sum(r.connection_losses for r in reports)}


def latency_ms(encoded: Sequence[bytes]) -> dict[str, float]:
    """p50/p90/p99/p999/max in ms of the workers' encoded histograms (us) added up; empty when none recorded."""
    histogram = HdrHistogram(1, LATENCY_MAX_US, 3)
    for blob in encoded:
        if blob:
            histogram.add(HdrHistogram.decode(blob))
    if not histogram.get_total_count():
        return {}
    return {
        name: round(histogram.get_value_at_percentile(p) / 1000, 3)
        for name, p in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9))
    } | {"max": round(histogram.get_max_value() / 1000, 3)}


def generator_summary(reports: Sequence[WorkerReport]) -> dict[str, Any]:
    """CPU use of the generator's processes: the busiest one tells whether the generator set the pace."""
    shares = [r.cpu_s / r.wall_s if r.wall_s else 0.0 for r in reports]
    return {
        "processes": len(reports),
        "cpu_s": round(sum(r.cpu_s for r in reports), 2),
        "busiest_process_core_share": round(max(shares, default=0.0), 2),
        "per_process_core_share": [round(s, 2) for s in shares],
    }



class _Workers:
    """The worker processes of one run; on exit every one is joined, or killed if it hangs or the run failed."""

    def __init__(self) -> None:
        self._procs: list[tuple[Any, Connection]] = []

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        for proc, pipe in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            pipe.close()

    def start(self, job: Job) -> Connection:
        parent, child = _CONTEXT.Pipe()
        proc = _CONTEXT.Process(target=_worker_main, args=(job, child), daemon=True)
        proc.start()
        child.close()
        self._procs.append((proc, parent))
        return parent

    def expect_ready(self, pipes: Sequence[Connection]) -> None:
        for pipe in pipes:
            self._receive(pipe, "ready")

    def collect(self, pipes: Sequence[Connection]) -> list[WorkerReport]:
        return [self._receive(pipe, "report") for pipe in pipes]

    @staticmethod
    def _receive(pipe: Connection, what: str) -> Any:
        try:
            kind, value = pipe.recv()
        except EOFError:
            raise LoadError(f"a load worker died before sending its {what}") from None
        if kind == "error":
            raise LoadError(value)
        return value


# --- inside a worker process --------------------------------------------------------------


def _worker_main(job: Job, pipe: Connection) -> None:
    """Process entry point: run the job, send ("ready", n), wait for commands, send ("report", WorkerReport)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # thousands of sockets in one process
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    failure = ""
    try:
        report = trio.run(_run_job, job, pipe)
    except* (OSError, LoadError, trio.TooSlowError, trio.BrokenResourceError) as group:
        failure = "; ".join(repr(exc) for exc in leaves(group))
    if failure:
        pipe.send(("error", f"{job.kind} worker {job.first}..{job.first + job.count - 1}: {failure}"))
    else:
        pipe.send(("report", report))


async def _command(pipe: Connection) -> tuple[str, Any]:
    return await trio.to_thread.run_sync(pipe.recv)


async def _run_job(job: Job, pipe: Connection) -> WorkerReport:
    report = WorkerReport(job.kind, job.count)
    clock = _Clock()
    report.connect_ns = time.time_ns()
    clients = await _connect_all(job)
    report.connects = len(clients)
    report.sessions_present = sum(client.session_present for client in clients)
    pipe.send(("ready", len(clients)))
    # CPU share of the load phase only: spawning and connecting are not the load (except for idle workers).
    if job.kind == "publish":
        await _command(pipe)
        clock = _Clock()
        if job.reconnect:
            await _publish_until_stopped(job, clients, pipe, report)
        else:
            await _publish_all(job, clients, report)
        report.cpu_s, report.wall_s = clock.elapsed()
    elif job.kind == "subscribe":
        receive = partial(_receive_through_restarts, job, report) if job.reconnect else _poll
        report.cpu_s, report.wall_s = await _subscribe_until_drained(job, clients, pipe, report, receive)
    elif job.kind == "churn":
        await _command(pipe)
        clock = _Clock()
        await _churn_all(job, clients, report)
        report.cpu_s, report.wall_s = clock.elapsed()
    else:
        report.cpu_s, report.wall_s = clock.elapsed()
        await _command(pipe)
    for client in clients:
        await client.close()
    return report


class _Clock:
    """CPU time (all threads of the process) and wall time since it was made."""

    __slots__ = ("cpu0", "wall0")

    def __init__(self) -> None:
        self.cpu0 = _cpu_s()
        self.wall0 = time.perf_counter()

    def elapsed(self) -> tuple[float, float]:
        return _cpu_s() - self.cpu0, time.perf_counter() - self.wall0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Client:
    """One MQTT connection: a trio stream and a CLIENT-role decoder.

    Bytes go straight to and from the socket's descriptor (``write_now``,
    ``send_bytes``, ``receive_bytes``), trio's stream only when the socket is
    full: at a device's pace trio's ``send_all`` and ``receive_some`` cost the
    generator more than a message costs a fast broker, and on a 2-core machine
    the generator's CPU is taken from the broker under test.
    """

    __slots__ = ("stream", "decoder", "number", "session_present", "_drained")

    def __init__(self, stream: trio.SocketStream, number: int) -> None:
        self.stream = stream
        self.number = number
        self.decoder = MqttDecoder(role=Role.CLIENT, protocol_level=PROTOCOL_LEVEL)
        self.session_present = False
        self._drained = True  # the last read emptied the socket: wait for readability before the next

    async def send(self, packet: Any) -> None:
        await self.send_bytes(encode(packet, PROTOCOL_LEVEL))

    def write_now(self, data: bytes) -> bytes:
        """Write what the socket takes now; returns the rest (empty nearly always).

        Raises:
            trio.BrokenResourceError: the broker closed or reset the connection.
        """
        try:
            sent = os.write(self.stream.socket.fileno(), data)
        except BlockingIOError:
            return data
        except OSError as exc:
            raise trio.BrokenResourceError(f"client {self.number}: send failed: {exc!r}") from exc
        return data[sent:]

    async def send_bytes(self, data: bytes) -> None:
        """Write all of ``data`` (a checkpoint, like ``send_all``)."""
        rest = self.write_now(data)
        if rest:
            await self.stream.send_all(rest)
        else:
            await trio.lowlevel.checkpoint()

    async def receive_bytes(self) -> bytes:
        """The next bytes from the broker; b"" once it closed (a checkpoint, like ``receive_some``).

        Raises:
            trio.BrokenResourceError: the connection was reset.
        """
        fd = self.stream.socket.fileno()
        if self._drained:
            await trio.lowlevel.wait_readable(fd)
        else:
            await trio.lowlevel.checkpoint()
        while True:
            try:
                data = os.read(fd, RECEIVE_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"client {self.number}: receive failed: {exc!r}") from exc
            self._drained = len(data) < RECEIVE_BYTES
            return data

    async def receive(self) -> Any:
        """The next packet; raises LoadError when the broker closes the connection."""
        while (packet := self.decoder.next_packet()) is NEED_DATA:
            data = await self.receive_bytes()
            if not data:
                raise LoadError(f"client {self.number}: the broker closed the connection")
            self.decoder.feed(data)
        return packet

    async def close(self) -> None:
        try:
            await self.send(Disconnect())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # already closed (by the broker, or by a reconnecting client): nothing left to say goodbye to
        await self.stream.aclose()


async def _connect_all(job: Job) -> list[_Client]:
    clients: list[_Client] = []
    limit = trio.Semaphore(CONNECT_CONCURRENCY)

    async def connect(number: int) -> None:
        async with limit:
            client = await _connect(job, number)
            clients.append(client)

    with trio.fail_after(CONNECT_ALL_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for number in range(job.first, job.first + job.count):
                nursery.start_soon(connect, number)
    clients.sort(key=lambda c: c.number)
    return clients


async def _connect(job: Job, number: int) -> _Client:
    """Connect client ``number`` and subscribe it unless the broker resumed its session.

    Resource handling: on any failure the new connection is closed before the exception propagates.
    """
    client = _Client(await trio.open_tcp_stream(job.host, job.port), number)
    try:
        sock = client.stream.socket
        if sock.getsockname() == sock.getpeername():
            # Linux connects a socket to itself when a loopback port nobody listens on (a broker that is
            # restarting) is also the ephemeral port it picked; holding it would keep the broker from binding.
            raise LoadError(f"client {number}: connected to itself while the broker was down")
        await client.send(Connect(protocol_level=PROTOCOL_LEVEL, client_id=f"{job.prefix}{number}", keep_alive=0,
                                  clean_start=job.clean_start))
        connack = await client.receive()
        if not isinstance(connack, Connack) or connack.reason_code is not ReasonCode.SUCCESS:
            raise LoadError(f"client {number}: CONNECT refused: {connack!r}")
        client.session_present = connack.session_present
        if job.filters and not connack.session_present:
            filter = job.filters[number % len(job.filters)].format(i=number)
            await client.send(Subscribe(1, ((filter, SubscriptionOptions(qos=job.qos)),)))
            suback = await client.receive()
            if not isinstance(suback, Suback) or int(suback.reason_codes[0]) > 2:
                raise LoadError(f"client {number}: SUBSCRIBE {filter!r} refused: {suback!r}")
    except BaseException:
        await client.stream.aclose()
        raise
    return client


async def _reconnect(job: Job, number: int, stop: trio.Event | None = None) -> _Client | None:
    """Connect client ``number``, retrying every ``RECONNECT_S`` while the broker is down; None once ``stop`` is set."""
    while stop is None or not stop.is_set():
        try:
            with trio.fail_after(RECONNECT_TIMEOUT_S):
                return await _connect(job, number)
        except _CONNECTION_LOST:
            await trio.sleep(RECONNECT_S)  # back-off between attempts at a broker that is not there yet
    return None


# --- publishing ----------------------------------------------------------------------------


class _Bitmap:
    """A growable bitmap of sequence numbers: one byte operation per bit, unlike an int (which copies)."""

    __slots__ = ("bits",)

    def __init__(self) -> None:
        self.bits = bytearray(1024)

    def set(self, n: int) -> bool:
        """Set bit ``n``; return whether it was set already."""
        index = n >> 3
        bits = self.bits
        if index >= len(bits):
            bits.extend(bytes(max(index + 1 - len(bits), len(bits))))
        mask = 1 << (n & 7)
        was = bits[index] & mask
        bits[index] |= mask
        return bool(was)

    def as_int(self) -> int:
        return int.from_bytes(self.bits, "little")


async def _publish_all(job: Job, clients: list[_Client], report: WorkerReport) -> None:
    publishers = [_Publisher(job, client) for client in clients]
    start = trio.current_time()  # trio's clock, not perf_counter: deadlines are given to trio.sleep_until
    async with trio.open_nursery() as nursery:
        if job.qos:
            for publisher in publishers:
                nursery.start_soon(publisher.read_acks)
        if job.rate:
            await _paced(job, publishers, start)
        else:
            async with trio.open_nursery() as senders:
                for publisher in publishers:
                    senders.start_soon(publisher.flood, start + job.duration_s)
        report.publish_s = trio.current_time() - start
        with trio.move_on_after(ACK_WAIT_S):
            for publisher in publishers:
                await publisher.until_acked()
        nursery.cancel_scope.cancel()
    report.sent = sum(p.seq for p in publishers)
    for p in publishers:
        sent = (1 << p.seq) - 1
        report.sent_bits[p.number] = sent
        report.published[p.number] = p.acked.as_int() if job.qos else sent


async def _paced(job: Job, publishers: list[_Publisher], start: float) -> None:
    """The worker's token bucket: every ``TICK_S``, each publisher sends what its rate allows since its start.

    Publisher starts are spread over one message interval, so the worker's
    messages reach the broker evenly rather than in one burst per interval.
    """
    limit = job.messages or (1 << 62)
    count = len(publishers)
    starts = [start + k / (count * job.rate) for k in range(count)]
    end = start + job.duration_s
    while True:
        now = trio.current_time()
        if now >= end or all(p.seq >= limit for p in publishers):
            return
        for publisher, begun in zip(publishers, starts):
            due = min(int(job.rate * (now - begun)) + 1, limit) - publisher.seq if now >= begun else 0
            if due > 0:
                data = publisher.burst(due)
                # Not send_bytes: its checkpoint per publisher would cost a scheduler round each, every tick.
                rest = publisher.client.write_now(data) if data else b""
                if rest:
                    await publisher.client.stream.send_all(rest)
        await trio.sleep_until(now + TICK_S)


class _Publisher:
    """One publishing connection: pre-encoded PUBLISH bytes and the QoS 1 window."""

    def __init__(self, job: Job, client: _Client) -> None:
        self.job = job
        self.client = client
        self.number = client.number
        self.seq = 0
        self.acked = _Bitmap()
        self.inflight: dict[int, int] = {}  # packet id -> sequence number
        self.space = trio.Event()
        if job.payload_bytes < STAMP.size:
            raise LoadError(f"payload of {job.payload_bytes} B cannot hold the {STAMP.size}-byte stamp")
        self.padding = bytes(job.payload_bytes - STAMP.size)
        template = PublishTemplate(job.topic.format(i=client.number), bytes(job.payload_bytes))
        rendered = template.render(PROTOCOL_LEVEL, job.qos, packet_id=1 if job.qos else None)
        cut = len(rendered) - job.payload_bytes - (2 if job.qos else 0)
        self.head = rendered[:cut]  # fixed header + topic, identical for every message of this publisher
        self.packet_ids = _PACKET_IDS if job.qos else []
        self.next_pid = 1

    def burst(self, want: int) -> bytes:
        """Up to ``want`` next messages (fewer when the QoS 1 window is full), stamped now, as one byte string."""
        if self.job.qos:
            want = min(want, WINDOW - len(self.inflight))
        if want <= 0:
            return b""
        stamp, head, padding, number = STAMP.pack, self.head, self.padding, self.number
        wall = time.time_ns()
        parts: list[bytes] = []
        if self.job.qos:
            for seq in range(self.seq, self.seq + want):
                parts += (head, self.packet_ids[self._take_pid(seq)], stamp(number, seq, wall), padding)
        else:
            for seq in range(self.seq, self.seq + want):
                parts += (head, stamp(number, seq, wall), padding)
        self.seq += want
        return b"".join(parts)

    async def flood(self, end: float) -> None:
        """Send bursts of ``BURST`` as fast as the socket (and the QoS 1 window) allows until ``end``."""
        limit = self.job.messages or (1 << 62)
        while self.seq < limit and trio.current_time() < end:
            data = self.burst(min(BURST, limit - self.seq))
            if data:
                await self.client.send_bytes(data)
            else:
                self.space = trio.Event()
                await self.space.wait()

    async def until_acked(self) -> None:
        while self.inflight:
            self.space = trio.Event()
            await self.space.wait()

    def _take_pid(self, seq: int) -> int:
        pid = self.next_pid
        while pid in self.inflight:
            pid = pid % 65535 + 1
        self.next_pid = pid % 65535 + 1
        self.inflight[pid] = seq
        return pid

    async def read_acks(self) -> None:
        client = self.client
        decoder = client.decoder
        while True:
            data = await client.receive_bytes()
            if not data:
                raise LoadError(f"publisher {self.number}: the broker closed the connection")
            decoder.feed(data)
            while (packet := decoder.next_packet()) is not NEED_DATA:
                if type(packet) is Puback:
                    seq = self.inflight.pop(packet.packet_id, None)
                    if seq is not None and packet.reason_code is ReasonCode.SUCCESS:
                        self.acked.set(seq)
            self.space.set()


# --- subscribing ---------------------------------------------------------------------------


class _Latencies:
    """Delivery latencies counted per ``LATENCY_STEP_NS`` step, added to an HDR histogram in bulk.

    ``record_value`` costs ~2 us in Python, as much as the rest of a delivery's
    accounting; a dict increment per delivery and one ``record_value(v, count)``
    per step seen is a few percent of that. Steps are midpoints, so a latency is
    off by at most half a step (8 us), within the histogram's 3 digits above 8 ms.
    """

    __slots__ = ("steps", "histogram")

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}  # (receive - send ns) >> LATENCY_SHIFT -> deliveries
        self.histogram = HdrHistogram(1, LATENCY_MAX_US, 3)

    def flush(self) -> None:
        """Move the counted steps into the histogram (the caller bounds ``steps`` with it)."""
        record, half = self.histogram.record_value, LATENCY_STEP_NS // 2
        for step, count in self.steps.items():
            record(max(1, ((step << LATENCY_SHIFT) + half) // 1000), count)
        self.steps.clear()

    def encode(self) -> bytes:
        self.flush()
        return self.histogram.encode() if self.histogram.get_total_count() else b""


class _Subscriber:
    """One subscribing connection's bookkeeping: bitmaps per publisher, counts, the bytes of an unfinished packet.

    ``take`` reads PUBLISH frames straight from the received bytes (MQTT 3.1.1,
    ``PROTOCOL_LEVEL``): at a fan-out's 300,000 deliveries/s, the decoder's
    packet objects cost the generator more than the broker spends per delivery.
    """

    __slots__ = ("client", "got", "count", "duplicates", "first_ns", "last_ns", "rest", "unsent")

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.got: dict[int, _Bitmap] = {}
        self.count = 0
        self.duplicates = 0
        self.first_ns = 0
        self.last_ns = 0
        self.rest = b""  # the start of a packet whose end has not arrived
        self.unsent = b""  # PUBACKs the socket did not take yet (raw polling only)

    def has_all(self, wanted: dict[int, int]) -> bool:
        """Whether every sequence number in ``wanted`` (publisher -> bitmap) arrived."""
        got = self.got
        return all(bits & got[number].as_int() == bits if number in got else not bits
                   for number, bits in wanted.items())

    def take_over(self, client: _Client) -> None:
        """Read ``client``'s deliveries from now on, starting with what its decoder holds undecoded."""
        self.client = client
        self.rest = client.decoder.buffered()

    def take(self, data: bytes, now: int, steps: dict[int, int]) -> bytes:
        """Account the PUBLISHes completed by ``data`` (received at ``now``, time.time_ns) and return their PUBACKs.

        Every other packet is skipped. Latencies are counted in ``steps`` (see ``_Latencies``).

        Raises:
            LoadError: a QoS 2 delivery (loadgen subscriptions are QoS 0 or 1).
        """
        buf = self.rest + data if self.rest else data
        end = len(buf)
        pos = 0
        acks: list[bytes] = []
        unpack, got = STAMP.unpack_from, self.got
        count = duplicates = 0
        while end - pos >= 2:
            first = buf[pos]
            length = buf[pos + 1]
            body = pos + 2
            if length & 0x80:  # a multi-byte remaining length
                length &= 0x7F
                shift = 7
                while body < end and buf[body - 1] & 0x80:
                    length |= (buf[body] & 0x7F) << shift
                    shift += 7
                    body += 1
                if buf[body - 1] & 0x80:
                    break  # the length's own end has not arrived
            stop = body + length
            if stop > end:
                break
            if first >> 4 == 3:  # PUBLISH
                start = body + 2 + ((buf[body] << 8) | buf[body + 1])
                qos = (first >> 1) & 3
                if qos:
                    if qos != 1:
                        raise LoadError(f"subscriber {self.client.number}: a QoS {qos} delivery")
                    acks.append(buf[start:start + 2])
                    start += 2
                number, seq, sent_ns = unpack(buf, start)
                bitmap = got.get(number)
                if bitmap is None:
                    bitmap = got[number] = _Bitmap()
                if bitmap.set(seq):
                    duplicates += 1
                count += 1
                step = (now - sent_ns) >> LATENCY_SHIFT
                steps[step] = steps.get(step, 0) + 1
            pos = stop
        self.rest = buf[pos:] if pos < end else b""
        if count:
            self.count += count
            self.duplicates += duplicates
            self.first_ns = self.first_ns or now
            self.last_ns = now
        return b"".join(b"\x40\x02" + pid for pid in acks) if acks else b""


async def _subscribe_until_drained(
    job: Job, clients: list[_Client], pipe: Connection, report: WorkerReport,
    receive: Callable[[list[_Subscriber], _Latencies, threading.Event], Awaitable[None]],
) -> tuple[float, float]:
    """Receive until every expected message arrived or deliveries stopped; return the load phase's CPU and wall s.

    ``receive(subscribers, latencies, stop)`` reads the subscribers' deliveries until ``stop`` is set or it is
    cancelled.
    """
    latencies = _Latencies()
    subscribers = [_Subscriber(client) for client in clients]
    for sub in subscribers:
        sub.take_over(sub.client)
    stop = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive, subscribers, latencies, stop)
        await _command(pipe)  # "go": the publishers are starting
        clock = _Clock()
        busy = clock.elapsed()
        _, (wanted, drain_s, quiet_s) = await _command(pipe)
        with trio.move_on_after(drain_s) as cap:
            total = sum(bits.bit_count() for bits in wanted.values()) * len(subscribers)
            seen, changed = -1, trio.current_time()
            while True:
                count = sum(s.count - s.duplicates for s in subscribers)
                if count != seen:
                    seen, changed, busy = count, trio.current_time(), clock.elapsed()
                # The count alone may reach the total early: it includes messages delivered though their PUBACK
                # never reached the publisher (in flight at a broker kill), which are not in ``wanted``.
                if count >= total and all(s.has_all(wanted) for s in subscribers):
                    break
                if trio.current_time() - changed >= quiet_s:
                    break  # busy stays at the last progress: the quiet wait that ends a drain is not load
                await trio.sleep(POLL_S)
        stop.set()
        nursery.cancel_scope.cancel()
    report.drain_capped = cap.cancelled_caught
    report.received = [{p: bits.as_int() for p, bits in s.got.items()} for s in subscribers]
    report.received_count = sum(s.count for s in subscribers)
    report.duplicates = sum(s.duplicates for s in subscribers)
    report.histogram = latencies.encode()
    report.first_ns = min((s.first_ns for s in subscribers if s.count), default=0)
    report.last_ns = max((s.last_ns for s in subscribers), default=0)
    clients[:] = [s.client for s in subscribers]  # reconnecting subscribers replaced their connections
    return busy


async def _poll(subscribers: list[_Subscriber], latencies: _Latencies, stop: threading.Event) -> None:
    """Read every subscriber in one thread of raw epoll (the worker's trio loop only watches the drain)."""
    await trio.to_thread.run_sync(_poll_sockets, subscribers, latencies, stop)


def _poll_sockets(subscribers: list[_Subscriber], latencies: _Latencies, stop: threading.Event) -> None:
    """epoll over the subscribers' sockets until ``stop``: per ready socket one read, its PUBACKs in one write.

    A trio task per connection costs a scheduler round per delivery when a
    broker writes each message to each socket; one epoll set makes a delivery
    a share of one ``epoll_wait`` and one read.

    Raises:
        LoadError: the broker closed a connection (or sent a QoS 2 delivery).
    """
    by_fd = {sub.client.stream.socket.fileno(): sub for sub in subscribers}
    poller = select.epoll()
    try:
        for fd in by_fd:
            poller.register(fd, select.EPOLLIN)
        steps = latencies.steps
        now = time.time_ns()
        for fd, sub in by_fd.items():  # what arrived with the CONNACK (a resumed session's deliveries)
            if acks := sub.take(b"", now, steps):
                _write_acks(poller, fd, sub, acks)
        while not stop.is_set():
            for fd, events in poller.poll(POLL_S):
                sub = by_fd[fd]
                if events & select.EPOLLOUT:
                    _write_acks(poller, fd, sub, b"")
                if not events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                    continue
                try:
                    data = os.read(fd, RECEIVE_BYTES)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise LoadError(f"subscriber {sub.client.number}: receive failed: {exc!r}") from exc
                if not data:
                    raise LoadError(f"subscriber {sub.client.number}: the broker closed the connection")
                acks = sub.take(data, time.time_ns(), steps)
                if acks or sub.unsent:
                    _write_acks(poller, fd, sub, acks)
            if len(steps) > LATENCY_STEPS_MAX:
                latencies.flush()
    finally:
        poller.close()


def _write_acks(poller: select.epoll, fd: int, sub: _Subscriber, acks: bytes) -> None:
    """Write ``sub``'s PUBACKs behind any it could not write before; watch for room while some are left."""
    data = sub.unsent + acks if sub.unsent else acks
    try:
        sent = os.write(fd, data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        raise LoadError(f"subscriber {sub.client.number}: send failed: {exc!r}") from exc
    was_waiting = bool(sub.unsent)
    sub.unsent = data[sent:]
    if bool(sub.unsent) != was_waiting:
        poller.modify(fd, select.EPOLLIN | (select.EPOLLOUT if sub.unsent else 0))


async def _receive_loop(sub: _Subscriber, latencies: _Latencies) -> None:
    """One subscriber read by its own trio task (a connection that may be replaced: ``_receive_through_restarts``)."""
    client = sub.client
    acks = sub.take(b"", time.time_ns(), latencies.steps)  # what arrived with the CONNACK (a resumed session's)
    while True:
        if acks:
            await client.send_bytes(acks)
        data = await client.receive_bytes()
        if not data:
            raise LoadError(f"subscriber {client.number}: the broker closed the connection")
        acks = sub.take(data, time.time_ns(), latencies.steps)
        if len(latencies.steps) > LATENCY_STEPS_MAX:
            latencies.flush()


# --- through broker restarts (reconnect jobs) -----------------------------------------------


async def _publish_until_stopped(job: Job, clients: list[_Client], pipe: Connection, report: WorkerReport) -> None:
    """Publish at ``job.rate`` per publisher, reconnecting whenever the broker goes away, until "stop".

    A message counts as accepted only when its PUBACK arrived; what was in
    flight when a connection broke is given up (not resent), so it is
    unacknowledged: received or not, it is never counted as lost.
    """
    publishers = [_Publisher(job, client) for client in clients]
    stop = trio.Event()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for publisher in publishers:
            nursery.start_soon(_publish_through_restarts, job, publisher, stop, report)
        await _command(pipe)  # "stop"
        stop.set()
        report.publish_s = trio.current_time() - start
    clients[:] = [p.client for p in publishers]
    report.sent = sum(p.seq for p in publishers)
    for p in publishers:
        report.sent_bits[p.number] = (1 << p.seq) - 1
        report.published[p.number] = p.acked.as_int()


async def _publish_through_restarts(job: Job, publisher: _Publisher, stop: trio.Event, report: WorkerReport) -> None:
    """One publisher: steady publishing on its connection; when the broker breaks it, reconnect and go on."""
    while True:
        lost = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(publisher.read_acks)
                await _steady(job, publisher, stop)
                with trio.move_on_after(ACK_WAIT_S):
                    await publisher.until_acked()
                nursery.cancel_scope.cancel()
        except* _CONNECTION_LOST:
            lost = True  # (no `continue` inside except*)
        if not lost:
            return
        report.connection_losses += 1
        publisher.inflight.clear()
        await publisher.client.stream.aclose()
        client = await _reconnect(job, publisher.number, stop)
        if client is None:
            return
        publisher.client = client
        report.connects += 1


async def _steady(job: Job, publisher: _Publisher, stop: trio.Event) -> None:
    """Send at ``job.rate`` from now until ``stop``; time spent disconnected is not made up for afterwards."""
    start, base = trio.current_time(), publisher.seq
    while not stop.is_set():
        now = trio.current_time()
        due = int(job.rate * (now - start)) + 1 - (publisher.seq - base)
        if due > 0:
            data = publisher.burst(due)
            if data:
                await publisher.client.send_bytes(data)
        await trio.sleep_until(now + TICK_S)


async def _receive_through_restarts(job: Job, report: WorkerReport, subscribers: list[_Subscriber],
                                   latencies: _Latencies, stop: threading.Event) -> None:
    """A task per subscriber that reconnects (resuming its session, or subscribing again) whenever the broker goes
    away; they run until cancelled."""
    async with trio.open_nursery() as nursery:
        for sub in subscribers:
            nursery.start_soon(_reconnecting, job, report, sub, latencies)


async def _reconnecting(job: Job, report: WorkerReport, sub: _Subscriber, latencies: _Latencies) -> None:
    while True:
        try:
            await _receive_loop(sub, latencies)
        except _CONNECTION_LOST:
            pass  # the broker went away: reconnect below
        report.connection_losses += 1
        await sub.client.stream.aclose()
        sub.take_over(await _reconnect(job, sub.client.number))
        report.connects += 1
        report.sessions_present += sub.client.session_present


# --- churning persistent sessions -----------------------------------------------------------


class _Churner:
    """One churn client: its current connection, its publisher state and what came back to it."""

    def __init__(self, job: Job, client: _Client) -> None:
        self.job = job
        self.client = client
        self.publisher = _Publisher(job, client)
        self.got = _Bitmap()
        self.count = 0
        self.duplicates = 0
        self.foreign = 0
        self.sending = trio.StrictFIFOLock()  # the reader's PUBACKs and the publisher's PUBLISHes share the stream

    async def cycles(self, limit: trio.Semaphore, report: WorkerReport, histogram: HdrHistogram) -> None:
        """Publish, disconnect, resume, ``job.cycles`` times; the last resume stays connected for the drain."""
        for _ in range(self.job.cycles):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.read)
                await self._publish(self.job.messages)
                nursery.cancel_scope.cancel()
            await self.client.close()
            self.publisher.inflight.clear()  # unacknowledged by now: given up, not resent
            async with limit:
                began = time.perf_counter_ns()
                self.client = self.publisher.client = await _connect(self.job, self.client.number)
                histogram.record_value(max(1, (time.perf_counter_ns() - began) // 1000))
            report.connects += 1
            report.sessions_present += self.client.session_present

    async def _publish(self, count: int) -> None:
        publisher = self.publisher
        target = publisher.seq + count
        while publisher.seq < target:
            data = publisher.burst(target - publisher.seq)
            if data:
                async with self.sending:
                    await self.client.send_bytes(data)
            else:
                publisher.space = trio.Event()
                await publisher.space.wait()
        with trio.move_on_after(ACK_WAIT_S):
            await publisher.until_acked()

    def missing(self) -> bool:
        """Some message the broker acknowledged has not come back yet."""
        return bool(self.publisher.acked.as_int() & ~self.got.as_int())

    async def read(self) -> None:
        """Take PUBACKs for the publisher and this client's own messages (acknowledging them) until cancelled."""
        client, publisher = self.client, self.publisher
        decoder = client.decoder
        while True:
            replies = []
            while (packet := decoder.next_packet()) is not NEED_DATA:
                kind = type(packet)
                if kind is Puback:
                    seq = publisher.inflight.pop(packet.packet_id, None)
                    if seq is not None and packet.reason_code is ReasonCode.SUCCESS:
                        publisher.acked.set(seq)
                elif kind is Publish:
                    number, seq, _ = STAMP.unpack_from(packet.payload)
                    if number != client.number:
                        self.foreign += 1
                    elif self.got.set(seq):
                        self.duplicates += 1
                    self.count += 1
                    if packet.packet_id is not None:
                        replies.append(encode(Puback(packet.packet_id), PROTOCOL_LEVEL))
            publisher.space.set()
            if replies:
                async with self.sending:
                    await client.send_bytes(b"".join(replies))
            data = await client.receive_bytes()
            if not data:
                raise LoadError(f"churn client {client.number}: the broker closed the connection")
            decoder.feed(data)


async def _churn_all(job: Job, clients: list[_Client], report: WorkerReport) -> None:
    """Run every client's cycles at once, then read until each has its acknowledged messages back (or quiet/cap).

    The report: ``publish_s`` is the cycling phase's wall time, ``histogram`` the
    reconnect (CONNECT -> CONNACK) times in us, ``published``/``received`` per client.
    """
    churners = [_Churner(job, client) for client in clients]
    histogram = HdrHistogram(1, LATENCY_MAX_US, 3)
    limit = trio.Semaphore(CONNECT_CONCURRENCY)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for churner in churners:
            nursery.start_soon(churner.cycles, limit, report, histogram)
    report.publish_s = trio.current_time() - start
    async with trio.open_nursery() as nursery:
        for churner in churners:
            nursery.start_soon(churner.read)
        with trio.move_on_after(DRAIN_S) as cap:
            pending, seen, changed = list(churners), -1, trio.current_time()
            while pending and trio.current_time() - changed < QUIET_S:
                count = sum(c.count for c in churners)
                if count != seen:
                    seen, changed = count, trio.current_time()
                    pending = [c for c in pending if c.missing()]
                await trio.sleep(POLL_S)
        nursery.cancel_scope.cancel()
    report.drain_capped = cap.cancelled_caught
    clients[:] = [c.client for c in churners]
    report.sent = sum(c.publisher.seq for c in churners)
    report.published = {c.client.number: c.publisher.acked.as_int() for c in churners}
    report.received = [{c.client.number: c.got.as_int()} for c in churners]
    report.received_count = sum(c.count for c in churners)
    report.duplicates = sum(c.duplicates for c in churners)
    report.histogram = histogram.encode() if histogram.get_total_count() else b""
