"""The code of the commit before control records carried session state (BASE), run as a subprocess: the tests
of the first start over a data directory written by it (store/node.py, ``_restate_legacy``) need its real format.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.processes import ROOT, LightgateProcess

BASE = "9cb2293"
"""The last commit whose session blobs, client ledger and QoS 2 releases were side tables beside the log."""


def base_tree(dest: Path) -> Path:
    """BASE's files under ``dest`` (``git archive`` of this repository's history); the test is skipped, saying why,
    in a clone without that history (a shallow one)."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BASE}^{{commit}}"], capture_output=True)
    if known.returncode:
        pytest.skip(f"commit {BASE} is not in this clone's history (a shallow clone): its data format cannot be made")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASE], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


class BaseNode(LightgateProcess):
    """A `lightgate serve` of BASE's code (from ``tree``, see :func:`base_tree`) on a free port."""

    def __init__(self, tree: Path, data: Path, *flags: str) -> None:
        super().__init__("serve", "--port", "0", "--data", str(data), *flags, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)})
        self.data = data
        self.port = self.ready("gateway node ready")
