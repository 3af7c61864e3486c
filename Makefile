# pyreducer: `make demo` and `make test` work on a fresh machine with Python 3.10+ and a C++ compiler.
# They create .venv, install the pinned CPU torch and the other dependencies, build the extension.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# The frameworks pyreducer plugs into (docs/pages/coming-from.md) and torchft (pyreducer.torchft), at the versions of pyproject.toml's test extra; their tests take about 10 minutes on 2 busy cores, torchft's about 1.
FRAMEWORKS := lightning==2.6.6 accelerate==1.15.0 transformers==5.24.0 torchft==0.2.0
DEPS_STAMP := $(VENV)/.deps-$(TORCH_VERSION)-frameworks-torchft
CMAKE_BUILD := build/cmake
PYTEST_ARGS ?=
export MAX_JOBS ?= 2

.PHONY: venv build demo test test-fast test-multirank test-netem test-frameworks cpp-test pytest bench \
        bench-suite fuzz soak \
        cuda-build cuda-check gpu-test gpu-rehearsal test-torch-oldest docs docs-serve docs-figures \
        docs-screenshots clean

venv: $(DEPS_STAMP)

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(VPY) -m pip install --quiet --disable-pip-version-check numpy pytest ninja matplotlib expecttest
	$(VPY) -m pip install --quiet --disable-pip-version-check $(FRAMEWORKS) torch==$(TORCH_VERSION)
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

# The whole suite but the frameworks' tests (FRAMEWORK_LAYERS, about 10 minutes here): those run
# in `make test-frameworks`, and in CI in `make cuda-check`, against torch 2.15.
pytest: build
	$(VPY) -m pytest $(foreach t,$(FRAMEWORK_LAYERS),--deselect $(t)) $(PYTEST_ARGS)

# The C++ tests, then the three pytest layers (tests/conftest.py describes them), but the
# frameworks' tests (about 15 minutes on 2 cores).
test: cpp-test pytest

# Lightning, Accelerate and the HF Trainer (FRAMEWORK_LAYERS), at the test extra's versions.
test-frameworks: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) $(FRAMEWORK_LAYERS)

# The unit layer alone: no spawned ranks (a few short subprocesses), seconds.
test-fast: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/unit

test-multirank: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/multirank

# Emulated hosts: needs root and iproute2 (skipped with the reason otherwise).
test-netem: build
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests/netem

# What can differ with another build or another torch, run by the passes below at 2 ranks (about
# 4 minutes here): the unit layer (the GPU kit's runner, signatures, ops), torch DDP as the oracle
# (parity scenarios, bucket plans, DDP's private API, torch's own DDP tests), the built-in hooks
# and mixed precision (the ops), the overlapped optimizer (torch's optimizers' internals), compiled
# models (dynamo's internals, pyreducer/compiled/dynamo.py; about 2 more minutes), the sparse
# buckets' one-thread Gloo backend (torch's semi-private ProcessGroupGloo options and group
# table: pyreducer/wrapper/gloo_race.py), the sharded optimizer (torch's optimizers' state and Gloo's
# reduce-scatter). The rest of the suite exercises the same code on any build.
VERSION_LAYERS := tests/unit tests/multirank/test_parity.py tests/multirank/test_plan_matches_ddp.py \
    tests/multirank/test_ddp_private_api.py tests/multirank/test_torch_suite.py \
    tests/multirank/test_comm_hooks.py tests/multirank/test_mixed_precision.py \
    tests/multirank/test_overlap.py tests/multirank/test_compiled.py \
    tests/multirank/test_gloo_race.py tests/multirank/test_sharded.py

# The CUDA build, checked without a GPU: a separate venv with the CUDA build of the newest
# supported torch (2.15.0, CUDA 13.2: what a plain `pip install torch` gets), the extension
# compiled with its CUDA kernels (csrc/cuda) for CUDA_ARCHS by the GPU kit's build step
# (tests/gpu/run_kit.py --build-only), imported, and VERSION_LAYERS run against it, with
# FRAMEWORK_LAYERS and the frameworks at FRAMEWORKS' versions. The kernels are compiled, not run,
# on a machine without a GPU.
CUDA_VENV ?= .venv-cuda
CUDA_TORCH_VERSION ?= 2.15.0
CUDA_BUILD := build/cuda
CUDA_STAMP := $(CUDA_VENV)/.deps-$(CUDA_TORCH_VERSION)-frameworks
CUDA_ARCHS ?= 8.0;9.0
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
# The CI machines cap torch at 2.14.1 in pip's global constraint file
# (/etc/xdg/pip/constraints.txt); the installs into CUDA_VENV lift it: PIP_CONSTRAINT in the
# environment replaces the configured file (a --constraint option would add to it). Every install
# there names torch's version, so that pip cannot replace it.
CUDA_PIP := PIP_CONSTRAINT=/dev/null $(CUDA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check
# The frameworks' tests (Lightning, Accelerate, the HF Trainer, and the "Coming from" page's
# scripts for them): what depends on the frameworks' use of torch. 7 to 8.5 minutes on 2 cores with
# other work beside them, VERSION_LAYERS 5 to 10 (benchmarks/results/torch_versions_20261129.md).
COMING_FROM_TEST := tests/multirank/test_coming_from.py::test_snippet_runs_and_ranks_agree
FRAMEWORK_LAYERS := tests/multirank/test_lightning.py tests/multirank/test_accelerate.py \
    tests/multirank/test_hf_trainer.py "$(COMING_FROM_TEST)[lightning]" \
    "$(COMING_FROM_TEST)[accelerate]" "$(COMING_FROM_TEST)[hf-trainer]"

$(CUDA_STAMP):
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PIP) torch==$(CUDA_TORCH_VERSION)
	$(CUDA_PIP) numpy pytest ninja matplotlib expecttest torch==$(CUDA_TORCH_VERSION)
	$(CUDA_PIP) $(FRAMEWORKS) torch==$(CUDA_TORCH_VERSION)
	touch $@

# The oldest supported torch (pyreducer/wrapper/torch_versions.py), as the lent GPU machine has it: a venv
# standing in for that machine's interpreter (its CUDA build comes from the package index, with
# the nvidia-* packages; about 5 GB).
OLDEST_VENV ?= .venv-torch211
OLDEST_TORCH_VERSION ?= 2.11.0
OLDEST_STAMP := $(OLDEST_VENV)/.deps-$(OLDEST_TORCH_VERSION)
REHEARSAL_OUT ?= run/gpu-rehearsal

$(OLDEST_STAMP):
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --disable-pip-version-check torch==$(OLDEST_TORCH_VERSION)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --disable-pip-version-check numpy pytest ninja matplotlib expecttest \
	    "setuptools>=64" wheel
	touch $@

ifeq ($(NVCC),)
cuda-build cuda-check gpu-rehearsal test-torch-oldest:
	@echo "$@: nvcc not found: the CUDA build was not checked (nothing compiled)."
else
cuda-build: $(CUDA_STAMP)
	$(CUDA_VENV)/bin/python tests/gpu/run_kit.py --build-only --arch "$(CUDA_ARCHS)" \
	    --jobs $(MAX_JOBS) --build-dir $(CUDA_BUILD)

# The frameworks must import: their tests would skip where they are absent.
cuda-check: cuda-build
	$(CUDA_VENV)/bin/python -c "import lightning.pytorch, accelerate, transformers"
	PYTHONPATH=$(abspath $(CUDA_BUILD)/pkg) $(CUDA_VENV)/bin/python -P -m pytest -q \
	    -p no:cacheprovider $(PYTEST_ARGS) $(VERSION_LAYERS) $(FRAMEWORK_LAYERS) -k "not 3ranks"

# What the GPU kit does on the GPU machine, up to its first CUDA call, against torch 2.11 in an
# existing interpreter: pip offline, the build for sm_90 only, the import, the collection of the
# one-GPU selection and its plan (tests/gpu/run_kit.py --rehearse). The report: $(REHEARSAL_OUT).
gpu-rehearsal: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python tests/gpu/run_kit.py --rehearse --jobs $(MAX_JOBS) \
	    --out $(REHEARSAL_OUT)

# The oldest supported torch against its own DDP, on the rehearsal's build (CUDA kernels
# compiled, run on the CPU): the layers that can differ, at 2 ranks.
test-torch-oldest: gpu-rehearsal
	PYTHONPATH=$(abspath build/gpu-kit/pkg) $(OLDEST_VENV)/bin/python -P -m pytest -q \
	    -p no:cacheprovider $(PYTEST_ARGS) $(VERSION_LAYERS) -k "not 3ranks"
endif

# On the GPU machine (no network; its own interpreter and torch): the GPU kit in one command,
# report in GPU_OUT (docs/pages/guides/gpus.md, "The GPU kit"). GPU_KIT_ARGS: e.g. --full, --bench-s 0.
GPU_PYTHON ?= python3
GPU_OUT ?= run/gpu-kit
GPU_KIT_ARGS ?=
gpu-test:
	$(GPU_PYTHON) tests/gpu/run_kit.py --out $(GPU_OUT) $(GPU_KIT_ARGS)

# The documentation site (docs/): MkDocs, Material for MkDocs and mkdocstrings at the versions of
# pyproject.toml's docs extra (tests/unit/test_docs.py checks that they agree); ruff formats the
# API pages' signatures. `make docs` builds it offline into site/, strict: a broken link or
# anchor, a missing API object or a docstring that does not render fails the build.
DOCS_PACKAGES := mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 \
    ruff==0.17.6
DOCS_STAMP := $(VENV)/.docs-$(shell echo '$(DOCS_PACKAGES)' | cksum | cut -d' ' -f1)
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs

$(DOCS_STAMP): $(DEPS_STAMP)
	$(VPY) -m pip install --quiet --disable-pip-version-check $(DOCS_PACKAGES)
	touch $@

# No --quiet: it raises MkDocs' log level to ERROR, and --strict counts only the warnings that
# were logged, so a broken link or a docstring that did not render passed unseen.
docs: build $(DOCS_STAMP)
	$(MKDOCS) build --strict -f docs/mkdocs.yml
	@echo "docs: built into site/ (open site/index.html, or make docs-serve)"

docs-serve: build $(DOCS_STAMP)
	$(MKDOCS) serve -f docs/mkdocs.yml

# The pages' pictures of a real run (docs/figures.py: 2 emulated 1 Gbit/s hosts; root and
# iproute2 needed, about 2 minutes); commit what it writes into docs/pages/img/.
docs-figures: build
	$(VPY) docs/figures.py

# The built site as a reader sees it: screenshots by headless Chromium, driven by Selenium
# (docs/screenshots.py; Debian's chromium and chromium-driver needed) into SCREENSHOTS_OUT.
SCREENSHOTS_OUT ?= run/docs-screenshots
docs-screenshots: docs
	$(VPY) -m pip install --quiet --disable-pip-version-check selenium==4.51.0
	$(VPY) docs/screenshots.py --site site --out $(SCREENSHOTS_OUT)

bench: build
	$(VPY) benchmarks/bench_ddp.py --json benchmarks/results/latest.json

# Models no one here wrote (pyreducer/testing/third_party.py) on 2 emulated hosts at 1 Gbit/s:
# torch DDP, the autotuned barrier, the overlapped and the sharded optimizer, whole loops of
# SUITE_LOOP steps, 3 blocks a round, SUITE_ROUNDS rounds, paired in one run (about 12 minutes a
# model on 2 cores; needs root). --caps-once: the overlap recalls the caps the autotuned barrier
# chose (one tuning cache for the run), so their ratio compares schedules on the same buckets.
SUITE_MODELS ?= hf_resnet18,hf_bert,hf_gpt2,tv_resnet18
SUITE_LOOP ?= 12
SUITE_ROUNDS ?= 3
SUITE_OUT ?= run/suite
bench-suite: build
	mkdir -p $(SUITE_OUT)
	$(VPY) benchmarks/bench.py --link 1gbit --nproc 2 --model $(SUITE_MODELS) \
	    --impl torch,auto,overlap,sharded --loop-steps $(SUITE_LOOP) --steps 3 \
	    --rounds $(SUITE_ROUNDS) --caps-once --warmup 30 --overlap-gantt $(SUITE_OUT)/gantt.png \
	    --json $(SUITE_OUT)/suite.json
	$(VPY) benchmarks/suite_report.py $(SUITE_OUT)/suite.json --plot $(SUITE_OUT)/suite.png

# 10,000 steps at world size 2, the plain step and the overlapped optimizer: parameters identical
# across ranks, memory growth under 5 MB after warm-up, descriptors and threads constant.
SOAK_STEPS ?= 10000
SOAK_OUT ?= run/soak
soak: build
	mkdir -p $(SOAK_OUT)
	$(VPY) -m pyreducer soak --steps $(SOAK_STEPS) --json $(SOAK_OUT)/step.json --plot $(SOAK_OUT)/step.png
	$(VPY) -m pyreducer soak --steps $(SOAK_STEPS) --overlap --json $(SOAK_OUT)/overlap.json --plot $(SOAK_OUT)/overlap.png

# Differential fuzzing against torch DDP, of models and options, then of user actions around the
# overlapped and sharded steps (tests/multirank/test_fuzz.py runs slices of 40 and 200 cases).
FUZZ_CASES ?= 500
FUZZ_SEED ?= 1
fuzz: build
	$(VPY) -m pyreducer fuzz --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) --json fuzz.json
	$(VPY) -m pyreducer fuzz --actions --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) --json fuzz_actions.json

clean:
	rm -rf build site pyreducer/_C*.so
