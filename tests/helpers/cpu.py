"""Pinning the test process to one CPU, for tests whose sends on two sockets must reach the node in order."""

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_cpu() -> Iterator[None]:
    """Run the test process on one CPU meanwhile: loopback segments are delivered through a per-CPU queue, so
    two sends made on different CPUs may reach the node in either order; on one CPU, in the order sent."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
