# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NODES  ?= 4

.PHONY: venv demo test lint down clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 CPU build (on local disk here); pyproject keeps a range for users
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dlrover-hpc local-slurm up --nodes $(NODES)
	bash examples/demo.sh

lint: venv
	$(VENV)/bin/ruff check dlrover_hpc tests benchmarks examples
	$(VENV)/bin/ruff format --check dlrover_hpc tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: venv lint
	$(PY) -m pytest -q tests

down: venv
	$(VENV)/bin/dlrover-hpc local-slurm down

clean: down
	rm -rf $(VENV)
