"""The layer contracts of pyproject.toml ([tool.importlinter]) hold: imports point down (issue 18)."""

from __future__ import annotations

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


PACKAGES = ("gateway", "store", "lightqueue", "retain", "notify", "spark_analytics")

def import_cycles(graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module of ``graph`` (a grimp graph): each is a cycle."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in modules:  # Tarjan's algorithm, iteratively (module chains run deeper than the recursion limit)
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    """Type-checking imports count (``exclude_type_checking_imports = false``): an import made only for the type
    checker is still a dependency, and a cycle through one is a cycle (issue 31). A lower module names what it
    uses of a higher one with a Protocol, or is passed a callable, instead."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    cycles = import_cycles(graph)
    assert not cycles, [sorted(cycle) for cycle in cycles]


def test_the_cycle_check_finds_a_cycle():
    """The check above is only as good as its search."""

    class Graph:
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return self.edges[module]

    assert import_cycles(Graph()) == [frozenset({"a", "b", "c"})]
