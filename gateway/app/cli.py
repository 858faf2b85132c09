"""The ``lightgate`` command: one entry point, one subcommand per job.

Every subcommand that runs a node takes the same configuration flags (see
gateway/app/config.py); ``lightgate config`` prints the effective configuration.
Heavy imports (trio, RocksDB, Spark) happen inside the subcommand that needs
them, so ``lightgate --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable

from gateway import __version__

from gateway.app import extras
from gateway.app import config as cfg
from gateway.app.logs import setup_logging

if TYPE_CHECKING:
    from gateway.app.reload import Reloader
    from store.rpc.access import StoreAccess

LOG = logging.getLogger("lightgate")

BENCHMARKS = {
    "store": ("gateway.bench.store", "CommitLog appends (async and sync group commit) next to the raw disk"),
    "codec": ("gateway.bench.codec", "the per-message codec work in one process: PUBLISH decode and encode, record "
                                     "encode and decode; says whether the compiled codec modules were loaded"),
    "index": ("gateway.bench.index", "light queues: dispatch rate, filter match, pull latency, bytes per message"),
    "produce": ("gateway.bench.produce", "back-end producers, embedded and over the RPC: single sends vs send_batch vs "
                                         "AutoBatch with a consumer group reading: produced/s, consumed/s, p99, bytes, CPU"),
    "compression": ("gateway.bench.compression", "batch records raw vs zstd bodies (commitlog.batch_compression), "
                                                 "telemetry JSON and random bytes: log bytes, CPU to append and read"),
    "pop": ("gateway.bench.pop", "POP vs claim/ack consumer groups with hung and crashed members: delivered/s, lost, "
                                 "redelivered, dead-lettered, publish-to-ack p99"),
    "timers": ("gateway.bench.timers", "delayed messages: scheduling and dequeue rates, lateness, RSS and disk pending"),
    "analytics": ("gateway.bench.analytics", "rows/s of the Spark per-device telemetry aggregation"),
    "fanin": ("gateway.bench.fanin", "many publishers -> one tele/# subscriber, as fast as possible"),
    "fanin-rate": ("gateway.bench.fanin_rate", "fan-in at a fixed 5,000 msg/s, QoS 1: loss and latency"),
    "fanout": ("gateway.bench.fanout", "one publisher -> 1,000 subscribers on cmd/+ and cmd/broadcast"),
    "conns": ("gateway.bench.conns", "idle connections: broker memory per connection"),
    "churn": ("gateway.bench.churn", "persistent sessions publishing, disconnecting and resuming: connects/s, loss"),
    "offline-fanout": ("gateway.bench.offline_fanout",
                       "10,000 offline persistent sessions, 1,000 broadcasts, then all reconnect: delivered, RSS, disk"),
    "durability": ("gateway.bench.durability",
                   "QoS 1 (or --qos 2) under load, broker SIGKILLed and restarted 10 times: acked but lost"),
    "failover": ("gateway.bench.failover",
                 "3 store replicas + 2 gateways under QoS 1/2 load, leader killed 20 and frozen 5 times: acked but "
                 "lost, QoS 2 duplicates, unavailable s; acks=leader|quorum|all fan-in vs one store"),
    "hostile": ("gateway.bench.hostile", "hostile clients (big topics, many filters, User Properties, partial-packet "
                                         "churn) beside a canary: its latency, the broker's RSS and CPU"),
    "proportion": ("gateway.bench.proportion", "costs in proportion: 50 sessions x 1,000 filters, 30,000 long topics, "
                                               "a subscriber that never reads, beside a canary, against targets"),
}
"""``lightgate bench NAME`` -> (module with ``add_arguments(parser)`` and ``run(args) -> dict``, help).

The modules import trio, the store and the load generator; they are imported
only when the command is ``bench``, so other commands start without them."""

EXTRAS = {
    "tls-certs": ("tls",),
    "analytics": ("analytics",),
    "simulate": ("bench",),
    "bench": ("bench",),
    "bench analytics": ("bench", "analytics"),
    "bench all": ("bench", "analytics"),
}
"""The pyproject extras a command needs beyond the base install (the broker's commands need none); the
longest matching command wins. Checked before the command's modules are imported (gateway/app/extras.py)."""


NODE_USAGE = "%(prog)s [-h] [--config FILE] [--FLAG VALUE ...]"
"""The usage line of the node commands: their flags, one per option, are listed by section below it."""


def _lacks_the_tier(command: str, node: str, conf: cfg.Config) -> bool:
    """Log the one line saying how to install the tier extra when ``tier.uri`` is set without it (store/node.py
    would refuse too, but cannot tell how lightgate was installed)."""
    lacking = extras.missing_line(f"{command} with tier.uri set", ["tier"]) if conf["tier.uri"] else None
    if lacking:
        LOG.error("%s node not started: %s", node, lacking)
    return lacking is not None


def _cmd_serve(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.app.embedded import run_gateway_node

    if _lacks_the_tier("serve", "gateway", conf):
        return 1
    LOG.info("starting embedded node", extra={"ctx": {"data": conf["node.data"]}})
    return run_gateway_node(conf)


GROUP_ACTIONS = ("run", "status", "add-replica", "remove-replica")
"""What ``lightgate store`` does: run the store node (the default), or show or change its replicated group."""


def _cmd_store(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.app.reload import Reloader
    from gateway.mqtt.session import clamp_session_blob, session_blob_expiry
    from gateway.app.store_node import run_store_node

    if args.action not in GROUP_ACTIONS:  # checked here, not by argparse: another command's flag is named first
        LOG.error("lightgate store: unknown action %r (%s)", args.action, ", ".join(GROUP_ACTIONS))
        return 2
    if args.action != "run":
        return _group_command(args, conf)
    if _lacks_the_tier("store", "store", conf):
        return 1
    reloader = Reloader(conf)
    try:
        access = _store_access(conf, reloader)
    except ValueError as exc:  # PasswordFileError, AclError (the message names the file and line), no store.token
        LOG.error("store node not started: %s", exc)
        return 1
    LOG.info("starting store node", extra={"ctx": {"data": conf["node.data"]}})
    return run_store_node(conf, access, reloader.reload, clamp_session_blob, session_blob_expiry)


def _group_command(args: argparse.Namespace, conf: cfg.Config) -> int:
    """``lightgate store status | add-replica NAME | remove-replica NAME``: read or change the store group
    ``replication.group`` in its controller (etcd), without joining it. Prints the group as JSON, with each live
    replica's own figures (``figures``: read from the ``/metrics`` it registered, store.metrics_port)."""
    import json

    import trio

    from gateway.ops.replica import read_figures
    from store.controller.etcd import EtcdError
    from store.controller.group import GroupAdmin, MembershipRefused

    group = conf["replication.group"]
    if not group:
        LOG.error("lightgate store %s: replication.group is not set (--replication-group NAME)", args.action)
        return 1
    if args.action != "status" and not args.replica_name:
        LOG.error("lightgate store %s: name the replica (lightgate store %s NAME)", args.action, args.action)
        return 1

    async def run() -> dict[str, Any]:
        async with GroupAdmin.open(conf["replication.etcd"], group) as admin:
            if args.action == "add-replica":
                await admin.add_replica(args.replica_name)
            elif args.action == "remove-replica":
                await admin.remove_replica(args.replica_name)
            return await admin.status()

    try:
        status = trio.run(run)
    except (EtcdError, MembershipRefused) as exc:
        LOG.error("lightgate store %s: %s", args.action, exc)
        return 1
    figures: dict[str, object] = {}
    for name, address in status["metrics"].items():
        try:
            figures[name] = read_figures(address, STATUS_TIMEOUT_S)
        except (OSError, ValueError) as exc:  # gone since etcd listed it, or not a replica's endpoint
            figures[name] = {"error": f"{address}: {exc}"}
    status["figures"] = figures
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


STATUS_TIMEOUT_S = 2.0
"""``lightgate store status`` waits this long for each replica's ``/metrics``: a stalled one is shown as such."""


def _cmd_repair(args: argparse.Namespace, conf: cfg.Config) -> int:
    from pathlib import Path

    from store.log.commitlog import CommitLogConfig
    from store.repair import repair

    try:
        done = repair(Path(conf["node.data"]), CommitLogConfig.from_settings(conf.values))
    except Exception as exc:  # rocksdict raises plain Exceptions; OSError: a node still runs on the data
        LOG.error("repair failed: %s", exc, extra={"ctx": {"data": conf["node.data"]}})
        return 1
    LOG.info("repair done: start the node again", extra={"ctx": done})
    return 0


ACL_REFRESH_S = 1.0
"""The store looks for an edited ACL file at most this often: its checks run per appended message."""


def _store_access(conf: cfg.Config, reloader: Reloader | None = None) -> StoreAccess:
    """Who may use a store node (store/rpc/access.py): gateway nodes by ``store.token``, back-end producers and
    consumers by the password file and ACL of ``auth.*``, checked by the same code as MQTT clients.

    The store does not import the gateway; this wiring hands it the checks as callables. The files are
    handed to ``reloader`` too (SIGHUP).

    Raises:
        ValueError: ``auth.*`` is set without ``store.token`` (no gateway node could connect), or the
            password or ACL file cannot be loaded.
    """
    import functools
    import time

    from gateway.auth.acl import Access, Acl
    from gateway.auth.authn import Authenticator, ReloadError, WatchedFile
    from store.rpc.access import StoreAccess, Verdict

    token = conf["store.token"]
    auth = bool(conf["auth.password_file"] or conf["auth.acl_file"] or conf["auth.allow_anonymous"] == "false")
    if not token and not auth:
        return StoreAccess()
    if not token:
        raise ValueError("store.token must be set on a store node with auth.* set: gateway nodes present it")
    authenticator = Authenticator.from_config(conf)
    if reloader is not None:
        reloader.passwords = authenticator.passwords

    def authenticate(username: str | None, password: bytes | None, source: str) -> Verdict:
        try:
            authenticator.reload_if_changed()
        except ReloadError as exc:
            LOG.error("password file not reloaded: %s", exc)
        decision = authenticator.authenticate(username, password, source)
        return Verdict(decision.accepted, decision.username, decision.delay_s, decision.why)

    if not conf["auth.acl_file"]:
        return StoreAccess(token=token, authenticate=authenticate)
    # The store has no delivery check for back-end consumers: a group's filter overlapping a deny rule is refused.
    acl = WatchedFile(conf["auth.acl_file"], functools.partial(Acl.load, wildcard_mode="refuse"))
    if reloader is not None:
        reloader.acl = acl
    refreshed = [time.monotonic()]

    def authorize(username: str | None, client_id: str, access: str, topic: str) -> bool:
        now = time.monotonic()
        if now - refreshed[0] >= ACL_REFRESH_S:
            refreshed[0] = now
            try:
                acl.refresh()
            except ReloadError as exc:
                LOG.error("ACL file not reloaded: %s", exc)
        return acl.value.check(username, client_id, Access(access), topic)

    return StoreAccess(token=token, authenticate=authenticate, authorize=authorize)


def _cmd_gateway(args: argparse.Namespace, conf: cfg.Config) -> int:
    if conf["gateway.workers"] > 1:
        from gateway.app.workers import run_workers

        return run_workers(args.argv, conf)
    from gateway.app.cluster import run_cluster_gateway

    LOG.info("starting cluster gateway node", extra={"ctx": {"store": conf["gateway.store"]}})
    return run_cluster_gateway(conf)


def _cmd_config(args: argparse.Namespace, conf: cfg.Config) -> int:
    values = {o.key: o.default for o in cfg.OPTIONS} if args.defaults else cfg.redacted(conf.values)
    sys.stdout.write(cfg.to_toml(values))
    return 0


def _cmd_bench(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.bench.common import emit
    from gateway.bench.history import main as report, show

    if args.bench == "report":
        return report(args)
    names = list(BENCHMARKS) if args.bench == "all" else [args.bench]
    for name in names:
        module = importlib.import_module(BENCHMARKS[name][0])
        if args.bench == "all":
            sub = argparse.ArgumentParser(prog=f"lightgate bench {name}")
            module.add_arguments(sub)
            bench_args = sub.parse_args([])
        else:
            bench_args = args
        show(emit(name, module.run(bench_args)))
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
    from gateway.auth.passwords import PasswordFile, validate_username

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


def _cmd_tls_certs(args: argparse.Namespace, conf: cfg.Config) -> int:
    from pathlib import Path

    from gateway.app.certs import issue

    out = Path(args.out)
    try:
        issued = issue(out, args.host, args.client, days=args.days)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"lightgate tls-certs: {exc}\n")
        return 1
    lines = [f"wrote {path}" for path in issued.files]
    if not issued.new_ca:
        lines.append(f"signed with the existing CA {out / 'ca.pem'}")
    if args.host:
        lines.append(f"serve TLS with: --tls-port 8883 --tls-certfile {out / 'server.pem'} "
                     f"--tls-keyfile {out / 'server.key'}")
    if args.client:
        lines.append(f"ask clients for certificates with: --tls-cafile {out / 'ca.pem'} "
                     f"(and --tls-require-client-cert for mTLS)")
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


def _cmd_systemd_unit(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.app.unit import render_unit, this_install

    sys.stdout.write(render_unit(*this_install()))
    return 0


def _cmd_simulate(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.bench.simulate import run

    return run(args)


def _cmd_dump(args: argparse.Namespace, conf: cfg.Config) -> int:
    from pathlib import Path

    from store.dump import dump_json

    try:
        text = dump_json(Path(conf["node.data"]) / "index")
    except Exception as exc:  # rocksdict raises plain Exceptions; FileNotFoundError: no index there
        LOG.error("dump failed: %s", exc, extra={"ctx": {"data": conf["node.data"]}})
        return 1
    sys.stdout.write(text + "\n")
    return 0


def _cmd_snapshot(args: argparse.Namespace, conf: cfg.Config) -> int:
    from pathlib import Path

    from store.log.commitlog import CommitLogConfig
    from store.snapshot import snapshot

    if not args.to:
        LOG.error("snapshot needs --to DIR: the new directory to write the copy to")
        return 2
    try:
        done = snapshot(Path(conf["node.data"]), Path(args.to), CommitLogConfig.from_settings(conf.values))
    except Exception as exc:  # rocksdict raises plain Exceptions; OSError: a node still runs on the data
        LOG.error("snapshot failed: %s", exc, extra={"ctx": {"data": conf["node.data"]}})
        return 1
    LOG.info("snapshot done", extra={"ctx": done})
    return 0


def _cmd_bridge(args: argparse.Namespace, conf: cfg.Config) -> int:
    from gateway.bridge import run_bridge

    return run_bridge(conf)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser; ``argv`` says whether the benchmarks' own flags are needed."""
    parser = argparse.ArgumentParser(
        prog="lightgate",
        description="LightGate: an MQTT gateway for IoT fleets over read-amplified storage.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def node_command(name: str, help_text: str, handler: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, usage=NODE_USAGE)
        cfg.add_arguments(p, name)
        p.set_defaults(handler=handler)
        return p

    node_command("serve", "run the embedded node (gateway, store, dispatch, notify in one process)", _cmd_serve)
    p = node_command("store", "run a store node (CommitLog, RocksDB light queues, dispatch, retention) serving "
                              "gateway nodes over the RPC (--listen HOST:PORT), alone or as a replica of "
                              "--replication-group; or show or change that group (status, add-replica NAME, "
                              "remove-replica NAME; docs/cluster.md)", _cmd_store)
    p.add_argument("action", nargs="?", default="run", metavar="{run,status,add-replica,remove-replica}",
                   help="run (the default): run the store node; status: print the group's leader, epoch, in-sync"
                        " set and members as JSON; add-replica / remove-replica NAME: change its configured replicas")
    p.add_argument("replica_name", nargs="?", metavar="NAME", help="the replica add-replica / remove-replica change")
    node_command("repair", "repair a stopped node's data after its index database broke (a new index, derived "
                           "again from the CommitLog; docs/storage.md, \"Repair\")", _cmd_repair)
    node_command("dump", "print a stopped node's index database as canonical JSON: what it derived from the "
                         "CommitLog, independent of how it was written (docs/storage.md, \"Recovery\")", _cmd_dump)
    p = node_command("snapshot", "copy a stopped node's index database consistently (RocksDB's checkpoint) to "
                                 "--to DIR, for a replica to start from (docs/storage.md, \"Recovery\")",
                     _cmd_snapshot)
    p.add_argument("--to", metavar="DIR", help="the new directory to write the copy to (required)")
    p = node_command("gateway", "run a cluster gateway node in front of a store node (--store HOST:PORT, "
                                "--workers N)", _cmd_gateway)
    p.set_defaults(argv=argv)  # --workers N starts N processes with the same command line
    node_command("bridge", "mirror topics to and from an external MQTT broker (--rule, bridge.* options; "
                           "docs/bridge.md)", _cmd_bridge)
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

    p = sub.add_parser("tls-certs", help="write a test CA, a server certificate and client certificates for "
                                         "trying TLS and mTLS (the tls extra)",
                       description="Write ca.pem/ca.key (reused if DIR has them), server.pem/server.key for every "
                                   "--host, and NAME.pem/NAME.key per --client (CN = NAME) into DIR; keys mode 0600. "
                                   "Existing files are not overwritten. Exit 1 with the reason otherwise.")
    p.add_argument("--out", metavar="DIR", required=True, help="the directory to write into (created if missing)")
    p.add_argument("--host", metavar="NAME", action="append", default=[],
                   help="a DNS name or IP address clients reach the node by (repeat; the first is the CN)")
    p.add_argument("--client", metavar="NAME", action="append", default=[],
                   help="a client certificate with CN = NAME, for mTLS (repeat)")
    p.add_argument("--days", type=int, default=365, help="validity of the server and client certificates")
    p.set_defaults(handler=_cmd_tls_certs)

    p = sub.add_parser("systemd-unit", help="print the systemd unit that runs `lightgate serve` from this install",
                       description="Print the systemd unit of `lightgate serve` with ExecStart naming this "
                                   "install's lightgate: lightgate systemd-unit > "
                                   "/etc/systemd/system/lightgate.service (docs/operations.md).")
    p.set_defaults(handler=_cmd_systemd_unit)

    p = sub.add_parser("bench", help="run a benchmark (prints a BENCH <json> line per benchmark; the bench extra)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    bench_sub.add_parser("all", help="every benchmark with its default sizes")
    rp = bench_sub.add_parser("report", help="the broker benchmarks' results table across runs, and their charts",
                              description="Print the results table of bench/results/*.jsonl and write "
                                          "bench/results/charts/<scenario>.png.")
    if argv is None or argv[:1] == ["bench"]:
        importlib.import_module("gateway.bench.history").add_arguments(rp)
    for name, (module_name, help_text) in BENCHMARKS.items():
        bp = bench_sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or argv[:1] == ["bench"]:
            importlib.import_module(module_name).add_arguments(bp)
    p.set_defaults(handler=_cmd_bench)

    p = sub.add_parser("analytics", help="Spark aggregation of device telemetry read from the CommitLog "
                                         "(the analytics extra)")
    if argv is None or argv[:1] == ["analytics"]:
        importlib.import_module("spark_analytics.cli").add_arguments(p)
    p.set_defaults(handler=_cmd_analytics)

    p = sub.add_parser("simulate", help="a fleet of paho-mqtt devices against any MQTT broker: throughput, "
                                        "latency percentiles, lost messages (the bench extra)")
    if argv is None or argv[:1] == ["simulate"]:
        importlib.import_module("gateway.bench.simulate").add_arguments(p)
    p.set_defaults(handler=_cmd_simulate)

    parser.add_argument("--version", action="version", version=f"lightgate {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, set up logging once, run the subcommand; return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((c for c in (" ".join(argv[:2]), " ".join(argv[:1])) if c in EXTRAS), None)
    lacking = extras.missing_line(command, EXTRAS[command]) if command else None
    if lacking:  # before build_parser imports the command's modules
        sys.stderr.write(lacking + "\n")
        return 2
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        misplaced = cfg.misplaced_flag(args.command, unknown)
        parser.exit(2, f"lightgate {args.command}: error: {misplaced}\n") if misplaced else None
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]  # a value may be a secret
        parser.error(f"unrecognized arguments: {' '.join(flags or unknown)}")
    try:
        conf = cfg.resolve(args)
    except cfg.ConfigError as exc:
        parser.exit(2, f"lightgate: configuration error: {exc}\n")
    setup_logging(conf["log.level"], conf["log.json"])
    if args.command in cfg.COMMAND_KEYS:
        LOG.info("configuration", extra={"ctx": {"command": args.command, "file": conf.source,
                                                 **cfg.non_defaults(conf, args.command)}})
    return args.handler(args, conf)


if __name__ == "__main__":
    sys.exit(main())
