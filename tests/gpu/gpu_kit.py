"""What the GPU kit's tests share: how many GPUs are visible, why a test cannot run, and NCCL
ranks run once per session."""
import functools

import pytest
import torch

import pyreducer
from pyreducer.testing import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WITH_CUDA = bool(pyreducer._C.WITH_CUDA)


def gpu_skip_reason(world_size: int = 1) -> str | None:
    """Why a test needing `world_size` GPUs cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no GPU: the CUDA/NCCL path is compiled, not run"
    if not WITH_CUDA:
        return "pyreducer was built without its CUDA kernels (make gpu-test builds them)"
    if GPUS < world_size:
        return f"world size {world_size} needs {world_size} GPUs, {GPUS} visible"
    return None


def needs_gpus(world_size: int = 1):
    """A skip mark, with the reason, unless `world_size` GPUs and a CUDA build are here."""
    reason = gpu_skip_reason(world_size)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


@functools.lru_cache(maxsize=None)
def nccl_ranks(fn, world_size: int, args: tuple = (), set_device: bool = True):
    """fn(rank, world_size, *args) on `world_size` NCCL ranks, one GPU each, once per session
    (cached)."""
    return run_ranks(fn, world_size, args=args, timeout_s=600, pg_timeout_s=120,
                     backend="nccl", set_device=set_device)
