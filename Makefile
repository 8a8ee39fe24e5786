# The README's two commands: `make demo` and `make test`. Both create the environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kdcache-installed

.PHONY: install lint test test-fast demo demo-clean bench clean

install: $(STAMP)

# torch==2.13.0 resolves to the CPU wheel on this kind of machine; it is installed only when the environment
# has no torch yet, so a GPU user's own torch build stands (point VENV at that environment).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --disable-pip-version-check -q "torch==2.13.0"
	$(PY) -m pip install --disable-pip-version-check -q -e ".[dev,plots,demo]"
	touch $(STAMP)

# ruff on everything; mypy on the installed package layout (kdcache.pipeline, kdcache.stages, kdcache.storage),
# which a scratch folder of links gives it, since mypy cannot follow setuptools' editable-install finder.
TYPECHECK := build/typecheck
lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline stages storage kdcache tests benchmarks
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kdcache && cp kdcache/*.py $(TYPECHECK)/kdcache/
	for p in pipeline stages storage; do ln -s $(CURDIR)/$$p $(TYPECHECK)/kdcache/$$p; done
	cd $(TYPECHECK) && $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml -p kdcache

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test module whole on one of them, so a module's
# shared fixtures (a cache, a trained run) are built once; TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadscope
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not demo"

# A second `make demo` reuses the first one's caches, student and run (and prints the same figures);
# `make demo-clean` removes the demo's outputs only, so that the next `make demo` starts over.
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/kdcache demo

demo-clean:
	rm -rf demo-out

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

# Everything make built, the environment included (`make demo-clean` keeps it).
clean:
	rm -rf $(VENV) demo-out .pytest_cache
