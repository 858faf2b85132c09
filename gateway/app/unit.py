"""The systemd unit of this install: the packaged unit, its ExecStart pointing at the lightgate that runs now.

The unit (gateway/app/lightgate.service) names /opt/lightgate/bin/lightgate;
``lightgate systemd-unit`` prints it with the program of the install that runs
the command instead, so ``systemd-analyze verify`` passes and the service
starts wherever LightGate was installed: a venv's ``bin/lightgate``, or, for a
checkout run without being installed, its Python with ``-m gateway.app.cli``
and the checkout on PYTHONPATH. Hardening that would hide the install from the
service is loosened for it: ``ProtectHome=read-only`` for an install under a
home directory, ``PrivateTmp=no`` for one under /tmp.
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

from gateway import SOURCE_DIR

__all__ = ["render_unit", "this_install"]

UNIT = "lightgate.service"
"""The unit file, package data of gateway.app (in the wheel too)."""

SHIPPED_PROGRAM = "/opt/lightgate/bin/lightgate"
"""The program the shipped unit names: the install docs/operations.md describes."""

HIDING = (
    ("ProtectHome", ("/home", "/root", "/run/user"), "read-only"),  # =yes makes home directories empty
    ("PrivateTmp", ("/tmp", "/var/tmp"), "no"),  # =yes gives the service an empty /tmp of its own
)
"""(setting, directories it hides from the service, the value that lets it see an install there)."""


def _word(text: str, *, command: bool = True) -> str:
    """``text`` as one word of a systemd command line (or an ``Environment=`` assignment, where ``$`` is not
    expanded): ``%`` and ``$`` taken literally, quoted if it has spaces."""
    text = text.replace("%", "%%")
    if command:
        text = text.replace("$", "$$")
    if re.search(r'[\s"\'\\]', text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def this_install() -> tuple[list[str], dict[str, str]]:
    """The command that runs this install's lightgate, and the environment it needs.

    The ``lightgate`` script next to the running Python (a venv or ``pip
    install``) when there is one, else that Python with ``-m gateway.app.cli``
    and the directory holding ``gateway`` on PYTHONPATH.
    """
    script = Path(sys.executable).with_name("lightgate")
    if script.is_file():
        return [str(script)], {}
    return [sys.executable, "-m", "gateway.app.cli"], {"PYTHONPATH": str(SOURCE_DIR)}


def render_unit(program: list[str], environment: dict[str, str] | None = None) -> str:
    """The unit with ExecStart running ``program`` (its arguments kept), ``environment`` set, and the hardening
    that would hide ``program``'s files or ``environment``'s paths loosened.

    Args:
        program: the command that runs lightgate, as :func:`this_install` gives it.
        environment: variables the service needs (``PYTHONPATH`` of a checkout).
    """
    environment = environment or {}
    text = resources.files(__package__).joinpath(UNIT).read_text(encoding="utf-8")
    paths = [*program[:1], *environment.values(), str(Path(program[0]).resolve())]
    for setting, directories, value in HIDING:
        if any(Path(path).is_relative_to(directory) for path in paths for directory in directories):
            text = re.sub(rf"^{setting}=.*$", f"{setting}={value}", text, count=1, flags=re.M)
    start = " ".join(_word(word) for word in program)
    text = text.replace(f"ExecStart={SHIPPED_PROGRAM} ", f"ExecStart={start} ", 1)
    lines = "".join(f"Environment={_word(f'{name}={value}', command=False)}\n"
                    for name, value in environment.items())
    return text.replace("\nExecStart=", f"\n{lines}ExecStart=", 1)
