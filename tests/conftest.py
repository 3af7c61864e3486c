"""Shared fixtures. The suite has three layers, by cost:
    tests/unit/       no ranks: in-process, plus a few short runs of the command line (seconds,
                      `make test-fast`)
    tests/multirank/  spawned Gloo ranks (pyreducer.testing.run_ranks: file-store rendezvous, hard
                      wall-clock bound, failing rank named), and torchrun
    tests/netem/      emulated hosts (network namespaces, tc): root only, skipped with the reason
"""
import functools
import os
import sys

import pytest

# The checkout's root, for `benchmarks` (tables.py): appended, so that the pyreducer under test
# (an installed or CUDA build on PYTHONPATH) still comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyreducer.testing import run_ranks  # noqa: E402

# Autotune remembers its decisions in a cache file (pyreducer/tuning/memory.py) unless told not to:
# tests that tune must not read a developer's cache nor each other's decisions. The spawned ranks
# inherit this; the cache's own tests give AutotuneConfig(cache=<path>).
os.environ["PYREDUCER_TUNING_CACHE"] = "off"


@functools.lru_cache(maxsize=None)
def _cached_run(fn, world_size, args):
    return run_ranks(fn, world_size, args=args, timeout_s=240)


@pytest.fixture(scope="session")
def ranks_once():
    """ranks_once(fn, world_size, args) runs fn on spawned ranks once per session and caches the
    per-rank results, so many parametrized tests can check one run."""
    return _cached_run
