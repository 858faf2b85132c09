"""One device worker process: hundreds to thousands of paho-mqtt clients driven by one selector loop.

Why one selector loop and not paho's ``loop_start()``: that starts a thread per
client, and a thousand threads on two cores spend their time in the GIL and the
scheduler, not in MQTT. paho's external-loop API (``on_socket_open`` /
``on_socket_close`` / ``on_socket_register_write`` plus ``loop_read`` /
``loop_write`` / ``loop_misc``) lets one thread run every client of the process
over one epoll selector, with a timer heap for the per-device publish schedule,
connect ramp, reconnects and churn. Writes are coalesced: a client that queued
packets is put on a dirty list and written once per loop turn, and only a
socket that would block is registered for EVENT_WRITE, so a publish costs no
selector syscalls.

A device (client id = device id):

- connects per the ramp (or all at once in a storm), with a will
  ``status/<device>`` = ``offline`` (retained) and publishes ``online`` (retained)
  when connected;
- subscribes to ``cmd/<device>`` and the fleet's broadcast filter, counts the
  commands it gets and answers MQTT 5 requests on their response topic with
  their correlation data;
- publishes telemetry (gateway/bench/telemetry.py) at ``rate`` messages/s with jitter
  until the end of the publishing window, only while connected;
- with churn, disconnects at random and reconnects to its persistent session;
  after a lost connection or a failed connect, retries after ``RETRY_S``.

Once the fleet is gone, ``clear_status`` deletes the retained status messages.

Protocol with the parent (over a duplex Pipe, see gateway/bench/simulate.py):
``ready`` -> ``go <epoch>`` -> ``progress ...`` every ``PROGRESS_S`` ->
``published <acked>`` once the window closed and acknowledgements are in ->
(keeps answering commands) -> ``stop`` -> ``done <WorkerTotals>``; any
exception is sent as ``failed <traceback>``.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import random
import selectors
import ssl
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import orjson
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.bench.report import WorkerTotals, new_histogram, record_us
from gateway.bench.telemetry import RandomWalk, TopicTemplate, encode_payload, metrics_by_name, next_interval

__all__ = ["BrokerOptions", "FleetJob", "broadcast_filter", "clear_status", "command_topic", "device_id", "new_client",
           "worker_main"]

PROTOCOLS = {"3.1.1": mqtt.MQTTv311, "5": mqtt.MQTTv5}
"""``--protocol`` values -> paho protocol constants."""

KEEPALIVE_S = 60
"""MQTT keep alive of every client: the common device default; PINGREQs then cost nothing measurable."""

CONNECT_TIMEOUT_S = 10.0
"""A CONNECT without CONNACK for this long is an error and is retried (a broker drowning in a storm)."""

RETRY_S = 1.0
"""Base delay before reconnecting after a failure; randomised up to twice this so retries do not synchronise."""

CHURN_OFFLINE_S = (0.2, 1.0)
"""A churned device stays offline for a uniform time in this range before it resumes its session."""

SESSION_EXPIRY_S = 600
"""MQTT 5 session expiry with churn: long enough to outlive any reconnect of a run, short enough to clean up."""

ACK_WAIT_S = 15.0
"""After the window closes, how long to wait for the broker to acknowledge what is in flight."""

STOP_WAIT_S = 5.0
"""How long clean disconnects may take at the end before the worker reports anyway."""

PROGRESS_S = 0.5
"""Progress snapshots to the parent: the terminal line refreshes about twice a second."""

HOUSEKEEPING_S = 1.0
"""Period of keep-alive checks (loop_misc), connect timeouts and churn draws (churn is a per-second probability)."""

INFLIGHT = 100
"""paho's window of unacknowledged QoS 1/2 messages per client (its default 20 throttles fast devices)."""

_CONNECT, _PUBLISH = 0, 1  # timer kinds


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    """Where and how every client of a run connects (any MQTT broker, not only LightGate)."""

    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    cafile: str | None = None
    insecure: bool = False  # TLS without certificate or host name checks (self-signed test brokers)
    username: str | None = None
    password: str | None = None

    def tls_context(self) -> ssl.SSLContext | None:
        """One context per process, shared by its clients (loading CA files per client costs milliseconds)."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.cafile)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


@dataclass(frozen=True, slots=True)
class FleetJob:
    """What one worker simulates: devices ``first .. first + count - 1`` of fleet ``fleet``."""

    broker: BrokerOptions
    fleet: str  # device id prefix, unique per run so runs on a shared broker stay apart
    first: int
    count: int
    protocol: str = "5"
    qos: int = 1
    rate: float = 1.0  # messages/s per device
    jitter: float = 0.1
    duration_s: float = 30.0
    template: str = "tele/{device}/{metric}"
    metrics: tuple[str, ...] = ("temperature", "humidity", "battery")
    ramp: float = 500.0  # connects/s of this worker
    storm: bool = False
    churn: float = 0.0  # probability per second that a connected device disconnects and resumes later
    seed: int = 0


def device_id(fleet: str, index: int) -> str:
    return f"{fleet}-{index:05d}"


def command_topic(device: str) -> str:
    return f"cmd/{device}"


def broadcast_filter(fleet: str) -> str:
    """Every device of a fleet subscribes to this; a broadcast goes to ``bcast/<fleet>/<command>``."""
    return f"bcast/{fleet}/#"


def status_topic(device: str) -> str:
    return f"status/{device}"


def new_client(broker: BrokerOptions, client_id: str, protocol: str, *, persistent: bool = False,
               tls: ssl.SSLContext | None = None) -> mqtt.Client:
    """A paho client with the broker's TLS and credentials, not yet connected."""
    version = PROTOCOLS[protocol]
    kwargs = {} if version == mqtt.MQTTv5 else {"clean_session": not persistent}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=version, **kwargs)
    if tls is not None:
        client.tls_set_context(tls)
    if broker.username is not None:
        client.username_pw_set(broker.username, broker.password)
    client.max_inflight_messages_set(INFLIGHT)
    return client


class _Device:
    __slots__ = ("id", "client", "walk", "topics", "seq", "pending", "acked", "state", "closing", "deadline",
                 "ever_online", "scheduled", "next_topic")

    def __init__(self, ident: str, client: mqtt.Client, walk: RandomWalk, topics: list[str]) -> None:
        self.id = ident
        self.client = client
        self.walk = walk
        self.topics = topics
        self.seq = 0
        self.pending: dict[int, tuple[int, int]] = {}  # mid -> (seq, sent_ns)
        self.acked = 0  # bitmap of acknowledged seqs
        self.state = "offline"  # offline -> connecting -> connected (CONNACK) -> online (SUBACK)
        self.closing = False  # we asked for the disconnect (churn or stop)
        self.deadline = 0.0  # connecting: CONNACK due by then
        self.ever_online = False
        self.scheduled = False  # the publish timer runs
        self.next_topic = 0


class _Worker:
    """The selector loop and the devices of one process (see the module docstring)."""

    def __init__(self, job: FleetJob, pipe: Connection) -> None:
        self.job = job
        self.pipe = pipe
        self.rng = random.Random(job.seed)
        self.template = TopicTemplate.parse(job.template)
        self.metrics = metrics_by_name(job.metrics)
        self.persistent = job.churn > 0
        self.selector = selectors.DefaultSelector()
        self.selector.register(pipe.fileno(), selectors.EVENT_READ, None)
        self.timers: list[tuple[float, int, int, _Device]] = []
        self.tick = itertools.count()
        self.dirty: list[mqtt.Client] = []
        self.blocked: set[int] = set()  # sockets registered for EVENT_WRITE
        self.histogram = new_histogram()
        self.totals = WorkerTotals(devices=job.count)
        self.errors: dict[str, int] = {}
        self.online = 0
        self.acked = 0
        self.go = 0.0
        self.end = 0.0
        self.stopping = False
        tls = job.broker.tls_context()
        self.devices = [self._device(device_id(job.fleet, job.first + k), tls) for k in range(job.count)]

    def _device(self, ident: str, tls: ssl.SSLContext | None) -> _Device:
        job = self.job
        client = new_client(job.broker, ident, job.protocol, persistent=self.persistent, tls=tls)
        if self.template.per_metric:
            topics = [self.template.topic(ident, m.name) for m in self.metrics]
        else:
            topics = [self.template.topic(ident)]
        device = _Device(ident, client, RandomWalk(self.metrics), topics)
        client.user_data_set(device)
        client.will_set(status_topic(ident), b"offline", qos=1, retain=True)
        properties = None
        if job.protocol == "5" and self.persistent:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = SESSION_EXPIRY_S
        clean: bool | int = mqtt.MQTT_CLEAN_START_FIRST_ONLY if self.persistent or job.protocol != "5" else True
        client.connect_async(job.broker.host, job.broker.port, KEEPALIVE_S, clean_start=clean, properties=properties)
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        return device

    # --- paho's external-loop callbacks -------------------------------------------------

    def _on_socket_open(self, client: mqtt.Client, device: _Device, sock) -> None:
        self.selector.register(sock, selectors.EVENT_READ, client)

    def _on_socket_close(self, client: mqtt.Client, device: _Device, sock) -> None:
        self.blocked.discard(sock.fileno())
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):  # never registered, or already closed
            pass

    def _on_register_write(self, client: mqtt.Client, device: _Device, sock) -> None:
        self.dirty.append(client)

    def _on_unregister_write(self, client: mqtt.Client, device: _Device, sock) -> None:
        if sock.fileno() in self.blocked:
            self.blocked.discard(sock.fileno())
            self.selector.modify(sock, selectors.EVENT_READ, client)

    def _flush(self) -> None:
        """Write what every dirty client queued; only sockets that would block wait for EVENT_WRITE."""
        while self.dirty:
            dirty, self.dirty = self.dirty, []
            for client in dirty:
                client.loop_write()
                sock = client.socket()
                if sock is not None and client.want_write() and sock.fileno() not in self.blocked:
                    self.blocked.add(sock.fileno())
                    self.selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, client)

    # --- MQTT callbacks ---------------------------------------------------------------

    def _on_connect(self, client: mqtt.Client, device: _Device, flags, reason, properties) -> None:
        if reason.is_failure:
            self._error(f"connect_refused:{reason}")
            device.state = "refused"  # the broker closes; _on_disconnect schedules the retry
            return
        device.state = "connected"
        self.totals.connects += 1
        client.subscribe([(command_topic(device.id), 1), (broadcast_filter(self.job.fleet), 1)])
        client.publish(status_topic(device.id), b"online", qos=1, retain=True)
        if not device.scheduled and time.monotonic() < self.end:
            device.scheduled = True
            self._at(time.monotonic() + self.rng.uniform(0, 1 / self.job.rate), _PUBLISH, device)

    def _on_subscribe(self, client: mqtt.Client, device: _Device, mid, reasons, properties) -> None:
        if device.state != "connected":
            return
        device.state = "online"
        self.online += 1
        if not device.ever_online:
            device.ever_online = True
            self.totals.ever_connected += 1
            if self.totals.ever_connected == self.job.count:
                self.totals.all_online_s = time.monotonic() - self.go

    def _on_publish(self, client: mqtt.Client, device: _Device, mid: int, reason, properties) -> None:
        entry = device.pending.pop(mid, None)
        if entry is None:  # a status message
            return
        if reason.is_failure:
            self.totals.publish_refused += 1
            return
        seq, sent_ns = entry
        device.acked |= 1 << seq
        self.acked += 1
        record_us(self.histogram, time.time_ns() - sent_ns)

    def _on_message(self, client: mqtt.Client, device: _Device, message: mqtt.MQTTMessage) -> None:
        self.totals.commands_received += 1
        props = message.properties
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        if response_topic:
            reply = Properties(PacketTypes.PUBLISH)
            correlation = getattr(props, "CorrelationData", None)
            if correlation is not None:
                reply.CorrelationData = correlation
            client.publish(response_topic, orjson.dumps({"device": device.id, "ok": True}), qos=1, properties=reply)
            self.totals.responses_sent += 1

    def _on_disconnect(self, client: mqtt.Client, device: _Device, flags, reason, properties) -> None:
        if device.state == "online":
            self.online -= 1
        was_refused = device.state == "refused"
        device.state = "offline"
        if self.stopping:
            return
        if device.closing:
            device.closing = False
            self._at(time.monotonic() + self.rng.uniform(*CHURN_OFFLINE_S), _CONNECT, device)
            return
        if not was_refused:
            self._error("connection_lost")
        self._at(time.monotonic() + RETRY_S * (1 + self.rng.random()), _CONNECT, device)

    # --- timers -------------------------------------------------------------------------

    def _at(self, due: float, kind: int, device: _Device) -> None:
        heapq.heappush(self.timers, (due, next(self.tick), kind, device))

    def _run_timers(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now:
            due, _, kind, device = heapq.heappop(self.timers)
            if kind == _CONNECT:
                self._connect(device, now)
            elif due < self.end:
                if device.state in ("connected", "online"):
                    self._publish(device)
                self._at(due + next_interval(self.job.rate, self.job.jitter, self.rng), _PUBLISH, device)
            else:
                device.scheduled = False

    def _connect(self, device: _Device, now: float) -> None:
        if self.stopping:
            return
        device.state = "connecting"
        device.deadline = now + CONNECT_TIMEOUT_S
        try:
            device.client.reconnect()
        except OSError as exc:  # refused, unreachable, TLS handshake failure, timeout
            self._error(f"connect_failed:{type(exc).__name__}")
            device.state = "offline"
            self._at(now + RETRY_S * (1 + self.rng.random()), _CONNECT, device)

    def _publish(self, device: _Device) -> None:
        readings = device.walk.step(self.rng)
        topic = device.topics[device.next_topic]
        if self.template.per_metric:
            name = self.metrics[device.next_topic].name
            readings = {name: readings[name]}
            device.next_topic = (device.next_topic + 1) % len(device.topics)
        sent_ns = time.time_ns()
        seq = device.seq
        info = device.client.publish(topic, encode_payload(device.id, seq, sent_ns, readings), self.job.qos)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self._error(f"publish_failed:{mqtt.error_string(info.rc)}")
            return
        device.seq += 1
        device.pending[info.mid] = (seq, sent_ns)
        self.totals.sent += 1

    def _housekeeping(self, now: float) -> None:
        """Keep-alives, CONNACKs that never came, and churn (during the publishing window only)."""
        churn = self.job.churn if now < self.end and not self.stopping else 0.0
        for device in self.devices:
            if device.state == "offline":
                continue
            if device.state == "connecting" and now > device.deadline:
                self._error("connect_timeout")
                self._connect(device, now)
                continue
            device.client.loop_misc()
            if churn and device.state == "online" and self.rng.random() < churn:
                device.closing = True
                self.totals.churn_disconnects += 1
                device.client.disconnect()

    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        self.pipe.send(("ready",))
        command, go_epoch = self.pipe.recv()
        if command != "go":
            raise RuntimeError(f"expected 'go' from the parent, got {command!r}")
        self.go = time.monotonic() + (go_epoch - time.time())
        self.end = self.go + self.job.duration_s
        per_connect = 0.0 if self.job.storm else 1.0 / self.job.ramp
        for k, device in enumerate(self.devices):
            self._at(self.go + k * per_connect, _CONNECT, device)
        cpu_start = time.process_time()
        next_progress = next_housekeeping = self.go
        published_sent = False
        stop_deadline = None
        while True:
            now = time.monotonic()
            wake = min(next_progress, next_housekeeping, self.timers[0][0] if self.timers else next_progress)
            for key, mask in self.selector.select(max(0.0, min(wake - now, PROGRESS_S))):
                if key.data is None:
                    if self.pipe.recv()[0] == "stop":
                        stop_deadline = self._stop()
                    continue
                client = key.data
                if mask & selectors.EVENT_READ:
                    client.loop_read()
                if mask & selectors.EVENT_WRITE:
                    client.loop_write()
            now = time.monotonic()
            self._run_timers(now)
            self._flush()
            if now >= next_housekeeping:
                next_housekeeping = now + HOUSEKEEPING_S
                self._housekeeping(now)
                self._flush()
            if now >= next_progress:
                next_progress = now + PROGRESS_S
                self.pipe.send(("progress", (self.online, self.totals.sent, self.acked,
                                             sum(self.errors.values()), self.totals.commands_received)))
            if not published_sent and now >= self.end and (
                    now >= self.end + ACK_WAIT_S or not any(d.pending for d in self.devices)):
                published_sent = True
                self.pipe.send(("published", self.acked))
            if stop_deadline is not None and (now >= stop_deadline or not any(d.client.socket() for d in self.devices)):
                break
        self.totals.acknowledged = {d.id: d.acked for d in self.devices if d.acked}
        self.totals.errors = self.errors
        self.totals.ack_histogram = self.histogram.encode()
        self.totals.cpu_s = time.process_time() - cpu_start
        self.pipe.send(("done", self.totals))

    def _stop(self) -> float:
        """Disconnect every device cleanly (no wills); MQTT 5 persistent sessions end with it."""
        self.stopping = True
        properties = None
        if self.job.protocol == "5" and self.persistent:
            properties = Properties(PacketTypes.DISCONNECT)
            properties.SessionExpiryInterval = 0
        for device in self.devices:
            if device.client.socket() is not None:
                device.closing = True
                device.client.disconnect(properties=properties)
        self._flush()
        return time.monotonic() + STOP_WAIT_S


def clear_status(broker: BrokerOptions, fleet: str, devices: int, protocol: str) -> int:
    """Delete the retained ``status/<device>`` message of every device of a fleet (its "online", or its will's
    "offline"), once the fleet is gone, so that a run leaves nothing behind on the broker; returns how many
    deletions the broker acknowledged (an empty retained QoS 1 message each, MQTT's way to delete one).

    Raises:
        OSError: the broker cannot be reached; RuntimeError: it refused the client or did not answer in time.
    """
    client = new_client(broker, f"{fleet}-cleanup", protocol, tls=broker.tls_context())
    connected: queue.Queue = queue.Queue()
    client.on_connect = lambda c, u, flags, reason, props: connected.put(reason)
    client.connect(broker.host, broker.port, KEEPALIVE_S)
    client.loop_start()
    try:
        try:
            reason = connected.get(timeout=CONNECT_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"no CONNACK within {CONNECT_TIMEOUT_S} s") from None
        if reason.is_failure:
            raise RuntimeError(f"the broker refused the clean-up client: {reason}")
        sent = [client.publish(status_topic(device_id(fleet, i)), b"", qos=1, retain=True) for i in range(devices)]
        deadline = time.monotonic() + ACK_WAIT_S
        for info in sent:
            info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
        return sum(info.is_published() for info in sent)
    finally:
        client.disconnect()
        client.loop_stop()


def worker_main(job: FleetJob, pipe: Connection) -> None:
    """Process entry point (multiprocessing, spawn): run one worker, report failures instead of dying silently."""
    try:
        _Worker(job, pipe).run()
    except Exception:  # noqa: BLE001 - any failure is reported to the parent with its traceback
        pipe.send(("failed", traceback.format_exc()))
    finally:
        pipe.close()
