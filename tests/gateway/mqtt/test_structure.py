"""The packet handlers use the channel's public face only (issue 31): they read and change the connection's protocol
state through ``ConnectionState`` (``channel.conn``, gateway/mqtt/state.py) and the channel's public methods, never
through its private names, which stay the channel's own (its state, timers and dispatch)."""

from __future__ import annotations

import ast
from pathlib import Path

HANDLERS = Path(__file__).resolve().parents[3] / "gateway" / "mqtt" / "handlers"


def private_uses(source: str) -> list[str]:
    """Each ``channel.<...>._name`` in ``source``: an attribute starting with ``_`` reached from a name ``channel``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "channel" and node.attr.startswith("_"):
            found.append(f"line {node.lineno}: channel.{'.'.join(reversed(chain))}")
    return found


def test_handlers_use_no_private_name_of_the_channel():
    offenders = {path.name: uses for path in sorted(HANDLERS.glob("*.py")) if (uses := private_uses(path.read_text()))}
    assert not offenders, f"use channel.conn (ConnectionState) or a public Channel method: {offenders}"


def test_the_check_sees_private_names_however_reached():
    """The check above is only as good as its parser."""
    for form in ["channel._session", "channel._pending[ref] = 1", "x = channel._close(r, 'why')",
                 "channel.conn._held", "f(channel._now_ms)"]:
        assert private_uses(form), form
    for fine in ["channel.conn.pending", "channel.close(r, 'why')", "other._session", "channel.config.max_qos"]:
        assert not private_uses(fine), fine
