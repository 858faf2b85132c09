# Two commands on a fresh machine: `make run` and `make test`. Everything else is a step of those.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test test-fast bench bench-peers clean

venv: $(STAMP)

# Re-install only when pyproject.toml changed (the stamp is older than it).
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

run: venv
	$(BIN)/lightgate serve $(ARGS)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -m "not slow and not spark" $(PYTEST_ARGS)

bench: venv
	$(BIN)/lightgate bench all $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
