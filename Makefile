# qlink — the two set-up commands: `make run` and `make test`. Each bootstraps .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qlink-installed
# torch's CPU build first: nixl-cu12 needs torch, and an unpinned torch would pull several GB of CUDA wheels.
TORCH_PIN ?= torch==2.13.0
# Where pip finds that CPU build. Empty: pip's own configuration (a local wheel or index).
# On a machine without one: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: run test test-fast bench paper clean-venv lab

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[all]'
	@touch $(STAMP)

run: $(STAMP)
	PYTHONUNBUFFERED=1 $(VENV)/bin/qlink run

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/qlink bench all

# make paper QUICK=1: the --quick build (minutes)
paper: $(STAMP)
	$(VENV)/bin/qlink paper build $(if $(QUICK),--quick)

# Jupyter refuses to run as root unless told; containers often are root
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

clean-venv:
	rm -rf $(VENV)
