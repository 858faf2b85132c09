"""A one-member etcd for the replicated benchmarks: started on given loopback ports, read, stopped.

The replicated store group (docs/cluster.md) keeps its leader, epoch and in-sync set in etcd. The benchmarks
start their own Debian etcd (3.4, ``/usr/bin/etcd``) beside the store replicas, wait until it answers
``GET /health`` with ``{"health":"true"}``, and read the group's keys through the v3 JSON gateway
(``POST /v3/kv/range``, base64 keys and values) to learn which replica leads: the benchmark watches the system
from outside, so it reads what every replica reads rather than trusting one replica's log.

Resource handling: ``start`` returns a running ``Etcd``; its owner calls ``stop()`` (it is also a context
manager), which terminates and reaps the process. The data directory and the log file belong to the caller.

Error handling: ``start`` raises ``EtcdError`` with the tail of etcd's log when it exits or is not healthy in
time; a read of a key raises ``EtcdError`` when etcd does not answer (the caller decides whether to retry).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"

READY_TIMEOUT_S = 30.0
"""How long a fresh etcd may take to elect itself and answer healthy (about a second on an idle machine)."""

CALL_TIMEOUT_S = 2.0
"""One HTTP call to etcd: far above a healthy answer, short enough that a poll loop notices a dead etcd."""

STOP_TIMEOUT_S = 10.0
"""How long etcd gets to exit after SIGTERM before it is killed."""

GROUP_PREFIX = "/lightgate/groups/"
"""Where the replicated store keeps each group's keys (``<prefix><group>/leader``, ``.../isr``)."""


class EtcdError(RuntimeError):
    """etcd could not be started or did not answer; the message says why."""


def missing() -> str | None:
    """Why etcd cannot run here, or None when it can."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server, or `make test-deps`)"
    return None


@dataclass
class Etcd:
    """A running single-member etcd serving clients on ``client_url``."""

    process: subprocess.Popen[bytes]
    client_url: str
    log_path: Path

    def healthy(self) -> bool:
        """``GET /health`` answers ``{"health": "true"}``."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=CALL_TIMEOUT_S) as answer:
                return json.load(answer).get("health") == "true"
        except (OSError, ValueError):
            return False

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist.

        Raises:
            EtcdError: etcd did not answer, or answered something that is no range response.
        """
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        request = urllib.request.Request(f"{self.client_url}/v3/kv/range", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as answer:
                doc = json.load(answer)
        except (OSError, ValueError) as exc:
            raise EtcdError(f"etcd at {self.client_url} did not answer a read of {key}: {exc}") from None
        kvs = doc.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def get_json(self, key: str) -> Any:
        """The JSON value of ``key``, or None when it does not exist."""
        value = self.get(key)
        return None if value is None else json.loads(value)

    def leader(self, group: str) -> dict[str, Any] | None:
        """Group ``group``'s leader key, ``{"name", "epoch", "address"}``, or None while it has none."""
        return self.get_json(f"{GROUP_PREFIX}{group}/leader")

    def in_sync(self, group: str) -> dict[str, Any] | None:
        """Group ``group``'s in-sync set as etcd last recorded it, ``{"epoch", "members"}``; None before the first."""
        return self.get_json(f"{GROUP_PREFIX}{group}/isr")

    def stop(self) -> None:
        """Terminate etcd and reap it (killed if it ignores SIGTERM)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(data_dir: Path, client_port: int, peer_port: int, log_path: Path) -> Etcd:
    """Start member ``e0`` of a one-member cluster, its data in ``data_dir``; return once it is healthy.

    Raises:
        EtcdError: etcd is not installed, exited, or was not healthy within ``READY_TIMEOUT_S``.
    """
    reason = missing()
    if reason:
        raise EtcdError(reason)
    client, peer = f"http://{HOST}:{client_port}", f"http://{HOST}:{peer_port}"
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [shutil.which("etcd") or "etcd", "--name", "e0", "--data-dir", str(data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"e0={peer}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    etcd = Etcd(process, client, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not etcd.healthy():
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"not healthy within {READY_TIMEOUT_S} s" if process.returncode is None else \
                f"exited with status {process.returncode}"
            etcd.stop()
            raise EtcdError(f"etcd on {client} {state}: {log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)  # polling /health: etcd signals readiness no other way
    return etcd
