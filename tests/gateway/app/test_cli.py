"""The ``lightgate`` command as operators run it: a real subprocess, real signals, real files."""

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib

import pytest

from tests.helpers.processes import ROOT

LIGHTGATE = [sys.executable, "-m", "gateway.app.cli"]


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


@pytest.mark.parametrize("command, flag, failed", [("serve", "--port", "gateway node failed"),
                                                   ("store", "--listen", "store node failed")])
def test_a_node_exits_1_when_its_port_is_taken_and_says_why(tmp_path, command, flag, failed):
    """The one error line names the cause (the store's said "Exceptions from Trio nursery (1 sub-exception)" when a
    test's restarted store found its port taken)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = run([command, flag, port if command == "serve" else f"127.0.0.1:{port}"], tmp_path)
    assert out.returncode == 1
    assert failed in out.stderr
    assert "Address already in use" in out.stderr and "Exceptions from Trio nursery" not in out.stderr  # the cause


def help_flags(command, tmp_path):
    out = run([command, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout, {word.rstrip(",") for word in out.stdout.split() if word.startswith("--")}


def test_serve_help_shows_only_what_serve_uses_grouped_by_section(tmp_path):
    text, flags = help_flags("serve", tmp_path)
    assert {"--host", "--port", "--data", "--tls-port", "--commitlog-flush", "--limits-publish-rate",
            "--admin-token", "--auth-acl-file", "--tier-uri"} <= flags
    assert not flags & {"--listen", "--store", "--store-token", "--store-lease-s", "--workers",
                        "--bridge-remote-host", "--rule"}
    sections = [line.split()[0] for line in text.splitlines() if line.startswith("[")]
    assert sections == ["[node]", "[tls]", "[ws]", "[wss]", "[log]", "[commitlog]", "[mqtt]", "[retention]",
                        "[tier]", "[auth]", "[limits]", "[delayed]", "[admin]"]
    node = text[text.index("[node]"):text.index("[tls]")]
    assert "--port" in node and "--tls-port" not in node and "LIGHTGATE_NODE_<KEY>" in node


def test_store_help_shows_only_what_the_store_node_uses(tmp_path):
    _, flags = help_flags("store", tmp_path)
    assert {"--data", "--listen", "--store-token", "--store-lease-s", "--commitlog-flush", "--retention-hours",
            "--auth-password-file", "--auth-acl-file"} <= flags
    assert not flags & {"--host", "--port", "--admin-port", "--tls-port", "--mqtt-max-packet-size",
                        "--limits-max-connections", "--store", "--workers", "--auth-acl-wildcard-mode"}


def test_repair_help_shows_only_what_repair_uses(tmp_path):
    _, flags = help_flags("repair", tmp_path)
    assert flags == {"--help", "--config", "--data", "--log-level", "--log-json", "--no-log-json",
                     "--commitlog-segment-bytes", "--commitlog-max-record-bytes", "--commitlog-batch-compression",
                     "--commitlog-flush",
                     "--commitlog-flush-interval-ms", "--commitlog-flush-min-bytes",
                     "--commitlog-flush-force-interval-ms", "--commitlog-sync-interval-ms"}


@pytest.mark.parametrize("argv, flag, key", [
    (["serve", "--bridge-remote-host", "example.com"], "--bridge-remote-host", "bridge.remote_host"),
    (["serve", "--workers=2"], "--workers", "gateway.workers"),
    (["store", "--admin-port", "0"], "--admin-port", "admin.port"),
    (["store", "--no-tls-require-client-cert"], "--no-tls-require-client-cert", "tls.require_client_cert"),
    (["repair", "--data", "d", "--port", "1884"], "--port", "node.port"),
])
def test_a_flag_of_another_command_is_an_error_naming_the_flag_and_the_command(tmp_path, argv, flag, key):
    out = run(argv, tmp_path)
    assert out.returncode == 2
    assert f"lightgate {argv[0]}: error: {flag} does not apply to lightgate {argv[0]}: it sets {key}" in out.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "d").exists()  # nothing started


def test_an_unknown_flag_is_still_unrecognized_and_its_value_not_echoed(tmp_path):
    out = run(["serve", "--admin-tokn", "adm1n-s3cret", "--frob=s3cret-2"], tmp_path)  # a typo must not leak it
    assert out.returncode == 2 and "unrecognized arguments: --admin-tokn --frob\n" in out.stderr
    assert "s3cret" not in out.stderr


def test_every_flag_a_command_shows_is_accepted_and_config_takes_them_all():
    from gateway.app import config as cfg
    from gateway.app.cli import build_parser

    parser = build_parser(["serve"])
    for command in (*cfg.COMMAND_KEYS, "config"):
        for opt in cfg.OPTIONS:
            if not cfg.uses(command, opt):
                continue
            value = [] if isinstance(opt.default, bool) else [opt.choices[0] if opt.choices else "1"]
            args, unknown = parser.parse_known_args([command, opt.cli_flag, *value])
            assert not unknown and getattr(args, opt.dest) is not None, (command, opt.key)


SECRETS = {"admin.token": "adm1n-s3cret-t0ken", "store.token": "st0re-s3cret-t0ken",
           "bridge.remote_password": "rem0te-pw", "bridge.local_password": "l0cal-pw"}


def test_config_redacts_every_secret_from_any_layer(tmp_path):
    (tmp_path / "lightgate.toml").write_text('[bridge]\nremote_password = "rem0te-pw"\nlocal_password = "l0cal-pw"\n'
                                             '[tier]\nuri = "s3://AKIAKEY:t1er/s3cret@bucket/lg"\n')
    out = run(["config", "--store-token", "st0re-s3cret-t0ken"], tmp_path,
              env={"LIGHTGATE_ADMIN_TOKEN": "adm1n-s3cret-t0ken"})
    assert out.returncode == 0, out.stderr
    for secret in (*SECRETS.values(), "t1er", "s3cret@"):  # an unencoded / in the key: hidden too
        assert secret not in out.stdout + out.stderr
    doc = tomllib.loads(out.stdout)
    for key in SECRETS:
        section, name = key.split(".")
        assert doc[section][name] == "<redacted>", key
    assert doc["tier"]["uri"] == "s3://AKIAKEY:<redacted>@bucket/lg"  # the rest of the URI is no secret
    assert doc["node"]["port"] == 1883 and tomllib.loads(run(["config"], tmp_path).stdout)["admin"]["token"] == ""


def test_the_start_up_configuration_line_redacts_secrets(tmp_path):
    with socket.socket() as taken:  # the node stops at once: the port is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run(["serve", "--port", str(taken.getsockname()[1]), "--log-json", "--admin-token",
                   "adm1n-s3cret-t0ken", "--mqtt-receive-maximum", "9"], tmp_path)
    assert out.returncode == 1
    assert "adm1n-s3cret-t0ken" not in out.stderr
    line = next(json.loads(text) for text in out.stderr.splitlines() if '"configuration"' in text)
    assert line["command"] == "serve" and line["admin.token"] == "<redacted>"
    assert line["mqtt.receive_maximum"] == 9 and "node.host" not in line  # what differs from the defaults


def test_a_word_that_contains_a_secret_is_logged_as_it_is(tmp_path):
    """Every occurrence of a secret's value in any line was replaced: a token ``t`` turned every t of the log into
    <redacted> and so told the token. Only the values of secret keys and URI passwords are redacted now."""
    token = "0123456789abcdef"
    data = tmp_path / f"data-{token}-2"
    with socket.socket() as taken:  # the node stops at once: the port is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run(["serve", "--port", str(taken.getsockname()[1]), "--log-json", "--admin-token", token,
                   "--data", str(data)], tmp_path)
    assert out.returncode == 1
    line = next(json.loads(text) for text in out.stderr.splitlines() if '"configuration"' in text)
    assert line["admin.token"] == "<redacted>" and line["node.data"] == str(data)
    assert "<redacted>" not in out.stderr.replace('"admin.token": "<redacted>"', "")


@pytest.mark.parametrize("args, env, key", [
    (["serve", "--port", "0", "--admin-token", "changeme"], {}, "admin.token (--admin-token, LIGHTGATE_ADMIN_TOKEN)"),
    (["store", "--listen", "127.0.0.1:0"], {"LIGHTGATE_STORE_TOKEN": "changeme"},
     "store.token (--store-token, LIGHTGATE_STORE_TOKEN)"),
    (["config", "--config", "lg.toml"], {}, "store.token (--store-token, LIGHTGATE_STORE_TOKEN)"),
])
def test_a_token_too_short_to_be_a_secret_is_refused_at_start_with_one_line(tmp_path, args, env, key):
    (tmp_path / "lg.toml").write_text('[store]\ntoken = "changeme"\n')
    out = run([*args, "--data", str(tmp_path / "data")] if args[0] != "config" else args, tmp_path, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"lightgate: configuration error: {key} is 8 characters long: a token needs at least 16"
                          " (e.g. `openssl rand -hex 16`)\n")
    assert not (tmp_path / "data").exists()  # refused before anything started


def test_the_cli_loads_the_benchmarks_only_for_lightgate_bench():
    """``lightgate serve`` (and every command but ``bench`` and ``simulate``) runs without the benchmark code:
    importing the CLI and building its parser for ``serve`` leaves gateway.bench unloaded (issue 31); building it
    for ``bench`` loads it, else the check would prove nothing."""
    script = ("import sys\n"
              "from gateway.app import cli\n"
              "cli.build_parser(['serve'])\n"
              "print(sorted(name for name in sys.modules if name.startswith('gateway.bench')))\n"
              "cli.build_parser(['bench'])\n"
              "print('gateway.bench.fanin' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "True"]
