"""Shared fixtures. Multi-process tests use pyreducer.testing.run_ranks (spawned Gloo ranks on
this machine, file-store rendezvous, hard wall-clock bound, failing rank named)."""
import functools

import pytest

from pyreducer.testing import run_ranks


@functools.lru_cache(maxsize=None)
def _cached_run(fn, world_size, args):
    return run_ranks(fn, world_size, args=args, timeout_s=240)


@pytest.fixture(scope="session")
def ranks_once():
    """ranks_once(fn, world_size, args) runs fn on spawned ranks once per session and caches the
    per-rank results, so many parametrized tests can check one run."""
    return _cached_run
