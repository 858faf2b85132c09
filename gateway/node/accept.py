"""Accept loops that survive running out of file descriptors: one log line per episode, and back-off.

``trio.serve_listeners`` logs an error with a traceback and retries every
0.1 s while ``accept`` fails for lack of resources (EMFILE at the
file-descriptor limit, ENFILE, ENOMEM, ENOBUFS): ten tracebacks a second for as
long as the node is full. Here an *episode* (accepts failing until one
succeeds) is logged once when it starts (a warning, no traceback), the loop
backs off (``FIRST_BACKOFF_S`` doubling to ``MAX_BACKOFF_S``; waiting
connections stay in the kernel's backlog meanwhile), and once accepts succeed
again one line says how many were refused and for how long.

Resource handling: each accepted stream belongs to the handler's task and is
closed (forcefully, if the handler did not) when the handler returns, as
``trio.serve_listeners`` does, unless the handler returns True: it kept the
stream, to close it itself later (a plain MQTT connection, served with no task).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

import trio

__all__ = ["ACCEPT_CAPACITY_ERRNOS", "CapacityLog", "serve_accepting"]

LOGGER = logging.getLogger(__name__)

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""``accept`` failures that mean "no resources now", not a broken listener: wait and try again (trio's list)."""

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
"""The wait after a refused accept, doubling per refusal in an episode: descriptors come back when connections
close, which takes longer than retrying 10 times a second finds out."""


@final
class CapacityLog:
    """The state of one listener's episodes of refused accepts, and their log lines.

    Args:
        listener: the listener's name in the log lines (``tcp``, ``ws``, ``admin``...).
    """

    __slots__ = ("listener", "refused", "episodes", "_since", "_backoff_s")

    def __init__(self, listener: str) -> None:
        self.listener = listener
        self.refused = 0  # accepts refused in the episode in progress (0: none in progress)
        self.episodes = 0  # episodes since the start
        self._since = 0.0
        self._backoff_s = FIRST_BACKOFF_S

    def failed(self, exc: OSError) -> float:
        """An accept failed for lack of resources; returns how long to wait before the next."""
        if not self.refused:
            self.episodes += 1
            self._since = time.monotonic()
            self._backoff_s = FIRST_BACKOFF_S
            LOGGER.warning("accept failed: %s (%s); backing off until connections close", errno.errorcode[exc.errno],
                           os.strerror(exc.errno),
                           extra={"ctx": {"listener": self.listener, "open_descriptors": _open_descriptors()}})
        self.refused += 1
        wait = self._backoff_s
        self._backoff_s = min(wait * 2, MAX_BACKOFF_S)
        return wait

    def accepted(self) -> None:
        """An accept succeeded: ends the episode in progress, if any, with its one summary line."""
        if self.refused:
            LOGGER.warning("accepting again after %d refused accepts in %.1f s", self.refused,
                           time.monotonic() - self._since, extra={"ctx": {"listener": self.listener}})
            self.refused = 0


def _open_descriptors() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux, or no descriptor left even for this
        return None


async def serve_accepting(
    listeners: Sequence[trio.abc.Listener[Any]],
    handler: Callable[[Any], Awaitable[object]],
    log: CapacityLog,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on every listener until cancelled and run ``handler(stream)`` for each connection.

    ``task_status.started()`` is called once every accept loop runs.

    Raises:
        OSError: a listener failed other than for lack of resources.
    """
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, handler, log, nursery)
        task_status.started()


async def _accept_loop(listener: trio.abc.Listener[Any], handler: Callable[[Any], Awaitable[object]],
                       log: CapacityLog, nursery: trio.Nursery) -> None:
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                await trio.sleep(log.failed(exc))
                continue
            log.accepted()
            nursery.start_soon(_run_handler, stream, handler)


async def _run_handler(stream: trio.abc.AsyncResource, handler: Callable[[Any], Awaitable[object]]) -> None:
    kept = False
    try:
        kept = await handler(stream) is True
    finally:
        if not kept:
            await trio.aclose_forcefully(stream)
