# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap first:
# a virtualenv in .venv (created once, never recreated), the project installed into it
# whenever pyproject.toml changes, and a redis-server on PATH.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Touched after a successful install; older than pyproject.toml means reinstall.
INSTALLED := $(VENV)/.tokenwire-installed
PYTEST_ARGS ?=
# Test processes: most tests wait on child processes (workers, gateways, Redis), so two
# keep a 2-core machine busy where one leaves a core idle.
TEST_WORKERS ?= 2
LINT_PATHS := protocol worker gateway clients ops bench tests

.PHONY: help bootstrap system-deps run test lint bench plots test-gpu

help:
	@echo "make run       bootstrap, then run the main job (see README.md)"
	@echo "make test      bootstrap, then run the whole test suite"
	@echo "make lint      ruff + mypy"
	@echo "make bench     benchmarks, one table per section"
	@echo "make plots     docs/img/ images from the saved bench results (bench/plots.py)"
	@echo "make test-gpu  GPU tests with the system python on a CUDA host (no venv, no install)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# The grep drops pip's warnings about index folders this machine's pip config names
# but lacks; everything else pip prints stays.
$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test,dev]' 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
	touch $@

# Debian packages: redis-server (required) and systemd (for systemd-analyze, which
# checks the unit files in ops/). Installed only when missing and we are root;
# otherwise a missing redis-server stops make with what to do.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	elif [ -n "$$missing" ]; then \
	  if ! command -v redis-server >/dev/null 2>&1; then \
	    echo "error: redis-server is not on PATH, and this user cannot install it." >&2; \
	    echo "  Debian/Ubuntu: sudo apt-get install redis-server; or put a redis-server binary" >&2; \
	    echo "  (Redis >= 6) on PATH. Then run make again." >&2; \
	    exit 1; \
	  fi; \
	  echo "warning: systemd-analyze is missing (sudo apt-get install systemd); unit-file checks will fail" >&2; \
	fi

bootstrap: system-deps $(INSTALLED)

# The whole stack on this machine: Redis if needed, a worker, a gateway, a streamed demo; Ctrl-C stops.
run: bootstrap
	$(VENV)/bin/tokenwire up

# pytest exits 5 when it collected nothing: that must fail, loudly.
test: bootstrap
	@rc=0; $(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest ran no tests" >&2; exit 1; fi; \
	exit $$rc

lint: bootstrap
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy

# OpenBLAS picks its kernels from the CPU unless OPENBLAS_CORETYPE pins them, and some
# machines pin an AVX2 core on AVX-512 CPUs (this one pins Haswell on a Zen 5). torch,
# the peer in the CPU tables, detects the CPU regardless; so that both sides run the
# kernels made for this CPU, benchmarks let OpenBLAS detect it too.
bench: bootstrap
	env -u OPENBLAS_CORETYPE $(PY) -m bench.run

# matplotlib comes with the test extra the bootstrap installs (and alone in the `bench` extra).
plots: bootstrap
	$(PY) -m bench.plots

# The GPU host has no network and no pip: use its python as it is.
test-gpu:
	@rc=0; $(PYTHON) -m pytest tests -m gpu $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: no GPU tests ran" >&2; exit 1; fi; \
	exit $$rc
