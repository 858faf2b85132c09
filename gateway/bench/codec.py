"""``lightgate bench codec``: the per-message codec work of a node, in one process: PUBLISH decode and encode, and
CommitLog record encode and decode.

What every message costs before any socket, lock or index: a PUBLISH read from a client's bytes
(``MqttDecoder``), the record made of it (``new_record``), the record read back (``decode_record``) and the
PUBLISH written to a subscriber (a ``PublishTemplate`` and its ``render``, and ``encode`` of a ``Publish``).
Each operation runs ``--count`` times per run; the rate reported is the median of ``--runs`` runs. ``compiled``
lists the codec modules loaded as compiled extensions (docs/benchmarks.md#compiled-codec), so two results of
the same machine say which build they measured.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from gateway.mqtt import codec, packets, properties
from gateway.mqtt.codec import NEED_DATA, MqttDecoder, Role, encode
from gateway.mqtt.template import PublishTemplate
from gateway.mqtt.packets import MQTT_5, MQTT_311, Connect, Publish
from gateway.mqtt.properties import EMPTY_PROPERTIES, Properties
from store.log import record
from store.log.record import decode_record, new_record

CODEC_MODULES = (properties, packets, codec, record)
"""The modules ``make compiled`` builds (docs/benchmarks.md#compiled-codec)."""

TOPIC = "tele/dev{i}"
PROPERTIES = Properties(message_expiry_interval=3600, content_type="json", user_properties=(("site", "a"),))
"""A PUBLISH's properties as devices send them: most send none (the other decodes), some a few."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=50_000, help="operations of each kind per run")
    parser.add_argument("--runs", type=int, default=5, help="runs of each operation (the median is reported)")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes of each message")


def run(args: argparse.Namespace) -> dict[str, Any]:
    payload = bytes(args.payload)
    topics = [TOPIC.format(i=i % 50) for i in range(args.count)]
    operations: dict[str, Callable[[], int]] = {
        "publish_decode_311_qos0": _decoding(MQTT_311, 0, topics, payload),
        "publish_decode_5_qos1": _decoding(MQTT_5, 1, topics, payload),
        "publish_decode_5_qos1_properties": _decoding(MQTT_5, 1, topics, payload, PROPERTIES),
        "publish_encode_311_qos0": lambda: _encode_packets(topics, payload),
        "publish_template_5_qos1": lambda: _render_templates(topics, payload),
        "record_new": lambda: _new_records(topics, payload),
        "record_decode": _decoding_records(topics, payload),
    }
    rates = {}
    for name, operation in operations.items():
        samples = []
        for _ in range(args.runs):
            started = time.process_time()
            done = operation()
            samples.append(done / max(time.process_time() - started, 1e-9))
        rates[name] = round(statistics.median(samples))
    return {
        "settings": {"count": args.count, "runs": args.runs, "payload": args.payload},
        "compiled": [module.__name__ for module in CODEC_MODULES if is_compiled(module)],
        "per_s": rates,
        "load_average": round(os.getloadavg()[0], 2),
    }


def is_compiled(module: Any) -> bool:
    """Whether ``module`` was loaded from a compiled extension rather than its Python source."""
    return isinstance(getattr(module.__spec__, "loader", None), importlib.machinery.ExtensionFileLoader)


def _decoding(level: int, qos: int, topics: list[str], payload: bytes,
              props: Properties = EMPTY_PROPERTIES) -> Callable[[], int]:
    """Decoding the PUBLISH packets of one connection, fed in 64 KiB reads as a socket would give them."""
    connect = encode(Connect(protocol_level=level, client_id="bench"), level)
    stream = connect + b"".join(
        encode(Publish(topic, payload, qos, packet_id=1 + i % 65535 if qos else None, properties=props), level)
        for i, topic in enumerate(topics)
    )
    chunks = [stream[start:start + 65536] for start in range(0, len(stream), 65536)]

    def decode() -> int:
        decoder = MqttDecoder(role=Role.SERVER)
        count = 0
        for chunk in chunks:
            decoder.feed(chunk)
            while decoder.next_packet() is not NEED_DATA:
                count += 1
        return count - 1  # the CONNECT

    return decode


def _encode_packets(topics: list[str], payload: bytes) -> int:
    for topic in topics:
        encode(Publish(topic, payload), MQTT_311)
    return len(topics)


def _render_templates(topics: list[str], payload: bytes) -> int:
    """A delivery's encoding: the template of the stored message, rendered with the subscriber's packet id."""
    for i, topic in enumerate(topics):
        PublishTemplate(topic, payload).render(MQTT_5, 1, packet_id=1 + i % 65535)
    return len(topics)


def _new_records(topics: list[str], payload: bytes) -> int:
    for topic in topics:
        new_record(topic, payload, 1_700_000_000_000, "bench", 1)
    return len(topics)


def _decoding_records(topics: list[str], payload: bytes) -> Callable[[], int]:
    raws = [new_record(topic, payload, 1_700_000_000_000, "bench", 1)[0] for topic in topics]

    def decode() -> int:
        for offset, raw in enumerate(raws):
            decode_record(raw, 0, offset)
        return len(raws)

    return decode
