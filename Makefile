# pyreducer: `make demo` and `make test` work on a fresh machine with Python 3.10+ and a C++ compiler.
# They create .venv, install the pinned CPU torch and the other dependencies, build the extension.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEPS_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
CMAKE_BUILD := build/cmake
PYTEST_ARGS ?=
export MAX_JOBS ?= 2

.PHONY: venv build demo test test-fast test-multirank test-netem cpp-test pytest bench fuzz soak cuda-build cuda-check gpu-test clean

venv: $(DEPS_STAMP)

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(VPY) -m pip install --quiet --disable-pip-version-check numpy pytest ninja matplotlib expecttest
	@command -v cmake >/dev/null || $(VPY) -m pip install --quiet --disable-pip-version-check cmake
	touch $@

build: venv
	$(VPY) setup.py --quiet build_ext --inplace

demo: build
	$(VPY) -m pyreducer demo

# The C++ core without Python (CMake + find_package(Torch)), and its unit tests.
cpp-test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake -S . -B $(CMAKE_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	    -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" cmake --build $(CMAKE_BUILD) -j2
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ctest --test-dir $(CMAKE_BUILD) --output-on-failure

pytest: build
	$(VPY) -m pytest $(PYTEST_ARGS)

# Everything: the C++ tests, then the three pytest layers (tests/conftest.py describes them).
test: cpp-test pytest

# The unit layer alone: no spawned ranks (a few short subprocesses), seconds.
test-fast: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/unit

test-multirank: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/multirank

# Emulated hosts: needs root and iproute2 (skipped with the reason otherwise).
test-netem: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/netem

# The CUDA build, checked without a GPU: a separate venv with torch's CUDA 13.0 build, the
# extension compiled with its CUDA kernels (csrc/cuda) for CUDA_ARCHS, imported, and the whole
# test suite run against it (the GPU kit is collected and skipped). The kernels are compiled,
# not run, on a machine without a GPU.
CUDA_VENV ?= .venv-cuda
CUDA_TORCH_VERSION ?= 2.14.1
# The toolkit: $CUDA_HOME if set, else /usr/local/cuda (nvcc on PATH may be a wrapper script).
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(abspath $(dir $(realpath $(shell command -v nvcc 2>/dev/null)))..))
NVCC := $(wildcard $(CUDA_HOME)/bin/nvcc)
CUDA_BUILD := build/cuda
CUDA_STAMP := $(CUDA_VENV)/.deps-$(CUDA_TORCH_VERSION)

$(CUDA_STAMP):
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check torch==$(CUDA_TORCH_VERSION)
	$(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check numpy pytest ninja matplotlib expecttest
	touch $@

CUDA_ARCHS ?= 8.0;9.0

ifeq ($(NVCC),)
cuda-build cuda-check gpu-test:
	@echo "$@: nvcc not found: the CUDA build was not checked (nothing compiled)."
else
cuda-build: $(CUDA_STAMP)
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST="$(CUDA_ARCHS)" PYREDUCER_CUDA=1 \
	    $(CUDA_VENV)/bin/python setup.py --quiet build_ext --build-lib $(CUDA_BUILD)/lib --build-temp $(CUDA_BUILD)/temp
	rm -rf $(CUDA_BUILD)/pkg && mkdir -p $(CUDA_BUILD)/pkg
	cp -r pyreducer $(CUDA_BUILD)/pkg/ && rm -f $(CUDA_BUILD)/pkg/pyreducer/_C*.so
	cp $(CUDA_BUILD)/lib/pyreducer/_C*.so $(CUDA_BUILD)/pkg/pyreducer/
	cd $(CUDA_BUILD)/pkg && $(abspath $(CUDA_VENV))/bin/python -c "import torch, pyreducer; \
	    assert pyreducer._C.WITH_CUDA, 'built without CUDA kernels'; \
	    print('cuda-build: pyreducer built with CUDA kernels against torch', torch.version.__version__, \
	          '(CUDA', torch.version.cuda + '); GPUs visible:', torch.cuda.device_count())"

cuda-check: cuda-build
	PYTHONPATH=$(abspath $(CUDA_BUILD)/pkg) $(CUDA_VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

# On a machine with GPUs: the GPU kit (tests/gpu) and the CUDA op tests, against the CUDA build.
# Its "GPU kit" summary says what ran and what could not (e.g. world size 2+ with one GPU).
gpu-test: cuda-build
	PYTHONPATH=$(abspath $(CUDA_BUILD)/pkg) $(CUDA_VENV)/bin/pytest -q -rs -p no:cacheprovider \
	    $(PYTEST_ARGS) tests/gpu tests/unit/test_ops.py
endif

bench: build
	$(VPY) benchmarks/bench_ddp.py --json benchmarks/results/latest.json

# 10,000 steps at world size 2, the plain step and the overlapped optimizer: parameters identical
# across ranks, memory growth under 5 MB after warm-up, descriptors and threads constant.
SOAK_STEPS ?= 10000
SOAK_OUT ?= run/soak
soak: build
	mkdir -p $(SOAK_OUT)
	$(VPY) -m pyreducer soak --steps $(SOAK_STEPS) --json $(SOAK_OUT)/step.json --plot $(SOAK_OUT)/step.png
	$(VPY) -m pyreducer soak --steps $(SOAK_STEPS) --overlap --json $(SOAK_OUT)/overlap.json --plot $(SOAK_OUT)/overlap.png

# Differential fuzzing against torch DDP (tests/multirank/test_fuzz.py runs a 40-case slice).
FUZZ_CASES ?= 500
FUZZ_SEED ?= 1
fuzz: build
	$(VPY) -m pyreducer fuzz --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) --json fuzz.json

clean:
	rm -rf build pyreducer/_C*.so
