"""Background tasks that live exactly as long as a ``with`` block.

The store's parts (flusher, retention, dispatcher) are long-running trio tasks
that belong to the object that opened them. ``background`` starts them, runs the
block, cancels them on exit, and lets an exception from the block come out as
itself rather than wrapped in an exception group, so callers keep ordinary
``except`` clauses.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

__all__ = ["background"]


@asynccontextmanager
async def background(*starters: Callable[..., Awaitable[Any]]) -> AsyncIterator[trio.Nursery]:
    """Start each ``starter(task_status=...)`` with ``nursery.start``, yield, cancel them all on exit.

    Error handling: a single exception (from the block or a task) is re-raised
    unwrapped; several are raised as the exception group trio produced.
    """
    try:
        async with trio.open_nursery() as nursery:
            for start in starters:
                await nursery.start(start)
            try:
                yield nursery
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
