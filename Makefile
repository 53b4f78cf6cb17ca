# Set-up is part of every target: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

# --system-site-packages lets an installed torch be reused; install-torch.sh adds one if none.
$(STAMP): pyproject.toml scripts/install-torch.sh scripts/install-browser.sh | $(BIN)/python
	scripts/install-torch.sh $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,cli]'
	@# chromium for the page tests (skipped, and said so, where it cannot be installed)
	scripts/install-browser.sh
	@# the l1 / linf / l2 C kernels, built once per machine (without a compiler torch's kernels run)
	-$(BIN)/python -c 'from densematch.kernels import native; print(native.build())'
	touch $@

demo: $(STAMP)
	$(BIN)/densematch demo

# one worker per core, each test file on one worker (its subprocesses, torchrun's port, Ray's
# cluster stay its own); tests/conftest.py gives each worker its share of the cores' threads
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile -p no:benchmark

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# the API reference from the docstrings, warnings as errors, into build/docs
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs/api build/docs

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/suites/bench_match.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
