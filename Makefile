# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
LLMBATCH := .venv/bin/llmbatch
PYTEST_ARGS ?=
# `make test` runs on this many pytest-xdist workers, a test file per worker at a time (a file's
# module fixtures set up once); each worker starts its own services. 1: one process, as before.
# Files are handed out in testpaths order (the e2e files, minutes each, first), not xdist's default
# "most tests first", which left the longest files to the end and one worker idle meanwhile.
PYTEST_WORKERS ?= 2

.PHONY: setup setup-test setup-deploy lock up down status demo test test-deploy test-fast chaos lint clean-run

# Set-up in tiers (scripts/bootstrap.sh), each installing only what is missing, from locks; heavy
# downloads are cached in ~/.cache/llmbatch, the .venv is the checkout's own (hard-linked from uv's
# cache). `setup`: what the stack and the demo run (Redis and tcmalloc from Debian, the .venv without
# the test tools, Kafka jars, MinIO, the model). `setup-test`: + the test and lint tools and the Go tool
# that validates deploy/. `setup-deploy`: the deploy tests' Kubernetes, built from Go (root; 15-20 min
# of CPU the first time).
setup:
	bash scripts/bootstrap.sh demo

setup-test:
	bash scripts/bootstrap.sh test

setup-deploy: setup-test
	bash scripts/bootstrap.sh deploy

# Re-resolve the lock on purpose (newer versions within pyproject.toml's ranges) and export the
# hashed requirement files the Docker images install. Commit uv.lock and requirements/lock/.
lock:
	bash scripts/lock.sh

up: setup
	$(LLMBATCH) stack up

down:
	@if [ -x $(LLMBATCH) ]; then $(LLMBATCH) stack down; else echo "nothing to stop"; fi

status:
	$(LLMBATCH) stack status

demo: setup
	$(PY) -m llmbatch.demo

# the lock check fails when pyproject.toml, uv.lock and requirements/lock/ disagree. mypy keeps its
# incremental cache in the shared cache, so a fresh clone re-checks only what differs from the last
# check there (it validates each entry by the source's hash; 78 s -> 2-3 s here, measured).
lint: setup-test
	bash scripts/lock.sh --check
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	MYPY_CACHE_DIR="$${LLMBATCH_CACHE:-$$HOME/.cache/llmbatch}/mypy" .venv/bin/mypy
	.venv/bin/lint-imports

# The whole suite. Tests start their own services on free ports and stop them by PID; each worker
# (PYTEST_WORKERS) has its own.
# pytest exit 5 (nothing collected) counts as a failure: a suite that ran nothing proves nothing.
# Line coverage per package is printed at the end (scripts/coverage_by_package.py).
# As root (CI) the deploy tier is built first and its tests run; otherwise they are skipped, and the
# run says so (tests/conftest.py).
test: setup-test lint
	@if [ "$$(id -u)" = 0 ]; then bash scripts/bootstrap.sh deploy; \
	else echo "[test] not root: the deploy tier (tests marked deploy) is skipped; sudo make test-deploy runs it"; fi
	@rm -f .coverage .coverage.*; $(PY) -m pytest --cov --cov-report= $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; \
	$(PY) scripts/coverage_by_package.py || true; exit $$rc

# The full chaos suite (llmbatch/chaos): 200 batches and 1,000 malformed records on a private local
# stack while dispatcher replicas, job drivers, Redis, Kafka, MinIO and the Ray head are killed (twice
# each, the services kept down 120 s: --down), the tracker's leader and the batch runner's replicas are
# frozen (SIGSTOP) for 60 s (--pause), Redis is cut off from the dispatchers and MinIO resets every
# connection (uploads mid-write included) for as long, Redis is brought back from a copy 60 s old, the
# leader of a partition of a three-broker Kafka is killed, and the job side's clock runs two minutes
# ahead (libfaketime, installed by the test tier); prints the verdict table, exits 1 on any broken
# promise. Each batch runs as a Ray job;
# CHAOS_ARGS=--shared-engines runs them on the shared engines (the service's default) and kills the
# batch runner's replica instead of job drivers. The short version of both runs in `make test`
# (tests/e2e/test_chaos.py).
chaos: setup-test
	$(PY) -m llmbatch.chaos $(CHAOS_ARGS)

# The deploy tier alone (a real Kubernetes, network namespaces, iptables, cgroups): needs root.
test-deploy: setup-deploy
	$(PY) -m pytest -m deploy $(PYTEST_ARGS)

# Unit tests only: no services, seconds.
test-fast:
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

clean-run: down
	rm -rf run
