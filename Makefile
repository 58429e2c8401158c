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

.PHONY: setup lock up down status demo test test-fast chaos lint bench clean-run

# Installs what is missing (Debian packages, this checkout's .venv from uv.lock, Kafka jars, MinIO
# binary, model, and the Go tool that renders/validates deploy/). Heavy downloads are cached in
# ~/.cache/llmbatch; the .venv is the checkout's own (hard-linked from uv's cache).
setup:
	bash scripts/bootstrap.sh

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
lint:
	bash scripts/lock.sh --check
	.venv/bin/ruff check .
	MYPY_CACHE_DIR="$${LLMBATCH_CACHE:-$$HOME/.cache/llmbatch}/mypy" .venv/bin/mypy

# The whole suite. Tests start their own services on free ports and stop them by PID; each worker
# (PYTEST_WORKERS) has its own.
# pytest exit 5 (nothing collected) counts as a failure: a suite that ran nothing proves nothing.
# Line coverage per package is printed at the end (scripts/coverage_by_package.py).
test: setup lint
	@rm -f .coverage .coverage.*; $(PY) -m pytest --cov --cov-report= $(if $(filter-out 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; \
	$(PY) scripts/coverage_by_package.py || true; exit $$rc

# The full chaos suite (llmbatch/chaos): 200 batches and 1,000 malformed records on a private local
# stack while dispatcher replicas, job drivers, Redis, Kafka, MinIO and the Ray head are killed (twice
# each); prints the verdict table, exits 1 on any broken promise. Each batch runs as a Ray job;
# CHAOS_ARGS=--shared-engines runs them on the shared engines (the service's default) and kills the
# batch runner's replica instead of job drivers. The short version of both runs in `make test`
# (tests/e2e/test_chaos.py).
chaos: setup
	$(PY) -m llmbatch.chaos $(CHAOS_ARGS)

# Unit tests only: no services, seconds.
test-fast:
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

clean-run: down
	rm -rf run
