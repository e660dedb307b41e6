# streamq: `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment they need on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck bench bench-quick powerloss simulate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,spark,bench]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m streamq demo
	$(BIN)/python -m spark_source.demo

test: $(STAMP)
	$(BIN)/ruff check streamq spark_source bench tests
	$(BIN)/ruff format --check streamq spark_source bench tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

bench: $(STAMP)  # every workload at full size, against a real Kafka broker
	$(BIN)/python -m bench

bench-quick: $(STAMP)  # every workload at small size, in a few minutes
	$(BIN)/python -m bench --quick

powerloss: $(STAMP)  # power-loss images of a producer's database, 60 commits each mode: figures
	$(BIN)/python -m tests.powerloss --commits 60

simulate: $(STAMP)  # the protocol and storage simulation, 10,500 generated programs
	STREAMQ_SIM_EXAMPLES=10500 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_simulation.py::test_simulation --hypothesis-show-statistics

lint: $(STAMP)
	$(BIN)/ruff check streamq spark_source bench tests
	$(BIN)/ruff format --check streamq spark_source bench tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
