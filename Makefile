# streamq: `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment they need on a fresh machine.
# `make docs` builds the documentation site (mkdocs.yml) into build/site, warnings as errors.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck bench bench-quick bench-smoke nats-server soak soak-spark soak-spark-many fuzz powerloss simulate clean docs docs-fit docs-console native test-pure test-cluster wheel chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	STREAMQ_PURE=1 $(BIN)/pip install --quiet -e '.[dev,spark,bench]'  # $(NATIVE) compiles
	touch $(STAMP)

venv: $(STAMP)

DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)  # the site: guides, API and CLI reference, protocol, benchmarks
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-fit: docs chromium  # no code block scrolls sideways at 1280 px, in headless Chromium
	$(BIN)/python -m tests.docs.fit

# Debian's Chromium for the browser tests (the console's, docs-fit), from Debian's packages
# when missing: as root (CI), or through sudo.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	$(if $(filter 0,$(shell id -u)),,sudo) sh -c 'apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null'

chromium: $(CHROMIUM)

docs-console: $(STAMP) chromium  # the console's screenshots in docs/guides/operations.md
	STREAMQ_CONSOLE_SCREENSHOTS=docs/images $(BIN)/python -m pytest -q -p no:randomly \
		tests/console/test_console.py -k the_page

# The compiled path (setup.py, streamq/native.py): the listed modules built by mypyc and
# the C extensions, in place, again whenever one of them changes. Without a C compiler it
# says so, and the pure-Python path runs.
NATIVE_SOURCES := $(shell sed -n '/^COMPILED = (/,/^)/s/^ *"streamq\.\([a-z_.]*\)",/streamq.\1/p' streamq/native.py | tr . / | sed 's/$$/.py/')
NATIVE := streamq/native.json

$(NATIVE): $(STAMP) setup.py streamq/native.py $(NATIVE_SOURCES) $(wildcard streamq/*/*.c)
	$(BIN)/python setup.py --quiet build_ext --inplace

native: $(NATIVE)

wheel: $(STAMP)  # built as users build it (python -m build, pip install .) in clean venvs: runs compiled
	$(BIN)/python -m pytest -q -p no:randomly tests/packaging/check_wheel.py

demo: $(STAMP)
	$(BIN)/python -m streamq demo
	$(BIN)/python -m spark_source.demo

# nats-server (the NATS baseline's tests need it) builds meanwhile: `go install` takes
# minutes on a fresh machine; a test that finds the build under way waits for it.
# The suite runs on the compiled build (STREAMQ_TEST_BUILD: the run fails if another
# path would run); `make test-pure` runs the core suites again on pure Python.
test: $(STAMP) $(NATIVE) $(CHROMIUM)
	$(BIN)/python -m bench.nats.server --build > $(VENV)/nats-build.log 2>&1 & \
	$(BIN)/ruff check streamq spark_source bench tests setup.py && \
	$(BIN)/ruff format --check streamq spark_source bench tests setup.py && \
	$(BIN)/mypy && \
	STREAMQ_TEST_BUILD=compiled $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not cluster"; \
	status=$$?; wait; exit $$status

test-cluster: $(STAMP) $(NATIVE)  # the Spark standalone cluster and Spark Connect suites, ~10 min
	STREAMQ_TEST_BUILD=compiled $(BIN)/python -m pytest -q -n 2 --dist loadgroup -m cluster

PURE_SUITES := tests/protocol tests/crash tests/docs tests/test_sql.py \
	tests/producer/test_producer.py tests/producer/test_group_commit.py \
	tests/producer/test_publish_conn.py tests/consumer/test_consumer.py \
	tests/consumer/test_poison.py tests/consumer/test_apply_conn.py

test-pure: $(STAMP)  # the protocol, transactions, group commit, turn, crash and docs suites on pure Python
	STREAMQ_PURE=1 STREAMQ_TEST_BUILD=pure $(BIN)/python -m pytest -q -n 2 --dist loadgroup $(PURE_SUITES)

bench: $(STAMP) nats-server  # every workload at full size, against real Kafka and NATS servers
	$(BIN)/python -m bench

bench-quick: $(STAMP) nats-server  # every workload at small size, in a few minutes
	$(BIN)/python -m bench --quick

bench-smoke: $(STAMP)  # the groups workload's quick mode against a real Kafka broker, checked
	$(BIN)/python -m pytest -q -p no:randomly tests/smoke_bench_groups.py

# bench/nats/bin/nats-server at the pinned version, by `go install` when missing (or
# the binary NATS_SERVER names, if set, is checked instead)
nats-server: $(STAMP)
	$(BIN)/python -m bench.nats.server --build

# SOAK_ENGINE=postgres: both databases on a throwaway PostgreSQL server, which is killed
# with -9 too, and other writer processes publishing with streamq.publish; SOAK_WAL=1
# runs that server with wal_level = logical (records published through the WAL).
SOAK_ENGINE ?= sqlite
SOAK_WAL ?= 0
soak: $(STAMP)  # the crash test run after run: >= 1,000 kill -9 cycles, at most 30 min
	STREAMQ_CRASH_ENGINE=$(SOAK_ENGINE) STREAMQ_CRASH_WAL=$(SOAK_WAL) \
		$(BIN)/python -m tests.soak --kills 1000 --max-seconds 1800

soak-spark: $(STAMP)  # the Spark parquet sink's exactly-once test through 20 kill -9s, ~10 min
	STREAMQ_SPARK_KILLS=20 $(BIN)/python -m pytest -q -p no:randomly tests/spark/test_spark_exactly_once.py

soak-spark-many: $(STAMP)  # the same at 256 producers served 16 to a process, 5 kill -9s, ~4 min
	STREAMQ_SPARK_PRODUCERS=256 STREAMQ_SPARK_KILLS=5 $(BIN)/python -m pytest -q -p no:randomly \
		tests/spark/test_spark_exactly_once.py

FUZZ_SECONDS ?= 300
fuzz: $(STAMP)  # atheris on the decoder and state machines, then 20,000 hostile sessions on a socket
	$(BIN)/pip install --quiet -e '.[fuzz]'
	$(BIN)/python tests/fuzz_protocol.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=1024
	STREAMQ_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/protocol/test_hostile_input.py

powerloss: $(STAMP)  # power-loss images of a producer's database, 60 commits each mode: figures
	$(BIN)/python -m tests.powerloss --commits 60

simulate: $(STAMP)  # the protocol and storage simulation, 10,500 generated programs
	STREAMQ_SIM_EXAMPLES=10500 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/protocol/test_simulation.py::test_simulation --hypothesis-show-statistics

lint: $(STAMP)
	$(BIN)/ruff check streamq spark_source bench tests
	$(BIN)/ruff format --check streamq spark_source bench tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
