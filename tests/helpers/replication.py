"""An in-process replicated store for tests: a leader node served over real sockets, followers in this process,
and the controller protocol in memory (etcd is outside what these tests test: the data path)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from store.api import NewMessage
from store.log.commitlog import CommitLog, CommitLogConfig
from store.node import open_follower, open_store
from store.replica.follower import LeaderChanged, follow
from store.replica.leader import Replication
from store.rpc.server import serve_rpc

WAIT_S = 30.0  # every condition is waited for with this timeout, never slept for
SEGMENT = 256 * 1024  # small segments: the copies roll and seal segments as the leader's do
CONFIG = CommitLogConfig(segment_bytes=SEGMENT, max_record_bytes=64 * 1024, retention_check_interval_s=0)
REPLICAS = ["a", "b", "c"]


class Controller:
    """The controller protocol in memory: the ISR changes it was asked for, refused while ``accept`` is False;
    ``lease`` says whether the leader lease is valid; ``gate``, when set, holds every ISR write until it is."""

    def __init__(self, *, accept: bool = True) -> None:
        self.accept = accept
        self.lease = True
        self.writes: list[list[str]] = []
        self.gate: trio.Event | None = None

    async def set_isr(self, epoch: int, members: list[str]) -> bool:
        self.writes.append(members)
        if self.gate is not None:
            await self.gate.wait()
        return self.accept

    def leader_lease_valid(self) -> bool:
        return self.lease


async def until(condition, what: str) -> None:
    """Wait for ``condition()`` (re-checked whenever the other tasks have run), failing after ``WAIT_S``."""
    with trio.fail_after(WAIT_S):
        while not condition():
            await trio.sleep(0.01)
    assert condition(), what


def messages(n: int, start: int = 0, size: int = 200) -> list[NewMessage]:
    return [NewMessage(f"t/{i % 5}", bytes([i % 251]) * size, "pub", qos=1, retain=i % 7 == 0)
            for i in range(start, start + n)]


def start_epoch(data: Path, epoch: int) -> None:
    """What the role loop does on winning: the epoch's entry at the log's end."""
    (data / "commitlog").mkdir(parents=True, exist_ok=True)
    with CommitLog.open(data / "commitlog", CONFIG) as log:
        log.epochs.append(epoch, log.written_offset)


def log_bytes(data: Path) -> dict[str, bytes]:
    """The segment files of a log (a stopped node's), by name: what ``read_frames`` and ``append_frames`` keep
    identical."""
    return {path.name: path.read_bytes() for path in sorted((data / "commitlog").iterdir())
            if path.name.isdigit()}


@asynccontextmanager
async def leader(data: Path, *, acks: str = "quorum", isr=("a",), max_lag_s: float = 60.0,
                 controller: Controller | None = None, epoch: int = 1, config: CommitLogConfig = CONFIG):
    start_epoch(data, epoch)
    controller = controller or Controller()
    replication = Replication(name="a", epoch=epoch, replicas=REPLICAS, isr=list(isr), acks=acks,
                              max_lag_s=max_lag_s, controller=controller)
    async with open_store(data, config, replication=replication) as node, trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(serve_rpc, node, "127.0.0.1", 0))
        node.port = listeners[0].socket.getsockname()[1]
        node.controller = controller
        yield node
        nursery.cancel_scope.cancel()


class Follower:
    """A follower in this process: its store in follower mode and its fetch loop, stopped with ``stop``."""

    def __init__(self, data: Path, name: str, config: CommitLogConfig = CONFIG) -> None:
        self.config = config
        self.data = data
        self.name = name
        self.log = None
        self.dispatcher = None
        self.done = trio.Event()
        self._cancel = trio.CancelScope()
        self.error: BaseException | None = None

    async def run(self, port: int, epoch: int = 1, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._cancel:
                async with open_follower(self.data, self.config) as (alog, dispatcher):
                    self.log, self.dispatcher = alog.log, dispatcher
                    task_status.started()
                    await follow(alog, dispatcher, ("127.0.0.1", port), name=self.name, epoch=epoch)
        except LeaderChanged as exc:
            self.error = exc
        finally:
            self.done.set()

    async def stop(self) -> None:
        self._cancel.cancel()
        await self.done.wait()

    @property
    def written(self) -> int:
        return self.log.written_offset
