"""Packaging: the base install is the broker, the extras add the rest; the wheel runs without the checkout; the
version has one source; the systemd unit and the Dockerfile hold together (docs/operations.md#install)."""

from __future__ import annotations

import configparser
import http.client
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
import uuid
import venv
import zipfile
from pathlib import Path

import pytest

from gateway import __version__
from gateway.app import config as cfg
from gateway.app.cli import build_parser
from tests.helpers.mqtt_fixtures import WAIT_S, connected
from tests.helpers.processes import LightgateProcess

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BASE_COMMANDS = ("serve", "store", "gateway", "bridge", "passwd", "config")
OPTIONAL_MODULES = ("store.tier", "store.tierfiles", "gateway.app.certs", "gateway.bench.")
"""The Parquet tier: the store imports it only when ``tier.uri`` is set, and says to install the tier extra
when pyarrow is missing (store/node.py, ``open_store``); the test CA of ``lightgate tls-certs`` (the tls extra);
the benchmarks' modules (the bench extra). Prefixes of module names."""
"""The commands the base install must run (the others need an extra)."""

PACKAGES = ("gateway", "store", "lightqueue", "notify", "retain", "spark_analytics")
"""Every top-level package of the wheel (pyproject's find include), and nothing else: the benchmarks are
gateway/bench/, their results (bench/results/) are the checkout's data."""

HEAVY = {"pyspark", "pyarrow", "pandas", "numpy", "matplotlib", "amqtt", "rich", "psutil", "hdrhistogram",
         "selenium", "pytest", "hypothesis"}
"""What the base install must not pull in (the 1.1 GB that made `make run` slow)."""

OPTIONAL = {
    "tls-certs --out pki --host localhost": "lightgate tls-certs needs the tls extra: {pip} 'lightgate[tls]'",
    "analytics": "lightgate analytics needs the analytics extra: {pip} 'lightgate[analytics]'",
    "simulate": "lightgate simulate needs the bench extra: {pip} 'lightgate[bench]'",
    "bench fanin": "lightgate bench needs the bench extra: {pip} 'lightgate[bench]'",
    "bench report": "lightgate bench needs the bench extra: {pip} 'lightgate[bench]'",
    "bench analytics": "lightgate bench analytics needs the bench and analytics extras: "
                       "{pip} 'lightgate[bench,analytics]'",
}
"""Command line -> the one line that refuses it on the base install; ``{pip}`` is the venv's pip, told to look in
the directory of the wheel it was installed from (tests/gateway/app/test_extras.py: the checkout's lines)."""


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group())


def extras_only() -> set[str]:
    """What the extras require that the base install does not (their direct requirements, by name)."""
    extras = {requirement_name(r) for rs in PYPROJECT["project"]["optional-dependencies"].values() for r in rs}
    return extras - {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]} - {"lightgate"}


def test_the_version_has_one_source():
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gateway.__version__"}
    done = subprocess.run([sys.executable, "-m", "gateway.app.cli", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"lightgate {__version__}\n"


def test_broker_commands_load_only_base_dependencies():
    """Every module of the broker's packages, and each base command's parser, import nothing of the analytics,
    bench or dev extras (optional imports of other packages, e.g. msgspec's of typing_extensions, are theirs)."""
    script = (
        "import importlib, json, pkgutil, sys\n"
        "from importlib import metadata\n"
        "before = set(sys.modules)\n"
        "from gateway.app.cli import build_parser\n"
        f"for command in {BASE_COMMANDS!r}:\n"
        "    build_parser([command])\n"
        "for package in ('gateway', 'store', 'lightqueue', 'notify', 'retain'):\n"
        "    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + '.'):\n"
        f"        if not info.name.startswith({OPTIONAL_MODULES!r}):\n"
        "            importlib.import_module(info.name)\n"
        "tops = {name.split('.')[0] for name in set(sys.modules) - before}\n"
        "dists = metadata.packages_distributions()\n"
        "print(json.dumps(sorted({d for top in tops for d in dists.get(top, [])})))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    used = {normalized(d) for d in json.loads(done.stdout)}
    assert {"trio", "rocksdict", "h11"} <= used, "the broker's own dependencies must show: else this proves nothing"
    assert not used & (extras_only() | HEAVY)


def test_extras_hold_the_heavy_packages_and_dev_holds_them_all():
    extras = PYPROJECT["project"]["optional-dependencies"]
    base = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not base & HEAVY
    assert {"pyspark", "pyarrow", "pandas", "numpy"} <= {requirement_name(r) for r in extras["analytics"]}
    assert {"amqtt", "hdrhistogram", "psutil", "rich"} <= {requirement_name(r) for r in extras["bench"]}
    assert "lightgate[analytics,bench,tier,tls]" in extras["dev"]  # make test installs the extras through dev
    assert {requirement_name(r) for r in extras["tls"]} == {"cryptography"}  # lightgate tls-certs
    assert {requirement_name(r) for r in extras["tier"]} == {"pyarrow"}  # the store's Parquet tier (tier.uri)
    assert {"pytest", "selenium", "build"} <= {requirement_name(r) for r in extras["dev"]}


# --- the systemd unit ---------------------------------------------------------------------------------------

UNIT = ROOT / "gateway" / "app" / "lightgate.service"


def unit_service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def test_the_unit_runs_serve_as_a_notify_service_reloaded_by_sighup():
    service = unit_service()
    assert service["Type"] == "notify"  # gateway/app/sdnotify.py sends READY=1 (tests/gateway/app/test_sdnotify.py)
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["Restart"] == "on-failure"
    assert service["User"] == "lightgate" and service["StateDirectory"] == "lightgate"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    program, *args = shlex.split(service["ExecStart"])
    assert program.endswith("/bin/lightgate") and args[0] == "serve"
    conf = cfg.resolve(build_parser(args).parse_args(args))  # flags `lightgate serve` accepts
    assert conf["node.data"] == "/var/lib/" + service["StateDirectory"]  # the directory systemd makes writable


def systemd_verify(unit_text: str, directory: Path) -> None:
    """``systemd-analyze verify`` accepts the unit: it exits 0 on unknown keys and bad values and only warns, so
    any output is a failure (it also checks that ExecStart's program exists and is executable)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    unit = directory / "lightgate.service"
    unit.write_text(unit_text)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], cwd=directory, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def exec_start(unit_text: str) -> list[str]:
    (line,) = [line for line in unit_text.splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def test_systemd_analyze_verifies_the_unit_this_install_prints(tmp_path):
    """``lightgate systemd-unit`` in the test environment (an editable install of a checkout, not under /opt)."""
    lightgate = Path(sys.executable).with_name("lightgate")
    if not lightgate.exists():
        pytest.skip(f"no lightgate script next to {sys.executable} for ExecStart (pip install -e .)")
    done = subprocess.run([str(lightgate), "systemd-unit"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert exec_start(done.stdout) == [str(lightgate), "serve", "--data", "/var/lib/lightgate"]
    systemd_verify(done.stdout, tmp_path)


def test_a_checkout_that_is_not_installed_prints_a_unit_running_its_python_with_the_checkout_on_its_path(tmp_path):
    python = tmp_path / "bare python"  # no lightgate script beside it; a space, which ExecStart must quote
    python.mkdir()
    (python / "python").symlink_to(sys.executable)
    done = subprocess.run([str(python / "python"), "-m", "gateway.app.cli", "systemd-unit"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert exec_start(done.stdout)[:3] == [str(python / "python"), "-m", "gateway.app.cli"]
    assert f'Environment="PYTHONPATH={ROOT}"' in done.stdout or f"Environment=PYTHONPATH={ROOT}" in done.stdout
    assert "PrivateTmp=no" in done.stdout.splitlines()  # the service's own empty /tmp would hide this python
    systemd_verify(done.stdout, tmp_path)


def test_an_install_in_a_home_directory_stays_visible_to_the_service(tmp_path):
    from gateway.app.unit import render_unit

    text = render_unit(["/home/alice/venvs/lightgate 1/bin/lightgate"])
    assert exec_start(text) == ["/home/alice/venvs/lightgate 1/bin/lightgate", "serve", "--data", "/var/lib/lightgate"]
    assert "ProtectHome=read-only" in text.splitlines() and "PrivateTmp=yes" in text.splitlines()
    assert render_unit(["/opt/lightgate/bin/lightgate"]) == UNIT.read_text()  # the shipped unit is /opt's


# --- the Dockerfile -----------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in (ROOT / "Dockerfile").read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip()]


def test_the_dockerfile_builds_from_the_checkout_and_runs_serve_as_a_user():
    steps = dockerfile()
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    assert len(stages) == 2, "multi-stage: the wheels are built apart from the image that runs them"
    copied = set()
    for op, rest in steps[:stages[1]]:
        if op == "COPY":
            *sources, _ = rest.split()
            copied.update(sources)
    for source in copied:
        assert (ROOT / source).exists(), source
    assert {"pyproject.toml", "README.md", *PACKAGES} <= copied, "the wheel needs every package"
    final = dict(steps[stages[1]:])  # the last of each instruction in the final stage
    assert final["USER"] not in ("root", "0")
    entry = json.loads(final["ENTRYPOINT"]) + json.loads(final["CMD"])
    assert entry[:2] == ["lightgate", "serve"]
    conf = cfg.resolve(build_parser(entry[1:]).parse_args(entry[1:]))
    assert final["VOLUME"] == conf["node.data"]
    assert set(final["EXPOSE"].split()) == {str(conf["node.port"]), str(conf["admin.port"])} == {"1883", "18083"}
    assert conf["node.host"] == conf["admin.host"] == "0.0.0.0"  # reachable through published ports
    assert f"http://127.0.0.1:{conf['admin.port']}/healthz" in final["HEALTHCHECK"]


# --- the wheel, installed without the checkout --------------------------------------------------------------


def clean_env() -> dict[str, str]:
    """This environment without what would put the checkout or another venv on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def build_ignore(directory: str, names: list[str]) -> set[str]:
    """What a copy of the checkout leaves out: VCS, virtualenvs, caches, build output, node data."""
    skipped = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "data"}
    return {n for n in names if n in skipped or n.endswith(".egg-info")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel of the checkout, built by ``python -m build`` (the wheel from the sdist) in a copy,
    so the checkout gets no build output."""
    work = tmp_path_factory.mktemp("packaging")
    shutil.copytree(ROOT, work / "src", ignore=build_ignore)
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(work / "src")],
                          cwd=work, capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "dist"


@pytest.fixture(scope="module")
def base_venv(dist, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed, base only (the index or pip's cache supplies the
    dependencies)."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    venv.create(where, with_pip=True)
    (wheel,) = dist.glob("*.whl")
    done = subprocess.run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return where


@pytest.mark.slow
def test_the_wheel_holds_the_packages_the_dashboard_and_the_split_requirements(dist):
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name == f"lightgate-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"lightgate-{__version__}.dist-info/METADATA").decode()
    assert "gateway/ops/dashboard.html" in names  # served by GET /
    assert "gateway/app/lightgate.service" in names  # printed by lightgate systemd-unit
    assert {name.split("/")[0] for name in names} == {*PACKAGES, f"lightgate-{__version__}.dist-info"}
    assert {f"{p}/__init__.py" for p in PACKAGES} | {"gateway/bench/__init__.py"} <= names  # lightgate bench imports it
    requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.MULTILINE)
    base = {requirement_name(r) for r in requires if "extra ==" not in r}
    assert base == {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert any(r.startswith("pyspark") and 'extra == "analytics"' in r for r in requires)
    extras = {"analytics", "bench", "dev", "tier", "tls"}
    assert set(re.findall(r"^Provides-Extra: (.*)$", meta, re.MULTILINE)) == extras
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "gateway/ops/dashboard.html", "tests/test_packaging.py", "gateway/app/lightgate.service",
            "Dockerfile", "Makefile"} <= members


@pytest.mark.slow
def test_the_base_install_serves_mqtt_from_the_wheel_without_the_checkout(base_venv, tmp_path):
    lightgate = base_venv / "bin" / "lightgate"
    where = subprocess.run([str(base_venv / "bin" / "python"), "-c", "import gateway; print(gateway.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60, env=clean_env())
    assert Path(where.stdout.strip()).is_relative_to(base_venv), where
    node = LightgateProcess("serve", "--port", "0", "--data", str(tmp_path / "data"), command=[str(lightgate)],
                            cwd=tmp_path, env=clean_env())
    try:
        port = node.ready("gateway node ready")
        admin_port = node.wait_log(lambda doc: doc.get("msg") == "admin API ready")["port"]
        topic = f"wheel/{uuid.uuid4().hex[:8]}"
        with connected(port) as sub, connected(port) as pub:
            sub.subscribe(topic, 1)
            pub.publish(topic, b"from the wheel", 1)
            (message,) = sub.receive(1)
        assert (message.topic, message.payload) == (topic, b"from the wheel")
        conn = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=WAIT_S)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.request("GET", "/")  # the dashboard page, a data file of the wheel
        page = conn.getresponse()
        assert (page.status, page.getheader("content-type").split(";")[0]) == (200, "text/html")
        page.read()
        conn.close()
        assert f'lightgate_build_info{{version="{__version__}"}} 1.0' in metrics
    finally:
        node.stop()
    assert node.proc.returncode == 0
    assert not node.errors()


@pytest.mark.slow
def test_the_base_install_names_the_extra_each_optional_command_needs(base_venv, dist, tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(base_venv / "bin" / "lightgate"), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env=clean_env())

    pip = f"{base_venv / 'bin' / 'python'} -m pip install --find-links {dist}"
    for command, line in OPTIONAL.items():
        done = run(*command.split())
        assert (done.returncode, done.stdout, done.stderr) == (2, "", line.format(pip=pip) + "\n")
    assert run("--version").stdout == f"lightgate {__version__}\n"
    # gateway.bench and spark_analytics are in the wheel (importable), only usable with their extras; an installed
    # wheel keeps the benchmarks' results under the working directory, not in site-packages.
    imported = subprocess.run([str(base_venv / "bin" / "python"), "-c", "import spark_analytics\n"
                               "from gateway.bench.common import RESULTS_DIR\nprint(RESULTS_DIR.resolve())"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, env=clean_env())
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout == f"{tmp_path.resolve() / 'bench' / 'results'}\n"


@pytest.mark.slow
def test_the_wheel_prints_a_unit_systemd_verifies_for_its_own_install(base_venv, tmp_path):
    lightgate = base_venv / "bin" / "lightgate"
    done = subprocess.run([str(lightgate), "systemd-unit"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert done.returncode == 0, done.stderr
    assert exec_start(done.stdout) == [str(lightgate), "serve", "--data", "/var/lib/lightgate"]
    systemd_verify(done.stdout, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["serve", "--port", "0", "--admin-port", "0"],
                                     ["store", "--listen", "127.0.0.1:0"]], ids=["serve", "store"])
def test_the_base_install_refuses_a_tier_with_one_line_naming_the_tier_extra(base_venv, dist, tmp_path, command):
    """``tier.uri`` set on a node without pyarrow: no traceback, exit 1, one line saying what to install, with the
    venv's pip and the wheel's directory."""
    done = subprocess.run([str(base_venv / "bin" / "lightgate"), *command,
                           "--data", str(tmp_path / "data"), "--tier-uri", str(tmp_path / "tier"), "--log-json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 1
    errors = [json.loads(line) for line in done.stderr.splitlines() if '"error"' in line]
    pip = f"{base_venv / 'bin' / 'python'} -m pip install --find-links {dist}"
    assert len(errors) == 1 and f"needs the tier extra: {pip} 'lightgate[tier]'" in errors[0]["msg"], done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "data").exists()
