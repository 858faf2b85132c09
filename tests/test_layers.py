"""The layer contracts of pyproject.toml ([tool.importlinter]) hold: imports point down (issue 18)."""

from __future__ import annotations

import ast
import shutil
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


def test_the_gateway_importing_the_engine_breaks_the_seam_contract(tmp_path):
    """The seam contract bites: a copy of the tree where a gateway node module imports the CommitLog's errors
    directly (not through store.api) fails ``lint-imports`` on that contract, naming the import (issue 26)."""
    for package in ("gateway", "store", "lightqueue", "retain", "notify", "spark_analytics"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    owed = tmp_path / "gateway" / "node" / "owed.py"
    owed.write_text(owed.read_text().replace("from store.api import FULL_RETRY_S, LogFullError\n",
                                             "from store.api import FULL_RETRY_S\nfrom store.log.errors import LogFullError\n"))
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache", "--config", str(tmp_path / "pyproject.toml")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout
    assert "gateway is not allowed to import store.log" in result.stdout
    assert "gateway.node.owed -> store.log.errors" in result.stdout


def test_the_poller_and_the_transports_import_nothing_above_them_not_even_for_the_type_checker():
    """gateway/node/{poller,transports}.py imported the connection (the poller under TYPE_CHECKING, which the
    contracts do not count): the dependency is one-way now, connection -> transports -> poller (issue 31)."""
    above = {"gateway/node/poller.py": ("gateway.node.transports", "gateway.node.connection"),
             "gateway/node/transports.py": ("gateway.node.connection",)}
    for path, forbidden in above.items():
        tree = ast.parse((ROOT / path).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & set(forbidden), (path, sorted(imported & set(forbidden)))
