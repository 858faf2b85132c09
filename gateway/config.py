"""Configuration: one TOML file, every key also a command-line flag, documented defaults.

The options are one table (``OPTIONS``). The TOML file, the flags, the
defaults printed by ``lightgate config`` and the table in the README all come
from it, so they cannot drift apart. Precedence: flag > file > default.

A key ``section.name`` is ``[section] name = ...`` in the file and
``--section-name`` on the command line, except for the few keys that operators
and scripts know by short names (``--host``, ``--port``, ``--data``).
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DEFAULT_CONFIG_FILE = "lightgate.toml"
"""Read from the working directory when present and no ``--config`` is given."""


class ConfigError(Exception):
    """A configuration file or value is invalid; the message says which key and why."""


@dataclass(frozen=True, slots=True)
class Option:
    key: str
    default: Any
    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.key.split(".", 1)[1]

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.key.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        return self.key.replace(".", "__")


MiB = 1024 * 1024

OPTIONS: tuple[Option, ...] = (
    Option("node.host", "127.0.0.1", "address the MQTT listener binds to", flag="--host"),
    Option("node.port", 1883, "MQTT listener port", flag="--port"),
    Option("node.data", "./data", "data directory (CommitLog, RocksDB)", flag="--data"),
    Option("log.level", "info", "log level", choices=("debug", "info", "warning", "error")),
    Option("log.json", False, "log JSON lines instead of human-readable text"),
    Option("commitlog.segment_bytes", 256 * MiB, "size of each CommitLog segment file"),
    Option("commitlog.max_record_bytes", 1 * MiB, "largest record accepted; larger appends are rejected"),
    Option("commitlog.flush", "async", "flush policy: async (periodic) or sync (group commit before ack)",
           choices=("async", "sync")),
    Option("commitlog.flush_interval_ms", 500, "async: how often to check for dirty data"),
    Option("commitlog.flush_min_bytes", 16 * 1024, "async: flush when at least this much is dirty"),
    Option("commitlog.flush_force_interval_ms", 10_000, "async: flush unconditionally this often"),
    Option("commitlog.sync_interval_ms", 10, "sync: longest a group commit waits to gather writers"),
    Option("mqtt.max_packet_size", 1 * MiB + 1024,
           "largest MQTT packet accepted (and advertised); room for a max-size record plus headers"),
    Option("mqtt.receive_maximum", 128, "inbound QoS 1/2 PUBLISHes a client may have unacknowledged (1..65535)"),
    Option("mqtt.connect_timeout_s", 10.0, "close connections that send no CONNECT within this"),
    Option("mqtt.max_keepalive", 0, "longest keep alive granted to MQTT 5 clients, told as Server Keep Alive"
           " (0 = grant what the client asks)"),
    Option("mqtt.sys_interval_s", 10.0, "publish the $SYS/broker/... statistics this often (0 = never)"),
    Option("retention.hours", 72.0, "delete sealed segments older than this"),
    Option("retention.max_bytes", 0, "delete oldest sealed segments beyond this total (0 = no limit)"),
    Option("retention.check_interval_s", 60.0, "how often retention runs"),
    Option("auth.password_file", "", "password file of user:argon2-hash lines (`lightgate passwd`); empty = none"),
    Option("auth.allow_anonymous", "auto", "accept clients without a user name; auto = only when no password file",
           choices=("auto", "true", "false")),
    Option("auth.acl_file", "", "ACL file (docs/security.md); empty = every client may publish and subscribe anywhere"),
    Option("auth.failure_delay_s", 1.0, "wait before refusing bad credentials; doubles per failure of a source, to 5 s"),
)

_BY_KEY = {o.key: o for o in OPTIONS}


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration: a flat mapping of ``section.name`` to value."""

    values: dict[str, Any]
    source: str | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def section(self, name: str) -> dict[str, Any]:
        """The keys of one section without their prefix, e.g. ``section("commitlog")``."""
        prefix = name + "."
        return {k[len(prefix):]: v for k, v in self.values.items() if k.startswith(prefix)}


def _coerce(opt: Option, value: Any, where: str) -> Any:
    kind = type(opt.default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: {opt.key} must be true or false, not {value!r}")
    if opt.choices and isinstance(value, bool):
        value = "true" if value else "false"  # `allow_anonymous = true` in TOML means the choice "true"
    try:
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        result = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {opt.key} must be {kind.__name__}, not {value!r}") from None
    if opt.choices and result not in opt.choices:
        raise ConfigError(f"{where}: {opt.key} must be one of {', '.join(opt.choices)}, not {value!r}")
    if kind in (int, float) and result < 0:
        raise ConfigError(f"{where}: {opt.key} must not be negative, not {value!r}")
    return result


def load_file(path: Path) -> dict[str, Any]:
    """Read a TOML file into flat ``section.name`` keys; unknown keys are errors."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in _BY_KEY:
                raise ConfigError(f"{path}: unknown key {key!r} (see `lightgate config --defaults`)")
            flat[key] = _coerce(_BY_KEY[key], value, str(path))
    return flat


def add_arguments(parser: argparse.ArgumentParser, keys: Callable[[Option], bool] = lambda o: True) -> None:
    """Add ``--config`` and one flag per option; unset flags stay ``None``."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML configuration file (default: ./{DEFAULT_CONFIG_FILE} if present)")
    group = parser.add_argument_group("configuration (each flag overrides its key in the file)")
    for opt in OPTIONS:
        if not keys(opt):
            continue
        if isinstance(opt.default, bool):
            group.add_argument(opt.cli_flag, dest=opt.dest, default=None,
                               action=argparse.BooleanOptionalAction, help=f"{opt.help} [{opt.key}]")
        else:
            group.add_argument(opt.cli_flag, dest=opt.dest, default=None, metavar=type(opt.default).__name__.upper(),
                               choices=opt.choices, help=f"{opt.help} (default {opt.default!r}) [{opt.key}]")


def resolve(args: argparse.Namespace) -> Config:
    """Merge defaults, the configuration file and the flags into a Config."""
    values = {o.key: o.default for o in OPTIONS}
    source = getattr(args, "config", None)
    if source is None and Path(DEFAULT_CONFIG_FILE).is_file():
        source = DEFAULT_CONFIG_FILE
    if source is not None:
        values.update(load_file(Path(source)))
    for opt in OPTIONS:
        flag_value = getattr(args, opt.dest, None)
        if flag_value is not None:
            values[opt.key] = _coerce(opt, flag_value, opt.cli_flag)
    return Config(values, source)


def to_toml(values: dict[str, Any]) -> str:
    """Render flat values as a TOML document, one table per section, with help comments."""
    lines: list[str] = []
    section = None
    for opt in OPTIONS:
        if opt.section != section:
            section = opt.section
            lines.append(("\n" if lines else "") + f"[{section}]")
        value = values[opt.key]
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        lines.append(f"{opt.name} = {text}  # {opt.help}")
    return "\n".join(lines) + "\n"
