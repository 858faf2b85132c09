"""Shared test settings, and the fixtures several test modules use (one definition each).

A fixture one module alone uses stays in that module, named for what makes it differ from these.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from store.leases import LEASE_S
from store.log.commitlog import CommitLogConfig
from store.node import open_store
from tests.helpers.fulldisk import DISK, tmpfs
from tests.helpers.mqtt_fixtures import running_node

# Two shared cores: wall-clock deadlines would make property tests flaky, not stricter.
settings.register_profile(
    "lightgate",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("lightgate")


SPARK_TIMEOUT_S = 900
"""pytest-timeout's budget of a Spark test, which counts its fixtures' setup: the first Spark test of a worker
starts the worker's SparkSession and may build a module's fleet and batch run. Under load (six developers on two
cores, three workers each starting a JVM) one such test took 275 s and another was stopped at the default 300 s
in the middle of a Spark call, which left the worker's session broken for every later Spark test on it. A hang
is still stopped, after 15 minutes."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A Spark test gets :data:`SPARK_TIMEOUT_S` (unless it sets its own). On a pytest-xdist worker, the modules
    with Spark tests come first, then those with other slow tests.

    `make test` hands each worker whole modules (``--dist loadfile``), in this order
    (``--no-loadscope-reorder``): the longest modules start first, so the run does not end waiting for a Spark
    module that started last. A serial run keeps the collection order.
    """
    for item in items:
        if item.get_closest_marker("spark") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SPARK_TIMEOUT_S))
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    kinds: dict[Path, tuple[bool, bool]] = {}
    for item in items:
        spark, slow = kinds.get(item.path, (False, False))
        kinds[item.path] = (spark or bool(item.get_closest_marker("spark")),
                            slow or bool(item.get_closest_marker("slow")))
    items.sort(key=lambda item: (not kinds[item.path][0], not kinds[item.path][1]))


SMALL_RECORD_BYTES = 4096  # small enough that a test can send a message over the limit without megabytes


def _stops_cleanly(node) -> None:
    assert node.proc.returncode == 0
    assert not [doc for doc in node.logs if doc.get("level") == "error"], node.logs


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One `lightgate serve` node with the default settings for a test module; it must stop cleanly, no error."""
    with running_node(tmp_path_factory.mktemp("node") / "data") as node:
        yield node
    _stops_cleanly(node)


@pytest.fixture(scope="module")
def interop_node(tmp_path_factory):
    """One node for a test module that closes a connection without CONNECT after 2 s; it must stop cleanly."""
    with running_node(tmp_path_factory.mktemp("node") / "data", "--mqtt-connect-timeout-s", "2") as node:
        yield node
    _stops_cleanly(node)


@pytest.fixture
async def store(tmp_path):
    """An in-process store node (real CommitLog and RocksDB) with the default settings."""
    async with open_store(tmp_path / "data", CommitLogConfig()) as node:
        yield node


@pytest.fixture
async def store_small_records(tmp_path, request):
    """A store node that refuses records over SMALL_RECORD_BYTES, with the test module's ``LEASE_S`` if it sets one
    (short leases make the presence and will tests take seconds)."""
    lease_s = getattr(request.module, "LEASE_S", LEASE_S)
    async with open_store(tmp_path / "data", CommitLogConfig(max_record_bytes=SMALL_RECORD_BYTES),
                          lease_s=lease_s) as node:
        yield node


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs of its own, unmounted at the end (skipped where mounting is not permitted)."""
    with tmpfs(tmp_path / "disk", DISK) as mount:
        yield mount
