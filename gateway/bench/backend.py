"""The fleet's backend, in its own process: the checking subscriber and, with ``--commands``, the requester.

The checker is one paho client subscribed to the telemetry template's filter.
For every message of this run it sets bit ``seq`` of the device's bitmap
(a second arrival is a duplicate) and records ``now - sent_ns`` in an HDR
histogram; anything else on the filter is counted as foreign and ignored. It
runs in a process of its own so the latency it measures is not inflated by
device workers or the terminal display competing for its GIL.

The requester is an MQTT 5 client that sends one broadcast (to the fleet's
broadcast filter) and one request per device (to ``cmd/<device>``), each with a
response topic and correlation data, and checks every response against what it
sent: the right correlation data, from the right device, once.

Protocol with the parent (duplex Pipe): ``ready`` -> [``commands``] ->
``progress (received, responses)`` every ``PROGRESS_S`` -> ``drain <acked>`` ->
``done <CheckerTotals>``; failures are sent as ``failed <traceback>``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import orjson
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway.bench.devices import BrokerOptions, command_topic, device_id, new_client
from gateway.bench.report import CheckerTotals, CommandTotals, new_histogram, record_us
from gateway.bench.telemetry import TopicTemplate, decode_stamp

__all__ = ["BackendJob", "backend_main"]

CONNECT_WAIT_S = 20.0
"""How long the backend's clients may take to connect and subscribe before the run is abandoned."""

DRAIN_S = 30.0
"""Longest wait for acknowledged messages and responses still in flight; past it the report says ``capped``."""

QUIET_S = 3.0
"""The drain also ends after this long without any arrival: what has not come by then is lost."""

PROGRESS_S = 0.5
"""Progress snapshots to the parent, as the device workers send them."""


@dataclass(frozen=True, slots=True)
class BackendJob:
    broker: BrokerOptions
    fleet: str
    devices: int
    template: str
    qos: int
    commands: bool = False
    responses_expected: bool = True  # devices speak MQTT 5, so requests carry a response topic they can use


class _Waiter:
    """One paho event (CONNACK, SUBACK) that the backend's main thread waits for with a timeout."""

    def __init__(self) -> None:
        self._events: queue.Queue = queue.Queue()

    def put(self, value: object) -> None:
        self._events.put(value)

    def get(self, what: str) -> object:
        try:
            return self._events.get(timeout=CONNECT_WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"backend: no {what} within {CONNECT_WAIT_S} s") from None


def _connect(client: mqtt.Client, broker: BrokerOptions, filter_: str, qos: int, name: str) -> None:
    """Connect, start paho's network thread, subscribe, and wait for CONNACK and SUBACK."""
    acks = _Waiter()
    client.on_connect = lambda c, u, flags, reason, props: acks.put(reason)
    client.on_subscribe = lambda c, u, mid, reasons, props: acks.put(reasons)
    client.connect(broker.host, broker.port, 60)
    client.loop_start()
    reason = acks.get(f"CONNACK for the {name}")
    if reason.is_failure:
        raise RuntimeError(f"backend: the broker refused the {name}: {reason}")
    client.subscribe(filter_, qos)
    reasons = acks.get(f"SUBACK for the {name}")
    if any(r.is_failure for r in reasons):
        raise RuntimeError(f"backend: the broker refused the {name}'s subscription to {filter_}: {reasons}")


class _Checker:
    """Counts this run's telemetry per (device, seq) and records end-to-end latency (see the module docstring)."""

    def __init__(self, job: BackendJob) -> None:
        self.prefix = job.fleet + "-"
        self.totals = CheckerTotals()
        self.histogram = new_histogram()
        self.unique = 0
        self.last_arrival = time.monotonic()
        tls = job.broker.tls_context()
        self.client = new_client(job.broker, f"{job.fleet}-checker", "3.1.1", tls=tls)
        self.client.on_message = self._on_message
        _connect(self.client, job.broker, TopicTemplate.parse(job.template).filter, job.qos, "checker")

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        now_ns = time.time_ns()
        stamp = decode_stamp(message.payload)
        if stamp is None or not stamp.device.startswith(self.prefix):
            self.totals.foreign += 1
            return
        self.last_arrival = time.monotonic()
        self.totals.deliveries += 1
        record_us(self.histogram, now_ns - stamp.sent_ns)
        bit = 1 << stamp.seq
        bits = self.totals.received.get(stamp.device, 0)
        if bits & bit:
            self.totals.duplicates += 1
        else:
            self.totals.received[stamp.device] = bits | bit
            self.unique += 1


class _Requester:
    """Sends the broadcast and per-device requests and matches the responses (see the module docstring)."""

    def __init__(self, job: BackendJob) -> None:
        self.job = job
        self.totals = CommandTotals()
        self.histogram = new_histogram()
        self.outstanding: dict[bytes, tuple[str, int]] = {}  # correlation -> (device, sent_ns)
        self.broadcast_correlation = f"{job.fleet}/broadcast".encode()
        self.broadcast_sent_ns = 0
        self.answered: set[str] = set()
        self.lock = threading.Lock()  # responses arrive on paho's thread while requests are still being sent
        self.reply_topic = f"reply/{job.fleet}"
        self.client = new_client(job.broker, f"{job.fleet}-requester", "5", tls=job.broker.tls_context())
        self.client.on_message = self._on_message
        _connect(self.client, job.broker, self.reply_topic, 1, "requester")

    def send(self) -> None:
        with self.lock:
            self.broadcast_sent_ns = time.time_ns()
            self._request(f"bcast/{self.job.fleet}/ping", self.broadcast_correlation, {"command": "ping"})
            self.totals.broadcasts_sent += 1
            for i in range(self.job.devices):
                device = device_id(self.job.fleet, i)
                correlation = f"{device}/{i}".encode()
                self.outstanding[correlation] = (device, time.time_ns())
                self._request(command_topic(device), correlation, {"command": "report", "n": i})
                self.totals.requests_sent += 1

    def _request(self, topic: str, correlation: bytes, body: dict) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = correlation
        self.client.publish(topic, orjson.dumps(body), qos=1, properties=props)

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        now_ns = time.time_ns()
        correlation = getattr(message.properties, "CorrelationData", None)
        try:
            device = orjson.loads(message.payload)["device"]
        except (orjson.JSONDecodeError, TypeError, KeyError):
            device = None
        with self.lock:
            if correlation == self.broadcast_correlation and device is not None and device not in self.answered:
                self.answered.add(device)
                self.totals.broadcast_responses += 1
                record_us(self.histogram, now_ns - self.broadcast_sent_ns)
                return
            expected = self.outstanding.get(correlation)
            if expected is None or expected[0] != device:
                self.totals.unmatched += 1
                return
            del self.outstanding[correlation]
            self.totals.responses += 1
            record_us(self.histogram, now_ns - expected[1])

    def complete(self) -> bool:
        """Every request and every device's broadcast answered (MQTT 3.1.1 devices cannot answer: trivially)."""
        if not self.job.responses_expected:
            return self.totals.requests_sent > 0
        return (self.totals.requests_sent > 0 and self.totals.responses == self.totals.requests_sent
                and self.totals.broadcast_responses == self.job.devices)


def _run(job: BackendJob, pipe: Connection) -> None:
    cpu_start = time.process_time()
    checker = _Checker(job)
    requester = _Requester(job) if job.commands else None
    pipe.send(("ready",))
    expected: int | None = None
    drain_start = 0.0
    try:
        while True:
            if pipe.poll(PROGRESS_S):
                command, *rest = pipe.recv()
                if command == "commands" and requester is not None:
                    requester.send()
                elif command == "drain":
                    expected, drain_start = rest[0], time.monotonic()
                    checker.last_arrival = max(checker.last_arrival, drain_start)
            responses = requester.totals.responses if requester else 0
            pipe.send(("progress", (checker.totals.deliveries, responses)))
            if expected is None:
                continue
            now = time.monotonic()
            done = checker.unique >= expected and (requester is None or requester.complete())
            if done or now - checker.last_arrival >= QUIET_S or now - drain_start >= DRAIN_S:
                checker.totals.drain_capped = not done and now - drain_start >= DRAIN_S
                checker.totals.drain_s = now - drain_start
                break
    finally:
        for client in (checker.client, requester.client if requester else None):
            if client is not None:
                client.disconnect()
                client.loop_stop()
    totals = checker.totals
    totals.histogram = checker.histogram.encode()
    if requester is not None:
        requester.totals.rtt_histogram = requester.histogram.encode()
        totals.commands = requester.totals
    totals.cpu_s = time.process_time() - cpu_start
    pipe.send(("done", totals))


def backend_main(job: BackendJob, pipe: Connection) -> None:
    """Process entry point (multiprocessing, spawn); failures reach the parent with their traceback."""
    try:
        _run(job, pipe)
    except Exception:  # noqa: BLE001 - any failure is reported to the parent with its traceback
        pipe.send(("failed", traceback.format_exc()))
    finally:
        pipe.close()
