"""Work done, counted rather than timed: a cost bound that two busy cores cannot make flaky.

``python_lines(fn)`` counts the Python lines ``fn()`` executes (``sys.settrace``
line events, loop iterations included). A cost that grows with the input
shows as a count that grows with it, whatever the machine's speed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def python_lines(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``fn()``; return (Python lines it executed, its result)."""
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        result = fn()
    finally:
        sys.settrace(previous)
    return count, result
