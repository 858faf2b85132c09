"""A data disk filled for real: a tmpfs of its own, filled, and the full-disk log lines of a node."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.processes import LightgateProcess

DISK = "16m"

FLAGS = ("--commitlog-segment-bytes", str(1 << 20), "--commitlog-max-record-bytes", "65536",
         "--mqtt-sys-interval-s", "0")


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) at ``mount``, unmounted at the end; the test is skipped where
    mounting is not permitted (it needs root)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here (needs root): {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the disk is full (ENOSPC)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
        except OSError:
            pass


def full_lines(node: LightgateProcess) -> tuple[list[dict], list[dict]]:
    return ([d for d in node.logs if d.get("msg", "").startswith("data disk full")],
            [d for d in node.logs if d.get("msg", "").startswith("data disk has room again")])
