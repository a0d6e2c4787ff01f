# Every entry point of the project. The virtual environment lives in .venv/ and is
# created on demand, so these targets work on a bare machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help install lock audit test test-loaded test-slow lint typecheck layering pytest demo bench bench-soak bench-floor bench-storage bench-runners bench-enqueue bench-failover bench-scorecard format clean

help:
	@echo "make demo           run a main on SQLite with a worker and example jobs"
	@echo "make test           lint + mypy --strict + import layering + pytest"
	@echo "make test-loaded    make test three times with two CPU-bound processes beside it"
	@echo "make test-slow      the soak and long end-to-end runs left out of make test"
	@echo "make audit          known vulnerabilities in requirements-dev.lock (pip-audit)"
	@echo "make lock           pin the dependencies again into requirements-dev.lock"
	@echo "make bench-storage  storage micro-benchmark (claims/s, completions/s)"
	@echo "make bench-runners  inline / pooled / forked throughput and per-job overhead"
	@echo "make bench          side-by-side benchmark (see bench/)"
	@echo "make bench-soak     broker-main RSS over 1,000,000 jobs on PostgreSQL (about 20 min)"
	@echo "make bench-floor    the per-job cost of each hot-path primitive (the floor estimate)"
	@echo "make bench-enqueue  the enqueue path alone on PostgreSQL: rates and CPU per job per process"
	@echo "make bench-failover first job completed after a leader's kill -9, ten takeovers (PostgreSQL)"
	@echo "make bench-scorecard issue 35's targets in one run, beside PgQueuer (about 45 min)"
	@echo "make format         apply ruff formatting"

# The development environment is requirements-dev.lock: every package pinned, with its
# hashes (pip then refuses any other file). The project itself goes on top, editable, and
# adds nothing (--no-deps).
$(STAMP): pyproject.toml requirements-dev.lock
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Pin the dependencies of pyproject.toml (and the dev extra) again, keeping the versions
# already locked where they still fit: `make lock` after changing pyproject.toml, and
# `make lock LOCK_ARGS=--upgrade-package=NAME` to move one package (--upgrade: all).
LOCK_ARGS ?=
lock: $(STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(BIN)/pip-compile --quiet --extra dev --generate-hashes \
	  --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) \
	  -o requirements-dev.lock pyproject.toml

# Known vulnerabilities in the locked packages (PyPI's advisory data); .ci/run runs it.
# A finding fails it: bump that package with `make lock LOCK_ARGS=--upgrade-package=NAME`.
audit: $(STAMP)
	$(BIN)/pip-audit --requirement requirements-dev.lock --disable-pip --progress-spinner off

lint: $(STAMP)
	$(BIN)/ruff check broker adapters runners tests bench
	$(BIN)/ruff format --check broker adapters runners tests bench

typecheck: $(STAMP)
	$(BIN)/mypy broker adapters runners

layering: $(STAMP)
	$(BIN)/lint-imports

# Two test processes (pytest-xdist): most tests wait on real processes, sockets and
# fsyncs, so two of them keep a 2-core machine busy and halve the wall time.
# --dist worksteal: an idle process takes over half of the other's queue. With xdist's
# default (load) the end-to-end tests, which sit together in collection order, piled up
# in one process: it ran 177 s while the other idled after 117 s.
# PYTHONDONTWRITEBYTECODE (set in many containers) is dropped for the run: the suite
# starts hundreds of Python processes (mains, workers, children, CLIs), each of which
# would compile the broker from source again, and pytest would rewrite every test module
# again in each test process. The __pycache__ directories are git-ignored.
pytest: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -n 2 --dist worksteal

# The four stages run side by side (their results are the same as one after the other):
# pytest is the long pole and its processes often wait on sockets, timers and fsyncs,
# while mypy from a clean checkout (no .mypy_cache) takes a CPU for about 12 s. make
# stops with the first stage that fails, once the stages already running have ended.
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 pytest lint typecheck layering

# Before an issue is resolved: make test passes three times in a row while two CPU-bound
# processes spin beside it (tests/cpu_load.py). A test that fails here is fixed, not retried.
test-loaded: $(STAMP)
	for run in 1 2 3; do echo "== loaded run $$run"; $(BIN)/python tests/cpu_load.py -- $(MAKE) test || exit 1; done

# -m on the command line overrides the "not soak and not slow_e2e" default in
# pyproject.toml. The handoff and worker state machines run again under their long
# hypothesis profile (make test runs the short one). That profile's 2,000 runs of 80
# steps took a worker-prefetch state machine 46 s at load 6, 93 s at load 14, over 120 s (the
# per-test timeout of pyproject.toml, a guard against hangs) in a loaded CI run, which
# failed on it; the guard stays, scaled to the profile's length.
test-slow: $(STAMP)
	$(BIN)/pytest -m "soak or slow_e2e"
	HYPOTHESIS_PROFILE=slow $(BIN)/pytest --timeout=900 tests/unit

demo: $(STAMP)
	$(BIN)/python -m broker.demo

bench-storage: $(STAMP)
	$(BIN)/python bench/storage_bench.py

bench-runners: $(STAMP)
	$(BIN)/python bench/runners_bench.py

bench: $(STAMP)
	$(BIN)/python -m bench

# Not part of make bench or CI: a million jobs take about 20 minutes. JOBS=20000 for a short run.
JOBS ?= 1000000
bench-soak: $(STAMP)
	$(BIN)/python -m bench.rss_soak --jobs $(JOBS)

bench-floor: $(STAMP)
	$(BIN)/python -m bench.floor

bench-enqueue: $(STAMP)
	$(BIN)/python -m bench.enqueue_bench broker-postgres --reps 3

bench-failover: $(STAMP)
	$(BIN)/python -m bench.failover

# Every figure issue 35's "Done when" names, from one run of the benches above:
# bench/results/scorecard/scorecard.md and .png.
bench-scorecard: $(STAMP)
	$(BIN)/python -m bench.scorecard

format: $(STAMP)
	$(BIN)/ruff check --fix broker adapters runners tests bench
	$(BIN)/ruff format broker adapters runners tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache dist build
