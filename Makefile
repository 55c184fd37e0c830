# Developer entry points. Needs GNU make and python3 (>= 3.11) with the venv module; everything else is
# installed into ./.venv from PyPI on first use.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when pyproject.toml (dependencies, extras) changes, not on every run.
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
DOCS_STAMP := $(VENV)/.installed-docs

.DEFAULT_GOAL := help
.PHONY: help venv .venv test chaos soak demo web screenshot dashboard-screenshots lint bench longtx costs fleet prune clean install-check docs conformance bytecode

help:
	@echo "pgflow development targets:"
	@echo "  make test    run the test suite, all but its long fault cases (more pytest arguments: PYTEST_ARGS='-k foo -x')"
	@echo "               (TEST_SHARDS=n: the sessions of the embedded PostgreSQL 18, default 2; logs in .venv/test-*.log)"
	@echo "  make install-check  a fresh venv gets the checkout by the README's Install command; App() runs there"
	@echo "  make chaos   the fault suite's long pytest cases (every fault mixed, on PostgreSQL 15 and 18)"
	@echo "  make soak    the fault suite for SOAK_MINUTES (default 5) on a PostgreSQL 18 of its own; FAULTS=kill,stop,..."
	@echo "  make demo    run examples/demo.py against the embedded PostgreSQL in ./.pgflow"
	@echo "  make web     run the web example (examples/web/app.py) on http://127.0.0.1:8000"
	@echo "  make screenshot  rewrite examples/web/screenshot.png from the browser test (needs chromium)"
	@echo "  make dashboard-screenshots  rewrite docs/dashboard/*.png from the dashboard's browser test (needs chromium)"
	@echo "  make lint    ruff check pgflow tests, then mypy --strict on pgflow"
	@echo "  make docs    install the [docs] extra and build the documentation site (mkdocs.yml, docs/) into"
	@echo "               build/docs-site, in strict mode: a broken link or API reference fails it"
	@echo "  make bench   install the [bench] extra (the peers) and run python -m benchmarks BENCH (default tasks;"
	@echo "               BENCH=streams|latency|recovery, BENCH_ARGS='--quick --json')"
	@echo "  make longtx  benchmarks/long_transaction.py: a steady load through three overlapping 120 s REPEATABLE READ"
	@echo "               transactions (BENCH_ARGS='--rate 200 --dsn ...', '--quick')"
	@echo "  make costs   benchmarks/costs.py: WAL per workflow and per chunk, NOTIFY's cost per commit, sessions"
	@echo "               per worker, on a private PostgreSQL 18 (for docs/scaling.md)"
	@echo "  make fleet   python -m benchmarks fleet: 4 worker processes x concurrency 64, direct and through pgbouncer"
	@echo "               (server sessions and CPU per 1,000 workflows; needs pgbouncer; BENCH_ARGS='--processes 8')"
	@echo "  make prune   benchmarks/prune_under_load.py at 10M chunks: streams during a prune that drops partitions,"
	@echo "               and during the row-by-row prune of the version before (BENCH_ARGS='--dsn ...')"
	@echo "  make clean   stop the embedded server, remove .venv and caches (keeps the data in ./.pgflow)"
	@echo "  make venv    only create .venv and install '.[dev]' (done automatically by the targets above)"

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pgflow needs Python >= 3.11, $(PYTHON) is " + sys.version.split()[0] + "; run make PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "could not create $(VENV): on Debian/Ubuntu install python3-venv first" >&2; exit 1; }
	$(PY) -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	@touch $@

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -e '.[dev,bench]'
	@touch $@

$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -e '.[dev,docs]'
	@touch $@

venv .venv: $(STAMP)

# make test takes 8.5 to 11.5 minutes on two cores (README); the cases marked chaos (tests/test_chaos.py) are make chaos.
# Sessions side by side (see pytest_collection_modifyitems in tests/conftest.py): the tests on PostgreSQL 15,
# and the others (on the embedded PostgreSQL 18, or on no server) cut into TEST_SHARDS shards
# (PGFLOW_TEST_SHARD=k/n), each a session with an embedded server of its own. PostgreSQL 15 gets one session
# only: one peaks near its 100 connections. The suite mostly waits on leases, sleeps and processes, so the
# sessions barely slow each other on two cores. Each is logged to $(VENV)/test-<name>.log, and the logs are
# printed when all have ended; make test fails if any session failed. A session with no test selected (exit
# code 5, e.g. PYTEST_ARGS='-k pg18') counts as passed, unless none selected any.
TEST_SHARDS ?= 2
TEST_LOGS := $(VENV)/test-
test: $(STAMP) bytecode
	@pids=(); names=(); \
	run() { name=$$1; shift; env "$$@" $(PY) -m pytest -q -m 'not chaos and not install' --durations=15 $(PYTEST_ARGS) \
		> $(TEST_LOGS)$$name.log 2>&1 & pids+=($$!); names+=($$name); }; \
	run pg15 PGFLOW_TEST_SERVER=pg15; \
	for k in $$(seq 1 $(TEST_SHARDS)); do run pg18-$$k PGFLOW_TEST_SERVER=pg18 PGFLOW_TEST_SHARD=$$k/$(TEST_SHARDS); done; \
	trap 'kill -INT "$${pids[@]}" 2>/dev/null' INT TERM; \
	echo "$${#pids[@]} sessions (pids $${pids[*]}), logged to $(TEST_LOGS){$$(IFS=,; echo "$${names[*]}")}.log"; \
	codes=(); for pid in "$${pids[@]}"; do wait $$pid; codes+=($$?); done; \
	failed=""; passed=0; \
	for i in "$${!pids[@]}"; do \
		echo; echo "--- session $${names[$$i]} (exit $${codes[$$i]}, $(TEST_LOGS)$${names[$$i]}.log):"; \
		cat $(TEST_LOGS)$${names[$$i]}.log; \
		case $${codes[$$i]} in 0) passed=1;; 5) ;; *) failed="$$failed $${names[$$i]}=$${codes[$$i]}";; esac; \
	done; \
	if [ -z "$$failed" ] && [ $$passed = 1 ]; then echo "make test: all $${#pids[@]} sessions passed"; \
	else echo "make test: FAILED (exit codes:$${failed:- none selected any test})" >&2; exit 1; fi

# Slow (a venv and every dependency installed anew), so not part of make test.
install-check: $(STAMP)
	$(PY) -m pytest -q -m install tests/test_install.py $(PYTEST_ARGS)

chaos: $(STAMP) bytecode
	$(PY) -m pytest -q -m chaos $(PYTEST_ARGS)

# The bytecode of every module the tests' own processes import (workers, CLI commands, example apps: the
# suite starts hundreds). Where PYTHONDONTWRITEBYTECODE is set, as on the CI machines, each of them
# compiled pgflow and the test apps from source again: 0.15 s of CPU a start, a quarter of the time of
# tests that run many commands. (__pycache__ is ignored by git; make clean removes it.)
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 pgflow tests examples workers > /dev/null

# The public Durable Streams conformance suite (npm, pinned in conformance/package.json) against
# `pgflow streams serve` on $$PGFLOW_DSN and, for comparison, the reference server, both on this machine:
# conformance/run.mjs prints both pass counts. Needs node and npm; the packages are installed once.
conformance: $(STAMP)
	cd conformance && { [ node_modules/.package-lock.json -nt package-lock.json ] || npm ci --no-audit --no-fund; } \
		&& PYTHON=$(CURDIR)/$(PY) node run.mjs

SOAK_MINUTES ?= 5
FAULTS ?= kill,stop,terminate,cancel,restart,freeze,reset,refuse
soak: $(STAMP)
	$(PY) -m tests.chaos --minutes $(SOAK_MINUTES) --faults $(FAULTS)

demo: $(STAMP)
	$(PY) examples/demo.py

web: $(STAMP)
	$(PY) examples/web/app.py

screenshot: $(STAMP)
	PGFLOW_SCREENSHOT=examples/web/screenshot.png $(PY) -m pytest -q tests/test_web_browser.py -k pg18

dashboard-screenshots: $(STAMP)
	PGFLOW_DASHBOARD_SCREENSHOTS=docs/dashboard $(PY) -m pytest -q tests/test_dashboard_browser.py -k pg18

lint: $(STAMP)
	$(VENV)/bin/ruff check pgflow tests
	$(PY) -m mypy

# The site (mkdocs.yml): the tutorial and guides, whose marked code blocks tests/test_docs.py runs in make
# test; the reference pages for the CLI, the settings and the errors are generated from the code by
# docs/_hooks/reference.py. Strict: a broken link, a missing page or an unresolved reference fails.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/docs-site

BENCH ?= tasks
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(BENCH) $(BENCH_ARGS)

longtx: $(STAMP)
	$(PY) -m benchmarks.long_transaction $(BENCH_ARGS)

costs: $(STAMP)
	$(PY) -m benchmarks.costs $(BENCH_ARGS)

fleet: $(STAMP)
	$(PY) -m benchmarks fleet $(BENCH_ARGS)

prune: $(STAMP)
	$(PY) benchmarks/prune_under_load.py --mode both --repeats 1 --old-workflows 25000 --old-chunks 400 \
		--duration 30 $(BENCH_ARGS)

clean:
	@# The embedded server runs binaries from inside .venv: stop it before deleting them under its feet.
	-@if [ -x $(PY) ] && [ -d .pgflow ]; then \
		$(PY) -c 'from pathlib import Path; from pgflow.embedded import stop_embedded; stop_embedded(Path(".pgflow")) and print("stopped the embedded PostgreSQL in .pgflow")' \
		|| echo "warning: could not stop the embedded PostgreSQL in .pgflow" >&2; \
	fi
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -not -path './.git/*' -prune -exec rm -rf {} +
