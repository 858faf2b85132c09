"""Access control lists: who may publish to which topics and subscribe to which filters.

The ACL file (documented with examples in docs/security.md)::

    default deny                  # the decision when no rule matches (deny if absent)

    user alice                    # rules for one authenticated user
    allow both alice/#
    deny publish alice/readonly/#

    client sensor-17              # rules for one client id
    allow publish tele/sensor-17/#

    pattern                       # rules for everyone, with %u (user name) and %c (client id)
    allow publish tele/%c/#
    allow subscribe cmd/%c/#

Whole-line comments only: ``#`` is also the multi-level wildcard. A rule's
filter is the rest of its line (surrounding whitespace removed).

Decision: the first matching rule wins, looking at the user's rules, then the
client id's, then the patterns, each in file order; then the default. For a
PUBLISH an allow rule matches when its filter matches the topic. For a
SUBSCRIBE an allow rule matches only when its filter *covers* the requested one
(every topic the subscription can receive is allowed: ``a/#`` covers ``a/+``,
``a/+`` does not cover ``a/#``). A deny rule's match depends on the wildcard
mode (``auth.acl_wildcard_mode``):

- ``filter`` (the default, as Mosquitto and EMQX do): a deny rule refuses the
  subscriptions it covers (``deny subscribe test/nosubscribe`` refuses exactly
  that filter); a wildcard that merely *overlaps* it (``#``, ``test/+``) is
  granted, and the node withholds the denied topics at delivery
  (:meth:`ClientAcl.may_read`: a message is delivered only on a topic the subscriber
  may subscribe to exactly);
- ``refuse``: a deny rule matches as soon as the two filters overlap (some
  topic matches both), so a broad subscription is refused outright.

Substitution never widens access: a user name or client id that is missing
(anonymous), empty, contains ``+``, ``#``, ``/`` or U+0000, or starts with
``$`` cannot be substituted; an allow rule that needs it never matches, and a
deny rule that needs it always matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import final

from gateway.auth.passwords import validate_username
from lightqueue.topics import TopicError, filters_overlap, matches, parse_shared, validate_filter

__all__ = ["WILDCARD_MODES", "Access", "Acl", "AclError", "ClientAcl", "Decision", "Rule", "filter_covers"]

MAX_CACHED_IDENTITIES = 16_384
"""Compiled rule lists kept per (user, client id): one per connected client in the common case, bounded for floods."""

MAX_CACHED_DECISIONS = 65_536
"""Decisions kept per (user, client id, access, topic); devices publish to the same few topics over and over."""

MAX_CACHED_TOPIC_CHARS = 256
"""Longer topics are decided without caching, so the decision cache stays within tens of MiB."""

MAX_CACHED_READS = 4_096
"""Delivery decisions a ``ClientAcl`` keeps per connection (topic -> allowed): a wildcard subscriber over a large
fleet sees many topics, so the cache starts over when full (the ACL's own cache answers the misses)."""

WILDCARD_MODES = ("filter", "refuse")
"""``auth.acl_wildcard_mode``: grant a wildcard overlapping a deny rule and withhold the denied topics at delivery,
or refuse it (see the module docstring)."""

_PLACEHOLDER = re.compile(r"(%[uc])")
_UNSAFE_CHARS = frozenset("+#/\0")


class Access(Enum):
    """What a client asks to do with a topic."""

    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"


_ACCESS_WORDS = {
    "publish": frozenset({Access.PUBLISH}),
    "subscribe": frozenset({Access.SUBSCRIBE}),
    "both": frozenset({Access.PUBLISH, Access.SUBSCRIBE}),
}


class AclError(ValueError):
    """The ACL file cannot be read or is malformed; the message says ``source:line: why``."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``allow|deny publish|subscribe|both FILTER`` line; ``filter`` may hold ``%u`` / ``%c``."""

    allow: bool
    access: frozenset[Access]
    filter: str
    line: int


@dataclass(frozen=True, slots=True)
class Decision:
    """An ACL answer and its reason: the deciding rule, or None when the default policy decided."""

    allowed: bool
    rule: Rule | None


def filter_covers(rule: str, requested: str) -> bool:
    """Does every topic that the ``requested`` filter matches also match the ``rule`` filter?

    Both must be valid filters. This is the SUBSCRIBE permission test: a
    subscription may only receive what the rule allows.
    """
    if requested.startswith("$") and rule[:1] in ("+", "#"):
        return False  # a wildcard-led rule matches no $ topic, the requested filter does
    r_levels = rule.split("/")
    q_levels = requested.split("/")
    for i, r in enumerate(r_levels):
        if r == "#":
            return True
        if i == len(q_levels):
            return False
        q = q_levels[i]
        if q == "#":
            # "#" also matches the parent (zero levels) unless the parent would be the empty topic,
            # which does not exist: then "#" matches one level or more, exactly like "+/#".
            no_parent = i == 0 or (i == 1 and q_levels[0] == "")
            return no_parent and r == "+" and r_levels[i + 1:] == ["#"]
        if r != "+" and r != q:
            return False
    return len(r_levels) == len(q_levels)


def _safe_value(value: str) -> bool:
    return value != "" and not value.startswith("$") and _UNSAFE_CHARS.isdisjoint(value)


def _substitute(template: str, username: str | None, client_id: str | None) -> str | None:
    """The rule filter for this client, or None when a needed value is missing or unsafe.

    One pass over the template, so a user name containing ``%c`` is not
    substituted again.
    """
    if "%" not in template:
        return template
    parts = _PLACEHOLDER.split(template)
    for i in range(1, len(parts), 2):
        value = username if parts[i] == "%u" else client_id
        if value is None or not _safe_value(value):
            return None
        parts[i] = value
    return "".join(parts)


_Compiled = tuple[tuple[Rule, "str | None"], ...]


def _cache_put(cache: dict, key: object, value: object, limit: int) -> None:
    if len(cache) >= limit:
        del cache[next(iter(cache))]  # evict the oldest entry: O(1), and enough for a bound
    cache[key] = value


def _parse_rule(keyword: str, rest: str, number: int) -> Rule:
    """Parse the part of a rule line after ``allow``/``deny``; ValueError says what is wrong."""
    word, *tail = rest.split(None, 1) or [""]
    topic_filter = tail[0].strip() if tail else ""
    if word not in _ACCESS_WORDS:
        raise ValueError(f"expected publish, subscribe or both after {keyword!r}, not {word!r}")
    if not topic_filter:
        raise ValueError(f"'{keyword} {word}' needs a topic filter")
    if topic_filter.startswith("$share/"):
        raise ValueError("rules name topics, not shared subscriptions: '$share/<group>/' is removed before checking")
    validate_filter(topic_filter)  # substituted values hold no '/', '+', '#' or U+0000, so the template decides
    return Rule(keyword == "allow", _ACCESS_WORDS[word], topic_filter, number)


@final
class Acl:
    """A parsed ACL file with per-client caches. Use from one thread (the node's event loop).

    Replace the whole object to reload (see ``gateway.auth.authn.WatchedFile``): the
    caches belong to it.
    """

    def __init__(self, *, default_allow: bool = False, users: dict[str, tuple[Rule, ...]] | None = None,
                 clients: dict[str, tuple[Rule, ...]] | None = None, patterns: tuple[Rule, ...] = (),
                 source: str = "<acl>", wildcard_mode: str = "filter") -> None:
        if wildcard_mode not in WILDCARD_MODES:
            raise ValueError(f"wildcard_mode must be one of {', '.join(WILDCARD_MODES)}, not {wildcard_mode!r}")
        self.default_allow = default_allow
        self.wildcard_mode = wildcard_mode
        self.users = users or {}
        self.clients = clients or {}
        self.patterns = patterns
        self.source = source
        self._compiled: dict[tuple[str | None, str | None], _Compiled] = {}
        self._decisions: dict[tuple[str | None, str | None, Access, str], Decision] = {}

    @classmethod
    def load(cls, path: Path | str, wildcard_mode: str = "filter") -> Acl:
        """Read and parse an ACL file.

        Raises:
            AclError: the file cannot be read or a line is malformed (``path:line: why``).
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AclError(f"{path}: cannot read the ACL file: {exc}") from None
        return cls.parse(text, str(path), wildcard_mode)

    @classmethod
    def parse(cls, text: str, source: str = "<acl>", wildcard_mode: str = "filter") -> Acl:
        """Parse ACL text; ``source`` names it in error messages.

        Raises:
            AclError: ``source:line: why`` for the first malformed line.
        """
        default: bool | None = None
        default_line = 0
        users: dict[str, list[Rule]] = {}
        clients: dict[str, list[Rule]] = {}
        patterns: list[Rule] = []
        section: list[Rule] | None = None
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, *tail = line.split(None, 1)
            rest = tail[0] if tail else ""
            try:
                if keyword == "default":
                    if rest not in ("allow", "deny"):
                        raise ValueError(f"expected 'default allow' or 'default deny', not {line!r}")
                    if default is not None:
                        raise ValueError(f"the default policy is already set on line {default_line}")
                    default, default_line = rest == "allow", number
                elif keyword == "user":
                    section = users.setdefault(validate_username(rest), [])
                elif keyword == "client":
                    if not rest:
                        raise ValueError("'client ID' needs a client id")
                    section = clients.setdefault(rest, [])
                elif keyword == "pattern":
                    if rest:
                        raise ValueError(f"'pattern' starts a section and takes no argument, not {rest!r}")
                    section = patterns
                elif keyword in ("allow", "deny"):
                    if section is None:
                        raise ValueError("a rule must follow a 'user NAME', 'client ID' or 'pattern' line")
                    section.append(_parse_rule(keyword, rest, number))
                else:
                    raise ValueError(
                        f"unknown keyword {keyword!r} (expected default, user, client, pattern, allow or deny)")
            except ValueError as exc:
                raise AclError(f"{source}:{number}: {exc}") from None
        return cls(
            default_allow=bool(default),
            users={name: tuple(rules) for name, rules in users.items()},
            clients={cid: tuple(rules) for cid, rules in clients.items()},
            patterns=tuple(patterns),
            source=source,
            wildcard_mode=wildcard_mode,
        )

    def check(self, username: str | None, client_id: str | None, access: Access, topic: str) -> bool:
        """May this client publish to ``topic`` / subscribe to the filter ``topic``?

        ``username`` is the *authenticated* user name (None for anonymous
        clients). ``topic`` must already be a valid topic name (PUBLISH) or
        filter (SUBSCRIBE; a ``$share/<group>/`` prefix is removed first).
        """
        return self.explain(username, client_id, access, topic).allowed

    def explain(self, username: str | None, client_id: str | None, access: Access, topic: str) -> Decision:
        """Like :meth:`check`, also naming the deciding rule (for logs: "denied by acl:12")."""
        key = (username, client_id, access, topic)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decide(self._rules_for(username, client_id), access, topic)
            if len(topic) <= MAX_CACHED_TOPIC_CHARS:
                _cache_put(self._decisions, key, decision, MAX_CACHED_DECISIONS)
        return decision

    def _rules_for(self, username: str | None, client_id: str | None) -> _Compiled:
        key = (username, client_id)
        compiled = self._compiled.get(key)
        if compiled is None:
            rules = (*(self.users.get(username, ()) if username is not None else ()),
                     *(self.clients.get(client_id, ()) if client_id is not None else ()),
                     *self.patterns)
            compiled = tuple((rule, _substitute(rule.filter, username, client_id)) for rule in rules)
            _cache_put(self._compiled, key, compiled, MAX_CACHED_IDENTITIES)
        return compiled

    def _decide(self, rules: _Compiled, access: Access, topic: str) -> Decision:
        if access is Access.SUBSCRIBE:
            try:
                shared = parse_shared(topic)
            except TopicError:
                return Decision(False, None)
            if shared is not None:
                topic = shared[1]
        for rule, rule_filter in rules:
            if access not in rule.access:
                continue
            if rule_filter is None:
                if rule.allow:
                    continue
                return Decision(False, rule)
            if access is Access.PUBLISH:
                hit = matches(rule_filter, topic)
            elif rule.allow or self.wildcard_mode == "filter":  # filter: an overlap is withheld at delivery
                hit = filter_covers(rule_filter, topic)
            else:
                hit = filters_overlap(rule_filter, topic)
            if hit:
                return Decision(rule.allow, rule)
        return Decision(self.default_allow, None)


@final
class ClientAcl:
    """One connection's rights under the ACL: what the channel asks (``gateway.mqtt.actions.Authorizer``).

    Publish and subscribe checks ask the ACL in effect (``checked``: reloaded first when its file changed);
    the delivery check (:meth:`may_read`) asks the ACL in memory (``current``: no file look per message). A
    topic is readable when the subscriber may subscribe to exactly that topic; the answer depends only on the
    topic (the user and client id are fixed), so it is decided once per topic and kept for every subscription
    of the connection (at most ``MAX_CACHED_READS``); a reloaded ACL starts that cache over. Pure: the channel
    calls it as an injected check.
    """

    __slots__ = ("_checked", "_current", "_username", "_client_id", "_acl", "_allowed")

    def __init__(self, checked: Callable[[], Acl], current: Callable[[], Acl], username: str | None,
                 client_id: str) -> None:
        self._checked = checked
        self._current = current
        self._username = username
        self._client_id = client_id
        self._acl: Acl | None = None
        self._allowed: dict[str, bool] = {}

    def may_publish(self, topic: str) -> bool:
        return self._checked().check(self._username, self._client_id, Access.PUBLISH, topic)

    def may_subscribe(self, filter: str) -> bool:
        return self._checked().check(self._username, self._client_id, Access.SUBSCRIBE, filter)

    def may_read(self, topic: str) -> bool:
        acl = self._current()
        allowed = self._allowed.get(topic) if acl is self._acl else None
        if allowed is None:
            if acl is not self._acl:
                self._acl = acl
                self._allowed.clear()
            allowed = acl.check(self._username, self._client_id, Access.SUBSCRIBE, topic)
            if len(self._allowed) >= MAX_CACHED_READS:
                self._allowed.clear()
            self._allowed[topic] = allowed
        return allowed
