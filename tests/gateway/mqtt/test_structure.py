"""The packet handlers use the channel's public face only (issue 31): they read and change the connection's protocol
state through ``ConnectionState`` (``channel.conn``, gateway/mqtt/state.py) and call what ``ChannelView``
(gateway/mqtt/handlers/view.py) lists, never the channel's private names, which stay its own (its state, timers and
dispatch)."""

from __future__ import annotations

import ast
from pathlib import Path

from gateway.mqtt.channel import Channel
from gateway.mqtt.handlers.view import ChannelView

HANDLERS = Path(__file__).resolve().parents[3] / "gateway" / "mqtt" / "handlers"


def channel_uses(source: str) -> list[tuple[int, list[str]]]:
    """Each attribute chain reached from a name ``channel`` in ``source``: (line, [first attribute, ...])."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id == "channel":
            found.append((node.lineno, chain[::-1]))
    return found


def private_uses(source: str) -> list[str]:
    """Each ``channel.<...>._name`` in ``source``: an attribute starting with ``_`` reached from ``channel``."""
    return [f"line {line}: channel.{'.'.join(chain)}" for line, chain in channel_uses(source)
            if chain[-1].startswith("_")]


def view_members() -> set[str]:
    """The names ``ChannelView`` declares (attributes, properties, methods)."""
    return {name for name in vars(ChannelView) if not name.startswith("_")} | set(ChannelView.__annotations__)


def handler_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(HANDLERS.glob("*.py")) if path.name != "view.py"}


def test_handlers_use_no_private_name_of_the_channel():
    offenders = {name: uses for name, source in handler_sources().items() if (uses := private_uses(source))}
    assert not offenders, f"use channel.conn (ConnectionState) or a public Channel method: {offenders}"


def test_handlers_use_only_what_the_channel_view_lists():
    members = view_members()
    offenders = {name: [f"line {line}: channel.{chain[0]}" for line, chain in channel_uses(source)
                        if chain[0] not in members]
                 for name, source in handler_sources().items()}
    offenders = {name: uses for name, uses in offenders.items() if uses}
    assert not offenders, f"add it to ChannelView (gateway/mqtt/handlers/view.py) or keep it the channel's: {offenders}"


def test_the_channel_has_everything_the_view_lists():
    """The Protocol is structural: ``Channel`` does not name it, so this checks it still fits."""
    channel = Channel()
    assert {name for name in view_members() if not hasattr(channel, name)} == set()


def test_the_check_sees_private_names_however_reached():
    """The checks above are only as good as their parser."""
    for form in ["channel._session", "channel._pending[ref] = 1", "x = channel._close(r, 'why')",
                 "channel.conn._held", "f(channel._now_ms)"]:
        assert private_uses(form), form
    for fine in ["channel.conn.pending", "channel.close(r, 'why')", "other._session", "channel.config.max_qos"]:
        assert not private_uses(fine), fine
    assert [chain for _, chain in channel_uses("channel.conn.session.save()")] == [["conn", "session", "save"],
                                                                                  ["conn", "session"], ["conn"]]
