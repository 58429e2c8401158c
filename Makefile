# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
LLMBATCH := .venv/bin/llmbatch
PYTEST_ARGS ?=

.PHONY: setup up down status demo test test-fast lint bench clean-run

# Installs what is missing (Debian packages, cached venv, Kafka jars, MinIO binary, model, and the
# Go tool that renders/validates deploy/). Everything heavy is cached in ~/.cache/llmbatch.
setup:
	bash scripts/bootstrap.sh
	$(LLMBATCH) stack prepare
	$(PY) scripts/validate_deploy.py --build

up: setup
	$(LLMBATCH) stack up

down:
	@if [ -x $(LLMBATCH) ]; then $(LLMBATCH) stack down; else echo "nothing to stop"; fi

status:
	$(LLMBATCH) stack status

demo: setup
	$(PY) -m llmbatch.demo

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy

# The whole suite. Tests start their own services on free ports and stop them by PID.
# pytest exit 5 (nothing collected) counts as a failure: a suite that ran nothing proves nothing.
test: setup lint
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# Unit tests only: no services, seconds.
test-fast:
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

clean-run: down
	rm -rf run
