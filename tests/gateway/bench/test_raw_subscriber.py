"""The load generator's raw subscribers (gateway/bench/loadgen.py): what they count, acknowledge and time, and how a
fan-out's ratio names a peer's losses.

The subscribers read PUBLISH frames from the received bytes without the decoder (a fan-out's 300,000 deliveries/s
left the generator no time for packet objects), so these tests check the frame reading against the project's codec
(``encode``): every split of the stream counts the same deliveries, acknowledges each QoS 1 one with its packet id
([MQTT-4.3.2-2]), and times it.
"""

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from gateway.bench import compare, history
from gateway.bench.loadgen import (
    LATENCY_STEP_NS, STAMP, LoadError, _Latencies, _poll_sockets, _Subscriber, latency_ms,
)
from gateway.mqtt.codec import MqttDecoder, Role, encode
from gateway.mqtt.packets import MQTT_311, Pingresp, Puback, Publish, Suback
from gateway.mqtt.reasons import ReasonCode

SENT_NS = 1_700_000_000_000_000_000


def _publish(publisher: int, seq: int, qos: int, packet_id: int | None = None, dup: bool = False,
             payload: int = 64, topic: str = "cmd/broadcast") -> bytes:
    body = STAMP.pack(publisher, seq, SENT_NS) + bytes(payload - STAMP.size)
    return encode(Publish(topic, body, qos=qos, packet_id=packet_id, dup=dup), MQTT_311)


STREAM = [  # what a broker writes to one subscriber, and what each packet should count
    _publish(0, 0, 1, packet_id=7),
    _publish(0, 1, 0),
    encode(Pingresp(), MQTT_311),  # not a delivery: skipped
    _publish(2, 5, 1, packet_id=300, payload=400, topic="cmd/" + "x" * 200),  # a 3-byte remaining length
    _publish(0, 0, 1, packet_id=7, dup=True),  # a resend: counted, and a duplicate
]
DATA = b"".join(STREAM)
ACKS = b"".join(encode(Puback(pid), MQTT_311) for pid in (7, 300, 7))


def _take_all(sub: _Subscriber, chunks: list[bytes], now: int, steps: dict[int, int]) -> bytes:
    return b"".join(sub.take(chunk, now, steps) for chunk in chunks)


def _check(sub: _Subscriber, acks: bytes, steps: dict[int, int], now: int) -> None:
    assert acks == ACKS
    assert sub.count == 4 and sub.duplicates == 1 and sub.rest == b""
    assert {number: bits.as_int() for number, bits in sub.got.items()} == {0: 0b11, 2: 1 << 5}
    assert steps == {(now - SENT_NS) >> 14: 4}
    assert sub.first_ns == sub.last_ns == now


def test_a_stream_cut_anywhere_counts_every_delivery_once_and_acknowledges_each_qos1_one():
    now = SENT_NS + 5_000_000
    for cut in range(len(DATA) + 1):
        sub, steps = _Subscriber(None), {}  # type: ignore[arg-type]
        acks = _take_all(sub, [DATA[:cut], DATA[cut:]], now, steps)
        _check(sub, acks, steps, now)


def test_a_stream_read_a_byte_at_a_time_counts_the_same():
    now = SENT_NS + 5_000_000
    sub, steps = _Subscriber(None), {}  # type: ignore[arg-type]
    acks = _take_all(sub, [DATA[n:n + 1] for n in range(len(DATA))], now, steps)
    _check(sub, acks, steps, now)


def test_deliveries_that_arrived_behind_the_suback_are_read_from_the_decoders_leftovers():
    """The decoder read the SUBACK; the PUBLISHes behind it in the same read (a resumed session's backlog) are in its
    buffer, the last one cut short: the raw reader starts from there and loses none."""
    decoder = MqttDecoder(role=Role.CLIENT, protocol_level=MQTT_311)
    decoder.feed(encode(Suback(1, (ReasonCode.GRANTED_QOS_1,)), MQTT_311) + DATA[:-10])
    assert isinstance(decoder.next_packet(), Suback)
    sub = _Subscriber(None)  # type: ignore[arg-type]
    sub.take_over(SimpleNamespace(decoder=decoder, number=0))  # type: ignore[arg-type]
    now = SENT_NS + 5_000_000
    steps: dict[int, int] = {}
    acks = sub.take(b"", now, steps) + sub.take(DATA[-10:], now, steps)
    _check(sub, acks, steps, now)


def test_latencies_counted_in_steps_come_out_within_half_a_step():
    latencies = _Latencies()
    sub = _Subscriber(None)  # type: ignore[arg-type]
    for n, delay_us in enumerate((900, 5_000, 5_000, 120_000)):
        sub.take(_publish(0, n, 0), SENT_NS + delay_us * 1000, latencies.steps)
    figures = latency_ms([latencies.encode()])
    half_ms = LATENCY_STEP_NS / 2 / 1e6
    assert figures["p50"] == pytest.approx(5.0, abs=half_ms)
    assert figures["max"] == pytest.approx(120.0, rel=0.001)
    assert latencies.steps == {}  # all moved into the histogram


def test_a_qos2_delivery_is_refused_not_answered_with_a_puback():
    sub = _Subscriber(SimpleNamespace(number=3))  # type: ignore[arg-type]
    with pytest.raises(LoadError, match="subscriber 3: a QoS 2 delivery"):
        sub.take(_publish(0, 0, 2, packet_id=9), time.time_ns(), {})


def test_a_fanout_ratio_names_any_loss_of_the_peer_others_only_most():
    """Issue 31: a headline ratio against a peer that dropped messages says so in the same line. Fan-out's names
    any loss; the other scenarios keep naming only a loss of most (``compare.DROPPED_MOST``)."""
    brokers = {"lightgate": {"delivered_per_s": 250_000, "lost": 0, "expected": 1_500_000},
               "mosquitto": {"delivered_per_s": 50_000, "lost": 12, "expected": 1_500_000}}
    assert compare.caveats(brokers, most=0.0) == {"lightgate/mosquitto": "dropped 12 of 1,500,000"}
    assert compare.caveats(brokers) == {}
    brokers["mosquitto"]["lost"] = 300_000
    assert compare.caveats(brokers, most=0.0) == {"lightgate/mosquitto": "dropped 20%"}
    brokers["mosquitto"]["lost"] = 12
    for bench, caveat in (("fanout", {"mosquitto": "dropped 12 of 1,500,000"}), ("fanin-rate", {})):
        doc = {"bench": bench, "at": "2026-11-29T11:00:00+00:00", "result": {"brokers": brokers}}
        row = history.rows([doc])[0]
        assert row.ratios == {"mosquitto": 5.0} and row.caveats == caveat


def test_the_epoll_reader_keeps_the_pubacks_a_full_socket_did_not_take_and_writes_them_in_order():
    """A broker that does not read its PUBACKs fills the subscriber's socket: the reader keeps the rest, waits for
    room (EPOLLOUT) and goes on, so every QoS 1 delivery is acknowledged once, in order ([MQTT-4.3.2-2])."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        mine = socket.create_connection(listener.getsockname())
        broker, _ = listener.accept()
    broker.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    mine.setblocking(False)
    count = 20_000  # 80 KB of PUBACKs: far more than the two small buffers hold
    frames = b"".join(_publish(0, seq, 1, packet_id=seq % 65535 + 1, payload=16) for seq in range(count))
    sub = _Subscriber(SimpleNamespace(number=0, stream=SimpleNamespace(socket=mine)))  # type: ignore[arg-type]
    latencies, stop = _Latencies(), threading.Event()
    failures: list[BaseException] = []

    def poll() -> None:
        try:
            _poll_sockets([sub], latencies, stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failures.append(exc)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        broker.sendall(frames)  # blocks until the reader took them all, its PUBACKs unread meanwhile
        deadline = time.monotonic() + 30
        while sub.count < count and not failures and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a counter another thread advances; there is no event to wait on
        assert sub.count == count
        assert sub.unsent  # the PUBACKs it could not write yet are kept, not dropped
        got = bytearray()
        expected = b"".join(encode(Puback(seq % 65535 + 1), MQTT_311) for seq in range(count))
        broker.settimeout(10)
        while len(got) < len(expected):
            got += broker.recv(65536)
    finally:
        stop.set()
        reader.join()
        broker.close()
        mine.close()
    assert not failures
    assert bytes(got) == expected and sub.unsent == b""
    assert sub.count == count and sub.duplicates == 0
