"""What the GPU kit's tests share: how many GPUs are visible, why a test cannot run, the settings
a multi-rank test runs in, and each rank function run once per session.

Settings (backend, world size):
  - "gloo": the ranks share the visible GPUs (rank r on cuda:r % GPUs), so 2 and 3 ranks run on a
    machine with one GPU; torch's Gloo all-reduces CUDA tensors through pinned host copies. Every
    multi-rank behaviour that does not depend on NCCL itself runs here, against torch DDP in the
    same setting.
  - "nccl": one GPU per rank (NCCL refuses two ranks on one device: "Duplicate GPU detected"):
    world size 1 on one GPU (test_gpu_one_rank.py), 2 and 3 where that many GPUs are visible.
"""
import os
import time

import pytest
import torch

import pyreducer
from pyreducer.testing import RankTimeout, run_ranks

# tests/gpu/run_kit.py --rehearse plans the selection as if this many GPUs were visible: it only
# collects under that assumption (PYREDUCER_KIT_PLAN set), never runs a test.
_ASSUMED = os.environ.get("PYREDUCER_KIT_ASSUME_GPUS") if os.environ.get("PYREDUCER_KIT_PLAN") \
    else None
GPUS = int(_ASSUMED) if _ASSUMED is not None else \
    torch.cuda.device_count() if torch.cuda.is_available() else 0
WITH_CUDA = bool(pyreducer._C.WITH_CUDA)
# run_kit.py's deadline for the tests (seconds since the epoch): each rank run is bounded by it.
DEADLINE_ENV = "PYREDUCER_KIT_DEADLINE"


def gpu_skip_reason(gpus: int = 1) -> str | None:
    """Why a test needing `gpus` GPUs cannot run here, or None."""
    if _ASSUMED is None and not torch.cuda.is_available():
        return "no GPU: the CUDA/NCCL path is compiled, not run"
    if not WITH_CUDA:
        return "pyreducer was built without its CUDA kernels (tests/gpu/run_kit.py builds them)"
    if GPUS < gpus:
        return f"{gpus} GPUs needed (NCCL takes one per rank), {GPUS} visible"
    return None


def needs_gpus(gpus: int = 1):
    """A skip mark, with the reason, unless `gpus` GPUs and a CUDA build are here."""
    reason = gpu_skip_reason(gpus)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def setting(backend: str, world_size: int):
    """A pytest parameter for one multi-rank setting, skipped where it cannot run."""
    gpus = world_size if backend == "nccl" else 1
    return pytest.param((backend, world_size), marks=needs_gpus(gpus),
                        id=f"{backend}{world_size}")


SHARED = [setting("gloo", 2), setting("gloo", 3)]  # ranks share the GPU(s) over Gloo
ONE_PER_GPU = [setting("nccl", 2), setting("nccl", 3)]
MULTI = SHARED + ONE_PER_GPU
TWO_RANKS = [setting("gloo", 2), setting("nccl", 2)]
NCCL_TWO = [setting("nccl", 2)]  # what runs on NCCL alone (shard=True: Gloo refuses it on GPUs)
ONE_RANK = ("nccl", 1)


def rank_device(rank: int) -> torch.device:
    """Rank r's GPU: cuda:r with one GPU per rank, shared round-robin with fewer GPUs (Gloo)."""
    return torch.device("cuda", rank % torch.cuda.device_count())


# The longest one rank run may take (the 3-rank parity is the longest): a run that hangs costs
# at most this much of the kit's minutes.
RUN_BOUND_S = 240.0


def _deadline() -> float | None:
    deadline = os.environ.get(DEADLINE_ENV)
    return None if deadline is None else float(deadline)


def _time_left_s() -> float:
    """The bound of one rank run: RUN_BOUND_S, or less if the kit's deadline comes sooner (plus
    30 s for the run that is under way when it passes)."""
    deadline = _deadline()
    if deadline is None:
        return RUN_BOUND_S
    return max(30.0, min(RUN_BOUND_S, deadline - time.time() + 30.0))


_RUNS: dict = {}


def ranks(fn, setting_: tuple, args: tuple = (), set_device: bool = True):
    """fn(rank, world_size, *args) on the ranks of `setting_` ((backend, world size)), once per
    session: the per-rank results, or the same error for every test that reads a run that
    failed (run again, a failing run would cost every test its whole time). A run stopped
    because the kit's deadline passed skips its readers as not reached."""
    from kit_plugin import NOT_REACHED

    key = (fn, setting_, args, set_device)
    if key not in _RUNS:
        backend, world_size = setting_
        try:
            _RUNS[key] = ("ok", run_ranks(fn, world_size, args=args, timeout_s=_time_left_s(),
                                          pg_timeout_s=120, backend=backend,
                                          set_device=set_device))
        except RankTimeout as error:
            past = _deadline() is not None and time.time() > _deadline()
            _RUNS[key] = ("skip" if past else "error", error)
        except Exception as error:  # noqa: BLE001 - re-raised for every reader below
            _RUNS[key] = ("error", error)
    status, value = _RUNS[key]
    if status == "skip":
        pytest.skip(f"{NOT_REACHED} ({fn.__name__}'s ranks were stopped at the deadline)")
    if status == "error":
        raise RuntimeError(f"{fn.__name__} on {setting_[0]} x {setting_[1]} failed (this run is "
                           f"shared by several tests): {value}") from value
    return value
