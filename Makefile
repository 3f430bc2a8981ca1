# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit integration bench dev clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m workers.demo examples/hello.yaml

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not integration'

integration: $(STAMP)
	$(BIN)/python -m pytest -q -m integration

bench: $(STAMP)
	$(BIN)/python -m bench.runs

dev: $(STAMP)
	$(BIN)/astraeus dev

clean:
	rm -rf $(VENV) .astraeus .pytest_cache .mypy_cache .ruff_cache
