"""The brokers under test, each a subprocess on a free loopback port: LightGate, Mosquitto, amqtt.

Every broker runs as its own process so its RSS and CPU time can be measured
(psutil) apart from the load generator's. The configurations are generated
here and are the documented ones (docs/benchmarks.md):

- ``lightgate``: ``lightgate serve --data <tmp> --host 127.0.0.1 --port P --admin-port 0``,
  the embedded node with its defaults (async flush) and no admin HTTP listener,
  logging at warning level;
- ``mosquitto``: ``listener P 127.0.0.1``, ``allow_anonymous true``,
  ``persistence false``, logging of errors and warnings only, every limit at
  its default (max_inflight_messages 20, max_queued_messages 1000, ...);
- ``amqtt``: its own broker CLI (``amqtt -c <yaml>``) with one TCP listener on
  127.0.0.1:P and only the anonymous-auth plugin (no $SYS or packet-logging
  plugins), which is its default minus the plugins that cost per packet.

With ``durable=True`` (the durability scenario) LightGate runs with the
``sync`` flush policy (``--commitlog-flush sync``: PUBACK only after fsync) and
Mosquitto with ``persistence true``, ``persistence_location <workdir>/data/``,
``autosave_interval 1`` (the smallest interval; Mosquitto 2.0 compares
whole seconds, so it saves its in-memory state every two seconds, measured by
the database file's mtime) and ``user <the current user>`` (started as root it would
otherwise switch to a ``mosquitto`` user that cannot write there); amqtt has
no persistence the suite can use (see ``NOT_DURABLE``). Every broker keeps its
data under ``<workdir>/data``, which is what ``Broker.disk_bytes`` measures,
and ``restart`` starts a killed broker again on the same port and data.

With ``websocket=True`` (the hostile scenario) LightGate also listens for MQTT
over WebSocket (``--ws-port W``, path ``/mqtt``) and Mosquitto gets a second
listener ``listener W 127.0.0.1`` with ``protocol websockets``; the port is
``Broker.ws_port``.

Cluster mode (docs/cluster.md) runs as the peers named ``cluster_name(N)``
(``lightgate-cluster-<N>gw``): one ``lightgate store --data <tmp> --listen
127.0.0.1:S`` and one ``lightgate gateway --store 127.0.0.1:S --port P
--workers N`` (N gateway processes sharing P), both at warning level without
the admin listener; the broker's CPU time and memory are those of all its
processes, and it is ready once all N gateways listen.

Replicated mode (docs/cluster.md, a store group of 3 replicas) runs as the peers named
``replicated_name(acks)`` (``lightgate-r3-leader``, ``lightgate-r3-quorum``, ``lightgate-r3-all``): a
one-member etcd (gateway/bench/etcd.py), 3 ``lightgate store`` replicas of group ``g`` (``start_group``: each
``--replication-name r<i> --replica r0 --replica r1 --replica r2 --etcd <url> --replication-acks <acks>
--replication-lease-s 2 --replication-leader-lease-s 1.4``, ``--commitlog-flush sync`` when durable) and one
gateway process given the 3 replica addresses (``--store a,b,c``: it follows the leader). It is ready once
etcd names a leader, the in-sync set holds all 3 replicas and the gateway listens: the same start as the
cluster peer, whose one store process is the unreplicated comparison (``lightgate-cluster-1gw``). Both
kinds of cluster run their gateways with ``--mqtt-sys-interval-s 0``, so they compare the same work.

A peer that is not installed is skipped with a printed reason (the replicated peers need etcd).

Resource handling: ``start`` returns a running ``Broker``; its owner calls
``stop()`` (or uses it as a context manager), which terminates and reaps the
process. The broker's working directory belongs to the caller.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import psutil

from gateway import SOURCE_DIR
from gateway.bench import etcd

HOST = "127.0.0.1"
"""Loopback only: the benchmark measures the brokers, not the network."""

READY_TIMEOUT_S = 60.0
"""How long a broker may take to accept connections (LightGate opens RocksDB and its CommitLog first)."""

STOP_TIMEOUT_S = 10.0
"""How long a broker gets to exit after SIGTERM before it is killed."""

IDLE_WINDOW_S = 0.25
"""``wait_idle`` compares the broker's CPU time over windows this long."""

IDLE_SHARE = 0.05
"""A broker using less than this share of a core is done with the work it was given (timers cost less)."""

IDLE_TIMEOUT_S = 60.0
"""``wait_idle`` gives up after this long: a broker that never settles is measured as it is."""

PEERS = ("lightgate", "mosquitto", "amqtt")
"""Every broker the suite knows, LightGate first: the ratios are LightGate's figure over each peer's."""

NOT_DURABLE = {
    "amqtt": "amqtt 0.12.1 has no persistence for these clients: its only store (contrib SessionDBPlugin, "
             "sqlalchemy + aiosqlite) skips anonymous sessions and never saves in-flight or queued QoS 1 messages",
}
"""Brokers that cannot keep messages across a crash, with the reason the durability scenario reports."""

DATA_DIR = "data"
"""Every broker's data lives in ``<workdir>/data``, so disk growth is measured the same way for all of them."""


SOURCE_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(SOURCE_DIR), os.environ.get("PYTHONPATH"))))}
"""LightGate processes run this code (its directory on PYTHONPATH), not whatever ``gateway`` the interpreter finds
from the broker's working directory (an installed copy, another checkout)."""


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
    workdir: Path | None = None
    durable: bool = False
    companions: list[subprocess.Popen[bytes]] = field(default_factory=list)  # a cluster's store process
    ws_port: int | None = None  # MQTT over WebSocket (path /mqtt), when started with websocket=True

    def processes(self) -> list[psutil.Process]:
        """Every process of the broker: its own, its children (a cluster's gateway workers), its companions."""
        main = psutil.Process(self.process.pid)
        return [main, *main.children(recursive=True), *(psutil.Process(c.pid) for c in self.companions)]

    def rss_bytes(self) -> int:
        """Resident memory of the broker's processes now."""
        return sum(p.memory_info().rss for p in self.processes())

    def cpu_s(self) -> float:
        """User + system CPU seconds the broker's processes have used so far (all their threads)."""
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.processes()))

    def disk_bytes(self) -> int:
        """Bytes allocated on disk under the broker's data directory (blocks, not sizes: segments are sparse)."""
        if self.workdir is None:
            return 0
        total = 0
        for path in (self.workdir / DATA_DIR).rglob("*"):
            try:
                total += path.lstat().st_blocks * 512 if path.is_file() else 0
            except FileNotFoundError:
                pass  # deleted between listing and stat (RocksDB compacting): no longer on disk
        return total

    def clients(self) -> int:
        """Established TCP connections the broker's processes hold on its MQTT port."""
        return sum(1 for p in self.processes() for c in p.net_connections("tcp")
                   if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == self.port)

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> float:
        """Wait until the broker uses under ``IDLE_SHARE`` of a core over ``IDLE_WINDOW_S``; return the seconds waited.

        A broker keeps working after it acknowledged a flood (LightGate dispatches
        into its indexes); memory and disk are compared once that work is done.
        Gives up after ``timeout_s`` and returns the time waited.
        """
        start = time.monotonic()
        cpu = self.cpu_s()
        while time.monotonic() - start < timeout_s:
            time.sleep(IDLE_WINDOW_S)  # the sampling window of a CPU-time rate, not a synchronisation
            now = self.cpu_s()
            if now - cpu < IDLE_SHARE * IDLE_WINDOW_S:
                break
            cpu = now
        return time.monotonic() - start

    def kill(self) -> None:
        """SIGKILL the broker (no chance to flush or save anything) and reap it."""
        for process in self.processes()[1:]:
            process.kill()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for companion in self.companions:
            companion.wait()
        self.log.close()

    def stop(self) -> None:
        """Terminate the broker and reap it (killed if it ignores SIGTERM)."""
        for process in (self.process, *self.companions):  # a cluster's gateways first, then its store (or group)
            terminate(process)
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
    if replicated_acks(name) is not None:
        return etcd.missing()
    if name not in PEERS and cluster_gateways(name) is None:
        return (f"unknown broker {name!r} (known: {', '.join(PEERS)}, {CLUSTER_PREFIX}<N>gw, "
                f"{', '.join(map(replicated_name, ACKS))})")
    return None


def peer_name(name: str) -> str:
    """``name`` if it names a broker of the suite (installed or not), for ``--brokers``.

    Raises:
        argparse.ArgumentTypeError: it names none.
    """
    reason = missing(name)
    if reason and reason.startswith("unknown broker"):
        raise argparse.ArgumentTypeError(reason)
    return name


CLUSTER_PREFIX = "lightgate-cluster-"


def cluster_name(gateways: int) -> str:
    """The peer name of LightGate in cluster mode with ``gateways`` gateway processes."""
    return f"{CLUSTER_PREFIX}{gateways}gw"


def cluster_gateways(name: str) -> int | None:
    """The gateway processes of a cluster peer name, or None if ``name`` is not one."""
    count = name.removeprefix(CLUSTER_PREFIX).removesuffix("gw")
    return int(count) if name.startswith(CLUSTER_PREFIX) and count.isdigit() and int(count) > 0 else None


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


def start(name: str, workdir: Path, *, port: int | None = None, durable: bool = False,
          websocket: bool = False) -> Broker:
    """Start broker ``name`` on a free loopback port, its files in ``workdir``; return once it accepts connections.

    Args:
        port: listen here instead of a free port (a restart keeps its port so clients find it again).
        durable: the crash-safe configuration (see the module docstring).
        websocket: also listen for MQTT over WebSocket on another free port (LightGate and Mosquitto only).

    Raises:
        PeerError: the broker exited or did not accept connections within ``READY_TIMEOUT_S``,
            or ``durable`` was asked of a broker in ``NOT_DURABLE``.
    """
    if durable and name in NOT_DURABLE:
        raise PeerError(f"{name} cannot run durable: {NOT_DURABLE[name]}")
    if cluster_gateways(name) is not None:
        return _start_cluster(name, workdir, port or free_port(), durable)
    if (acks := replicated_acks(name)) is not None:
        return _start_replicated(name, acks, workdir, port or free_port(), durable)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DATA_DIR).mkdir(exist_ok=True)
    port = port or free_port()
    ws_port = free_port() if websocket else None
    if ws_port is not None and name not in WEBSOCKET_PEERS:
        raise PeerError(f"{name} is not run with a WebSocket listener here (only {', '.join(WEBSOCKET_PEERS)})")
    command = {"lightgate": _lightgate, "mosquitto": _mosquitto, "amqtt": _amqtt}[name](workdir, port, durable)
    if ws_port is not None:
        command = _with_websocket(name, command, workdir, ws_port)
    log = open(workdir / f"{name}.log", "ab")  # append: a restarted broker's log follows the killed one's
    # cwd=workdir: LightGate reads ./lightgate.toml when present; the repository's must not leak in.
    process = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=SOURCE_ENV)
    broker = Broker(name, port, process, log, workdir=workdir, durable=durable, ws_port=ws_port)
    try:
        _wait_until_accepting(broker, workdir / f"{name}.log")
    except PeerError:
        broker.stop()
        raise
    return broker


def restart(broker: Broker) -> Broker:
    """Start a stopped or killed ``broker`` again: same name, port, files and configuration."""
    if broker.workdir is None:
        raise PeerError(f"{broker.name} on port {broker.port} was not started by peers.start: nothing to restart")
    return start(broker.name, broker.workdir, port=broker.port, durable=broker.durable)


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _lightgate(workdir: Path, port: int, durable: bool) -> list[str]:
    # --admin-port 0: no admin HTTP listener, whose fixed default port would collide between brokers.
    return [sys.executable, "-m", "gateway.app.cli", "serve", "--data", str(workdir / DATA_DIR),
            "--host", HOST, "--port", str(port), "--log-level", "warning", "--admin-port", "0",
            *(["--commitlog-flush", "sync"] if durable else [])]


def _mosquitto(workdir: Path, port: int, durable: bool) -> list[str]:
    conf = workdir / "mosquitto.conf"
    # user <us>: run as root, Mosquitto would switch to the `mosquitto` user, which cannot write our directory.
    persistence = (f"persistence true\npersistence_location {workdir / DATA_DIR}/\nautosave_interval 1\n"
                   f"user {pwd.getpwuid(os.getuid()).pw_name}\n" if durable else "persistence false\n")
    conf.write_text(
        f"listener {port} {HOST}\n"
        "allow_anonymous true\n"
        + persistence +
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
    )
    return [shutil.which("mosquitto") or "mosquitto", "-c", str(conf)]


WEBSOCKET_PEERS = ("lightgate", "mosquitto")
"""The brokers ``start(websocket=True)`` can give a WebSocket listener."""


def _with_websocket(name: str, command: list[str], workdir: Path, ws_port: int) -> list[str]:
    """``command`` with an MQTT-over-WebSocket listener on ``ws_port`` added."""
    if name == "lightgate":
        return [*command, "--ws-port", str(ws_port), "--ws-host", HOST]
    conf = workdir / "mosquitto.conf"
    conf.write_text(conf.read_text() + f"listener {ws_port} {HOST}\nprotocol websockets\n")
    return command


def _amqtt(workdir: Path, port: int, durable: bool) -> list[str]:
    conf = workdir / "amqtt.yaml"
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{HOST}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    conf.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return [sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(conf)]


CLUSTER_TARGET_GATEWAYS = 2
CLUSTER_TARGET = 1.3
"""The cluster issue's target: with 2 gateway processes, at least 1.3x the embedded node's fan-in throughput."""


def add_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mode`` and ``--gateways``: measure LightGate's cluster mode next to the embedded node."""
    parser.add_argument("--mode", choices=("embedded", "cluster"), default="embedded",
                        help="cluster: also measure 1 store + N gateway processes (peers lightgate-cluster-<N>gw)")
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2],
                        help="with --mode cluster: the gateway process counts to measure")


def with_cluster(args: argparse.Namespace) -> list[str]:
    """The brokers to measure: ``--brokers``, plus the cluster peers when ``--mode cluster``."""
    if args.mode != "cluster":
        return list(args.brokers)
    return [*args.brokers, *(cluster_name(n) for n in args.gateways if cluster_name(n) not in args.brokers)]


def cluster_ratios(results: dict[str, Any], get: Callable[[dict[str, Any]], float]) -> dict[str, float | None]:
    """``<cluster peer>/lightgate`` and ``<cluster peer>/mosquitto`` of the figure ``get`` extracts."""
    out: dict[str, float | None] = {}
    for name, result in results.items():
        if cluster_gateways(name) is None:
            continue
        for base in ("lightgate", "mosquitto"):
            if base in results:
                theirs = get(results[base])
                out[f"{name}/{base}"] = round(get(result) / theirs, 3) if theirs else None
    return out


def _start_cluster(name: str, workdir: Path, port: int, durable: bool) -> Broker:
    """A store process and a gateway command with N workers (see the module docstring); ready when all listen."""
    gateways = cluster_gateways(name)
    assert gateways is not None
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DATA_DIR).mkdir(exist_ok=True)
    store_port = free_port()
    quiet = ["--log-level", "warning"]
    log = open(workdir / f"{name}.log", "ab")
    store = subprocess.Popen(
        [sys.executable, "-m", "gateway.app.cli", "store", "--data", str(workdir / DATA_DIR),
         "--listen", f"{HOST}:{store_port}", *quiet, *(["--commitlog-flush", "sync"] if durable else [])],
        cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=SOURCE_ENV)
    try:
        wait_listening([store.pid], store_port, 1, name, workdir / f"{name}.log")
        gateway = start_gateway([f"{HOST}:{store_port}"], port, workdir, log, workers=gateways)
    except BaseException:
        store.kill()
        store.wait()
        log.close()
        raise
    broker = Broker(name, port, gateway, log, workdir=workdir, durable=durable, companions=[store])
    try:
        wait_listening(None, port, gateways, name, workdir / f"{name}.log", broker)
    except PeerError:
        broker.stop()
        raise
    return broker


def wait_listening(pids: list[int] | None, port: int, count: int, name: str, log_path: Path,
                    broker: Broker | None = None) -> None:
    """Wait until ``count`` of the processes (``pids``, or the broker's) listen on ``port``.

    Raises:
        PeerError: a process exited, or they did not listen within ``READY_TIMEOUT_S``.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            processes = broker.processes() if broker is not None else [psutil.Process(pid) for pid in pids or ()]
            listening = sum(1 for p in processes for c in p.net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
        except psutil.NoSuchProcess:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise PeerError(f"{name}: a process exited: {tail}") from None
        if listening >= count:
            return
        time.sleep(0.05)  # polling sockets: nothing to wait on but the next look
    tail = log_path.read_text(errors="replace")[-2000:]
    raise PeerError(f"{name}: {count} processes did not listen on {HOST}:{port} within {READY_TIMEOUT_S} s: {tail}")


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


def start_gateway(stores: list[str], port: int, workdir: Path, log: IO[bytes], *, workers: int = 1
                  ) -> subprocess.Popen[bytes]:
    """A ``lightgate gateway`` command (``workers`` processes sharing ``port``) in front of the store addresses
    ``stores`` (a replicated group's replicas: it follows their leader), at warning level without the admin
    listener or $SYS publishing."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.app.cli", "gateway", "--store", ",".join(stores), "--host", HOST,
         "--port", str(port), "--workers", str(workers), "--log-level", "warning", "--admin-port", "0",
         "--mqtt-sys-interval-s", "0"],
        cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=SOURCE_ENV)


REPLICATED_PREFIX = "lightgate-r3-"
ACKS = ("leader", "quorum", "all")
"""``replication.acks`` of the replicated peers, in the order they are reported."""

REPLICAS = 3
GROUP = "g"
FOLLOWING = "following the leader"
"""The log line (its ``msg``) of a replica that follows the group's leader: a faulted leader has rejoined."""
LEASE_S = 2.0
"""``replication.lease_s`` of the benchmark groups: the leader's etcd lease, so the longest a dead leader holds
its key before an election can start."""

LEADER_LEASE_S = 1.4
"""``replication.leader_lease_s``: below ``LEASE_S``, so an old leader stops acknowledging before a new one is
elected."""

UNREPLICATED = cluster_name(1)
"""The replicated peers' comparison: one store process and one gateway process, the same gateway command."""


def replicated_name(acks: str) -> str:
    """The peer name of a 3-replica group acknowledging with ``acks``."""
    return f"{REPLICATED_PREFIX}{acks}"


def replicated_acks(name: str) -> str | None:
    """The ``replication.acks`` of a replicated peer name, or None if ``name`` is not one."""
    acks = name.removeprefix(REPLICATED_PREFIX)
    return acks if name.startswith(REPLICATED_PREFIX) and acks in ACKS else None


def replicated_ratios(results: dict[str, Any], get: Callable[[dict[str, Any]], float]) -> dict[str, float | None]:
    """``<acks>/unreplicated`` of the figure ``get`` extracts, for every replicated peer measured beside
    ``UNREPLICATED``."""
    if UNREPLICATED not in results:
        return {}
    theirs = get(results[UNREPLICATED])
    return {f"{acks}/unreplicated": round(get(results[name]) / theirs, 3) if theirs else None
            for acks in ACKS if (name := replicated_name(acks)) in results}


@dataclass
class Replica:
    """One store replica of a group: its command (a restart runs it again), port and log; ``process`` is the
    running one, or None once killed."""

    name: str
    port: int
    command: list[str]
    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        """Run the replica's command (again); its JSON log lines go to ``log_path`` after the earlier ones."""
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=SOURCE_ENV)

    def log_size(self) -> int:
        """The bytes in the replica's log now: ``logged(msg, since=log_size())`` looks only at what comes after."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def logged(self, msg: str, since: int = 0) -> bool:
        """The replica logged a JSON line whose ``msg`` is ``msg`` after byte ``since`` of its log."""
        with open(self.log_path, "rb") as log:
            log.seek(since)
            for line in log:
                try:
                    if json.loads(line).get("msg") == msg:
                        return True
                except (ValueError, AttributeError):
                    pass  # a line that is no JSON object (an interpreter's traceback): not the one
        return False

    def kill(self) -> None:
        """SIGKILL the replica (it may be stopped: a SIGKILL ends a stopped process too) and reap it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@dataclass
class Group:
    """A replicated store group on loopback: a one-member etcd and ``REPLICAS`` store replicas."""

    etcd: etcd.Etcd
    replicas: list[Replica]
    acks: str

    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The running replicas' processes, then etcd's (the order ``Broker.stop`` ends them in)."""
        return [*(r.process for r in self.replicas if r.process is not None), self.etcd.process]

    def leader(self) -> tuple[Replica, int] | None:
        """The replica etcd names the leader and its epoch, or None while no leader key exists (or it names a
        replica that is not running: its lease has not run out yet)."""
        key = self.etcd.leader(GROUP)
        replica = next((r for r in self.replicas if key and r.name == key.get("name")), None)
        if replica is None or replica.process is None:
            return None
        return replica, int(key["epoch"])  # type: ignore[index]

    def whole(self, above: int = -1, faulted: tuple[Replica, int] | None = None) -> tuple[Replica, int] | None:
        """The leader and its epoch once the group is whole again; else None.

        Whole: etcd names a running leader of an epoch above ``above``, its in-sync set holds every replica, and
        ``faulted`` (a replica that was killed or frozen, and the size of its log then) leads, or has logged
        since that it follows the leader.
        """
        leader = self.leader()
        if leader is None or leader[1] <= above:
            return None
        isr = self.etcd.in_sync(GROUP)
        if isr is None or sorted(isr.get("members", ())) != sorted(r.name for r in self.replicas):
            return None
        if faulted is not None and faulted[0] is not leader[0] and not faulted[0].logged(FOLLOWING, faulted[1]):
            return None
        return leader

    def wait_whole(self, timeout_s: float = READY_TIMEOUT_S, above: int = -1,
                   faulted: tuple[Replica, int] | None = None) -> tuple[Replica, int] | None:
        """``whole(above, faulted)``, polled until it holds or ``timeout_s`` passed (then None).

        Raises:
            PeerError: a replica exited (its log's tail says why).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for replica in self.replicas:
                if replica.process is not None and replica.process.poll() is not None:
                    raise PeerError(f"replica {replica.name} exited with status {replica.process.returncode}: "
                                    + replica.log_path.read_text(errors="replace")[-2000:])
            try:
                found = self.whole(above, faulted)
            except etcd.EtcdError:
                found = None  # etcd busy for a moment: look again
            if found is not None or time.monotonic() > deadline:
                return found
            time.sleep(0.05)  # polling etcd's keys and a log: the benchmark does not watch them

    def state(self) -> str:
        """What etcd says of the group now (leader and in-sync set), for a message."""
        try:
            return f"leader {self.etcd.leader(GROUP)}, in-sync set {self.etcd.in_sync(GROUP)}"
        except etcd.EtcdError as exc:
            return str(exc)

    def stop(self) -> None:
        """Terminate every replica, then etcd (each killed if it ignores SIGTERM)."""
        for replica in self.replicas:
            if replica.process is not None:
                terminate(replica.process)
        self.etcd.stop()

    def tail(self) -> str:
        """The last lines of every replica's log, for an error message."""
        return "\n".join(f"{r.name}: " + r.log_path.read_text(errors="replace")[-1000:]
                         for r in self.replicas if r.log_path.exists())


def terminate(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``process`` and reap it; SIGKILL it if it has not exited within ``STOP_TIMEOUT_S``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_group(workdir: Path, acks: str, *, durable: bool = False) -> Group:
    """etcd and ``REPLICAS`` replicas acknowledging with ``acks``, their data under ``workdir/data``; returns
    once the group is whole (``Group.whole``).

    Raises:
        PeerError: etcd or a replica did not start, or the group was not whole within ``READY_TIMEOUT_S``.
    """
    data = workdir / DATA_DIR
    data.mkdir(parents=True, exist_ok=True)
    try:
        server = etcd.start(data / "etcd", free_port(), free_port(), workdir / "etcd.log")
    except etcd.EtcdError as exc:
        raise PeerError(str(exc)) from None
    names = [f"r{i}" for i in range(REPLICAS)]
    members = [arg for name in names for arg in ("--replica", name)]
    replicas = []
    for name in names:
        port = free_port()
        command = [sys.executable, "-m", "gateway.app.cli", "store", "--data", str(data / name),
                   "--listen", f"{HOST}:{port}", "--replication-group", GROUP, "--replication-name", name,
                   *members, "--etcd", server.client_url, "--replication-acks", acks,
                   "--replication-lease-s", str(LEASE_S), "--replication-leader-lease-s", str(LEADER_LEASE_S),
                   "--log-json", *(["--commitlog-flush", "sync"] if durable else [])]
        replicas.append(Replica(name, port, command, workdir))
    group = Group(server, replicas, acks)
    try:
        for replica in replicas:
            replica.start()
        if group.wait_whole() is None:
            raise PeerError(f"replicated group ({acks}) not whole within {READY_TIMEOUT_S} s "
                            f"({group.state()}):\n{group.tail()}")
    except BaseException:
        group.stop()
        raise
    return group


def _start_replicated(name: str, acks: str, workdir: Path, port: int, durable: bool) -> Broker:
    """A replicated group and one gateway in front of it (see the module docstring); ready when the gateway
    listens."""
    group = start_group(workdir, acks, durable=durable)
    log = open(workdir / f"{name}.log", "ab")
    try:
        gateway = start_gateway(group.addresses(), port, workdir, log)
    except BaseException:
        group.stop()
        log.close()
        raise
    broker = Broker(name, port, gateway, log, workdir=workdir, durable=durable, companions=group.processes())
    try:
        wait_listening(None, port, 1, name, workdir / f"{name}.log", broker)
    except PeerError:
        broker.stop()
        raise
    return broker


@contextmanager
def store_process(data: Path, flush: str, compression: str = "zstd") -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A ``lightgate store`` process on ``data`` (created; its log beside it) with ``commitlog.flush`` ``flush``
    and ``commitlog.batch_compression`` ``compression``, listening: its port and process, terminated at the end.
    For the back-end benchmarks (produce, pop)."""
    data.mkdir(parents=True)
    port = free_port()
    log_path = data.parent / f"{data.name}.log"
    with open(log_path, "ab") as log:
        store = subprocess.Popen(
            [sys.executable, "-m", "gateway.app.cli", "store", "--data", str(data), "--listen", f"{HOST}:{port}",
             "--log-level", "warning", "--commitlog-flush", flush, "--commitlog-batch-compression", compression],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=SOURCE_ENV)
    try:
        wait_listening([store.pid], port, 1, "lightgate store", log_path)
        yield port, store
    finally:
        terminate(store)
