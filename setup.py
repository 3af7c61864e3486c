"""Builds pyreducer and its one compiled extension, pyreducer._C.

Install into an environment that already has torch (the extension is compiled against it):
    pip install --no-build-isolation .
or build in place for development:
    python setup.py build_ext --inplace
Build settings (environment):
    MAX_JOBS          parallel compile jobs
    PYREDUCER_CUDA    auto (default): CUDA kernels when torch is a CUDA build and nvcc is found;
                      1: require them; 0: never
    CUDA_HOME, TORCH_CUDA_ARCH_LIST   as for any torch CUDA extension
"""
import glob
import os
import sysconfig

import torch
from setuptools import setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


def want_cuda() -> bool:
    flag = os.environ.get("PYREDUCER_CUDA", "auto")
    if flag not in ("auto", "0", "1"):
        raise SystemExit(f"PYREDUCER_CUDA must be auto, 0 or 1, got {flag!r}")
    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag == "1" and not available:
        raise SystemExit(f"PYREDUCER_CUDA=1 but torch {torch.__version__} is "
                         f"{'a CPU build' if torch.version.cuda is None else 'a CUDA build'} and "
                         f"CUDA_HOME={cpp_extension.CUDA_HOME}: cannot build the CUDA kernels")
    return flag == "1" or (flag == "auto" and available)


def extension():
    # -g0: the inherited "-g" makes a 13 MB .so and a slower build.
    cxx = ["-O2", "-g0"]  # the C++ standard is torch's choice (C++17 for 2.13, C++20 for 2.14)
    if not want_cuda():
        return cpp_extension.CppExtension("pyreducer._C", sources("csrc/*.cpp"),
                                          extra_compile_args=cxx)
    # cuBLAS/NCCL headers that torch's CUDA headers include ship in pip's nvidia packages here.
    site = sysconfig.get_paths()["purelib"]
    includes = [p for p in (os.path.join(site, "nvidia", "cu13", "include"),
                            os.path.join(site, "nvidia", "nccl", "include")) if os.path.isdir(p)]
    return cpp_extension.CUDAExtension(
        "pyreducer._C", sources("csrc/*.cpp") + sources("csrc/cuda/*.cpp") + sources("csrc/cuda/*.cu"),
        include_dirs=includes, define_macros=[("PYREDUCER_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O2"]})


setup(ext_modules=[extension()],
      cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})
