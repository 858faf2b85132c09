# Two commands on a fresh machine: `make run` and `make test`. Everything else is a step of those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test test-deps test-fast bench bench-peers clean

venv: $(STAMP)

# Re-install only when pyproject.toml changed (the stamp is older than it).
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: venv
	$(BIN)/lightgate serve $(ARGS)

# The interop tests drive mosquitto_pub/mosquitto_sub and the dashboard test drives Debian's chromium through
# chromium-driver (Selenium, never a downloaded browser); they skip (saying why) when these cannot be installed.
test-deps:
	@if command -v mosquitto_pub >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "test-deps: mosquitto_pub missing and not root: mosquitto tests will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "test-deps: mosquitto_pub missing and no apt-get: mosquitto tests will skip"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto-clients) \
		|| echo "test-deps: could not install mosquitto-clients: mosquitto tests will skip"; fi
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "test-deps: chromium or chromium-driver missing and not root: the dashboard test will skip"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "test-deps: chromium missing and no apt-get: the dashboard test will skip"; \
	else (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
		|| echo "test-deps: could not install chromium and chromium-driver: the dashboard test will skip"; fi

test: venv test-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv test-deps
	$(BIN)/python -m pytest -m "not slow and not spark" $(PYTEST_ARGS)

bench: venv bench-peers
	$(BIN)/lightgate bench all $(ARGS)

# The brokers the gateway benchmarks compare against: Mosquitto from Debian (installed when missing and we
# are root; its package may start a system service, which the benchmarks ignore: they start their own on a
# free port), amqtt from the project's dependencies.
bench-peers: venv
	@command -v mosquitto >/dev/null || { test "$$(id -u)" = 0 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto; } \
		|| echo "bench-peers: mosquitto is missing and we are not root; its runs will be skipped"
	@$(BIN)/python -c "import amqtt" || echo "bench-peers: amqtt is missing (run make venv); its runs will be skipped"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
