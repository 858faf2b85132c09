"""Configuration: defaults, TOML file, flags, precedence and errors."""

import argparse
import re
import tomllib

import pytest

from gateway.app import config as cfg
from tests.helpers.processes import ROOT


def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return cfg.resolve(parser.parse_args(argv), {} if environ is None else environ)


def test_defaults_without_file_or_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = parse([])
    assert conf["node.host"] == "127.0.0.1"
    assert conf["node.port"] == 1883
    assert conf["node.data"] == "./data"
    assert conf["commitlog.flush"] == "async"
    assert conf.source is None


def test_operator_flags_have_exact_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conf = parse(["--host", "0.0.0.0", "--port", "1999", "--data", "/srv/lg"])
    assert (conf["node.host"], conf["node.port"], conf["node.data"]) == ("0.0.0.0", 1999, "/srv/lg")


def test_file_then_flag_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "lg.toml"
    path.write_text('[node]\nport = 2000\n[commitlog]\nflush = "sync"\nsegment_bytes = 1048576\n')
    conf = parse(["--config", str(path), "--port", "2001"])
    assert conf["node.port"] == 2001
    assert conf["commitlog.flush"] == "sync"
    assert conf["commitlog.segment_bytes"] == 1048576
    assert conf.section("commitlog")["flush"] == "sync"


def test_default_file_in_working_directory_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / cfg.DEFAULT_CONFIG_FILE).write_text("[log]\njson = true\n")
    conf = parse([])
    assert conf["log.json"] is True
    assert conf.source == cfg.DEFAULT_CONFIG_FILE


def test_every_option_has_a_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for opt in cfg.OPTIONS:
        if isinstance(opt.default, bool):
            conf = parse([opt.cli_flag])
            assert conf[opt.key] is True
        elif opt.choices:
            conf = parse([opt.cli_flag, opt.choices[-1]])
            assert conf[opt.key] == opt.choices[-1]
        else:
            value = "7" if not isinstance(opt.default, str) else "x" * cfg.MIN_TOKEN_LENGTH
            conf = parse([opt.cli_flag, value])
            assert conf[opt.key] == type(opt.default)(value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[node]\nprot = 1\n", "unknown key 'node.prot'"),
        ("[node]\nport = 'abc'\n", "node.port must be int"),
        ('[commitlog]\nflush = "sometimes"\n', "commitlog.flush must be one of async, sync"),
        ("[retention]\nhours = -1\n", "retention.hours must not be negative"),
        ("port = 1\n", "must be a [section]"),
        ("[node\n", "not valid TOML"),
    ],
)
def test_bad_files_get_clear_errors(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(cfg.ConfigError, match=re.escape(message)):
        parse(["--config", str(path)])


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        parse(["--config", str(tmp_path / "nope.toml")])


def test_list_option_from_file_and_repeated_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "lg.toml"
    path.write_text('[bridge]\nrules = ["out tele/# cloud/", "in cmd/#"]\n')
    assert parse(["--config", str(path)])["bridge.rules"] == ["out tele/# cloud/", "in cmd/#"]
    flags = parse(["--config", str(path), "--rule", "both a/#", "--rule", "out b/#"])
    assert flags["bridge.rules"] == ["both a/#", "out b/#"]  # the flags replace the file's list
    assert parse([])["bridge.rules"] == []


@pytest.mark.parametrize("text", ['[bridge]\nrules = "out tele/#"\n', "[bridge]\nrules = [1, 2]\n"])
def test_list_option_must_be_a_list_of_strings(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(cfg.ConfigError, match=re.escape("bridge.rules must be a list of strings")):
        parse(["--config", str(path)])


def test_to_toml_round_trips_a_list_with_quotes():
    values = {o.key: o.default for o in cfg.OPTIONS} | {"bridge.rules": ['out "a b"/# \\x', "in c/#"]}
    data = tomllib.loads(cfg.to_toml(values))
    assert data["bridge"]["rules"] == ['out "a b"/# \\x', "in c/#"]


def test_to_toml_round_trips_defaults():
    defaults = {o.key: o.default for o in cfg.OPTIONS}
    data = tomllib.loads(cfg.to_toml(defaults))
    flat = {f"{s}.{k}": v for s, t in data.items() for k, v in t.items()}
    assert flat == defaults


def test_readme_documents_every_option():
    readme = (ROOT / "README.md").read_text()
    for opt in cfg.OPTIONS:
        assert f"`{opt.key}`" in readme and f"`{opt.cli_flag}`" in readme, opt.key
    assert "LIGHTGATE_<SECTION>_<KEY>" in readme and "**flag > environment > file > default**" in readme


def test_each_layer_overrides_the_next_flag_env_file_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "lg.toml"
    path.write_text('[node]\nport = 2000\nhost = "10.0.0.1"\n[log]\nlevel = "warning"\n')
    env = {"LIGHTGATE_NODE_PORT": "2001", "LIGHTGATE_LOG_LEVEL": "debug", "LIGHTGATE_COMMITLOG_FLUSH": "sync"}
    conf = parse(["--config", str(path), "--port", "2002"], env)
    assert conf["node.port"] == 2002  # flag over environment
    assert conf["log.level"] == "debug"  # environment over file
    assert conf["commitlog.flush"] == "sync"  # environment over default
    assert conf["node.host"] == "10.0.0.1"  # file over default
    assert conf["node.data"] == "./data"  # default
    assert conf.flags == {"node.port"}


def test_env_values_are_typed_like_the_file():
    env = {"LIGHTGATE_LOG_JSON": "true", "LIGHTGATE_RETENTION_HOURS": "1.5", "LIGHTGATE_STORE_LEASE_S": "2",
           "LIGHTGATE_BRIDGE_RULES": '["out tele/# cloud/", "in cmd/#"]', "LIGHTGATE_AUTH_ALLOW_ANONYMOUS": "false",
           "PATH_NOT_OURS": "x"}
    conf = parse([], env)
    assert conf["log.json"] is True and conf["retention.hours"] == 1.5 and conf["store.lease_s"] == 2.0
    assert conf["bridge.rules"] == ["out tele/# cloud/", "in cmd/#"]
    assert conf["auth.allow_anonymous"] == "false"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("LIGHTGATE_NODE_PORT", "abc", "environment variable LIGHTGATE_NODE_PORT: node.port must be int, not 'abc'"),
        ("LIGHTGATE_LOG_JSON", "maybe", "environment variable LIGHTGATE_LOG_JSON: log.json must be true or false"),
        ("LIGHTGATE_COMMITLOG_FLUSH", "never", "environment variable LIGHTGATE_COMMITLOG_FLUSH: commitlog.flush"
                                               " must be one of async, sync"),
        ("LIGHTGATE_BRIDGE_RULES", "out a/#", "environment variable LIGHTGATE_BRIDGE_RULES: bridge.rules must be a"
                                              " TOML array of strings"),
        ("LIGHTGATE_NODE_PROT", "1", "environment variable LIGHTGATE_NODE_PROT is no option"),
    ],
)
def test_bad_env_values_get_clear_errors_naming_the_variable(name, value, message):
    with pytest.raises(cfg.ConfigError, match=re.escape(message)):
        parse([], {name: value})


def test_every_option_has_its_own_env_variable():
    names = [opt.env for opt in cfg.OPTIONS]
    assert len(set(names)) == len(names)
    for opt in cfg.OPTIONS:
        assert opt.env == "LIGHTGATE_" + opt.section.upper() + "_" + opt.name.upper()


def test_reread_keeps_the_environment_under_the_flags(tmp_path):
    path = tmp_path / "lg.toml"
    path.write_text('[log]\nlevel = "error"\n[node]\nport = 2000\n')
    env = {"LIGHTGATE_NODE_PORT": "2001"}
    conf = parse(["--config", str(path)], env)
    path.write_text('[log]\nlevel = "warning"\n[node]\nport = 2005\n')
    again = cfg.reread(conf, env)
    assert again["log.level"] == "warning" and again["node.port"] == 2001
