"""Which extras of the install are present: the base install is the broker, the rest is optional.

``lightgate serve``, ``store``, ``gateway``, ``bridge``, ``passwd`` and ``config``
run on the base install; ``analytics`` needs the ``analytics`` extra (Spark),
``bench`` and ``simulate`` the ``bench`` extra. The extras' contents are read
from the installed package's metadata, so pyproject.toml stays the one list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import metadata

DISTRIBUTION = "lightgate"

EXTRA_MARKER = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")
"""The environment marker that puts a requirement in an extra (``pyspark>=4; extra == "analytics"``)."""

REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A requirement's distribution name: what comes before its extras, version and marker."""


def missing(extra: str) -> list[str]:
    """The distributions ``extra`` requires that are not installed.

    Empty when lightgate itself has no installed metadata (run from a checkout
    on PYTHONPATH): there is no list to compare with then.
    """
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    absent = []
    for requirement in requirements:
        marker = EXTRA_MARKER.search(requirement)
        name = REQUIREMENT_NAME.match(requirement)
        if marker is None or marker.group(1) != extra or name is None or name.group() == DISTRIBUTION:
            continue
        try:
            metadata.distribution(name.group())
        except metadata.PackageNotFoundError:
            absent.append(name.group())
    return absent


def missing_line(command: str, extras: Iterable[str]) -> str | None:
    """One line naming the extras ``lightgate <command>`` needs and lacks, and how to install them; None when
    none lacks a package."""
    lacking = [extra for extra in extras if missing(extra)]
    if not lacking:
        return None
    named = f"the {lacking[0]} extra" if len(lacking) == 1 else f"the {' and '.join(lacking)} extras"
    return f"lightgate {command} needs {named}: pip install 'lightgate[{','.join(lacking)}]'"
