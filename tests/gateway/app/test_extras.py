"""The "missing extra" line names a command that installs the extra where lightgate runs from: a checkout (installed
editable or not installed at all) or a wheel (tests/test_packaging.py runs the wheel's case)."""

import json
import shlex
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

from gateway.app.extras import DISTRIBUTION, install_command
from tests.helpers.processes import ROOT

EXTRAS_MODULES = ("gateway/__init__.py", "gateway/app/__init__.py", "gateway/app/extras.py")
"""What gateway/app/extras.py imports of lightgate: nothing else, so a bare interpreter runs it."""


def test_a_checkout_that_is_not_installed_is_told_to_install_itself_editable_with_the_extra(tmp_path):
    """A bare virtualenv (no lightgate, no pyspark) running a checkout from PYTHONPATH: the extras come from the
    checkout's pyproject.toml, and the command installs that checkout, wherever the shell is."""
    checkout = tmp_path / "my checkout"  # a space: the command must quote the path
    for name in ("pyproject.toml", *EXTRAS_MODULES):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    bare = tmp_path / "venv"
    venv.create(bare, with_pip=False)
    python = bare / "bin" / "python"
    done = subprocess.run([str(python), "-c", "from gateway.app.extras import missing_line\n"
                                              "print(missing_line('analytics', ['analytics', 'tier']))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    line = done.stdout.rstrip("\n")
    prefix = "lightgate analytics needs the analytics and tier extras: "
    assert line.startswith(prefix), line
    assert shlex.split(line[len(prefix):]) == [str(python), "-m", "pip", "install", "-e",
                                               f"{checkout}[analytics,tier]"]


def test_an_editable_install_is_told_to_install_its_checkout_with_the_extra():
    """The dev environment is an editable install of a checkout (``make venv-dev``: ``pip install -e``)."""
    # the installed distribution, not the checkout's lightgate.egg-info that the working directory puts first
    installed = [d for d in metadata.distributions(name=DISTRIBUTION) if d.read_text("direct_url.json")]
    origin = json.loads(installed[0].read_text("direct_url.json")) if installed else {}
    if not origin.get("dir_info", {}).get("editable"):
        pytest.skip(f"lightgate is not installed editable in {sys.prefix} (make venv-dev installs it so)")
    python, *pip, spec = shlex.split(install_command(["bench", "analytics"]))
    assert (python, pip) == (sys.executable, ["-m", "pip", "install", "-e"])
    checkout, extras = spec.removesuffix("]").split("[")
    assert extras == "bench,analytics"
    assert 'name = "lightgate"' in (Path(checkout) / "pyproject.toml").read_text()
