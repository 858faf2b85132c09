"""Hostile clients beside a canary: what one attacker costs the broker and the clients that behave.

For each attack and each broker (LightGate and Mosquitto by default, in the
same run) a fresh broker is started (with a WebSocket listener: ``peers.start``
``websocket=True``) and a canary, a publisher and a subscriber on their own
topic (MQTT 3.1.1, QoS 0, ``--canary-rate`` messages/s, in their own process),
runs for the whole measurement: ``PHASE_S`` before the attack, the attack (in
its own process, started before the baseline: the attack is timed from its
"go", not from its process's start-up), and ``PHASE_S`` after it. Reported per
attack and broker:

- the canary's latency (publish -> delivery) p50 and p99 in ms, and the
  messages it lost, before / during / after the attack;
- the broker's RSS before the attack, at its peak during it (sampled every
  ``SAMPLE_S``), ``PHASE_S`` after it and ``SETTLE_S`` after it (past
  LightGate's 10 s trim of freed memory: what is still there is held); its
  CPU seconds during the attack, and the attack client's (with a warning when
  the client used more: it shares the cores, and may have set the pace);
- what the attacker saw (what the broker accepted, refused, and how often it
  closed the attacker's connection).

The attacks are issue 21's hostile-client campaign:

- ``big-topics``: 6,000 QoS 0 PUBLISHes, each to a distinct 65,000-byte topic
  (one connection; reconnects when the broker closes it);
- ``long-topics``: one client, 30,000 distinct 4,000-byte topics (under
  LightGate's default ``limits.max_topic_length``: what accepted long topics cost);
- ``many-filters``: one session SUBSCRIBEs 20,000 distinct filters, one per
  packet, 64 in flight; the ms per filter at each 5,000 held;
- ``session-filters``: 50 persistent sessions at once each SUBSCRIBE 1,000
  distinct filters (half of them wildcards), one per packet, 64 in flight
  (over raw sockets, ``subscribe_storm``: a cheaper client than the others');
- ``flood``: one publisher sends 3,000 QoS 0 PUBLISHes of 64 KB (192 MB) as fast
  as the broker reads them, to a topic a subscriber reads (the baseline of ``never-reads``);
- ``never-reads``: the same flood, with a second subscriber (QoS 0 and QoS 1
  filters over the flood) that never reads its socket;
- ``user-properties``: 50 MQTT 5 PUBLISHes with 20,000 User Properties each;
- ``churn-tcp`` / ``churn-ws``: 3 rounds of 150 connections that connect, send
  900 KB of a 1 MB PUBLISH and vanish (TCP: reset; WebSocket: the WebSocket
  closed with the packet incomplete).

Timings are of a shared machine unless said otherwise; nothing here is
asserted (tests/gateway/bench/test_hostile.py runs the scenario at tiny sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from gateway.bench import peers
from gateway.bench.peers import Broker
from gateway.bench.subscribe_storm import SubscribeStorm
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.packets import (
    MQTT_5, MQTT_311, Connack, Connect, Disconnect, Pingreq, Pingresp, Publish, Suback, Subscribe,
    SubscriptionOptions,
)
from gateway.mqtt.properties import Properties

PHASE_S = 5.0
"""The canary's baseline before an attack and its recovery after it."""

SETTLE_S = 12.0
"""The last RSS sample is this long after the attack: longer than the node's trim interval
(gateway/app/process.TRIM_INTERVAL_S), so memory freed but not yet given back is not counted as held."""

SAMPLE_S = 0.2
"""How often the broker's RSS is sampled during an attack."""

ATTACK_TIMEOUT_S = 600.0
"""An attack that has not finished by then is stopped and reported as timed out."""

ATTACKER_START_S = 60.0
"""How long the attacker's process may take to start (spawn and imports) before the benchmark gives up."""

CONNECT_TIMEOUT_S = 10.0
"""An attacker's CONNECT / barrier wait; longer counts as the broker closing the connection."""

STAMP = struct.Struct(">Qq")  # canary payload: sequence, monotonic ns at publish

_CONTEXT = multiprocessing.get_context("spawn")  # fork would copy the parent's state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--brokers", nargs="+", default=["lightgate", "mosquitto"], choices=peers.WEBSOCKET_PEERS,
                        help="brokers to attack (each gets a fresh process per attack)")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every attack's count (topics, filters, packets, connections) by this")
    parser.add_argument("--canary-rate", type=float, default=50.0, help="canary messages per second")
    parser.add_argument("--phase-s", type=float, default=PHASE_S, help="canary seconds before and after each attack")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="seconds after each attack of the last RSS sample (at least --phase-s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for attack in args.attacks:
        results[attack] = {}
        for name in peers.available(args.brokers):
            print(f"bench hostile: {attack} against {name}", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"bench-hostile-{name}-") as tmp, \
                    peers.start(name, Path(tmp), websocket=True) as broker:
                results[attack][name] = measure(broker, attack, args)
    return {
        "settings": {"attacks": args.attacks, "scale": args.scale, "canary_rate": args.canary_rate,
                     "phase_s": args.phase_s, "settle_s": args.settle_s, "sizes": {a: _sizes(a, args.scale) for a in args.attacks}},
        "attacks": results,
        "ratios": {attack: _ratios(per_broker) for attack, per_broker in results.items()},
        "warnings": client_warnings({(attack, name): run for attack, per_broker in results.items()
                                     for name, run in per_broker.items()}),
    }


def measure(broker: Broker, attack: str, args: argparse.Namespace) -> dict[str, Any]:
    """One attack against ``broker`` with the canary running: latency, losses, RSS, CPU, the attacker's view."""
    attack_pipe, attack_end = _CONTEXT.Pipe()
    attacker = _CONTEXT.Process(target=_attack_main, daemon=True, args=(
        attack, broker.host, broker.port, broker.ws_port, _sizes(attack, args.scale), attack_end))
    attacker.start()
    if not attack_pipe.poll(ATTACKER_START_S) or attack_pipe.recv() != "ready":
        attacker.kill()
        raise RuntimeError(f"the {attack} attacker did not start")
    canary_pipe, canary_end = _CONTEXT.Pipe()
    canary = _CONTEXT.Process(target=_canary_main, args=(broker.host, broker.port, args.canary_rate, canary_end),
                              daemon=True)
    canary.start()
    if canary_pipe.recv() != "ready":
        attacker.kill()
        raise RuntimeError(f"the canary could not connect to {broker.name}")
    time.sleep(args.phase_s)  # the canary's baseline: the time is the measurement
    rss_before, cpu_before = broker.rss_bytes(), broker.cpu_s()
    started = time.monotonic()
    attack_pipe.send("go")
    peak = rss_before
    while attacker.is_alive() and not attack_pipe.poll(SAMPLE_S) and time.monotonic() - started < ATTACK_TIMEOUT_S:
        peak = max(peak, broker.rss_bytes())
    seen: dict[str, Any] = attack_pipe.recv() if attack_pipe.poll(0) else {"timed_out": True}
    client_cpu = seen.pop("client_cpu_s", None)
    ended = time.monotonic()
    peak = max(peak, broker.rss_bytes())
    attacker.join(5)
    if attacker.is_alive():
        attacker.kill()
    cpu_attack = broker.cpu_s() - cpu_before
    time.sleep(args.phase_s)  # the canary's recovery
    rss_after = broker.rss_bytes()
    time.sleep(max(0.0, args.settle_s - args.phase_s))
    rss_settled = broker.rss_bytes()
    canary_pipe.send("stop")
    samples: list[tuple[int, float | None]] = canary_pipe.recv()
    canary.join(5)
    phases = _phases(samples, int(started * 1e9), int(ended * 1e9))
    return {
        "canary": phases,
        "rss_MiB": {"before": _mib(rss_before), "peak_during": _mib(peak), "after": _mib(rss_after),
                    "settled": _mib(rss_settled)},
        "broker_cpu_s_during": round(cpu_attack, 2),
        "client_cpu_s_during": client_cpu,
        "attack_s": round(ended - started, 2),
        "attacker": seen,
    }


def client_warnings(runs: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """One warning per (attack, broker) run whose attack client used more CPU than the broker did.

    The client and the broker share the machine's cores, and a client that works harder than the broker it
    attacks may be what the attack's seconds measure. The warnings are printed to stderr as well as returned.
    """
    warnings = []
    for (attack, name), run in runs.items():
        client, broker = run["client_cpu_s_during"], run["broker_cpu_s_during"]
        if client is not None and client > broker:
            warnings.append(f"{name} {attack}: the attack client used {client} CPU s, more than the broker's "
                            f"{broker} s: the client may have set the pace")
    for warning in warnings:
        print(f"bench: warning: {warning}", file=sys.stderr, flush=True)
    return warnings


def _mib(value: int) -> float:
    return round(value / 2**20, 1)


def _phases(samples: list[tuple[int, float | None]], start_ns: int, end_ns: int) -> dict[str, Any]:
    """Canary latency p50/p99 (ms) and losses by the phase each message was published in."""
    out = {}
    for phase, keep in (("before", lambda t: t < start_ns), ("during", lambda t: start_ns <= t < end_ns),
                        ("after", lambda t: t >= end_ns)):
        latencies = sorted(ms for t, ms in samples if keep(t) and ms is not None)
        lost = sum(1 for t, ms in samples if keep(t) and ms is None)
        out[phase] = {"p50_ms": _quantile(latencies, 0.5), "p99_ms": _quantile(latencies, 0.99),
                      "received": len(latencies), "lost": lost}
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def _ratios(per_broker: dict[str, Any]) -> dict[str, float | None]:
    """LightGate's canary p99 during the attack and RSS growth, over Mosquitto's."""
    if "lightgate" not in per_broker or "mosquitto" not in per_broker:
        return {}
    mine, theirs = per_broker["lightgate"], per_broker["mosquitto"]

    def ratio(get: Callable[[dict[str, Any]], float | None]) -> float | None:
        a, b = get(mine), get(theirs)
        return round(a / b, 2) if a is not None and b else None

    return {"canary_p99_during": ratio(lambda r: r["canary"]["during"]["p99_ms"]),
            "rss_peak_growth": ratio(lambda r: r["rss_MiB"]["peak_during"] - r["rss_MiB"]["before"]),
            "rss_settled_growth": ratio(lambda r: r["rss_MiB"]["settled"] - r["rss_MiB"]["before"])}


# --- the attacks --------------------------------------------------------------------------------

SIZES: dict[str, dict[str, int]] = {
    "big-topics": {"topics": 6000, "topic_bytes": 65_000},
    "long-topics": {"topics": 30_000, "topic_bytes": 4_000},
    "many-filters": {"filters": 20_000, "in_flight": 64, "report_every": 5000},
    "session-filters": {"sessions": 50, "filters": 1_000, "in_flight": 64},
    "flood": {"messages": 3_000, "payload_bytes": 65_536, "stalled": 0},
    "never-reads": {"messages": 3_000, "payload_bytes": 65_536, "stalled": 1},
    "user-properties": {"packets": 50, "properties": 20_000},
    "churn-tcp": {"rounds": 3, "connections": 150, "announced": 1_000_000, "sent": 900_000},
    "churn-ws": {"rounds": 3, "connections": 150, "announced": 1_000_000, "sent": 900_000},
}
"""Each attack's sizes at ``--scale 1``; the counts (not the byte sizes) scale."""

_SCALED = {"topics", "filters", "packets", "connections", "report_every", "messages"}


def _sizes(attack: str, scale: float) -> dict[str, int]:
    return {key: max(1, round(value * scale)) if key in _SCALED else value for key, value in SIZES[attack].items()}


class _Client:
    """A raw MQTT connection over the project's codec (the attacker's and the canary's)."""

    def __init__(self, stream: trio.SocketStream, level: int) -> None:
        self.stream = stream
        self.level = level
        self.decoder = MqttDecoder(role=Role.CLIENT, protocol_level=level)

    @classmethod
    async def connect(cls, host: str, port: int, client_id: str, level: int = MQTT_311, *, clean: bool = True,
                      receive_buffer: int | None = None) -> _Client:
        """Connected and accepted; ``receive_buffer``: the socket's SO_RCVBUF, set before it connects."""
        sock = trio.socket.socket()
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((host, port))
        client = cls(trio.SocketStream(sock), level)
        await client.send(Connect(level, client_id, clean, keep_alive=0))
        connack = await client.receive()
        if not isinstance(connack, Connack) or connack.reason_code.is_failure:
            raise ConnectionError(f"CONNECT refused: {connack!r}")
        return client

    async def send(self, *packets: Any) -> None:
        await self.stream.send_all(b"".join(encode(p, self.level) for p in packets))

    async def receive(self) -> Any:
        while (packet := self.decoder.next_packet()) is NEED_DATA:
            data = await self.stream.receive_some(256 * 1024)
            if not data:
                raise ConnectionError("closed by the broker")
            self.decoder.feed(data)
        return packet

    async def barrier(self) -> bool:
        """PINGREQ, then wait for the PINGRESP: True when the broker processed everything before it."""
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await self.send(Pingreq())
                while not isinstance(packet := await self.receive(), Pingresp):
                    if isinstance(packet, Disconnect):
                        return False
        except (ConnectionError, OSError, trio.BrokenResourceError, trio.TooSlowError):
            return False
        return True

    async def close(self) -> None:
        await self.stream.aclose()


_LOST = (ConnectionError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


async def _publish_topics(host: str, port: int, ws_port: int | None, sizes: dict[str, int]) -> dict[str, Any]:
    """Distinct long topics, QoS 0, one connection at a time: reconnect whenever the broker closes it."""
    client = await _Client.connect(host, port, "hostile-topics")
    closed = 0
    for n in range(sizes["topics"]):
        topic = f"hostile/{n:08d}/".ljust(sizes["topic_bytes"], "x")
        try:
            await client.send(Publish(topic, b"p"))
        except _LOST:
            closed += 1
            client = await _Client.connect(host, port, "hostile-topics")
    processed = await client.barrier()
    if not processed:  # every send fitted in the socket buffers before the broker read the first and closed
        closed += 1
    await client.close()
    return {"published": sizes["topics"], "connections_closed_by_broker": closed,
            "last_connection_processed_all": processed}


async def _subscribe_filters(host: str, port: int, ws_port: int | None, sizes: dict[str, int]) -> dict[str, Any]:
    """One session SUBSCRIBEs distinct filters, one per packet, a window of them in flight."""
    client = await _Client.connect(host, port, "hostile-filters")
    total, window, every = sizes["filters"], sizes["in_flight"], sizes["report_every"]
    granted = refused = 0
    ms_per_filter: dict[str, float] = {}
    mark = time.perf_counter()
    sent = answered = 0
    try:
        while answered < total:
            while sent < total and sent - answered < window:
                sent += 1
                await client.send(Subscribe(sent % 65535 + 1, ((f"hostile/filter/{sent}", SubscriptionOptions()),)))
            with trio.fail_after(ATTACK_TIMEOUT_S):
                suback = await client.receive()
            if not isinstance(suback, Suback):
                continue
            answered += 1
            if suback.reason_codes[0].is_failure:
                refused += 1
            else:
                granted += 1
            if answered % every == 0:
                now = time.perf_counter()
                ms_per_filter[str(answered)] = round((now - mark) * 1000 / every, 3)
                mark = now
    except (*_LOST, trio.TooSlowError) as exc:
        return {"granted": granted, "refused": refused, "ms_per_filter_by_held": ms_per_filter,
                "ended": f"{type(exc).__name__}: {exc}"}
    await client.close()
    return {"granted": granted, "refused": refused, "ms_per_filter_by_held": ms_per_filter}


async def _session_filters(host: str, port: int, ws_port: int | None, sizes: dict[str, int]) -> dict[str, Any]:
    """Persistent sessions SUBSCRIBE at once, each its own distinct filters, one per packet, a window in flight:
    over raw sockets in one thread (``SubscribeStorm``), so that the client does not set the pace."""
    storm = SubscribeStorm(sizes["sessions"], sizes["filters"], sizes["in_flight"], timeout_s=ATTACK_TIMEOUT_S)
    return await trio.to_thread.run_sync(storm.run, host, port)


async def _flood(host: str, port: int, ws_port: int | None, sizes: dict[str, int]) -> dict[str, Any]:
    """QoS 0 PUBLISHes as fast as the broker reads them, to a topic a subscriber reads; with ``stalled``, a second
    subscriber (QoS 0 and QoS 1 filters over it) with a small receive buffer never reads its socket."""
    reader = await _Client.connect(host, port, "flood-reader")
    await reader.send(Subscribe(1, (("flood/#", SubscriptionOptions()),)))
    await reader.receive()  # the SUBACK
    stalled = None
    if sizes["stalled"]:
        stalled = await _Client.connect(host, port, "flood-stalled", receive_buffer=4096)
        await stalled.send(Subscribe(1, (("flood/#", SubscriptionOptions()),
                                         ("flood/+", SubscriptionOptions(qos=1)))))
        await stalled.receive()  # the SUBACK; nothing is read after it
    publisher = await _Client.connect(host, port, "flood-publisher")
    received = 0

    async def read() -> None:
        nonlocal received
        with contextlib.suppress(*_LOST):
            while True:
                if isinstance(await reader.receive(), Publish):
                    received += 1

    payload = b"x" * sizes["payload_bytes"]
    packet = encode(Publish("flood/t", payload), MQTT_311)
    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for _ in range(sizes["messages"]):
            await publisher.stream.send_all(packet)
        processed = await publisher.barrier()
        published_s = time.perf_counter() - began
        with trio.move_on_after(PHASE_S):  # the reader catches up, or stops short of what it was dropped
            while received < sizes["messages"]:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    for client in (publisher, reader, stalled):
        if client is not None:
            await client.close()
    return {"published": sizes["messages"], "published_s": round(published_s, 2),
            "reader_received": received, "processed_all": processed}


async def _user_properties(host: str, port: int, ws_port: int | None, sizes: dict[str, int]) -> dict[str, Any]:
    """MQTT 5 PUBLISHes with thousands of User Properties, each followed by a barrier; reconnect when closed."""
    props = Properties(user_properties=tuple((f"k{i}", "v") for i in range(sizes["properties"])))
    packet = Publish("hostile/props", b"p", properties=props)
    client = await _Client.connect(host, port, "hostile-props", MQTT_5)
    accepted = refused = 0
    for _ in range(sizes["packets"]):
        try:
            await client.send(packet)
        except _LOST:
            pass
        if await client.barrier():
            accepted += 1
            continue
        refused += 1
        await client.close()
        client = await _Client.connect(host, port, "hostile-props", MQTT_5)
    await client.close()
    return {"packets": sizes["packets"], "packet_bytes": len(encode(packet, MQTT_5)), "accepted": accepted,
            "refused_with_close": refused}


async def _churn(host: str, port: int, ws_port: int | None, sizes: dict[str, int], websocket: bool) -> dict[str, Any]:
    """Rounds of connections that each send most of a big PUBLISH and vanish."""
    head = bytes((0x30,)) + _varint(sizes["announced"] - 5) + b"\x00\x01t"  # whole packet: `announced` bytes
    partial = head + b"x" * (sizes["sent"] - len(head))
    failed = 0

    async def one(n: int) -> None:
        nonlocal failed
        connect = encode(Connect(MQTT_311, f"hostile-churn-{n}", True, keep_alive=60), MQTT_311)
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                if websocket:
                    async with open_websocket_url(f"ws://{host}:{ws_port}/mqtt", subprotocols=["mqtt"]) as ws:
                        await ws.send_message(connect)
                        await ws.get_message()  # the CONNACK
                        await ws.send_message(partial)
                    return
                client = _Client(await trio.open_tcp_stream(host, port), MQTT_311)
                await client.stream.send_all(connect)
                await client.receive()
                await client.stream.send_all(partial)
                client.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await client.close()  # a reset: the client vanished
        except (*_LOST, ConnectionClosed, trio.TooSlowError):
            failed += 1

    for round_ in range(sizes["rounds"]):
        async with trio.open_nursery() as nursery:
            for n in range(sizes["connections"]):
                nursery.start_soon(one, round_ * sizes["connections"] + n)
    return {"connections": sizes["rounds"] * sizes["connections"], "failed": failed}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        value, digit = divmod(value, 128)
        out.append(digit | (0x80 if value else 0))
        if not value:
            return bytes(out)


ATTACKS: dict[str, Callable[..., Any]] = {
    "big-topics": _publish_topics,
    "long-topics": _publish_topics,
    "many-filters": _subscribe_filters,
    "session-filters": _session_filters,
    "flood": _flood,
    "never-reads": _flood,
    "user-properties": _user_properties,
    "churn-tcp": lambda *a: _churn(*a, websocket=False),
    "churn-ws": lambda *a: _churn(*a, websocket=True),
}


def _attack_main(attack: str, host: str, port: int, ws_port: int | None, sizes: dict[str, int], pipe: Pipe) -> None:
    """Say "ready" once imported (a process's start-up is not the attack), attack on "go", send back what it saw and
    the CPU seconds the attack took of this process (``client_cpu_s``)."""
    pipe.send("ready")
    pipe.recv()
    cpu = time.process_time()
    try:
        seen = trio.run(ATTACKS[attack], host, port, ws_port, sizes)
    except Exception as exc:  # the broker refusing the attacker is a result, not a crash of the benchmark
        seen = {"error": f"{type(exc).__name__}: {exc}"}
    seen["client_cpu_s"] = round(time.process_time() - cpu, 2)
    pipe.send(seen)


# --- the canary ---------------------------------------------------------------------------------


def _canary_main(host: str, port: int, rate: float, pipe: Pipe) -> None:
    trio.run(_canary, host, port, rate, pipe)


async def _canary(host: str, port: int, rate: float, pipe: Pipe) -> None:
    """Publish to itself at ``rate`` until told to stop; send back (publish ns, latency ms or None if lost)."""
    subscriber = await _Client.connect(host, port, "canary-sub")
    await subscriber.send(Subscribe(1, (("canary/t", SubscriptionOptions()),)))
    await subscriber.receive()  # the SUBACK
    publisher = await _Client.connect(host, port, "canary-pub")
    sent: dict[int, int] = {}
    latency: dict[int, float] = {}
    stop = trio.Event()

    async def publish() -> None:
        seq = 0
        next_at = trio.current_time()
        while not stop.is_set():
            now_ns = time.monotonic_ns()
            sent[seq] = now_ns
            try:
                await publisher.send(Publish("canary/t", STAMP.pack(seq, now_ns)))
            except _LOST:
                return
            seq += 1
            next_at += 1 / rate
            await trio.sleep_until(next_at)

    async def receive() -> None:
        while True:
            try:
                packet = await subscriber.receive()
            except _LOST:
                return
            if isinstance(packet, Publish):
                seq, at_ns = STAMP.unpack(packet.payload)
                latency[seq] = (time.monotonic_ns() - at_ns) / 1e6

    async def wait_stop() -> None:
        pipe.send("ready")
        await trio.to_thread.run_sync(pipe.recv)
        stop.set()
        with trio.move_on_after(2.0):  # stragglers published just before the stop
            while len(latency) < len(sent):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(publish)
        nursery.start_soon(receive)
        nursery.start_soon(wait_stop)
    pipe.send([(at_ns, latency.get(seq)) for seq, at_ns in sorted(sent.items())])
