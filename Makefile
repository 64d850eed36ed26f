# All set-up from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/eager_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info
