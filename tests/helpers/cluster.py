"""A cluster of real processes (one `lightgate store`, `lightgate gateway`s) and the waits its tests share."""

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import trio

from store.api import NewMessage
from store.rpc.client import RemoteStore
from tests.helpers.mqtt_fixtures import run_id, wait_until
from tests.helpers.ports import free_port
from tests.helpers.processes import LightgateProcess

WAIT_S = 30.0  # every condition below is waited for with this timeout (two cores, several processes)


class Process(LightgateProcess):
    """A `lightgate` subprocess, waited for until it logs ``ready`` (that line kept as ``ready_line``)."""

    def __init__(self, *args: str, ready: str) -> None:
        super().__init__(*args, wait_s=WAIT_S)
        self.ready_line = self.wait_log(lambda doc: doc.get("msg") == ready)


class Store(Process):
    def __init__(self, data: Path, port: int, *flags: str) -> None:
        super().__init__("store", "--data", str(data), "--listen", f"127.0.0.1:{port}", *flags,
                         ready="store node ready")
        self.data = data
        self.port = port
        self.flags = flags

    def restarted(self) -> "Store":
        """A new store process on the same data, port and flags (this one must have exited)."""
        return Store(self.data, self.port, *self.flags)


class Gateway(Process):
    """A `lightgate gateway` on the store at ``store`` (a port on 127.0.0.1, or its ``--store`` address list)."""

    def __init__(self, store: int | str, *flags: str) -> None:
        super().__init__("gateway", "--store", f"127.0.0.1:{store}" if isinstance(store, int) else store, "--port", "0",
                         "--mqtt-sys-interval-s", "0", *flags, ready="gateway node ready")
        self.port = self.ready_line["port"]
        self.node = self.wait_log(lambda doc: doc.get("msg") == "connected to the store")["node"]


@contextmanager
def running_cluster(tmp_path: Path, gateways: int = 2, *gateway_flags: str):
    store = Store(tmp_path / "data", free_port())
    started = [store]
    try:
        nodes = []
        for _ in range(gateways):
            nodes.append(Gateway(store.port, *gateway_flags))
            started.append(nodes[-1])
        yield store, nodes
    finally:
        for process in reversed(started):
            process.stop()


def ask_store(port: int, call):
    """``await call(client)`` with a RemoteStore of its own, as a gateway would ask."""
    async def ask():
        async with RemoteStore.connect("127.0.0.1", port, node=f"probe-{run_id()}", timeout_s=WAIT_S) as client:
            return await call(client)

    return trio.run(ask)


def pop_once(port: int, group: str, topic: str, payload: bytes, filter: str) -> list[int]:
    """Append ``payload`` to ``topic`` and pop it for POP ``group`` on ``filter`` at one attempt at most, invisible
    0.1 s, never acknowledged: the store's revive step dead-letters it to ``$dlq/<group>``. Returns the attempts
    popped."""
    async def pop(client) -> list[int]:
        await client.append([NewMessage(topic, payload, "dev-1", 1)])
        popped = await client.pop(group, filter, "m", 10, invisible_s=0.1, wait_s=WAIT_S, max_attempts=1,
                                  start="earliest")
        return [p.attempt for p in popped]

    return ask_store(port, pop)


def store_statistics(port: int):
    return ask_store(port, lambda client: client.statistics())


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` with the cluster's longer timeout (several processes on two cores)."""
    wait_until(condition, WAIT_S, what)
