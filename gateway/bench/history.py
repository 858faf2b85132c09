"""The broker benchmarks' history: the results table across runs and one PNG chart per scenario.

``bench.common.emit`` appends every run's document to ``bench/results/<date>.jsonl``.
This module reads those files back (``lightgate bench report``) and, for the
scenarios that compare brokers, picks each broker's headline figures
(``SCENARIOS``), computes LightGate's ratio to each peer on the scenario's
first figure, prints one table row per (run, scenario, broker) and draws
``charts/<scenario>.png``: per figure, the latest run of every broker as bars
and, once the scenario has more than one run, the trend of every broker across
runs. Scenarios without brokers (store, index, analytics) are left out.

Resource handling: ``write_charts`` creates its directory and overwrites the
PNG files; it holds no figure open after it returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gateway.bench.common import RESULTS_DIR
from gateway.bench.compare import DROPPED_MOST, dropped
from gateway.bench.peers import PEERS

__all__ = ["Figure", "Row", "SCENARIOS", "add_arguments", "load", "main", "results_table", "rows", "show",
           "write_charts"]

CHARTS_DIR = RESULTS_DIR / "charts"
"""Next to the results they are drawn from, so a commit carries both."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One headline figure: its label and how to read it from one broker's result (None when absent)."""

    label: str
    get: Callable[[dict[str, Any]], float | None]


def _at(*path: str) -> Callable[[dict[str, Any]], float | None]:
    def get(run: dict[str, Any]) -> float | None:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return get


def _percent(*path: str) -> Callable[[dict[str, Any]], float | None]:
    share = _at(*path)

    def get(run: dict[str, Any]) -> float | None:
        value = share(run)
        return None if value is None else round(100 * value, 3)
    return get


def _resumed_percent(run: dict[str, Any]) -> float | None:
    reconnects, resumed = _at("reconnects")(run), _at("resumed")(run)
    return round(100 * resumed / reconnects, 3) if reconnects and resumed is not None else None


_DELIVERY = (Figure("delivered/s", _at("delivered_per_s")), Figure("lost", _at("lost")),
             Figure("p50 ms", _at("latency_ms", "p50")), Figure("p99 ms", _at("latency_ms", "p99")))


SCENARIOS: dict[str, tuple[tuple[str | None, ...], tuple[Figure, ...]]] = {
    "fanin": (("qos0", "qos1"), _DELIVERY),
    "fanin-rate": ((), _DELIVERY),
    "fanout": ((), (*_DELIVERY, Figure("generator core", _at("generator", "busiest_process_core_share")))),
    "conns": ((), (Figure("KiB/connection", _at("KiB_per_connection")),)),
    "churn": ((), (Figure("connects/s", _at("connects_per_s")), Figure("resumed %", _resumed_percent),
                   Figure("lost", _at("lost")))),
    "offline-fanout": ((), (Figure("delivered %", _percent("delivered_share")), Figure("drain s", _at("drain_s")),
                            Figure("RSS growth MiB", _at("rss_growth_MiB")),
                            Figure("disk/payload B", _at("disk_per_payload_byte")))),
    "durability": ((None, "qos2"), (Figure("lost", _at("lost")), Figure("duplicates", _at("duplicates")),
                                    Figure("restart s", _at("restart_s", "median")))),
}
"""Benchmark name -> (result sections that hold ``brokers``, None or () for the top level; the headline figures).

The first figure is the one the ratios are computed on."""

DROPPED_ANY = {"fanout"}
"""Scenarios whose ratio names any loss of the peer's, not only most (``compare.DROPPED_MOST``): the fan-out's
delivered/s is issue 31's 5x figure, and a peer's rate after dropping some is not the same work."""


@dataclass(frozen=True, slots=True)
class Row:
    """One broker in one run of one scenario (a section such as ``fanin qos1`` is a scenario of its own)."""

    at: str
    scenario: str
    broker: str
    figures: dict[str, float | None]
    ratios: dict[str, float | None]  # peer -> LightGate's first figure over the peer's (LightGate rows only)
    caveats: dict[str, str] = field(default_factory=dict)  # peer -> why its ratio is no like-for-like comparison


def load(results_dir: Path) -> list[dict[str, Any]]:
    """Every document of ``results_dir/*.jsonl``, oldest first; lines that are not documents are reported, skipped."""
    docs = []
    for path in sorted(results_dir.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                print(f"bench report: skipping {path}:{number}: not JSON ({exc})", file=sys.stderr)
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("result"), dict) or "bench" not in doc:
                print(f"bench report: skipping {path}:{number}: not a benchmark document", file=sys.stderr)
                continue
            docs.append(doc)
    return sorted(docs, key=lambda doc: str(doc.get("at", "")))


def rows(docs: Iterable[dict[str, Any]], scenarios: Sequence[str] = ()) -> list[Row]:
    """The table rows of the broker scenarios among ``docs`` (only ``scenarios`` when given), in the docs' order."""
    out = []
    for doc in docs:
        if doc["bench"] not in SCENARIOS or (scenarios and doc["bench"] not in scenarios):
            continue
        sections, figures = SCENARIOS[doc["bench"]]
        for section in sections or (None,):
            part = doc["result"].get(section) if section else doc["result"]
            brokers = part.get("brokers") if isinstance(part, dict) else None
            if not isinstance(brokers, dict):
                continue
            values = {name: {f.label: f.get(run) for f in figures} for name, run in brokers.items()}
            first = figures[0].label
            for name in sorted(values, key=_broker_order):
                ratios = {}
                caveats = {}
                if name == "lightgate":
                    ratios = {peer: _ratio(values[name][first], theirs[first])
                              for peer, theirs in values.items() if peer != name}
                    most = 0.0 if doc["bench"] in DROPPED_ANY else DROPPED_MOST
                    caveats = {peer: caveat for peer in ratios if (caveat := dropped(brokers[peer], most))}
                out.append(Row(str(doc.get("at", "")), f"{doc['bench']} {section}" if section else doc["bench"],
                               name, values[name], ratios, caveats))
    return out


def _broker_order(name: str) -> tuple[int, str]:
    return (PEERS.index(name) if name in PEERS else len(PEERS), name)


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return round(mine / theirs, 3) if mine is not None and theirs else None


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.3g}"


def results_table(table_rows: Sequence[Row]) -> Table:
    """date, scenario, broker, headline figures, LightGate's ratio to each peer (on the scenario's first figure)."""
    measured = {peer for row in table_rows for peer in row.ratios}
    peers = sorted(measured, key=_broker_order)
    table = Table(title="broker benchmarks", header_style="bold",
                  caption="LightGate / peer: LightGate's first headline figure over the peer's, same run")
    for column in ("date (UTC)", "scenario", "broker"):
        table.add_column(column, no_wrap=True)
    table.add_column("headline figures", no_wrap=True)
    for peer in peers:
        table.add_column(f"LightGate / {peer}", justify="right", no_wrap=True)  # a caveat stays beside its ratio
    for row in table_rows:
        figures = "\n".join(f"{label} {_number(value)}" for label, value in row.figures.items())
        ratios = [_ratio_cell(row, p) if p in row.ratios else "" for p in peers]
        table.add_row(row.at[:16].replace("T", " "), row.scenario, row.broker, figures, *ratios)
    return table


def _ratio_cell(row: Row, peer: str) -> str:
    caveat = row.caveats.get(peer)
    return _number(row.ratios[peer]) + (f" ({caveat})" if caveat else "")


PIPE_WIDTH = 120
"""Columns of the table written to a file or a pipe (which have no width: rich assumes 80, where a ratio and the
caveat beside it do not fit with the figures)."""


def _console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=PIPE_WIDTH)


def show(doc: dict[str, Any]) -> None:
    """Print the table of one run of a broker scenario to stderr (stdout keeps the one ``BENCH`` line)."""
    table_rows = rows([doc])
    if table_rows:
        _console(stderr=True).print(results_table(table_rows))


def write_charts(table_rows: Sequence[Row], charts_dir: Path) -> list[Path]:
    """One PNG per scenario in ``charts_dir`` (see the module docstring); returns the files written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only for the report command
    from matplotlib.figure import Figure as MplFigure

    charts_dir.mkdir(parents=True, exist_ok=True)
    by_scenario: dict[str, list[Row]] = {}
    for row in table_rows:
        by_scenario.setdefault(row.scenario, []).append(row)
    written = []
    for scenario, scenario_rows in by_scenario.items():
        labels = list(scenario_rows[0].figures)
        runs = sorted({row.at for row in scenario_rows})
        brokers = sorted({row.broker for row in scenario_rows}, key=_broker_order)
        latest = {row.broker: row for row in scenario_rows}  # rows are oldest first: the last one wins
        columns = 2 if len(runs) > 1 else 1
        figure = MplFigure(figsize=(5.5 * columns, 2.6 * len(labels) + 0.6), layout="constrained")
        FigureCanvasAgg(figure)
        figure.suptitle(f"{scenario} (latest {runs[-1][:16].replace('T', ' ')} UTC)")
        axes = figure.subplots(len(labels), columns, squeeze=False)
        for line, label in enumerate(labels):
            bars = axes[line][0]
            values = [latest[b].figures.get(label) for b in brokers]
            bars.bar(brokers, [0 if v is None else v for v in values], color=[_colour(b) for b in brokers])
            for x, value in enumerate(values):
                bars.annotate(_number(value), (x, 0 if value is None else value), ha="center", va="bottom",
                              fontsize=8)
            bars.set_title(f"{label}: latest run per broker", fontsize=9)
            if columns == 2:
                trend = axes[line][1]
                for broker in brokers:
                    points = [(runs.index(r.at), r.figures.get(label)) for r in scenario_rows if r.broker == broker]
                    points = [(x, y) for x, y in points if y is not None]
                    if points:
                        trend.plot(*zip(*points), marker="o", label=broker, color=_colour(broker))
                trend.set_xticks(range(len(runs)), [r[5:16].replace("T", " ") for r in runs], rotation=30,
                                 fontsize=7)
                trend.set_title(f"{label}: trend", fontsize=9)
                trend.legend(fontsize=7)
        path = charts_dir / f"{scenario.replace(' ', '-')}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def _colour(broker: str) -> str:
    return {"lightgate": "tab:blue", "mosquitto": "tab:orange", "amqtt": "tab:green"}.get(broker, "tab:gray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of the <date>.jsonl files")
    parser.add_argument("--charts", type=Path, default=CHARTS_DIR, help="where the <scenario>.png charts go")
    parser.add_argument("--scenario", nargs="+", default=[], choices=sorted(SCENARIOS),
                        help="only these benchmarks (default: every broker benchmark)")
    parser.add_argument("--last", type=int, default=0, help="only the last N runs of each scenario (0: all)")


def main(args: argparse.Namespace) -> int:
    """``lightgate bench report``: print the table, write the charts; 1 when there is nothing to report."""
    table_rows = rows(load(args.results), args.scenario)
    if args.last:
        keep = {}
        for row in table_rows:
            keep.setdefault(row.scenario, []).append(row.at)
        recent = {scenario: set(sorted(set(ats))[-args.last:]) for scenario, ats in keep.items()}
        table_rows = [row for row in table_rows if row.at in recent[row.scenario]]
    if not table_rows:
        print(f"bench report: no broker benchmark results in {args.results}", file=sys.stderr)
        return 1
    _console().print(results_table(table_rows))
    for path in write_charts(table_rows, args.charts):
        print(f"bench report: wrote {path}")
    return 0
