# streamq: `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment they need on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,spark]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m streamq demo
	$(BIN)/python -m spark_source.demo

test: $(STAMP)
	$(BIN)/ruff check streamq spark_source tests
	$(BIN)/ruff format --check streamq spark_source tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check streamq spark_source tests
	$(BIN)/ruff format --check streamq spark_source tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
