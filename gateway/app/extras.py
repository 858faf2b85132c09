"""Which extras of the install are present: the base install is the broker, the rest is optional.

``lightgate serve``, ``store``, ``gateway``, ``bridge``, ``passwd`` and ``config``
run on the base install; ``analytics`` needs the ``analytics`` extra (Spark),
``bench`` and ``simulate`` the ``bench`` extra, ``tls-certs`` the ``tls`` extra
(and a node with ``tier.uri`` set the ``tier`` extra). The extras' contents are read
from the installed package's metadata (or, run from a checkout that is not
installed, from its pyproject.toml), so pyproject.toml stays the one list.

The hint names the command that installs the extra into the environment that
runs lightgate, from where lightgate came: the checkout of an editable install
(``pip install -e '/src/lightgate[analytics]'``), the directory of the wheel it
was installed from (``--find-links``), else the package index.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from gateway import checkout

DISTRIBUTION = "lightgate"

EXTRA_MARKER = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")
"""The environment marker that puts a requirement in an extra (``pyspark>=4; extra == "analytics"``)."""

REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A requirement's distribution name: what comes before its extras, version and marker."""


def _requirements() -> list[str]:
    """lightgate's requirements as installed metadata lists them (``name>=1; extra == "x"``), or as the checkout's
    pyproject.toml does when lightgate runs from a checkout that is not installed; empty if neither is there."""
    try:
        return metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        pass
    source = checkout()
    try:
        project = tomllib.loads((source / "pyproject.toml").read_text(encoding="utf-8"))["project"] if source else {}
    except (OSError, ValueError, KeyError):
        return []
    return [f'{requirement}; extra == "{extra}"'
            for extra, requirements in project.get("optional-dependencies", {}).items()
            for requirement in requirements]


def missing(extra: str) -> list[str]:
    """The distributions ``extra`` requires that are not installed (none when there is no list to compare with)."""
    absent = []
    for requirement in _requirements():
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
    return f"lightgate {command} needs {named}: {install_command(lacking)}"


def install_command(extras: Iterable[str]) -> str:
    """The shell command that adds ``extras`` to the environment running lightgate, from where lightgate came.

    An editable install (``pip install -e``, ``make venv``) or a checkout that is
    not installed gets ``pip install -e '<checkout>[extras]'``; an install from
    a source directory ``pip install '<directory>[extras]'``; an install from a
    wheel file that is still there ``--find-links <its directory>``; any other
    install (from an index) ``pip install 'lightgate[extras]'``.
    """
    wanted = f"[{','.join(extras)}]"
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    try:
        origin = json.loads(metadata.distribution(DISTRIBUTION).read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        origin = {}
    if not origin and (source := checkout()):
        # not installed, or found as the checkout's own lightgate.egg-info (``python -m`` from the checkout's root,
        # where that directory comes before site-packages): the checkout is where lightgate came from
        return f"{pip} -e {shlex.quote(f'{source}{wanted}')}"
    url = urlparse(origin.get("url", ""))
    where = Path(unquote(url.path)) if url.scheme == "file" else None
    if where is not None and "dir_info" in origin:
        editable = "-e " if origin["dir_info"].get("editable") else ""
        return f"{pip} {editable}{shlex.quote(f'{where}{wanted}')}"
    if where is not None and where.is_file():
        return f"{pip} --find-links {shlex.quote(str(where.parent))} {shlex.quote(DISTRIBUTION + wanted)}"
    return f"{pip} {shlex.quote(DISTRIBUTION + wanted)}"
