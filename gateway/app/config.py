"""Configuration: one TOML file, every key also an environment variable and a command-line flag, documented defaults.

The options are one table (``OPTIONS``). The TOML file, the variables, the
flags, the defaults printed by ``lightgate config`` and the table in the README
all come from it, so they cannot drift apart. Precedence: flag > environment >
file > default.

A key ``section.name`` is ``[section] name = ...`` in the file,
``LIGHTGATE_SECTION_NAME`` in the environment (containers configure that way) and
``--section-name`` on the command line, except for the few keys that operators
and scripts know by short names (``--host``, ``--port``, ``--data``).
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DEFAULT_CONFIG_FILE = "lightgate.toml"
"""Read from the working directory when present and no ``--config`` is given."""

ENV_PREFIX = "LIGHTGATE_"
"""Environment variables starting with it are options (``LIGHTGATE_NODE_PORT``); one no option has is an error,
as an unknown key in the file is, so a misspelt variable does not silently leave its default."""


class ConfigError(Exception):
    """A configuration file or value is invalid; the message says which key and why."""


@dataclass(frozen=True, slots=True)
class Option:
    key: str
    default: Any
    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    secret: bool = False  # a token or password: `lightgate config` and the logs show REDACTED instead

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

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.replace(".", "_").upper()


MiB = 1024 * 1024

OPTIONS: tuple[Option, ...] = (
    Option("node.host", "127.0.0.1", "address the MQTT listener binds to", flag="--host"),
    Option("node.port", 1883, "MQTT listener port", flag="--port"),
    Option("node.data", "./data", "data directory (CommitLog, RocksDB)", flag="--data"),
    Option("store.listen", "127.0.0.1:7883", "HOST:PORT the store node serves gateways on (`lightgate store`;"
           " port 0 = a free one, logged)", flag="--listen"),
    Option("gateway.store", "127.0.0.1:7883", "HOST:PORT of the store node a cluster gateway uses"
           " (`lightgate gateway`); a replicated store: its replicas' HOST:PORT,HOST:PORT,... (the leader is found and followed)",
           flag="--store"),
    Option("store.lease_s", 5.0, "a gateway node's lease (`lightgate store`): silent this long, its clients' wills"
           " are published and the node must drop them when it returns (docs/cluster.md)"),
    Option("store.metrics_port", 0, "a store replica's HTTP port for its own Prometheus /metrics (role, epoch, lag,"
           " in-sync set), on store.listen's host; 0 = off (`lightgate store` with replication.group; docs/operations.md)"),
    Option("store.failover_wait_s", 10.0, "a cluster gateway's store call that finds no store connection (a store"
           " restart, a new leader: a publish, a pull, a PUBREL, a CONNECT...) waits for the next one until this long"
           " after the break instead of failing at once; 0 = fail at once (`lightgate gateway`, docs/cluster.md)"),
    Option("store.token", "", "shared secret of gateway nodes and their store node (set the same on both), at least"
           " 16 characters; required on a store with auth.* set; empty = none (docs/cluster.md)", secret=True),
    Option("replication.group", "", "the store group this `lightgate store` is a replica of (empty = an"
           " unreplicated store; docs/cluster.md, \"Replicated store\")"),
    Option("replication.name", "", "this replica's name in its group (required with replication.group; stable across"
           " restarts: its data directory is this replica's copy)"),
    Option("replication.replicas", [], "the group's replica names, used when the group is first created (later"
           " `lightgate store add-replica` / `remove-replica` change it in etcd)", flag="--replica"),
    Option("replication.etcd", ["http://127.0.0.1:2379"], "client URLs of the etcd members that are the group's"
           " controller", flag="--etcd"),
    Option("replication.acks", "quorum", "when a write is acknowledged: leader (its own log), quorum (every in-sync"
           " replica, and they are a majority), all (every replica) (docs/storage.md, \"Replication\")",
           choices=("leader", "quorum", "all")),
    Option("replication.lease_s", 3.0, "the etcd lease of a replica: a leader silent this long is replaced"),
    Option("replication.leader_lease_s", 2.0, "a leader acknowledges nothing once this long has passed since its last"
           " successful etcd keep-alive (below replication.lease_s, so it stops before a new leader can be elected)"),
    Option("replication.max_lag_s", 3.0, "a follower this far behind the leader leaves the in-sync set"),
    Option("replication.unclean_election", False, "let a replica outside the in-sync set be elected when no member of"
           " it is alive: the group serves again, but acknowledged messages it lacks are lost"),
    Option("gateway.workers", 1, "gateway processes sharing the MQTT port (SO_REUSEPORT); worker i serves its admin"
           " API on admin.port + i", flag="--workers"),
    Option("tls.port", 0, "MQTT over TLS listener port (0 = off; 8883 is the usual one); a free port when node.port is 0"),
    Option("tls.host", "", "address the TLS listener binds to; empty = node.host"),
    Option("tls.certfile", "", "PEM certificate (chain) of the tls and wss listeners"),
    Option("tls.keyfile", "", "PEM private key of tls.certfile (not encrypted)"),
    Option("tls.cafile", "", "PEM CA certificates that client certificates must chain to; empty = none asked for"),
    Option("tls.require_client_cert", False, "refuse TLS handshakes without a client certificate (mTLS)"),
    Option("ws.port", 0, "MQTT over WebSocket listener port (0 = off); a free port when node.port is 0"),
    Option("ws.host", "", "address the WebSocket listener binds to; empty = node.host"),
    Option("ws.path", "/mqtt", "HTTP path of the ws and wss listeners"),
    Option("wss.port", 0, "MQTT over secure WebSocket listener port (0 = off; uses the tls.* certificate);"
           " a free port when node.port is 0"),
    Option("wss.host", "", "address the secure WebSocket listener binds to; empty = node.host"),
    Option("log.level", "info", "log level", choices=("debug", "info", "warning", "error")),
    Option("log.json", False, "log JSON lines instead of human-readable text"),
    Option("commitlog.segment_bytes", 256 * MiB, "size of each CommitLog segment file"),
    Option("commitlog.max_record_bytes", 1 * MiB, "largest record accepted; larger appends are rejected"),
    Option("commitlog.batch_compression", "zstd", "batch records' bodies as zstd frames when that saves an eighth or"
           " more (off = always raw; docs/storage.md, \"Compressed batch bodies\")", choices=("off", "zstd")),
    Option("commitlog.flush", "async", "flush policy: async (periodic) or sync (group commit before ack)",
           choices=("async", "sync")),
    Option("commitlog.flush_interval_ms", 500, "async: how often to check for dirty data"),
    Option("commitlog.flush_min_bytes", 16 * 1024, "async: flush when at least this much is dirty"),
    Option("commitlog.flush_force_interval_ms", 10_000, "async: flush unconditionally this often"),
    Option("commitlog.sync_interval_ms", 10, "sync: longest a group commit waits to gather writers"),
    Option("mqtt.max_packet_size", 1 * MiB + 1024,
           "largest MQTT packet accepted (and advertised); room for a max-size record plus headers"),
    Option("mqtt.max_connect_size", 128 * 1024, "largest CONNECT accepted (at most mqtt.max_packet_size): bounds what"
           " a client not yet authenticated can make the node buffer"),
    Option("mqtt.receive_maximum", 128, "inbound QoS 1/2 PUBLISHes a client may have unacknowledged (1..65535)"),
    Option("mqtt.inflight_311", 4096, "QoS 1/2 messages in flight to an MQTT 3.1.1 client before it acknowledges"
           " (MQTT 5 clients set theirs with Receive Maximum) (1..65535)"),
    Option("mqtt.connect_timeout_s", 10.0, "close connections that send no CONNECT within this"),
    Option("mqtt.max_keepalive", 0, "longest keep alive granted to MQTT 5 clients, told as Server Keep Alive"
           " (0 = grant what the client asks)"),
    Option("mqtt.sys_interval_s", 10.0, "publish the $SYS/broker/... statistics this often (0 = never)"),
    Option("mqtt.shared_invisible_s", 30.0, "a shared subscription's QoS 1/2 message not acknowledged by its member"
           " within this goes to another member (> 0)"),
    Option("retention.hours", 72.0, "delete sealed segments older than this"),
    Option("retention.max_bytes", 0, "delete oldest sealed segments beyond this total (0 = no limit)"),
    Option("retention.check_interval_s", 60.0, "how often retention runs"),
    Option("tier.uri", "", "Parquet tier of sealed segments: a directory or a pyarrow.fs URI (file://, s3://...);"
           " empty = no tier (docs/storage.md)"),
    Option("tier.retention_hours", 0.0, "delete tier files whose newest record is older than this (0 = keep)"),
    Option("tier.cpu_share", 0.25, "share of one core the tier conversion may use (0 < share <= 1)"),
    Option("tier.check_interval_s", 10.0, "how often the tier looks for newly sealed segments"),
    Option("auth.password_file", "", "password file of user:hash lines (argon2id by `lightgate passwd`, or "
                                     "mosquitto_passwd's); empty = none"),
    Option("auth.allow_anonymous", "auto", "accept clients without a user name; auto = only when no password file",
           choices=("auto", "true", "false")),
    Option("auth.acl_file", "", "ACL file (docs/security.md); empty = every client may publish and subscribe anywhere"),
    Option("auth.acl_wildcard_mode", "filter", "a wildcard subscription overlapping a deny rule: filter = granted,"
           " the denied topics withheld at delivery (as Mosquitto, EMQX); refuse = refused (SUBACK 0x80 / 0x87)",
           choices=("filter", "refuse")),
    Option("auth.failure_delay_s", 1.0, "wait before refusing bad credentials; doubles per failure of a source, to 5 s"),
    Option("auth.use_identity_as_username", False, "the CN of the verified client certificate is the user name"
           " (no password); clients without one are refused"),
    Option("limits.max_connections", 0, "open connections allowed at once over all listeners (0 = no cap)"),
    Option("limits.connect_rate", 0.0, "connects per second allowed per source address (0 = no limit)"),
    Option("limits.connect_burst", 10, "connects a source address may make at once when under its rate (at least 1)"),
    Option("limits.max_topic_length", 4096, "longest topic name or filter a client may use, UTF-8 bytes (1..65535)"),
    Option("limits.max_topic_levels", 128, "most levels in a topic name or filter a client may use (1..128)"),
    Option("limits.max_subscriptions", 1024, "subscriptions a session may hold (0 = no limit)"),
    Option("limits.publish_rate", 0.0, "PUBLISHes per second allowed per connection (0 = no limit)"),
    Option("limits.publish_burst", 0.0, "PUBLISHes a connection may send at once under its rate"
           " (0 = one second's worth)"),
    Option("limits.publish_bytes_rate", 0.0, "PUBLISH payload bytes per second allowed per connection (0 = no limit)"),
    Option("limits.max_user_properties", 32, "User Properties one property block of a received packet may hold"
           " (0 = no limit)"),
    Option("limits.max_user_property_bytes", 8192, "bytes the User Properties of one property block of a received"
           " packet may take (0 = no limit)"),
    Option("limits.qos0_queue_bytes", 0, "delivery bytes a session may have waiting for its socket before new"
           " QoS 0 messages to it are dropped (0 = no limit)"),
    Option("limits.outbound_bytes", 1024 * 1024, "delivery bytes a connection may have waiting for its socket; beyond"
           " them it is sent nothing more until the socket takes them, its messages wait in their queues (0 = no"
           " limit)"),
    Option("delayed.max_delay_s", 7 * 24 * 3600, "longest delay of a PUBLISH to $delayed/<seconds>/<topic>; a longer"
           " one is refused (docs/operations.md, \"Delayed delivery\")"),
    Option("delayed.max_pending_per_client", 10_000, "delayed messages a client may have pending; more are refused"
           " (MQTT 5: 0x97, 3.1.1: the connection closes) (0 = no limit)"),
    Option("admin.host", "127.0.0.1", "address the admin HTTP listener (metrics, health, admin API, dashboard) binds to"),
    Option("admin.port", 18083, "admin HTTP port (0 = off); a free port when node.port is 0"),
    Option("admin.max_connections", 32, "admin HTTP connections open at once (0 = no cap); at the cap a new one"
           " closes the one idle longest, and is answered 503 only while a request is answered on every other"),
    Option("admin.header_timeout_s", 5.0, "seconds a new admin HTTP connection has to send its request line and"
           " headers (a kept-alive one: from the first byte of its next request) before it is closed"),
    Option("admin.token", "", "bearer token the admin API and dashboard data require, at least 16 characters;"
           " empty = none (/metrics, /healthz, /readyz never need it)", secret=True),
    Option("bridge.remote_host", "", "broker `lightgate bridge` mirrors topics to and from (required by the bridge)"),
    Option("bridge.remote_port", 1883, "MQTT port of the remote broker (8883 is the usual TLS one)"),
    Option("bridge.remote_username", "", "the bridge's user name on the remote broker; empty = none"),
    Option("bridge.remote_password", "", "the bridge's password on the remote broker", secret=True),
    Option("bridge.remote_tls", False, "connect to the remote broker over TLS"),
    Option("bridge.remote_cafile", "", "PEM CA certificates that verify the remote broker; empty = the system's"),
    Option("bridge.local_username", "", "the bridge's user name on this node (node.host:node.port); empty = none"),
    Option("bridge.local_password", "", "the bridge's password on this node", secret=True),
    Option("bridge.client_id", "lightgate-bridge", "the bridge's client id on both brokers (names its persistent"
           " sessions: one per bridge)"),
    Option("bridge.rules", [], "bridge rule 'DIRECTION PATTERN [REMOTE_PREFIX [LOCAL_PREFIX]]', DIRECTION out, in"
           " or both (docs/bridge.md)", flag="--rule"),
    Option("bridge.session_expiry_s", 86400, "how long each broker keeps the bridge's session and queued messages"
           " while it is away (MQTT 5)"),
    Option("bridge.stats_interval_s", 60.0, "log the bridge's counters this often (0 = only at exit)"),
)

_BY_KEY = {o.key: o for o in OPTIONS}

REDACTED = "<redacted>"
"""What `lightgate config` and the logs show instead of a secret."""

TOKEN_KEYS = ("store.token", "admin.token")
"""The secrets LightGate alone checks, so the operator makes them up for it: each must be ``MIN_TOKEN_LENGTH`` long.
The bridge's passwords are accounts' passwords (of the remote broker, of the password file), whose rules are set
where the account is; a password in ``tier.uri`` is the object store's."""

MIN_TOKEN_LENGTH = 16
"""Characters a token needs at least. ``openssl rand -hex 16`` gives 32; 16 random characters of even the hex
alphabet are 64 bits, past guessing over the network (the store answers a wrong token after a delay, the admin
API at HTTP speed). A shorter value is most likely a placeholder left in (``t``, ``changeme``): refused at start
rather than run with."""

CREDENTIAL_URI_KEYS = ("tier.uri",)
"""Keys whose value is a URI that may carry a password (``s3://KEY_ID:SECRET@bucket/prefix``, as pyarrow.fs takes
it): that password is a secret, the rest of the URI is not."""
_BY_ENV = {o.env: o for o in OPTIONS}


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration: a flat mapping of ``section.name`` to value.

    ``source`` is the configuration file read (None: none); ``flags`` the keys the command line set.
    """

    values: dict[str, Any]
    source: str | None = None
    flags: frozenset[str] = frozenset()

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def section(self, name: str) -> dict[str, Any]:
        """The keys of one section without their prefix, e.g. ``section("commitlog")``."""
        prefix = name + "."
        return {k[len(prefix):]: v for k, v in self.values.items() if k.startswith(prefix)}


def _coerce(opt: Option, value: Any, where: str) -> Any:
    kind = type(opt.default)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{where}: {opt.key} must be a list of strings, not {value!r}")
        return list(value)
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


def load_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read the ``LIGHTGATE_*`` variables into flat ``section.name`` keys.

    A list option's variable is a TOML array (``LIGHTGATE_BRIDGE_RULES='["out tele/# cloud/"]'``).

    Raises:
        ConfigError: a variable names no option, or its value does not fit the option; the message names the variable.
    """
    flat: dict[str, Any] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        opt = _BY_ENV.get(name)
        if opt is None:
            raise ConfigError(f"environment variable {name} is no option (see `lightgate config --defaults`;"
                              f" LIGHTGATE_<SECTION>_<KEY>, e.g. {OPTIONS[1].env})")
        value: Any = text
        if isinstance(opt.default, list):
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise ConfigError(f"environment variable {name}: {opt.key} must be a TOML array of strings"
                                  f" (e.g. '[\"a\", \"b\"]'), not {text!r}") from None
        flat[opt.key] = _coerce(opt, value, f"environment variable {name}")
    return flat


COMMAND_KEYS: dict[str, tuple[str, ...]] = {
    "serve": ("node", "tls", "ws", "wss", "log", "commitlog", "mqtt", "retention", "tier", "auth", "limits", "admin",
              "delayed"),
    "store": ("node.data", "store", "replication", "log", "commitlog", "retention", "tier", "auth.password_file",
              "auth.allow_anonymous", "auth.acl_file", "auth.failure_delay_s", "delayed.max_pending_per_client"),
    "gateway": ("node.host", "node.port", "gateway", "store.token", "store.failover_wait_s", "tls", "ws", "wss", "log",
                "mqtt", "auth", "limits", "admin", "delayed.max_delay_s"),
    "repair": ("node.data", "log", "commitlog"),
    "dump": ("node.data", "log"),
    "snapshot": ("node.data", "log", "commitlog"),
    "bridge": ("node.host", "node.port", "log", "bridge"),
}
"""The keys each node command reads (a section stands for all its keys): its ``--help`` shows only their flags,
and another command's flag is an error, not silently ignored. ``lightgate config`` takes every flag. The file and
the environment may hold every key: one file serves every command of a deployment."""


def uses(command: str | None, opt: Option) -> bool:
    """Whether ``command`` reads ``opt`` (None, or a command not in ``COMMAND_KEYS``: every option)."""
    scope = COMMAND_KEYS.get(command or "")
    return scope is None or opt.section in scope or opt.key in scope


def add_arguments(parser: argparse.ArgumentParser, command: str | None = None) -> None:
    """Add ``--config`` and one flag per option ``command`` uses, grouped by section; unset flags stay ``None``."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"TOML configuration file (default: ./{DEFAULT_CONFIG_FILE} if present); each flag"
                             " below overrides its [key] given by the environment, which overrides the file")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in OPTIONS:
        if not uses(command, opt):
            continue
        group = groups.get(opt.section)
        if group is None:
            group = groups[opt.section] = parser.add_argument_group(
                f"[{opt.section}] (environment {ENV_PREFIX}{opt.section.upper()}_<KEY>)")
        if isinstance(opt.default, bool):
            group.add_argument(opt.cli_flag, dest=opt.dest, default=None,
                               action=argparse.BooleanOptionalAction, help=f"{opt.help} [{opt.key}]")
        elif isinstance(opt.default, list):
            group.add_argument(opt.cli_flag, dest=opt.dest, default=None, action="append", metavar="STR",
                               help=f"{opt.help}; repeat for more, replaces the file's list [{opt.key}]")
        else:
            group.add_argument(opt.cli_flag, dest=opt.dest, default=None, metavar=type(opt.default).__name__.upper(),
                               choices=opt.choices, help=f"{opt.help} (default {opt.default!r}) [{opt.key}]")


def misplaced_flag(command: str, unknown: list[str]) -> str | None:
    """The error for the first of ``unknown`` (arguments the command's parser did not take) that is another
    command's option flag, naming the flag, the command and the commands that take it; None: there is none."""
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        for opt in OPTIONS:
            if flag in (opt.cli_flag, "--no-" + opt.cli_flag[2:]) and not uses(command, opt):
                takers = ", ".join(name for name in COMMAND_KEYS if uses(name, opt))
                return (f"{flag} does not apply to lightgate {command}: it sets {opt.key}, which {command} does"
                        f" not use (used by: {takers}, config)")
    return None


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Config:
    """Merge defaults, the configuration file, the environment and the flags, in this order, into a Config.

    Raises:
        ConfigError: a file, variable or flag is invalid, or a token is too short (``check_tokens``).
    """
    source = getattr(args, "config", None)
    if source is None and Path(DEFAULT_CONFIG_FILE).is_file():
        source = DEFAULT_CONFIG_FILE
    values = _below_flags(source, environ)
    flags = set()
    for opt in OPTIONS:
        flag_value = getattr(args, opt.dest, None)
        if flag_value is not None:
            values[opt.key] = _coerce(opt, flag_value, opt.cli_flag)
            flags.add(opt.key)
    check_tokens(values)
    return Config(values, source, frozenset(flags))


def reread(conf: Config, environ: Mapping[str, str] = os.environ) -> Config:
    """The configuration as a running node sees it on SIGHUP: its file read again, its environment and flags
    as they were (a process's environment does not change from outside).

    Raises:
        ConfigError: the file is gone or no longer valid (the caller keeps ``conf``).
    """
    values = _below_flags(conf.source, environ)
    values.update({key: conf.values[key] for key in conf.flags})
    check_tokens(values)
    return Config(values, conf.source, conf.flags)


def check_tokens(values: Mapping[str, Any]) -> None:
    """Refuse a token (``TOKEN_KEYS``) that is set but shorter than ``MIN_TOKEN_LENGTH``.

    Raises:
        ConfigError: naming the key, its flag and its variable (never the value).
    """
    for key in TOKEN_KEYS:
        token = values.get(key, "")
        if 0 < len(token) < MIN_TOKEN_LENGTH:
            opt = _BY_KEY[key]
            raise ConfigError(f"{key} ({opt.cli_flag}, {opt.env}) is {len(token)} characters long: a token needs at"
                              f" least {MIN_TOKEN_LENGTH} (e.g. `openssl rand -hex 16`)")


def _below_flags(source: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults, overridden by the file ``source`` (None: no file), overridden by the environment."""
    values = {o.key: o.default for o in OPTIONS}
    if source is not None:
        values.update(load_file(Path(source)))
    values.update(load_env(environ))
    return values


def non_defaults(conf: Config, command: str) -> dict[str, Any]:
    """The keys ``command`` uses whose value is not the default, secrets redacted: the node commands log them
    at start, so a log says how the node was configured."""
    shown = redacted(conf.values)
    return {o.key: shown[o.key] for o in OPTIONS if uses(command, o) and conf.values[o.key] != o.default}


def redacted(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every secret key's value shown as ``REDACTED`` (empty ones stay empty: none is set), and the
    password of each credential URI (``CREDENTIAL_URI_KEYS``)."""
    shown = dict(values)
    for opt in OPTIONS:
        if opt.secret and shown.get(opt.key):
            shown[opt.key] = REDACTED
    for key in CREDENTIAL_URI_KEYS:
        if shown.get(key):
            shown[key] = without_uri_passwords(shown[key])
    return shown


URI_PASSWORD = re.compile(r"(?P<before>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*:)\S+@")
"""The password of a URI's userinfo (``scheme://user:PASSWORD@host``): up to the last ``@`` before a blank, since an
object store's secret key pasted unencoded may hold ``/`` and ``@`` (more is hidden rather than some of it shown)."""


def without_uri_passwords(text: str) -> str:
    """``text`` with the password of every URI in it replaced by ``REDACTED``, the rest as it was: a position
    known to hold a secret, wherever the URI is quoted (an option, an error message)."""
    return URI_PASSWORD.sub(lambda m: m["before"] + REDACTED + "@", text)


def to_toml(values: dict[str, Any]) -> str:
    """Render flat values as a TOML document, one table per section, with help comments."""
    lines: list[str] = []
    sections: dict[str, list[Option]] = {}  # first appearance order: a section is one table even if split in OPTIONS
    for opt in OPTIONS:
        sections.setdefault(opt.section, []).append(opt)
    for section, options in sections.items():
        lines.append(("\n" if lines else "") + f"[{section}]")
        for opt in options:
            lines.append(f"{opt.name} = {_toml_value(values[opt.key])}  # {opt.help}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_string(item) for item in value) + "]"
    return repr(value)


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
