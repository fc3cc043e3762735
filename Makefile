# The set-up commands of the README: `make demo`, `make test`, `make test-fast`, `make lint`
# and `make docs`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NODES  ?= 4
# Test workers side by side, each with a local Slurm of its own (tests/conftest.py).
# --dist loadgroup hands out one test at a time (no test is grouped), in collection order: the
# longest first (tests/conftest.py), so the short ones fill the gaps at the end.
WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadgroup --durations=10

.PHONY: venv demo test test-fast lint docs down clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 CPU build (on local disk here); pyproject keeps a range for users
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# Lightning 2.1 for the framework matrix, beside the current one (PYTHONPATH=$(VENV)/pl21);
	# its lightning_fabric needs pkg_resources, gone from setuptools 81
	$(PY) -m pip install -q --target $(VENV)/pl21 --no-deps 'pytorch-lightning==2.1.4' 'setuptools<81'
	# DeepSpeed for the framework matrix: an sdist whose build imports torch, so it is built
	# against the torch above (an isolated build would fetch another torch); no op is built
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation 'deepspeed==0.19.8'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dlrover-hpc local-slurm up --nodes $(NODES)
	bash examples/demo.sh

lint: venv docs
	$(VENV)/bin/ruff check dlrover_hpc tests benchmarks examples docs
	$(VENV)/bin/ruff format --check dlrover_hpc tests benchmarks examples docs
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml; default theme, no network): --strict fails on a broken
# link, an anchor that is not there or a page missing from the nav. Part of `make lint`, so of
# `make test` and CI. The generated reference pages are checked by tests/test_docs.py.
docs: venv
	$(VENV)/bin/mkdocs build --strict --quiet

# The lint and the docs run beside the tests (they need ~30 s of one core while the local
# Slurms come up), their output kept for the end; either one failing fails the target.
test: venv
	@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(PYTEST) tests; tests=$$?; \
	wait $$lint; lint=$$?; cat $(VENV)/lint.log; \
	if [ $$lint -ne 0 ]; then echo "make test: lint failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$lint -eq 0 ]

# The unit tests only (no local Slurm, no whole jobs): the edit loop.
test-fast: venv
	$(PYTEST) -m 'not slurm and not runtime' tests

down: venv
	$(VENV)/bin/dlrover-hpc local-slurm down

clean: down
	rm -rf $(VENV)
