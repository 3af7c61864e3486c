# The one list of pyreducer's C++ sources, by layer, and the C++ standard they are written in.
# CMakeLists.txt include()s this file; setup.py reads the same set() lines (keep them plain:
# one set(NAME ...) per list, paths relative to the repository root).

# The language standard: torch 2.13+ compiles its extensions as C++20 too.
set(PYREDUCER_CXX_STANDARD 20)

# The bucket planner: no torch, no Python.
set(PYREDUCER_PLANNER_SOURCES
    csrc/bucketing.cpp)

# The Reducer core: torch (ATen, autograd, c10d), no Python.
set(PYREDUCER_CORE_SOURCES
    csrc/bucket.cpp
    csrc/comm.cpp
    csrc/comm_hook.cpp
    csrc/device_timeline.cpp
    csrc/graph.cpp
    csrc/ops.cpp
    csrc/quorum_hook.cpp
    csrc/reducer.cpp
    csrc/reducer_buckets.cpp
    csrc/reducer_control.cpp
    csrc/reducer_finite.cpp
    csrc/reducer_timeline.cpp
    csrc/reducer_wait.cpp
    csrc/ring.cpp
    csrc/ring_gather.cpp
    csrc/timeline.cpp)

# The Python extension module pyreducer._C: the only pybind11 code.
set(PYREDUCER_PYTHON_SOURCES
    csrc/bindings.cpp)

# CUDA builds only (setup.py with a CUDA torch and nvcc): kernels, their op registration and the
# CUDA-event timeline. Compiled, not run: no GPU has run them yet.
set(PYREDUCER_CUDA_SOURCES
    csrc/cuda/cuda_timeline.cpp
    csrc/cuda/ops_cuda.cu
    csrc/cuda/register_cuda.cpp)
