# Goodput Gateway: `make run` starts a local stack, `make test` runs every check.
# Both install what is missing (into .venv and .venv-worker inside this folder) first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GATEWAY_PORT ?= 8000
WORKER_PORT ?= 8100
# pip's download cache stays inside the clone too (gitignored), not in ~/.cache.
export PIP_CACHE_DIR ?= $(CURDIR)/.run/cache/pip

.PHONY: help install compile worker ops-tools redis router run test lint typecheck unit bench bench-routing bench-admission bench-fairness clean

help:
	@echo "make run    - start a vLLM CPU worker and the gateway in front of it (port $(GATEWAY_PORT))"
	@echo "make test   - lint, type-check and run the whole test suite against a real vLLM worker"
	@echo "make bench  - gateway overhead benchmark (prints a table)"
	@echo "make bench-routing   - the routing policies compared on two real workers"
	@echo "make bench-admission - admission on vs off from 0.25x to 3x capacity (real workers;"
	@echo "                       ARGS=\"--engine sim\": four simulated GPU-scale ones)"
	@echo "make bench-fairness  - keys of one tier sharing a saturated worker (fake worker)"
	@echo "make unit   - the tests that need no vLLM worker"

# The per-request decision modules, compiled with mypyc beside their sources (scripts/compile.py).
COMPILED := $(shell sed -n 's/^    "\(app\/.*\.py\)",$$/\1/p' scripts/compile.py)
NATIVE := .run/mypyc/.compiled

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

$(NATIVE): $(STAMP) scripts/compile.py $(COMPILED)
	$(BIN)/python -m scripts.compile
	touch $@

install: $(STAMP) $(NATIVE)

worker:
	bash scripts/install_worker.sh

ops-tools:
	bash scripts/install_ops_tools.sh

# vllm-router (Rust), the reference `make bench` measures beside the gateway.
router:
	bash scripts/install_router.sh

# redis-server for the tests of state shared between gateway processes (Debian's package).
redis:
	bash scripts/install_redis.sh

run: install worker
	$(BIN)/python -m scripts.run_stack --gateway-port $(GATEWAY_PORT) --worker-port $(WORKER_PORT)

compile: $(NATIVE)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

test: lint typecheck worker ops-tools redis
	$(BIN)/pytest

unit: install redis
	$(BIN)/pytest -m "not worker"

bench: install router
	$(BIN)/python -m bench.overhead

bench-routing: install worker
	$(BIN)/python -m bench.routing

bench-admission: install worker
	$(BIN)/python -m bench.admission $(ARGS)

bench-fairness: install
	$(BIN)/python -m bench.fairness $(ARGS)

clean:
	test ! -x $(BIN)/python || $(BIN)/python -m scripts.compile --clean
	rm -rf $(VENV) .venv-worker .venv-ops .venv-router .run .mypy_cache .ruff_cache .pytest_cache
