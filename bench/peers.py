"""The brokers under test, each a subprocess on a free loopback port: LightGate, Mosquitto, amqtt.

Every broker runs as its own process so its RSS and CPU time can be measured
(psutil) apart from the load generator's. The configurations are generated
here and are the documented ones (docs/benchmarks.md):

- ``lightgate``: ``lightgate serve --data <tmp> --host 127.0.0.1 --port P``,
  the embedded node with its defaults (async flush), logging at warning level;
- ``mosquitto``: ``listener P 127.0.0.1``, ``allow_anonymous true``,
  ``persistence false``, logging of errors and warnings only, every limit at
  its default (max_inflight_messages 20, max_queued_messages 1000, ...);
- ``amqtt``: its own broker CLI (``amqtt -c <yaml>``) with one TCP listener on
  127.0.0.1:P and only the anonymous-auth plugin (no $SYS or packet-logging
  plugins), which is its default minus the plugins that cost per packet.

A peer that is not installed is skipped with a printed reason.

Resource handling: ``start`` returns a running ``Broker``; its owner calls
``stop()`` (or uses it as a context manager), which terminates and reaps the
process. The broker's working directory belongs to the caller.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

HOST = "127.0.0.1"
"""Loopback only: the benchmark measures the brokers, not the network."""

READY_TIMEOUT_S = 60.0
"""How long a broker may take to accept connections (LightGate opens RocksDB and its CommitLog first)."""

STOP_TIMEOUT_S = 10.0
"""How long a broker gets to exit after SIGTERM before it is killed."""

PEERS = ("lightgate", "mosquitto", "amqtt")
"""Every broker the suite knows, LightGate first: the ratios are LightGate's figure over each peer's."""


class PeerError(RuntimeError):
    """A broker could not be started (it exited, or never accepted a connection); the message says why."""


@dataclass
class Broker:
    """A running broker process on ``HOST:port``."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    host: str = HOST

    def rss_bytes(self) -> int:
        """Resident memory of the broker process now."""
        return psutil.Process(self.process.pid).memory_info().rss

    def cpu_s(self) -> float:
        """User + system CPU seconds the broker process has used so far (all its threads)."""
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        """Terminate the broker and reap it (killed if it ignores SIGTERM)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def missing(name: str) -> str | None:
    """Why broker ``name`` cannot run here, or None when it can."""
    if name == "mosquitto" and shutil.which("mosquitto") is None:
        return "mosquitto is not installed (run `make bench-peers`)"
    if name == "amqtt" and importlib.util.find_spec("amqtt") is None:
        return "amqtt is not installed (it is a project dependency: `make venv`)"
    if name not in PEERS:
        return f"unknown broker {name!r} (known: {', '.join(PEERS)})"
    return None


def available(names: tuple[str, ...] | list[str]) -> list[str]:
    """The brokers of ``names`` that can run here, printing why each other one is skipped."""
    runnable = []
    for name in names:
        reason = missing(name)
        if reason:
            print(f"bench: skipping {name}: {reason}", file=sys.stderr, flush=True)
        else:
            runnable.append(name)
    return runnable


def start(name: str, workdir: Path) -> Broker:
    """Start broker ``name`` on a free loopback port, its files in ``workdir``; return once it accepts connections.

    Raises:
        PeerError: the broker exited or did not accept connections within ``READY_TIMEOUT_S``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = {"lightgate": _lightgate, "mosquitto": _mosquitto, "amqtt": _amqtt}[name](workdir, port)
    log = open(workdir / f"{name}.log", "wb")
    # cwd=workdir: LightGate reads ./lightgate.toml when present; the repository's must not leak in.
    process = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    broker = Broker(name, port, process, log)
    try:
        _wait_until_accepting(broker, workdir / f"{name}.log")
    except PeerError:
        broker.stop()
        raise
    return broker


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _lightgate(workdir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--data", str(workdir / "data"),
            "--host", HOST, "--port", str(port), "--log-level", "warning"]


def _mosquitto(workdir: Path, port: int) -> list[str]:
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} {HOST}\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
    )
    return [shutil.which("mosquitto") or "mosquitto", "-c", str(conf)]


def _amqtt(workdir: Path, port: int) -> list[str]:
    conf = workdir / "amqtt.yaml"
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    conf.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return [sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(conf)]


def _wait_until_accepting(broker: Broker, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if broker.process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise PeerError(f"{broker.name} exited with status {broker.process.returncode}: {tail}")
        try:
            with socket.create_connection((broker.host, broker.port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)  # polling a port: nothing to wait on but the next attempt
    raise PeerError(f"{broker.name} did not accept connections on {broker.host}:{broker.port} "
                    f"within {READY_TIMEOUT_S} s")
