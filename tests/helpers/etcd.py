"""A real etcd for tests: 1 member, or 3 as one cluster, on free loopback ports, in a test's tmp dir.

Started members are waited for on their health endpoint (a condition, never a sleep); ``kill(i)`` SIGKILLs one
member, ``freeze(i)``/``thaw(i)`` SIGSTOP/SIGCONT it; ``stop()`` ends them all. Tests skip, saying why, when Debian's
``etcd-server`` (``/usr/bin/etcd``) is not installed (``make test-deps`` installs it).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.ports import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
WAIT_S = 30.0  # a 3-member cluster's first raft election, on two shared cores


def require_etcd() -> None:
    if not Path(ETCD).exists():
        pytest.skip(f"etcd is not installed ({ETCD} missing: `make test-deps` installs Debian's etcd-server)")


def healthy(url: str) -> bool:
    """Whether the member at client ``url`` answers its health endpoint with ``"health": "true"``."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as response:
            return json.loads(response.read()).get("health") == "true"
    except (OSError, ValueError, urllib.error.URLError):
        return False


class EtcdCluster:
    """``size`` etcd members, started now under ``directory``; ``endpoints`` are their client URLs."""

    def __init__(self, directory: Path, size: int = 1, name: str = "etcd") -> None:
        require_etcd()
        self.names = [f"{name}{index}" for index in range(size)]
        client_ports = [free_port() for _ in self.names]
        peer_ports = [free_port() for _ in self.names]
        self.endpoints = [f"http://127.0.0.1:{port}" for port in client_ports]
        peers = [f"http://127.0.0.1:{port}" for port in peer_ports]
        cluster = ",".join(f"{member}={peer}" for member, peer in zip(self.names, peers))
        self.processes: list[subprocess.Popen] = []
        for member, client, peer in zip(self.names, self.endpoints, peers):
            with open(directory / f"{member}.log", "wb") as log:  # the process keeps its own descriptor
                self.processes.append(subprocess.Popen(
                    [ETCD, "--name", member, "--data-dir", str(directory / member),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", cluster, "--initial-cluster-state", "new",
                     "--initial-cluster-token", f"{name}-{client_ports[0]}"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        self.logs = [directory / f"{member}.log" for member in self.names]
        for index in range(size):
            self.wait_healthy(index)

    def wait_healthy(self, index: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while not healthy(self.endpoints[index]):
            if self.processes[index].poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"etcd member {self.names[index]} did not become healthy: "
                            f"{self.logs[index].read_text()[-2000:]}")
            time.sleep(0.05)  # polling the health endpoint: the condition is checked, the sleep only paces it

    def kill(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait(timeout=WAIT_S)

    def freeze(self, index: int) -> None:
        """SIGSTOP the member and return once the kernel reports it stopped (state ``T`` in /proc): a signal sent is
        not yet a process stopped, and on a loaded machine the member could still answer a call made at once."""
        process = self.processes[index]
        process.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{process.pid}/stat")
        deadline = time.monotonic() + WAIT_S
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            if time.monotonic() > deadline:
                pytest.fail(f"etcd member {self.names[index]} did not stop within {WAIT_S} s of SIGSTOP")
            time.sleep(0.005)  # polling the kernel's process state: the condition, paced

    def thaw(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def running_etcd(directory: Path, size: int = 1) -> Iterator[EtcdCluster]:
    """An :class:`EtcdCluster` of ``size`` members for the ``with`` block."""
    cluster = EtcdCluster(directory, size)
    try:
        yield cluster
    finally:
        cluster.stop()
