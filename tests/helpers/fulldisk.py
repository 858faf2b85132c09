"""A data disk filled for real: fill a tmpfs, read a metric, find the full-disk log lines of a node."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from tests.helpers.mqtt_fixtures import WAIT_S
from tests.helpers.processes import LightgateProcess

DISK = "16m"

FLAGS = ("--commitlog-segment-bytes", str(1 << 20), "--commitlog-max-record-bytes", "65536",
         "--mqtt-sys-interval-s", "0")


def fill(path: Path) -> None:
    """Write ``path`` until the disk is full (ENOSPC)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
        except OSError:
            pass


def metric(port: int, sample: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


def full_lines(node: LightgateProcess) -> tuple[list[dict], list[dict]]:
    return ([d for d in node.logs if d.get("msg", "").startswith("data disk full")],
            [d for d in node.logs if d.get("msg", "").startswith("data disk has room again")])
