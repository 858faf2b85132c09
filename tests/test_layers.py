"""The layer contracts of pyproject.toml ([tool.importlinter]) hold: imports point down (issue 18)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_point_down_as_the_layer_contracts_say():
    """``lint-imports`` over this tree: a module importing one of a higher layer (the node importing ops, the
    store importing the gateway, the protocol core importing trio or the store engine) breaks a contract."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
