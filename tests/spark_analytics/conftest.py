"""The ``spark`` fixture of the spark_analytics tests: one local SparkSession for the whole test run."""

from collections.abc import Iterator
from typing import Any

import pytest

from spark_analytics.session import spark_session


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The test process's one local SparkSession (``commitlog`` registered), stopped after the last test."""
    session = spark_session("local[2]", app_name="lightgate-tests")
    yield session
    session.stop()
