"""How node processes hear the operator: SIGINT and SIGTERM stop them, SIGHUP reloads what can be reloaded."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import trio

__all__ = ["on_hangup", "until_signalled"]

LOGGER = logging.getLogger(__name__)


async def until_signalled(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Return on the first SIGINT or SIGTERM (logged): how node processes learn to shut down.

    ``task_status.started`` is called once the signals are caught, so a node
    started with ``nursery.start`` can log "ready" without a SIGTERM race.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            LOGGER.info("shutting down", extra={"ctx": {"signal": signal.Signals(signum).name}})
            return


async def on_hangup(reload: Callable[[], None] | None = None, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Call ``reload`` on every SIGHUP until cancelled, so that the signal never ends the process (its default).

    ``reload`` (None: nothing to reload, the signal is only logged) must not raise; it logs what it did. As with
    ``until_signalled``, ``task_status.started`` is called once the signal is caught.
    """
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            if reload is None:
                LOGGER.info("SIGHUP: nothing to reload here", extra={"ctx": {"signal": "SIGHUP"}})
            else:
                reload()
