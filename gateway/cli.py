"""The ``lightgate`` command: one entry point, one subcommand per job.

Every subcommand that runs a node takes the same configuration flags (see
gateway/config.py); ``lightgate config`` prints the effective configuration.
Heavy imports (trio, RocksDB, Spark) happen inside the subcommand that needs
them, so ``lightgate --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from gateway import config as cfg
from gateway.logs import setup_logging

LOG = logging.getLogger("lightgate")

BENCHMARKS = {
    "store": ("bench.store", "CommitLog appends (async and sync group commit) next to the raw disk"),
    "index": ("bench.index", "light queues: dispatch rate, filter match, pull latency, bytes per message"),
    "analytics": ("bench.analytics", "rows/s of the Spark per-device telemetry aggregation"),
    "fanin": ("bench.fanin", "many publishers -> one tele/# subscriber, as fast as possible"),
    "fanin-rate": ("bench.fanin_rate", "fan-in at a fixed 5,000 msg/s, QoS 1: loss and latency"),
    "fanout": ("bench.fanout", "one publisher -> 1,000 subscribers on cmd/+ and cmd/broadcast"),
    "conns": ("bench.conns", "idle connections: broker memory per connection"),
}
"""``lightgate bench NAME`` -> (module with ``add_arguments(parser)`` and ``run(args) -> dict``, help).

The modules import trio, the store and the load generator; they are imported
only when the command is ``bench``, so other commands start without them."""


def _cmd_serve(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.node import run_gateway_node

    LOG.info("starting embedded node", extra={"ctx": {"data": conf["node.data"]}})
    return run_gateway_node(conf)


def _cmd_store(args: argparse.Namespace, conf: cfg.Config) -> int:
    from store.node import run_store_node

    LOG.info("starting store node", extra={"ctx": {"data": conf["node.data"]}})
    return run_store_node(conf)


def _cmd_config(args: argparse.Namespace, conf: cfg.Config) -> int:
    values = {o.key: o.default for o in cfg.OPTIONS} if args.defaults else conf.values
    sys.stdout.write(cfg.to_toml(values))
    return 0


def _cmd_bench(args: argparse.Namespace, conf: cfg.Config) -> int:
    from bench.common import emit

    names = list(BENCHMARKS) if args.bench == "all" else [args.bench]
    for name in names:
        module = importlib.import_module(BENCHMARKS[name][0])
        if args.bench == "all":
            sub = argparse.ArgumentParser(prog=f"lightgate bench {name}")
            module.add_arguments(sub)
            bench_args = sub.parse_args([])
        else:
            bench_args = args
        emit(name, module.run(bench_args))
    return 0


def _cmd_analytics(args: argparse.Namespace, conf: cfg.Config) -> int:
    from spark_analytics.cli import run

    return run(args)


def _read_new_password(args: argparse.Namespace) -> str:
    """The new password: the first line of stdin with ``--password-stdin``, else typed twice without echo."""
    if args.password_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    import getpass

    first = getpass.getpass(f"New password for {args.user}: ")
    if getpass.getpass("Repeat the password: ") != first:
        raise ValueError("the two passwords differ; nothing was changed")
    return first


def _cmd_passwd(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.passwords import PasswordFile, validate_username

    try:
        validate_username(args.user)
        passwords = PasswordFile.load(args.file) if args.delete else PasswordFile.load_or_empty(args.file)
        if args.delete:
            passwords.remove(args.user)
            done = f"removed user {args.user!r} from {args.file}"
        else:
            new = passwords.set_password(args.user, _read_new_password(args))
            done = (f"added user {args.user!r} to {args.file}" if new
                    else f"changed the password of {args.user!r} in {args.file}")
        passwords.save()
    except EOFError:  # stdin closed at the prompt
        sys.stderr.write("lightgate passwd: no password given; nothing was changed\n")
        return 1
    except KeyError as exc:  # no such user to remove
        sys.stderr.write(f"lightgate passwd: {exc.args[0]}\n")
        return 1
    except ValueError as exc:  # a bad user name or password, or PasswordFileError (a bad or unwritable file)
        sys.stderr.write(f"lightgate passwd: {exc}\n")
        return 1
    sys.stdout.write(f"lightgate passwd: {done}\n")
    return 0


def _cmd_simulate(args: argparse.Namespace, conf: cfg.Config) -> int:
    from bench.simulate import run

    return run(args)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``argv`` says whether the benchmarks' own flags are needed."""
    parser = argparse.ArgumentParser(
        prog="lightgate",
        description="LightGate: an MQTT gateway for IoT fleets over read-amplified storage.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def node_command(name: str, help_text: str, handler: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        cfg.add_arguments(p)
        p.set_defaults(handler=handler)
        return p

    node_command("serve", "run the embedded node (gateway, store, dispatch, notify in one process)", _cmd_serve)
    node_command("store", "run a store node (CommitLog, RocksDB light queues, dispatch, retention)", _cmd_store)
    p = node_command("config", "print the effective configuration as TOML", _cmd_config)
    p.add_argument("--defaults", action="store_true", help="print the built-in defaults instead")

    p = sub.add_parser("passwd", help="add a user, change a password, or remove a user in a password file",
                       description="Add USER to FILE (created with mode 0600 if missing) or change their password; "
                                   "exit 0 on success, 1 with the reason on stderr otherwise.")
    p.add_argument("file", metavar="FILE", help="the password file (auth.password_file)")
    p.add_argument("user", metavar="USER", help="the user name (no ':' and no control characters)")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--password-stdin", action="store_true",
                        help="read the password from the first line of standard input (for scripts)")
    action.add_argument("--delete", action="store_true", help="remove USER instead")
    p.set_defaults(handler=_cmd_passwd)

    p = sub.add_parser("bench", help="run a benchmark (prints a BENCH <json> line per benchmark)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    bench_sub.add_parser("all", help="every benchmark with its default sizes")
    for name, (module_name, help_text) in BENCHMARKS.items():
        bp = bench_sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or argv[:1] == ["bench"]:
            importlib.import_module(module_name).add_arguments(bp)
    p.set_defaults(handler=_cmd_bench)

    p = sub.add_parser("analytics", help="Spark aggregation of device telemetry read from the CommitLog")
    from spark_analytics.cli import add_arguments as add_analytics_arguments

    add_analytics_arguments(p)
    p.set_defaults(handler=_cmd_analytics)

    p = sub.add_parser("simulate", help="a fleet of paho-mqtt devices against any MQTT broker: throughput, "
                                        "latency percentiles, lost messages")
    from bench.simulate import add_arguments as add_simulate_arguments

    add_simulate_arguments(p)
    p.set_defaults(handler=_cmd_simulate)

    parser.add_argument("--version", action="version", version="lightgate 0.1.0")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, set up logging once, run the subcommand; return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        conf = cfg.resolve(args)
    except cfg.ConfigError as exc:
        parser.exit(2, f"lightgate: configuration error: {exc}\n")
    setup_logging(conf["log.level"], conf["log.json"])
    return args.handler(args, conf)


if __name__ == "__main__":
    sys.exit(main())
