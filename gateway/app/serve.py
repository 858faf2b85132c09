"""Running one gateway node over a store, embedded or remote: what both composition roots share.

``serve_node`` builds the node (gateway/node/node.py) over any ``StoreApi``, with its listeners, its tasks, the
operator's endpoint (gateway/ops/) and ``$SYS``; ``run_node`` runs a ``serve_*`` root in a process until a
signal stops it (clients told first), reloading on SIGHUP. The embedded root (gateway/app/embedded.py) and the
cluster gateway's (gateway/app/cluster.py) differ only in the store they hand it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio

from gateway.app.config import Config
from gateway.app.logs import leaves
from gateway.app.process import return_freed_buffers, set_collection_policy, trim_freed_memory
from gateway.app.reload import Reloader
from gateway.app.sdnotify import notify
from gateway.app.signals import on_hangup, until_signalled
from gateway.auth.acl import Acl, AclError
from gateway.auth.authn import Authenticator, WatchedFile
from gateway.auth.passwords import PasswordFileError
from gateway.mqtt.channel import ChannelConfig
from gateway.node.admission import Admission
from gateway.node.connection import serve_mqtt
from gateway.node.guard import Guard
from gateway.node.listeners import ListenerSpec, TlsContext, listener_specs
from gateway.node.node import GatewayNode
from gateway.ops.admin import AdminApi, serve_admin
from gateway.ops.administration import Administration
from gateway.ops.metrics import NodeMetrics
from store.api import StartupError, StoreApi
from store.log.aio import LatencyBuckets

__all__ = ["NodeFront", "Running", "channel_config", "run_node", "serve_node"]

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeFront:
    """What a gateway node loads from its settings before it opens or connects to the store.

    Loaded first so that a broken password, ACL or certificate file stops the
    node before it touches the store.
    """

    authenticator: Authenticator
    acl: WatchedFile[Acl] | None
    specs: list[ListenerSpec]
    admission: Admission

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> NodeFront:
        """Raises PasswordFileError, AclError or ListenerError (each names the file)."""
        authenticator = Authenticator.from_config(settings)
        load = functools.partial(Acl.load, wildcard_mode=settings["auth.acl_wildcard_mode"])
        acl = WatchedFile(settings["auth.acl_file"], load) if settings["auth.acl_file"] else None
        LOGGER.info("authentication ready", extra={"ctx": {
            "password_file": settings["auth.password_file"] or None, "acl_file": settings["auth.acl_file"] or None,
            "allow_anonymous": authenticator.allow_anonymous}})
        return cls(authenticator, acl, listener_specs(settings), Admission.from_config(settings))


@dataclass
class Running:
    """The node a ``serve_*`` call runs, filled in before it reports ready: what signals act on."""

    node: GatewayNode | None = None
    front: NodeFront | None = None


def channel_config(settings: Mapping[str, Any]) -> ChannelConfig:
    """What every channel of the node offers its client, from the settings."""
    return ChannelConfig(
        max_packet_size=settings["mqtt.max_packet_size"],
        max_connect_size=min(settings["mqtt.max_connect_size"], settings["mqtt.max_packet_size"]),
        receive_maximum=settings["mqtt.receive_maximum"],
        default_receive_maximum=settings["mqtt.inflight_311"],
        max_keepalive=settings["mqtt.max_keepalive"] or None,
        reason_strings=True,
        max_topic_length=settings["limits.max_topic_length"],
        max_topic_levels=settings["limits.max_topic_levels"],
        max_subscriptions=settings["limits.max_subscriptions"],
        max_user_properties=settings["limits.max_user_properties"],
        max_user_property_bytes=settings["limits.max_user_property_bytes"],
        publish_rate=settings["limits.publish_rate"],
        publish_burst=settings["limits.publish_burst"],
        publish_bytes_rate=settings["limits.publish_bytes_rate"],
        qos0_queue_bytes=settings["limits.qos0_queue_bytes"],
        max_unwritten_bytes=settings["limits.outbound_bytes"],
        max_delay_s=settings["delayed.max_delay_s"],
        shared_invisible_s=settings["mqtt.shared_invisible_s"],
    )


async def serve_node(
    settings: Mapping[str, Any],
    store: StoreApi,
    front: NodeFront,
    *,
    flush_latency: LatencyBuckets | None = None,
    running: Running | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a gateway node over ``store`` until cancelled: listeners, notify, timers, ``$SYS``, and the admin HTTP
    endpoint (metrics, health, admin API, dashboard; gateway/ops/admin.py) unless ``admin.port`` is 0.

    ``task_status.started`` receives the (host, port) of the plain TCP listener. ``flush_latency`` is the
    CommitLog's flush histogram when the store runs in this process (exported with the node's metrics).
    ``running`` receives the node and its front before "ready".
    """
    async with trio.open_nursery() as nursery:
        guard = Guard(front.authenticator, front.acl,
                      identity_as_username=settings["auth.use_identity_as_username"])
        node = GatewayNode(store, nursery, channel_config(settings), settings["mqtt.connect_timeout_s"], guard=guard)
        administration = Administration(node)
        nursery.start_soon(node.timers.run)
        nursery.start_soon(node.reads.run)
        nursery.start_soon(node.consume_events)
        nursery.start_soon(node.consume_moved)
        nursery.start_soon(administration.answer_asks)
        nursery.start_soon(trim_freed_memory)
        if settings["mqtt.sys_interval_s"] > 0:
            nursery.start_soon(node.system.run, settings["mqtt.sys_interval_s"])
        admin = None
        if settings["admin.port"]:
            metrics = NodeMetrics(administration, flush_latency=flush_latency, admission=front.admission,
                                  cache=node.cache)
            admin = AdminApi(administration, metrics, token=settings["admin.token"])
            admin_port = 0 if settings["node.port"] == 0 else settings["admin.port"]  # several nodes on one machine
            max_body = 2 * settings["mqtt.max_packet_size"]  # room for a payload as base64 in JSON
            listeners = await nursery.start(functools.partial(
                serve_admin, admin, settings["admin.host"], admin_port, max_body=max_body,
                max_connections=settings["admin.max_connections"], header_timeout_s=settings["admin.header_timeout_s"]))
            admin_host, admin_port = listeners[0].socket.getsockname()[:2]
            LOGGER.info("admin API ready", extra={"ctx": {"host": admin_host, "port": admin_port,
                                                          "token": bool(settings["admin.token"])}})
        bound = await nursery.start(functools.partial(serve_mqtt, node, front.specs, admission=front.admission))
        if admin is not None:
            admin.mqtt_ready = True
        host, port = bound[0].host, bound[0].port  # the plain TCP listener comes first
        if running is not None:
            running.node, running.front = node, front
        LOGGER.info("gateway node ready", extra={"ctx": {"host": host, "port": port,
                                                         **{f"{b.kind}_port": b.port for b in bound[1:]}}})
        task_status.started((host, port))


async def _serve_until_signalled(conf: Config, serve: Any) -> None:
    """Run ``serve`` until SIGINT or SIGTERM (clients told first: ``GatewayNode.shutdown``); reload on SIGHUP."""
    running = Running()
    reloader = Reloader(conf)

    def reload() -> None:
        if running.front is None:
            LOGGER.info("SIGHUP before the node is ready: nothing reloaded", extra={"ctx": {"signal": "SIGHUP"}})
            return
        reloader.passwords = running.front.authenticator.passwords
        reloader.acl = running.front.acl
        reloader.tls = next((spec.ssl_context for spec in running.front.specs
                             if isinstance(spec.ssl_context, TlsContext)), None)
        reloader.node, reloader.admission = running.node, running.front.admission
        reloader.reload()

    async with trio.open_nursery() as nursery:

        async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
            await until_signalled(task_status=task_status)
            if running.node is not None:
                await running.node.shutdown()
            nursery.cancel_scope.cancel()

        await nursery.start(stop_on_signal)  # signals are caught before "ready" is logged
        await nursery.start(on_hangup, reload)
        await nursery.start(functools.partial(serve, conf.values, running=running))
        notify("READY=1")  # a systemd Type=notify service (gateway/app/lightgate.service) is started now
    LOGGER.info("gateway node stopped")


def run_node(conf: Any, serve: Any) -> int:
    """Run the gateway node of ``serve`` (``serve_gateway`` or ``serve_cluster_gateway``) in this process until a
    signal stops it; returns the process exit status."""
    set_collection_policy()
    return_freed_buffers()
    failed = False
    try:
        trio.run(_serve_until_signalled, conf, serve)
    except* OSError as group:  # e.g. the port is taken; nurseries may wrap it in a group
        failures = leaves(group)
        LOGGER.error("gateway node failed: %s", "; ".join(f"{type(exc).__name__}: {exc}" for exc in failures))
        LOGGER.debug("gateway node failure", exc_info=failures[0])  # the traceback, for a crash
        failed = True
    except* (PasswordFileError, AclError) as group:  # the message names the file and line
        LOGGER.error("gateway node not started: %s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    except* StartupError as group:  # the store's data cannot be opened: what happened and what to do
        LOGGER.error("%s", "; ".join(str(exc) for exc in leaves(group)))
        failed = True
    return 1 if failed else 0
