# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: screenshots demo test lint typecheck unit integration bench bench-burst chaos bench-containers dev clean engine

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(RUN_STAMP) $(STAMP)

# What running needs, without the test tools: `make demo` installs only this.
$(RUN_STAMP): pyproject.toml
	@echo "Installing Astraeus and what it runs on into $(VENV) (once; about a minute)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --progress-bar off -e .
	touch $(RUN_STAMP)

demo: $(RUN_STAMP)
	$(BIN)/python -m workers.demo examples/hello.yaml

# `make test` (what CI runs) and `make integration` allow no skip: a suite that cannot run here (no dockerd,
# not root) fails, saying why (tests/conftest.py). `make test REQUIRE_ALL_SUITES=0` lets such suites skip.
REQUIRE_ALL_SUITES ?= 1
# Two processes (pytest-xdist): CI's machine has two cores, and one process left half of them idle, waiting on servers
# and timers. tests/conftest.py keeps each module on one process and the tests that share this machine's one-of-a-kind
# things (default ports, the Docker engine, network namespaces, memory cgroups) on one, one after another.
# The tests marked `alone` keep both cores busy themselves; they run after the others, on one process, so that no
# test that waits for a heartbeat or a timer runs beside them.
TEST_PROCESSES ?= 2
PARALLEL := -n $(TEST_PROCESSES)

test: $(STAMP) lint typecheck engine
	REQUIRE_ALL_SUITES=$(REQUIRE_ALL_SUITES) $(BIN)/python -m pytest -q $(PARALLEL) -m 'not alone'
	REQUIRE_ALL_SUITES=$(REQUIRE_ALL_SUITES) $(BIN)/python -m pytest -q -m 'alone'

# The tests start their own Docker engine, build a fake NVML and check deploy/compose.yaml: Debian's docker.io,
# busybox-static (the rootfs of the test image), gcc and docker-compose, runsc (gVisor, the engine's sandbox runtime:
# tests/integration/test_docker_capabilities.py), and Debian's chromium and chromium-driver
# (tests/integration/test_console.py drives the console in it with Selenium), and WireGuard in userspace
# (wireguard-go, wireguard-tools: tests/integration/test_mesh.py), installed when missing (as root, like CI).
# Skipped when all are there.
engine:
	@if command -v dockerd >/dev/null && command -v docker >/dev/null && test -x /bin/busybox \
		&& command -v gcc >/dev/null && command -v docker-compose >/dev/null && test -x /usr/bin/runsc \
		&& command -v chromium >/dev/null && command -v chromedriver >/dev/null \
		&& command -v wireguard-go >/dev/null && command -v wg >/dev/null; then :; else \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			docker.io busybox-static gcc libc6-dev docker-compose runsc chromium chromium-driver \
			wireguard-go wireguard-tools; fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not integration'

integration: $(STAMP) engine
	REQUIRE_ALL_SUITES=$(REQUIRE_ALL_SUITES) $(BIN)/python -m pytest -q $(PARALLEL) -m 'integration and not alone'
	REQUIRE_ALL_SUITES=$(REQUIRE_ALL_SUITES) $(BIN)/python -m pytest -q -m 'integration and alone'

bench: $(STAMP)
	$(BIN)/python -m bench.runs

# A burst of one-GPU runs on machines of 8 GPUs, each a real agent, against the Temporal floor (bench/README.md).
bench-burst: $(STAMP)
	$(BIN)/python -m bench.burst $(ARGS)

# kill -9 of each process in turn under a burst of one-GPU runs, then checks: 0 runs lost, 0 workers started twice,
# 0 GPUs held twice, true reasons; and what each fault cost (bench/README.md). Flags through ARGS="--runs 300".
chaos: $(STAMP)
	$(BIN)/python -m bench.chaos $(ARGS)

bench-containers: $(STAMP) engine
	$(BIN)/python -m bench.containers

# PNGs of the console's main pages in docs/ (README "The console"), taken in headless chromium on a small cluster.
screenshots: $(STAMP) engine
	$(BIN)/python -m tests.integration.screenshots

dev: $(RUN_STAMP)
	$(BIN)/astraeus dev

clean:
	rm -rf $(VENV) .astraeus .pytest_cache .mypy_cache .ruff_cache
