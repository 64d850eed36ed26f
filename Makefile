# All set-up from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench upstream clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first, pinned, so nothing can pull a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q "jax[cpu]==0.10.2"
	$(PY) -m pip install -q -e ".[test,hf,ecosystem]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_classifier.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m ""

# PyTorch's own device-generic tests on neuron, complete (hours on 2 cores; resumes where it stopped):
# results under build/upstream, counts in docs/upstream.md. UPSTREAM_TESTS: a directory of the files.
UPSTREAM_TESTS ?=
upstream: $(STAMP)
	nice -n 10 $(PY) -m tools.upstream --cpu-check $(if $(UPSTREAM_TESTS),--tests-dir $(UPSTREAM_TESTS))

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/eager_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info
