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
import os
import re
import sysconfig

import torch
from setuptools import setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def build_facts(path=os.path.join(HERE, "csrc", "sources.cmake")) -> dict[str, list[str]]:
    """The set(NAME ...) lists of csrc/sources.cmake: the one source list CMake uses too."""
    with open(path) as f:
        text = re.sub(r"#.*", "", f.read())
    facts = {name: values.split() for name, values in re.findall(r"set\((\w+)\s+([^)]*)\)", text)}
    if not facts.get("PYREDUCER_CORE_SOURCES") or not facts.get("PYREDUCER_CXX_STANDARD"):
        raise SystemExit(f"{path}: expected set(PYREDUCER_CORE_SOURCES ...) and "
                         f"set(PYREDUCER_CXX_STANDARD ...), found {sorted(facts)}")
    return facts


FACTS = build_facts()
STANDARD = f"-std=c++{FACTS['PYREDUCER_CXX_STANDARD'][0]}"
CPU_SOURCES = (FACTS["PYREDUCER_PLANNER_SOURCES"] + FACTS["PYREDUCER_CORE_SOURCES"]
               + FACTS["PYREDUCER_PYTHON_SOURCES"])


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
    cxx = ["-O2", "-g0", STANDARD]
    if not want_cuda():
        return cpp_extension.CppExtension("pyreducer._C", CPU_SOURCES, extra_compile_args=cxx)
    # cuBLAS/NCCL headers that torch's CUDA headers include ship in pip's nvidia packages here.
    site = sysconfig.get_paths()["purelib"]
    includes = [p for p in (os.path.join(site, "nvidia", "cu13", "include"),
                            os.path.join(site, "nvidia", "nccl", "include")) if os.path.isdir(p)]
    return cpp_extension.CUDAExtension(
        "pyreducer._C", CPU_SOURCES + FACTS["PYREDUCER_CUDA_SOURCES"],
        include_dirs=includes, define_macros=[("PYREDUCER_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O2", STANDARD]})


setup(ext_modules=[extension()],
      cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})
