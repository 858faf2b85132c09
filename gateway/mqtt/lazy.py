"""Containers made at their first use and queues left ``()`` until used, for the objects every idle device has.

An idle device's channel and session hold a dozen containers that stay empty
for its whole life (acks owed, QoS 2 flows, aliases, in-flight messages...): an
empty dict is 64 B, an empty list 56 B, and they were 1 KiB of its 8 (issue 31,
``lightgate bench conns``). Such a container's slot is left unset until the
first access, which makes it; from then on it is a plain attribute, and the
code that uses it reads and writes it as it would any other.

A queue read on every step (a connection's output, its node work, its held
packets) is ``()`` while empty instead: reading it costs nothing, and
``appended`` gives the list it becomes when something is queued.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["Queued", "appended", "made", "made_on_first_use"]

T = TypeVar("T")

Queued = list[T] | tuple[()]
"""Items queued for later: ``()`` while there are none (an empty list is 56 B per connection)."""


def made_on_first_use(makers: Mapping[str, Callable[[], object]]) -> Callable[[Any, str], Any]:
    """A ``__getattr__`` for a slotted class: an unset slot named in ``makers`` is set to ``makers[name]()`` and
    returned; any other missing attribute raises ``AttributeError`` as usual.

    Python calls ``__getattr__`` only when the normal lookup fails, so a container costs the call once.
    """

    def __getattr__(self: Any, name: str) -> Any:
        make = makers.get(name)
        if make is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = make()
        object.__setattr__(self, name, value)
        return value

    return __getattr__


def made(owner: object, name: str) -> bool:
    """Whether ``owner``'s container ``name`` was made, without making it: for a reader that only counts (the
    ``$SYS`` figures ask every session), not for a hot path (an unset slot costs an exception here)."""
    try:
        object.__getattribute__(owner, name)
    except AttributeError:
        return False
    return True


def appended(queued: Queued[T], *items: T) -> list[T]:
    """``queued`` with ``items`` at its end: the same list, or a new one in place of ``()``."""
    if isinstance(queued, list):
        queued.extend(items)
        return queued
    return list(items)
