# Two entry points for a fresh clone: `make run` (set up + main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that lies on this project's machines; on a GPU machine an installed
# torch >= 2.6 in the venv is kept (pip only installs torch when none is importable).
TORCH_SPEC ?= torch==2.13.0
# Options for that pip call, e.g. --index-url https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS ?=
# Test processes (pytest-xdist): the suite mostly waits (timeouts, steps, start-ups), so two
# processes on the 2-core machine take ~0.6x the time of one, and three ~0.85x the time of
# two (500 s against 580-607 s in December 2026; the Ray file, slowed most by the sharing,
# stays within the others' time); see tests/conftest.py.
TEST_JOBS ?= 3

.PHONY: setup run test lint clean

$(VENV)/.ok: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e ".[all,test]"
	touch $@

setup: $(VENV)/.ok

run: setup
	$(VENV)/bin/autominato run --steps 30

test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check autominato tests

clean:
	rm -rf $(VENV) build *.egg-info
