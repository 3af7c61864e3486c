"""Builds pyreducer and its one compiled extension, pyreducer._C.

Install into an environment that already has torch (the extension is compiled against it):
    pip install --no-build-isolation .
or build in place for development:
    python setup.py build_ext --inplace
Build settings (environment): MAX_JOBS (parallel compile jobs).
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def cpp_sources():
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp")))


setup(
    ext_modules=[
        CppExtension(
            name="pyreducer._C",
            sources=cpp_sources(),
            # -g0: the inherited "-g" makes a 13 MB .so and a slower build.
            extra_compile_args=["-O2", "-g0", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
