"""A quiet SparkSession for the CLI, the tests and the benchmark.

Quiet means: no web UI, no console progress bar (the CLI shows its own),
driver bound to loopback only (without it Spark binds a non-loopback
address), two shuffle partitions (the default 200 costs ~70 ms each on a
laptop-sized job), UTC session time, and ERROR-level logs from the start:
the driver JVM gets :data:`LOG4J2_CONFIG`, so Spark's start-up lines (its
default log4j profile, the default log level, NativeCodeLoader) are not
printed. Python workers run the same interpreter as the driver so the
package and its dependencies match.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["DEFAULT_MASTER", "LOG4J2_CONFIG", "QUIET_CONF", "package_zip", "spark_session"]

DEFAULT_MASTER = "local[2]"
"""The machine this project is measured on has two cores."""

QUIET_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.authenticate.socketTimeout": "120s",
}
"""The settings measured in /work/shared/spark-notes.md; any of them can be overridden. The Python worker's
connect-back timeout is raised from 15 s: on two busy cores a streaming query's source runner took longer to
start, and the query failed with "Timed out while waiting for the Python worker to connect back"."""


LOG4J2_CONFIG = Path(__file__).with_name("log4j2.properties")
"""The driver JVM's log4j2 configuration: ERROR and above, from the JVM's start (``setLogLevel`` comes too late
for the start-up lines)."""


def spark_session(master: str = DEFAULT_MASTER, app_name: str = "lightgate-analytics",
                  conf: Mapping[str, str] | None = None, *, delta: bool = False,
                  py_files: Sequence[Path] = ()) -> Any:
    """Start (or reuse) a SparkSession with :data:`QUIET_CONF` and the ``commitlog`` source registered.

    ``delta=True`` adds Delta Lake (the optional delta-spark package: its
    ``configure_spark_with_delta_pip`` names the matching jars, which Spark
    fetches from Maven unless they are already in its cache).

    On a cluster master (not ``local[...]``), the bind settings are left to
    Spark and the project's code (:func:`package_zip`) is shipped to the
    executors with ``addPyFile``, before the ``commitlog`` source is registered
    (docs/analytics.md, "Running on a cluster"); ``py_files`` are added the same
    way on any master.

    Resource handling: the caller stops the session (``spark.stop()``).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master.startswith("local[") or master == "local"
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from .source import register

    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {**QUIET_CONF,
                "spark.driver.defaultJavaOptions": f"-Dlog4j2.configurationFile={LOG4J2_CONFIG.as_uri()}"}
    if not local:
        del settings["spark.driver.bindAddress"], settings["spark.driver.host"]
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if delta:
        from delta import configure_spark_with_delta_pip

        builder = configure_spark_with_delta_pip(
            builder.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
            .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    logging.getLogger("py4j").setLevel(logging.WARNING)  # a line per call from the JVM at INFO
    ship = list(py_files)
    if not local:
        ship.append(package_zip(Path(tempfile.mkdtemp(prefix="lightgate-spark-"))))
    for path in ship:
        spark.sparkContext.addPyFile(str(path))
    register(spark)
    return spark


def package_zip(directory: Path) -> Path:
    """Zip ``spark_analytics``, the record format (``store/log/record.py``
    and the target-queues codec it imports, ``lightqueue/targets.py``), the tier's
    file format (``store/tierfiles.py``), the store RPC's wire format (``store/rpc/wire.py``) and the
    store interface's types it carries (``store/api.py`` and what it re-exports: ``store/usage.py``,
    ``store/space.py``, ``store/log/errors.py``, ``lightqueue/results.py``)
    and the MQTT topic rules (``lightqueue/topics.py``) into ``directory``
    for ``SparkContext.addPyFile``: the code executors need when the project is
    not installed on them (its dependencies still must be: pyarrow, numpy,
    msgspec, crc32c). Returns the zip's path."""
    import zipfile

    root = Path(__file__).resolve().parent.parent
    target = directory / "lightgate-analytics.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in [*sorted((root / "spark_analytics").glob("*.py")),
                     root / "store" / "__init__.py", root / "store" / "api.py", root / "store" / "usage.py",
                     root / "store" / "space.py", root / "store" / "log" / "__init__.py",
                     root / "store" / "log" / "errors.py", root / "store" / "log" / "record.py",
                     root / "store" / "tierfiles.py",
                     root / "store" / "rpc" / "__init__.py", root / "store" / "rpc" / "wire.py",
                     root / "lightqueue" / "__init__.py", root / "lightqueue" / "results.py",
                     root / "lightqueue" / "targets.py", root / "lightqueue" / "topics.py"]:
            zf.write(path, path.relative_to(root).as_posix())
    return target
