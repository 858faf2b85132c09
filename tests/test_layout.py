"""The test tree's layout holds (issue 18): no test module imports another, and every folder is a package.

What several modules share lives in tests/helpers/ or a conftest.py: a test module that imports another one
collects that module's names (fixtures, tests) and ties the two together. Folders are packages so that equal
basenames in different folders (tests/store/test_tier.py, tests/spark_analytics/test_tier.py) do not clash.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported(source: str, package: tuple[str, ...]) -> set[str]:
    """The dotted names ``source`` imports (modules, and ``module.name`` for ``from module import name``), relative
    imports resolved against ``package``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = (*package[:len(package) - node.level + 1], node.module) if node.level else (node.module,)
            base = ".".join(part for part in parts if part)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def imported_test_modules(source: str, package: tuple[str, ...]) -> list[str]:
    """The test modules among what ``source`` imports: a dotted name with a ``test_`` part."""
    return sorted(name for name in imported(source, package) if any(p.startswith("test_") for p in name.split(".")))


def test_no_test_module_imports_another():
    offenders = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        package = path.relative_to(TESTS.parent).parent.parts
        if found := imported_test_modules(path.read_text(), package):
            offenders[str(path.relative_to(TESTS.parent))] = found
    assert not offenders, f"move what they share to tests/helpers/ or a conftest.py: {offenders}"


def test_each_form_of_importing_a_test_module_is_seen():
    """The check above is only as good as its parser."""
    package = ("tests", "gateway", "mqtt")
    for form in ["import test_cluster", "from test_cluster import x", "import tests.cluster.test_cluster as c",
                 "from tests.gateway.mqtt.test_codec import x", "from tests.gateway.mqtt import test_codec",
                 "from .test_codec import x", "from . import test_codec", "from ..node.test_server import x",
                 "def f():\n    from test_cluster import x\n"]:
        assert imported_test_modules(form, package), form
    for fine in ["from tests.helpers.mqtt_fixtures import Client", "import gateway.mqtt.codec", "from . import x"]:
        assert not imported_test_modules(fine, package), fine


def test_every_test_folder_is_a_package():
    folders = {path.parent for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"add an __init__.py (equal basenames in two folders clash without it): {missing}"
