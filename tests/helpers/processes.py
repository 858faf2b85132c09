"""A `lightgate <command>` subprocess whose JSON log lines are collected as they come, for tests to wait on.

Tests never sleep for a process: they wait, with a timeout, for the log line
that says what they need (ready, connected, a will published), and fail at
once with the process's last lines when it exited without writing it.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0


class LightgateProcess:
    """``python -m gateway.app.cli <args> --log-json``, started now, from the repository root.

    ``command`` replaces ``python -m gateway.app.cli`` (e.g. an installed ``lightgate``), ``cwd`` the repository root,
    and ``env`` the environment (default: this one, with the repository root on PYTHONPATH). ``json_logs=False``
    keeps the text format: each line is then collected as ``{"msg": line}``.
    """

    def __init__(self, *args: str, wait_s: float = WAIT_S, command: list[str] | None = None,
                 cwd: Path = ROOT, env: dict[str, str] | None = None, json_logs: bool = True) -> None:
        self.args = args
        self.wait_s = wait_s
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "gateway.app.cli"]), *args, *(["--log-json"] if json_logs else [])],
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT)} if env is None else env,
        )
        self.logs: list[dict] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            try:
                doc = json.loads(line)
            except ValueError:
                doc = {"msg": line.rstrip()}
            with self._changed:
                self.logs.append(doc)
                self._changed.notify_all()

    def wait_log(self, match, timeout: float | None = None, after: int = 0) -> dict:
        """The first log line from index ``after`` on that ``match``es, waiting for it."""
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        with self._changed:
            while True:
                for doc in self.logs[after:]:
                    if match(doc):
                        return doc
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not any(match(d) for d in self.logs[after:]):
                    pytest.fail(f"no such log line of {self.args[0]}; logs: {self.logs[-30:]}")
                self._changed.wait(min(left, 0.5))

    def ready(self, message: str) -> int:
        """Wait for the readiness line ``message``; return the port it reports."""
        return self.wait_log(lambda doc: doc.get("msg") == message)["port"]

    def errors(self) -> list[dict]:
        return [doc for doc in self.logs if doc.get("level") == "error"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=self.wait_s)

    def stop(self) -> int:
        """SIGTERM, and SIGKILL if it has not exited within the wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=max(self.wait_s, 30))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
