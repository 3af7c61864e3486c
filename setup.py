"""Builds pyreducer and its one compiled extension, pyreducer._C.

Install into an environment that already has torch 2.11 or newer (the extension is compiled
against it; pip must not replace it, hence no build isolation):
    pip install --no-build-isolation .
or build in place for development:
    python setup.py build_ext --inplace
Build settings (environment):
    MAX_JOBS          parallel compile jobs (torch's default: every core)
    PYREDUCER_CUDA    auto (default): CUDA kernels when torch is a CUDA build and nvcc is found;
                      1: require them; 0: never
    CUDA_HOME         the CUDA toolkit; default: the one whose nvcc is on PATH (its include/
                      folder holding cuda_runtime.h), else /usr/local/cuda
    TORCH_CUDA_ARCH_LIST  GPU architectures, e.g. "9.0"; default: those of the visible GPUs,
                      else those the installed torch was built for (docs/pages/getting-started.md,
                      "Into an existing GPU environment")
"""
import importlib.util
import os
import re
import shutil
import sysconfig

import torch
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
# With no GPU visible and no architectures listed by torch itself: A100 and H100/H200.
FALLBACK_ARCHS = "8.0;9.0"


def torch_versions():
    """pyreducer/wrapper/torch_versions.py, loaded alone (the package needs the extension built
    here)."""
    spec = importlib.util.spec_from_file_location(
        "torch_versions", os.path.join(HERE, "pyreducer", "wrapper", "torch_versions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_torch(versions) -> None:
    found = versions.version_tuple(torch.__version__)
    if found < versions.OLDEST:
        raise SystemExit(f"pyreducer builds against torch {versions.OLDEST[0]}.{versions.OLDEST[1]}"
                         f" or newer; this environment has torch {torch.__version__}")
    if found > versions.NEWEST_TESTED:
        print(f"setup.py: warning: torch {torch.__version__} is newer than the newest tested "
              f"({versions.NEWEST_TESTED[0]}.{versions.NEWEST_TESTED[1]})")


def cuda_toolkit() -> str | None:
    """The CUDA toolkit's folder: $CUDA_HOME (or $CUDA_PATH), else the toolkit of the nvcc on
    PATH (nvcc may be a wrapper script: its folder's ../include must hold cuda_runtime.h), else
    /usr/local/cuda. torch's own guess takes the folder above any nvcc on PATH."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return os.environ[variable]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "include", "cuda_runtime.h")):
            return folder
    return None


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set; else the visible GPUs' architectures; else the ones the
    installed torch was built for ("sm_90" -> "9.0"); else FALLBACK_ARCHS."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        capabilities = sorted({torch.cuda.get_device_capability(i)
                               for i in range(torch.cuda.device_count())})
        return ";".join(f"{major}.{minor}" for major, minor in capabilities)
    built = re.findall(r"sm_(\d+)(\d)\b", torch._C._cuda_getArchFlags() or "")
    return ";".join(f"{major}.{minor}" for major, minor in built) or FALLBACK_ARCHS


check_torch(torch_versions())
TOOLKIT = cuda_toolkit()
if TOOLKIT:  # before cpp_extension reads it at import
    os.environ["CUDA_HOME"] = TOOLKIT
from torch.utils import cpp_extension  # noqa: E402


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
    if flag == "auto" and torch.version.cuda is not None and not available:
        print(f"setup.py: warning: torch {torch.__version__} is a CUDA build but no CUDA toolkit "
              f"was found (set CUDA_HOME): building without the CUDA kernels")
    return flag == "1" or (flag == "auto" and available)


def extension():
    # -g0: the inherited "-g" makes a 13 MB .so and a slower build.
    cxx = ["-O2", "-g0", STANDARD]
    if not want_cuda():
        return cpp_extension.CppExtension("pyreducer._C", CPU_SOURCES, extra_compile_args=cxx)
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    print(f"setup.py: CUDA kernels for architectures {os.environ['TORCH_CUDA_ARCH_LIST']} with "
          f"the toolkit in {cpp_extension.CUDA_HOME}")
    # The toolkit's headers first; pip's nvidia packages after them, for the cuBLAS/NCCL headers
    # that torch's CUDA headers include and the toolkit may lack (pip's cu13/include holds a
    # cuda_runtime.h of its own, without crt/host_config.h in torch 2.11's wheels).
    site = sysconfig.get_paths()["purelib"]
    includes = [p for p in (os.path.join(cpp_extension.CUDA_HOME, "include"),
                            os.path.join(site, "nvidia", "cu13", "include"),
                            os.path.join(site, "nvidia", "nccl", "include")) if os.path.isdir(p)]
    return cpp_extension.CUDAExtension(
        "pyreducer._C", CPU_SOURCES + FACTS["PYREDUCER_CUDA_SOURCES"],
        include_dirs=includes, define_macros=[("PYREDUCER_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O2", STANDARD]})


setup(ext_modules=[extension()],
      cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})
