"""One logging set-up for every command: human-readable lines, or JSON lines with ``--log-json``.

Modules log through ``logging.getLogger(__name__)`` and pass structured context
as ``extra={"ctx": {...}}``; the text format appends it as ``key=value``, the
JSON format as fields, so operators can grep either.

The configuration's secrets never reach the log, by structure, not by searching for their values: the lines that
show the configuration show the secret keys as ``<redacted>`` (gateway/app/config.py ``redacted``), no other line
carries a token or a password, and every line has the password of each URI it quotes (``scheme://user:PASSWORD@``,
a ``tier.uri`` in an error message, say) replaced by ``<redacted>``. Nothing else in a line is ever changed:
replacing each occurrence of a secret's value anywhere turned every ``t`` of every line into ``<redacted>`` for a
token ``t``, and told the token by where it did.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from gateway.app.config import without_uri_passwords

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[exc]``: what a log line about a failed nursery
    should name, rather than "Exceptions from Trio nursery"."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


class TextFormatter(logging.Formatter):
    """``2026-11-22T10:00:00.123Z INFO store.log.commitlog: message key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname} {record.name}: {record.getMessage()}"
        ctx = getattr(record, "ctx", None)
        if ctx:
            line += " " + " ".join(f"{k}={v}" for k, v in ctx.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus the record's context fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = getattr(record, "ctx", None)
        if ctx:
            doc.update(ctx)
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key != "ctx":
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class RedactingFormatter(logging.Formatter):
    """Another formatter's lines with the password of each URI they quote replaced by ``REDACTED``."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self._inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return without_uri_passwords(self._inner.format(record))


QUIET_LIBRARIES = ("httpx", "httpcore")
"""Libraries that log every request at INFO (httpx: each etcd call of a store replica, several a second): only
their warnings are logged."""


def setup_logging(level: str = "info", json_lines: bool = False) -> None:
    """Configure the root logger once, writing to stderr, URI passwords redacted from every line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(JsonFormatter() if json_lines else TextFormatter()))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for chatty in QUIET_LIBRARIES:
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
