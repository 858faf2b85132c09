"""How spark_analytics reaches executors: partitions carry paths and options only,
and the addPyFile zip is all the project code an executor needs. No SparkSession."""

from __future__ import annotations

import pickle
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.helpers.spark_fixtures import telemetry, write_log

from spark_analytics.options import ReaderOptions
from spark_analytics.session import package_zip
from spark_analytics.source import CommitLogReader


def test_partitions_pickle_small_and_hold_only_paths_and_positions(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(3000), segment_bytes=64 * 1024)
    reader = CommitLogReader(ReaderOptions.parse({"path": str(tmp_path), "partitionBytes": "30000"}))
    partitions = reader.partitions()
    assert len(partitions) > 4
    for part in partitions:
        blob = pickle.dumps(part)
        assert len(blob) < 1024, "a partition must not carry data"
        for rng in part.ranges:
            assert Path(rng.path).parent == tmp_path / "commitlog"
    assert len(pickle.dumps(reader)) < 1024


def test_the_zip_alone_lets_a_fresh_interpreter_read_partitions(tmp_path: Path) -> None:
    write_log(tmp_path, telemetry(2000, bad_every=10))
    archive = package_zip(tmp_path)
    names = set(zipfile.ZipFile(archive).namelist())
    assert {"spark_analytics/source.py", "spark_analytics/framing.py", "store/log/record.py", "store/__init__.py"} <= names
    shipped = {"store/log/record.py", "store/__init__.py", "store/api.py", "store/usage.py", "store/log/__init__.py",
               "store/tierfiles.py", "store/rpc/__init__.py", "store/rpc/wire.py", "store/space.py",
               "store/log/errors.py"}
    assert not any(n.startswith("store/") and n not in shipped for n in names)  # no trio, RocksDB, CommitLog
    reader = CommitLogReader(ReaderOptions.parse({"path": str(tmp_path), "parse": "telemetry",
                                                 "telemetry.metrics": "temp,hum", "partitionBytes": "40000"}))
    work = tmp_path / "work.pickle"
    work.write_bytes(pickle.dumps((reader, reader.partitions())))
    # -S: no site-packages .pth files, so the editable install of the project is invisible;
    # the dependencies come from site-packages, the project code only from the zip.
    script = (
        "import sys, pickle\n"
        f"sys.path[:0] = [{str(archive)!r}]\n"
        f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
        f"reader, parts = pickle.loads(open({str(work)!r}, 'rb').read())\n"
        "import spark_analytics\n"
        f"assert spark_analytics.__file__.startswith({str(archive)!r}), spark_analytics.__file__\n"
        "batches = [b for p in parts for b in reader.read(p)]\n"
        "print(sum(b.num_rows for b in batches), sum(b.column('error').null_count for b in batches))\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2000", "1800"]
