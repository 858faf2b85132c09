"""Search, sort and paging of the admin API's client list (``GET /api/v1/clients?search=&sort=&order=&offset=&limit=``).

A node may hold 100,000 connections: the dashboard asks for one page, and the
node filters and sorts before answering, so the browser gets a page, not the
whole list. Sans-IO: records in, a page out; in a cluster every gateway node
answers ``ClientQuery.head()`` and the node asked merges their pages
(:func:`merge_pages`). A client is a ``ClientInfo`` or, from another node, its
JSON object.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_PAGE", "SORT_KEYS", "ClientQuery", "QueryError", "merge_pages"]

SORT_KEYS = ("client_id", "username", "peer", "protocol", "keep_alive_s", "expiry_s", "subscriptions", "inflight")
"""The ``ClientInfo`` fields a list may be sorted by (every column of the dashboard's table)."""

MAX_PAGE = 1000
"""The largest ``limit``: a page is for a screen or a script's loop, not a dump (omit ``limit`` for every client)."""


class QueryError(ValueError):
    """A query parameter is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class ClientQuery:
    """Which clients, in which order: ``search`` is a case-insensitive substring of the client id, user name or
    peer; ties in ``sort`` are ordered by client id, so pages neither repeat nor skip a client."""

    search: str = ""
    sort: str = "client_id"
    descending: bool = False
    offset: int = 0
    limit: int | None = None  # None: every client from ``offset`` on

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> ClientQuery:
        """The query of an HTTP request's parameters.

        Raises:
            QueryError: an unknown sort key or order, or an offset or limit that is not a number in range.
        """
        sort = params.get("sort", "client_id")
        if sort not in SORT_KEYS:
            raise QueryError(f"'sort' must be one of {', '.join(SORT_KEYS)}")
        order = params.get("order", "asc")
        if order not in ("asc", "desc"):
            raise QueryError("'order' must be asc or desc")
        offset = _number(params, "offset", 0, None)
        limit = _number(params, "limit", 1, MAX_PAGE) if "limit" in params else None
        return cls(params.get("search", ""), sort, order == "desc", offset, limit)

    def head(self) -> ClientQuery:
        """The query each node of a cluster answers: its matches from the first to the end of this page."""
        end = None if self.limit is None else self.offset + self.limit
        return ClientQuery(self.search, self.sort, self.descending, 0, end)

    def page(self, clients: Iterable[Any]) -> tuple[int, list[Any]]:
        """(how many clients match, the page of them in order)."""
        needle = self.search.casefold()
        found = [c for c in clients if not needle or any(
            needle in (_field(c, name) or "").casefold() for name in ("client_id", "username", "peer"))]
        found.sort(key=lambda c: _field(c, "client_id"))
        found.sort(key=self._key, reverse=self.descending)
        end = None if self.limit is None else self.offset + self.limit
        return len(found), found[self.offset:end]

    def _key(self, client: Any) -> Any:
        value = _field(client, self.sort)
        return "" if value is None else value


def merge_pages(query: ClientQuery, pages: Iterable[tuple[int, list[Any]]]) -> tuple[int, list[Any]]:
    """The page of ``query`` over several nodes, from each node's answer to ``query.head()``: (how many clients
    match on all of them, the page)."""
    total = 0
    clients: list[Any] = []
    for count, page in pages:
        total += count
        clients += page
    return total, query.page(clients)[1]


def _field(client: Any, name: str) -> Any:
    return client[name] if isinstance(client, dict) else getattr(client, name)


def _number(params: Mapping[str, str], name: str, low: int, high: int | None) -> int:
    text = params.get(name, str(low))
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise QueryError(f"'{name}' must be a whole number {bounds}")
    return int(text)
