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

.PHONY: venv build demo test cpp-test pytest bench clean

venv: $(DEPS_STAMP)

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(VPY) -m pip install --quiet --disable-pip-version-check numpy pytest ninja matplotlib
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

test: cpp-test pytest

bench: build
	$(VPY) benchmarks/bench_ddp.py --json benchmarks/results/latest.json

clean:
	rm -rf build pyreducer/_C*.so
