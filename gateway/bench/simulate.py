"""``lightgate simulate``: a fleet of paho-mqtt devices against any MQTT broker, with exact loss and latency.

The parent process only orchestrates: it splits ``--devices`` over
``--processes`` device workers (gateway/bench/devices.py: one selector loop each) and
starts the backend (gateway/bench/backend.py: the checking subscriber and the
requester), all with multiprocessing's spawn start method. Every process
reports ``ready``; the parent then gives all of them one wall-clock ``go`` time,
so the ramp (or the storm) starts together. During the run it shows live
progress from the processes' snapshots on stderr; after the publishing window
it tells the backend how many messages the broker acknowledged, the backend
drains until it has them all (or gives up), the devices disconnect, and the
report (gateway/bench/report.py) is printed as a table on stdout and, with ``--json``,
written as JSON. Whatever the outcome, the run ends by deleting the retained
``status/<device>`` message of each of its devices.

Exit status: 0 when every device connected and nothing acknowledged was lost,
1 otherwise (or when a process failed), 2 for bad options.

Resource handling: ``run`` starts every process it uses and always joins (or
terminates) them before returning.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any

from gateway.bench.telemetry import METRICS, TemplateError, TopicTemplate, metrics_by_name

__all__ = ["add_arguments", "run"]

GO_DELAY_S = 0.3
"""The shared start time is this far after the last ``ready``: time enough for ``go`` to reach every process."""

READY_S = 120.0
"""Longest wait for the processes to build their clients and for the backend to subscribe."""

PROGRESS_S = 0.5
"""The live display refreshes about twice a second."""

FINISH_S = 120.0
"""Longest wait, past the window, for acknowledgements, the drain and clean disconnects (all bounded below it)."""


class SimulateError(RuntimeError):
    """A process of the run failed or stopped answering; the message carries its traceback or reason."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    broker = parser.add_argument_group("broker")
    broker.add_argument("--host", default="127.0.0.1", help="broker host (default %(default)s)")
    broker.add_argument("--port", type=int, default=1883, help="broker port (default %(default)s)")
    broker.add_argument("--tls", action="store_true", help="connect over TLS")
    broker.add_argument("--cafile", help="CA certificates to verify the broker with (implies --tls)")
    broker.add_argument("--insecure", action="store_true",
                        help="TLS without certificate or host name checks (implies --tls)")
    broker.add_argument("--username", help="MQTT user name of every client")
    broker.add_argument("--password", help="MQTT password of every client")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--devices", type=int, default=1000, help="simulated devices (default %(default)s)")
    fleet.add_argument("--processes", type=int, default=2, help="device worker processes (default %(default)s)")
    fleet.add_argument("--rate", type=float, default=1.0, help="messages/s per device (default %(default)s)")
    fleet.add_argument("--jitter", type=float, default=0.1,
                       help="random +- fraction of each interval between messages (default %(default)s)")
    fleet.add_argument("--duration", type=float, default=30.0,
                       help="seconds of publishing, from the start of the ramp (default %(default)s)")
    fleet.add_argument("--qos", type=int, choices=(0, 1, 2), default=1, help="telemetry QoS (default %(default)s)")
    fleet.add_argument("--protocol", choices=("3.1.1", "5"), default="5", help="MQTT version (default %(default)s)")
    fleet.add_argument("--topic-template", default="tele/{device}/{metric}",
                       help="telemetry topic; without {metric} one message carries every metric (default %(default)s)")
    fleet.add_argument("--metrics", default="temperature,humidity,battery",
                       help=f"comma-separated, from {', '.join(METRICS)} (default %(default)s)")
    fleet.add_argument("--ramp", type=float, default=500.0, help="connects/s over the whole fleet (default %(default)s)")
    fleet.add_argument("--storm", action="store_true", help="connect every device at once instead of ramping")
    fleet.add_argument("--churn", type=float, default=0.0,
                       help="probability per second that a device disconnects and resumes its persistent session "
                            "(default %(default)s)")
    fleet.add_argument("--commands", action="store_true",
                       help="send a broadcast and one MQTT 5 request per device during the run; count the responses")
    fleet.add_argument("--seed", type=int, default=0, help="random seed of the telemetry walks and timings")
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="also write the JSON report to FILE ('-' = stdout)")
    output.add_argument("--no-progress", action="store_true", help="no live progress on stderr")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The validated options of a run, as the report shows them (no password).

    Raises:
        ValueError: an option out of range; the message names it.
    """
    checks = [
        (args.devices >= 1, "--devices must be at least 1"),
        (1 <= args.processes <= args.devices, "--processes must be between 1 and --devices"),
        (args.rate > 0, "--rate must be above 0"),
        (0 <= args.jitter < 1, "--jitter must be in [0, 1)"),
        (args.duration > 0, "--duration must be above 0"),
        (args.ramp > 0, "--ramp must be above 0"),
        (0 <= args.churn <= 1, "--churn must be a probability in [0, 1]"),
        (0 < args.port < 65536, "--port must be in 1..65535"),
        (args.password is None or args.username is not None, "--password needs --username"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    metrics = tuple(m.name for m in metrics_by_name(n.strip() for n in args.metrics.split(",") if n.strip()))
    TopicTemplate.parse(args.topic_template)
    return {
        "host": args.host, "port": args.port, "tls": bool(args.tls or args.cafile or args.insecure),
        "username": args.username, "devices": args.devices, "processes": args.processes, "rate": args.rate,
        "jitter": args.jitter, "duration_s": args.duration, "qos": args.qos, "protocol": args.protocol,
        "topic_template": args.topic_template, "metrics": list(metrics), "ramp": args.ramp, "storm": args.storm,
        "churn": args.churn, "commands": args.commands, "seed": args.seed,
    }


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each part; counts differ by at most one."""
    base, extra = divmod(total, parts)
    out, first = [], 0
    for i in range(parts):
        count = base + (i < extra)
        out.append((first, count))
        first += count
    return out


def run(args: argparse.Namespace) -> int:
    """Run the simulation the options describe; print the report; return the exit status (see the module doc)."""
    try:
        settings = _settings(args)
    except (ValueError, TemplateError) as exc:
        print(f"lightgate simulate: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console

    from gateway.bench.report import build_report, report_table

    try:
        workers, checker = _Run(args, settings).execute()
    except SimulateError as exc:
        print(f"lightgate simulate: {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, workers, checker, args.duration)
    Console().print(report_table(report))
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    complete = report["devices"]["ever_connected"] == report["devices"]["configured"]
    return 0 if complete and report["messages"]["lost"] == 0 else 1


class _Run:
    """The processes of one run and the parent's side of their protocol."""

    def __init__(self, args: argparse.Namespace, settings: dict[str, Any]) -> None:
        from gateway.bench.backend import BackendJob, backend_main
        from gateway.bench.devices import BrokerOptions, FleetJob, worker_main

        self.args = args
        self.fleet = "sim" + uuid.uuid4().hex[:6]
        self.broker = broker = BrokerOptions(args.host, args.port, settings["tls"], args.cafile, args.insecure,
                                             args.username, args.password)
        self.jobs = [
            (worker_main, FleetJob(
                broker, self.fleet, first, count, args.protocol, args.qos, args.rate, args.jitter, args.duration,
                args.topic_template, tuple(settings["metrics"]), args.ramp / args.processes, args.storm,
                args.churn, args.seed * 1000 + i))
            for i, (first, count) in enumerate(split(args.devices, args.processes))
        ]
        self.backend_job = (backend_main, BackendJob(broker, self.fleet, args.devices, args.topic_template, args.qos,
                                                      args.commands, args.protocol == "5"))
        self.progress: dict[Connection, tuple] = {}

    def execute(self) -> tuple[list, Any]:
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and sockets
        processes: list[multiprocessing.process.BaseProcess] = []
        pipes: list[Connection] = []
        try:
            for target, job in [self.backend_job, *self.jobs]:
                mine, theirs = context.Pipe()
                process = context.Process(target=target, args=(job, theirs), daemon=True)
                process.start()
                theirs.close()
                processes.append(process)
                pipes.append(mine)
            return self._drive(pipes[0], pipes[1:])
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.terminate()
                    process.join()
            self._clear_status()

    def _clear_status(self) -> None:
        """The devices are gone: delete their retained status messages (gateway/bench/devices.py ``clear_status``), also
        after a failed run. A broker that cannot be reached then is reported, not raised."""
        from gateway.bench.devices import clear_status

        try:
            cleared = clear_status(self.broker, self.fleet, self.args.devices, self.args.protocol)
        except (OSError, RuntimeError) as exc:
            print(f"lightgate simulate: the devices' retained status messages were not deleted: {exc}",
                  file=sys.stderr)
            return
        if cleared < self.args.devices:
            print(f"lightgate simulate: {self.args.devices - cleared} of the devices' retained status messages "
                  "were not deleted (no acknowledgement in time)", file=sys.stderr)

    def _receive(self, pipe: Connection) -> tuple:
        try:
            message = pipe.recv()
        except EOFError:
            raise SimulateError("a simulator process exited without reporting") from None
        if message[0] == "failed":
            raise SimulateError(f"a simulator process failed:\n{message[1]}")
        if message[0] == "progress":
            self.progress[pipe] = message[1]
        elif message[0] == "done":
            del self.progress[pipe]  # the process exits next: stop listening to it
        return message

    def _await(self, pipes: list[Connection], kind: str, timeout: float, tick=lambda: None) -> dict[Connection, Any]:
        """Receive until every pipe in ``pipes`` sent ``kind``; progress messages update the display."""
        got: dict[Connection, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(pipes):
            if time.monotonic() > deadline:
                raise SimulateError(f"no '{kind}' from {len(pipes) - len(got)} process(es) within {timeout:.0f} s")
            for pipe in wait(list(self.progress) or pipes, timeout=PROGRESS_S):
                message = self._receive(pipe)
                if message[0] == kind and pipe in pipes:
                    got[pipe] = message[1] if len(message) > 1 else None
            tick()
        return got

    def _drive(self, backend: Connection, workers: list[Connection]) -> tuple[list, Any]:
        for pipe in (backend, *workers):
            self.progress[pipe] = ()
        self._await([backend, *workers], "ready", READY_S)
        go = time.time() + GO_DELAY_S
        for pipe in workers:
            pipe.send(("go", go))
        view = _ProgressView(self.args, workers, backend, self.progress, go)
        commands_due = self.args.commands

        def tick() -> None:
            nonlocal commands_due
            view.update()
            online = sum(self.progress[p][0] for p in workers if self.progress[p])
            half_way = time.time() >= go + self.args.duration / 2
            if commands_due and (online == self.args.devices or half_way):
                commands_due = False
                backend.send(("commands",))

        with view:
            acked = self._await(workers, "published", self.args.duration + FINISH_S, tick)
            if commands_due:
                backend.send(("commands",))
            backend.send(("drain", sum(acked.values())))
            checker = self._await([backend], "done", FINISH_S, view.update)[backend]
            for pipe in workers:
                pipe.send(("stop",))
            totals = self._await(workers, "done", FINISH_S, view.update)
        return [totals[p] for p in workers], checker


class _ProgressView:
    """rich Live on stderr: connected devices, msg/s out and in, errors; off when not a TTY or --no-progress."""

    def __init__(self, args: argparse.Namespace, workers: list[Connection], backend: Connection,
                 progress: dict[Connection, tuple], go: float) -> None:
        self.enabled = not args.no_progress and sys.stderr.isatty()
        self.devices = args.devices
        self.workers, self.backend, self.progress, self.go = workers, backend, progress, go
        self.last = (time.monotonic(), 0, 0)
        self.live = None

    def __enter__(self) -> "_ProgressView":
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), auto_refresh=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self) -> None:
        if self.live is None:
            return
        from gateway.bench.report import progress_table

        snaps = [self.progress.get(p) or (0, 0, 0, 0, 0) for p in self.workers]
        backend = self.progress.get(self.backend) or (0, 0)
        sent, received = sum(s[1] for s in snaps), backend[0]
        now = time.monotonic()
        then, sent_then, received_then = self.last
        if now - then < PROGRESS_S:
            return
        self.last = (now, sent, received)
        self.live.update(progress_table(
            max(0.0, time.time() - self.go), sum(s[0] for s in snaps), self.devices,
            (sent - sent_then) / (now - then), (received - received_then) / (now - then), sum(s[3] for s in snaps),
        ), refresh=True)
