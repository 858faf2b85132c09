"""The ``lightgate`` command as operators run it: a real subprocess, real signals, real files."""

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

LIGHTGATE = [sys.executable, "-m", "gateway.app.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, env=None, **kw):
    return subprocess.run(LIGHTGATE + args, cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, **kw)


def test_config_defaults_is_valid_toml(tmp_path):
    out = run(["config", "--defaults"], tmp_path)
    assert out.returncode == 0, out.stderr
    doc = tomllib.loads(out.stdout)
    assert doc["node"] == {"host": "127.0.0.1", "port": 1883, "data": "./data"}


def test_config_shows_flag_overrides(tmp_path):
    out = run(["config", "--port", "1999", "--commitlog-flush", "sync"], tmp_path)
    doc = tomllib.loads(out.stdout)
    assert doc["node"]["port"] == 1999 and doc["commitlog"]["flush"] == "sync"


def test_config_shows_env_over_file_and_flags_over_env(tmp_path):
    (tmp_path / "lightgate.toml").write_text('[node]\nport = 2000\ndata = "/srv/file"\n[mqtt]\nreceive_maximum = 7\n')
    out = run(["config", "--data", "/srv/flag"], tmp_path,
              env={"LIGHTGATE_NODE_PORT": "2001", "LIGHTGATE_NODE_DATA": "/srv/env"})
    assert out.returncode == 0, out.stderr
    doc = tomllib.loads(out.stdout)
    assert doc["node"] == {"host": "127.0.0.1", "port": 2001, "data": "/srv/flag"}
    assert doc["mqtt"]["receive_maximum"] == 7


def test_bad_env_value_exits_2_naming_the_variable(tmp_path):
    out = run(["serve"], tmp_path, env={"LIGHTGATE_MQTT_RECEIVE_MAXIMUM": "lots"})
    assert out.returncode == 2
    assert "environment variable LIGHTGATE_MQTT_RECEIVE_MAXIMUM: mqtt.receive_maximum must be int" in out.stderr


def test_bad_config_file_exits_2_with_the_reason(tmp_path):
    (tmp_path / "bad.toml").write_text("[node]\nport = 'x'\n")
    out = run(["serve", "--config", "bad.toml"], tmp_path)
    assert out.returncode == 2
    assert "node.port must be int" in out.stderr


READY = {"serve": "gateway node ready", "store": "store node ready"}
STOPPED = {"serve": "gateway node stopped", "store": "store node stopped"}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["serve", "store"])
def test_node_starts_with_no_arguments_and_stops_cleanly_on_sigterm(tmp_path, command):
    proc = subprocess.Popen(LIGHTGATE + [command, "--log-json"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lines = []
        for line in proc.stderr:  # blocks until the node logs; the pytest timeout bounds it
            lines.append(line)
            if f'"{READY[command]}"' in line:
                break
        else:
            pytest.fail("node exited before it was ready:\n" + "".join(lines))
        if command == "serve":
            ready = json.loads(lines[-1])
            assert (ready["host"], ready["port"]) == ("127.0.0.1", 1883)  # the documented default listener
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, rest
    assert f'"{STOPPED[command]}"' in rest
    assert (tmp_path / "data" / "commitlog").is_dir()
    assert (tmp_path / "data" / "index").is_dir()


def test_serve_exits_1_when_the_port_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run(["serve", "--port", str(taken.getsockname()[1])], tmp_path)
    assert out.returncode == 1
    assert "gateway node failed" in out.stderr
    assert "Address already in use" in out.stderr and "Exceptions from Trio nursery" not in out.stderr  # the cause
