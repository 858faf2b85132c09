"""What a simulator run measured, the maths over it, and how it is shown (live line, final table, JSON).

Every process reports a plain, picklable record: each device worker a
``WorkerTotals``, the checking subscriber a ``CheckerTotals``. Latencies travel
as encoded HDR histograms (microseconds) and are added up here, so percentiles
are those of every message, not an average of per-process percentiles.

Loss is exact and per message. A device worker sets bit ``seq`` of its device's
bitmap when the broker acknowledged that message (PUBACK at QoS 1, PUBCOMP at
QoS 2; at QoS 0, when it was written to the socket), the checker sets the same
bit when the message arrives; ``lost`` is the acknowledged bits the checker
never saw. Messages that arrive more than once are counted apart
(``duplicates``), as are messages that arrived without their acknowledgement
having been seen (a device that went away before its PUBACK).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram
from rich.table import Table

__all__ = [
    "CheckerTotals", "CommandTotals", "Loss", "WorkerTotals", "account", "build_report", "latency_ms",
    "merge_histograms", "new_histogram", "progress_table", "record_us", "report_table",
]

LATENCY_MAX_US = 120_000_000
"""Largest latency a histogram holds (2 minutes): a message later than that is as good as lost."""

SIGNIFICANT_DIGITS = 3
"""HDR precision: 0.1 % of the value, enough for p99 and small (about 200 KiB per histogram)."""


def new_histogram() -> HdrHistogram:
    """An empty latency histogram in microseconds, the same shape in every process so they add up."""
    return HdrHistogram(1, LATENCY_MAX_US, SIGNIFICANT_DIGITS)


def record_us(histogram: HdrHistogram, latency_ns: int) -> None:
    """Record one latency, clamped into the histogram's range (clocks can step back by a few us)."""
    histogram.record_value(min(max(latency_ns // 1000, 1), LATENCY_MAX_US))


@dataclass(slots=True)
class WorkerTotals:
    """One device worker process's counts; ``acknowledged`` maps device id -> bitmap of acknowledged seqs."""

    devices: int
    sent: int = 0
    acknowledged: dict[str, int] = field(default_factory=dict)
    publish_refused: int = 0  # an MQTT 5 PUBACK/PUBREC with a failure reason code
    connects: int = 0  # successful CONNACKs, reconnects included
    ever_connected: int = 0
    churn_disconnects: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count
    commands_received: int = 0
    responses_sent: int = 0
    ack_histogram: bytes = b""
    all_online_s: float | None = None  # seconds from go until every device of the worker had been online once
    cpu_s: float = 0.0


@dataclass(slots=True)
class CommandTotals:
    """What the requester sent to the fleet and what came back on its response topic."""

    requests_sent: int = 0  # one MQTT 5 request per device, on cmd/<device>
    responses: int = 0  # responses carrying the correlation data of a request (each counted once)
    unmatched: int = 0  # responses whose correlation data matched nothing sent, or came twice
    broadcasts_sent: int = 0
    broadcast_responses: int = 0  # distinct devices that answered the broadcast
    rtt_histogram: bytes = b""


@dataclass(slots=True)
class CheckerTotals:
    """The checking subscriber's counts; ``received`` maps device id -> bitmap of seqs received."""

    received: dict[str, int] = field(default_factory=dict)
    deliveries: int = 0  # every telemetry message of this run that arrived, duplicates included
    duplicates: int = 0
    foreign: int = 0  # messages on the filter that were not this run's telemetry
    histogram: bytes = b""
    drain_s: float = 0.0
    drain_capped: bool = False  # stopped waiting while acknowledged messages were still missing
    commands: CommandTotals | None = None
    cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Loss:
    """Per-message accounting of acknowledged against received messages."""

    acknowledged: int
    received: int  # distinct messages
    lost: int  # acknowledged, never received
    unacknowledged: int  # received, acknowledgement never seen by the device


def account(acknowledged: Mapping[str, int], received: Mapping[str, int]) -> Loss:
    """Compare the devices' acknowledged bitmaps with the checker's received bitmaps (device -> bits)."""
    lost = sum((bits & ~received.get(device, 0)).bit_count() for device, bits in acknowledged.items())
    unacked = sum((bits & ~acknowledged.get(device, 0)).bit_count() for device, bits in received.items())
    return Loss(
        acknowledged=sum(bits.bit_count() for bits in acknowledged.values()),
        received=sum(bits.bit_count() for bits in received.values()),
        lost=lost,
        unacknowledged=unacked,
    )


def merge_histograms(encoded: Iterable[bytes]) -> HdrHistogram:
    """Add the encoded histograms of several processes into one (empty encodings are skipped)."""
    total = new_histogram()
    for blob in encoded:
        if blob:
            total.decode_and_add(blob)
    return total


def latency_ms(histogram: HdrHistogram) -> dict[str, Any]:
    """count, p50/p90/p99/max and mean in milliseconds (None when nothing was recorded)."""
    count = histogram.get_total_count()
    if count == 0:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    pct = histogram.get_percentile_to_value_dict([50, 90, 99])
    return {
        "count": count,
        "p50": pct[50] / 1000,
        "p90": pct[90] / 1000,
        "p99": pct[99] / 1000,
        "max": histogram.get_max_value() / 1000,
        "mean": round(histogram.get_mean_value() / 1000, 3),
    }


def _sum_counts(dicts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in dicts:
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
    return total


def build_report(settings: Mapping[str, Any], workers: Sequence[WorkerTotals], checker: CheckerTotals,
                 duration_s: float) -> dict[str, Any]:
    """The JSON report of a run: devices, messages and loss, throughput, latencies, errors, commands.

    Args:
        settings: the run's options, copied into the report as given.
        workers: one record per device worker process.
        checker: the checking subscriber's record.
        duration_s: the publishing window that throughput is computed over.
    """
    acknowledged: dict[str, int] = {}
    for w in workers:
        acknowledged.update(w.acknowledged)  # device ids are disjoint across workers
    loss = account(acknowledged, checker.received)
    errors = _sum_counts(w.errors for w in workers)
    sent = sum(w.sent for w in workers)
    onlines = [w.all_online_s for w in workers]
    report: dict[str, Any] = {
        "settings": dict(settings),
        "devices": {
            "configured": sum(w.devices for w in workers),
            "ever_connected": sum(w.ever_connected for w in workers),
            "connects": sum(w.connects for w in workers),
            "churn_disconnects": sum(w.churn_disconnects for w in workers),
            "all_online_s": None if None in onlines else round(max(onlines, default=0.0), 3),
        },
        "messages": {
            "sent": sent,
            "acknowledged": loss.acknowledged,
            "received": loss.received,
            "lost": loss.lost,
            "duplicates": checker.duplicates,
            "unacknowledged_received": loss.unacknowledged,
            "publish_refused": sum(w.publish_refused for w in workers),
            "foreign": checker.foreign,
        },
        "throughput_msgs_s": {
            "sent": round(sent / duration_s, 1),
            "acknowledged": round(loss.acknowledged / duration_s, 1),
            "received": round(loss.received / duration_s, 1),
        },
        "latency_ms": latency_ms(merge_histograms([checker.histogram])),
        "ack_latency_ms": latency_ms(merge_histograms(w.ack_histogram for w in workers)),
        "errors": {**errors, "total": sum(errors.values())},
        "drain": {"seconds": round(checker.drain_s, 3), "capped": checker.drain_capped},
        "cpu_s": {"devices": round(sum(w.cpu_s for w in workers), 2), "checker": round(checker.cpu_s, 2)},
        "commands": None,
    }
    if checker.commands is not None:
        c = checker.commands
        report["commands"] = {
            "requests_sent": c.requests_sent,
            "responses": c.responses,
            "unmatched": c.unmatched,
            "broadcasts_sent": c.broadcasts_sent,
            "broadcast_responses": c.broadcast_responses,
            "received_by_devices": sum(w.commands_received for w in workers),
            "responses_sent_by_devices": sum(w.responses_sent for w in workers),
            "rtt_ms": latency_ms(merge_histograms([c.rtt_histogram])),
        }
    return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def report_table(report: Mapping[str, Any]) -> Table:
    """The final report as a two-column rich table (the JSON has the same numbers and more)."""
    table = Table(title="lightgate simulate", show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    d, m, t, e = report["devices"], report["messages"], report["throughput_msgs_s"], report["errors"]
    rows = [
        ("devices connected / configured", f"{d['ever_connected']:,} / {d['configured']:,}"),
        ("connects (incl. reconnects)", f"{d['connects']:,}"),
        ("all online after (s)", "-" if d["all_online_s"] is None else f"{d['all_online_s']:.2f}"),
        ("messages sent / acknowledged", f"{m['sent']:,} / {m['acknowledged']:,}"),
        ("messages received", f"{m['received']:,}"),
        ("lost", f"{m['lost']:,}"),
        ("duplicates", f"{m['duplicates']:,}"),
        ("throughput acknowledged (msg/s)", f"{t['acknowledged']:,.1f}"),
        ("throughput received (msg/s)", f"{t['received']:,.1f}"),
    ]
    for name in ("latency_ms", "ack_latency_ms"):
        lat = report[name]
        label = "end-to-end latency ms" if name == "latency_ms" else "publish->ack latency ms"
        rows.append((f"{label} p50 / p90 / p99 / max",
                     " / ".join(_ms(lat[p]) for p in ("p50", "p90", "p99", "max"))))
    rows.append(("errors", ", ".join(f"{k} {v}" for k, v in e.items() if k != "total") or "0"))
    if report["commands"] is not None:
        c = report["commands"]
        rows += [
            ("requests sent / answered", f"{c['requests_sent']:,} / {c['responses']:,}"),
            ("broadcast answers", f"{c['broadcast_responses']:,}"),
            ("request round trip ms p50 / p99", f"{_ms(c['rtt_ms']['p50'])} / {_ms(c['rtt_ms']['p99'])}"),
        ]
    rows.append(("drain (s)", f"{report['drain']['seconds']:.2f}" + (" (capped)" if report["drain"]["capped"] else "")))
    for name, value in rows:
        table.add_row(name, value)
    return table


def progress_table(elapsed_s: float, connected: int, devices: int, out_rate: float, in_rate: float,
                   errors: int) -> Table:
    """The live progress line: connected devices, messages per second out (devices) and in (checker), errors."""
    table = Table.grid(padding=(0, 2))
    table.add_row(f"[bold]{elapsed_s:6.1f}s[/]", f"connected {connected:,}/{devices:,}",
                  f"out {out_rate:,.0f} msg/s", f"in {in_rate:,.0f} msg/s",
                  f"[red]errors {errors:,}[/]" if errors else "errors 0")
    return table
