# Two commands on a fresh machine: `make run` and `make test`. Everything else is a step of those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed-base
DEV := $(VENV)/.installed-dev

.PHONY: venv venv-dev run test test-deps test-fast bench bench-peers dist clean compiled pure

# `make run` needs the broker only: the base install. `make test` and `make bench` need everything: the dev
# extra (the analytics and bench extras, the test tools). A stamp is remade only when pyproject.toml changed;
# a dev install is a base install too, so it refreshes both stamps (`make run` after `make test` installs
# nothing, `make test` after `make run` installs the rest).
venv: $(BASE)

venv-dev: $(DEV)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(BASE): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(DEV): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@ $(BASE)

# The MQTT codec compiled with mypyc (docs/benchmarks.md#compiled-codec): opt-in, never needed. `make compiled`
# builds it in place beside its sources, which stay the reference; without mypy or a C compiler, or when the build
# fails, it says so and leaves the pure-Python codec (exit 0). A build, once made, is remade by `make run` and
# `make test` when its sources changed; `make pure` removes it. The suite runs against whichever is in place.
CODEC := gateway/mqtt/properties.py gateway/mqtt/codec.py
COMPILED := build/compiled/manifest.json
RECOMPILE := $(if $(wildcard $(COMPILED)),$(COMPILED))

compiled: venv
	@$(BIN)/python -m pip install --quiet 'mypy>=2.4,<3' \
		|| echo "compiled: could not install mypy: the build below will say so"
	$(BIN)/python packaging/compile_codec.py

$(COMPILED): $(CODEC) packaging/compile_codec.py
	$(BIN)/python packaging/compile_codec.py

pure: venv
	$(BIN)/python packaging/compile_codec.py --remove

run: venv $(RECOMPILE)
	$(BIN)/lightgate serve $(ARGS)

# The interop tests drive mosquitto_pub/mosquitto_sub, the password tests read files mosquitto_passwd (Debian's
# mosquitto package) writes, and the dashboard test drives Debian's chromium through
# chromium-driver (Selenium, never a downloaded browser), and the replicated-store tests start their own etcd
# (Debian's etcd-server; etcdctl from etcd-client for a look at its keys); they skip (saying why) when these cannot
# be installed.
test-deps:
	@if command -v mosquitto_pub >/dev/null 2>&1 && command -v mosquitto_passwd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "test-deps: mosquitto_pub or mosquitto_passwd missing and not root: mosquitto tests will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "test-deps: mosquitto_pub missing and no apt-get: mosquitto tests will skip"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto-clients mosquitto) \
		|| echo "test-deps: could not install mosquitto-clients and mosquitto: mosquitto tests will skip"; fi
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "test-deps: chromium or chromium-driver missing and not root: the dashboard test will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "test-deps: chromium missing and no apt-get: the dashboard test will skip"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
		|| echo "test-deps: could not install chromium and chromium-driver: the dashboard test will skip"; fi
	@if command -v etcd >/dev/null 2>&1 && command -v etcdctl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "test-deps: etcd or etcdctl missing and not root: the replicated-store tests will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "test-deps: etcd missing and no apt-get: the replicated-store tests will skip"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client) \
		|| echo "test-deps: could not install etcd-server and etcd-client: the replicated-store tests will skip"; fi

# The suite runs on TEST_WORKERS pytest-xdist workers: most tests wait on sockets and lightgate processes, not
# on a core, so more workers than CI's two cores pay. Each worker takes whole modules (--dist loadfile: a
# module's fixtures, a node or a wheel, are built once), the Spark modules first (tests/conftest.py orders them;
# --no-loadscope-reorder keeps that order). docs/architecture.md#5-how-the-suite-runs has the measured split.
# TEST_WORKERS=0 (or PYTEST_ARGS="-n 0") runs the tests in one process, one at a time.
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: venv-dev test-deps $(RECOMPILE)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: venv-dev test-deps $(RECOMPILE)
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not spark" $(PYTEST_ARGS)

bench: venv-dev bench-peers
	$(BIN)/lightgate bench all $(ARGS)

# The brokers the gateway benchmarks compare against: Mosquitto from Debian (installed when missing and we
# are root; its package may start a system service, which the benchmarks ignore: they start their own on a
# free port), amqtt from the project's dependencies.
bench-peers: venv-dev
	@command -v mosquitto >/dev/null || { test "$$(id -u)" = 0 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto; } \
		|| echo "bench-peers: mosquitto is missing and we are not root; its runs will be skipped"
	@$(BIN)/python -c "import amqtt" || echo "bench-peers: amqtt is missing (run make venv-dev); its runs will be skipped"

# The wheel and the sdist in dist/ (pip install dist/lightgate-*.whl, or 'lightgate[analytics]' with
# --find-links dist); docs/operations.md#install.
dist: venv-dev
	$(BIN)/python -m build --outdir dist .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist gateway/mqtt/*.so
