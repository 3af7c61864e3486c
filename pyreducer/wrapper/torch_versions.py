"""What differs between the torch versions pyreducer supports (2.11 through 2.15), in one place.

Each difference is found by feature in the installed torch, not by version number, and pyreducer
follows the installed torch's DDP (docs/pages/getting-started.md, "Supported torch versions"):
  - torch 2.12 added DDP's `batched_grad_copy`; 2.13 added `forward_sync_buffers` and
    deprecated `broadcast_buffers` (default None, a FutureWarning when given). Up to 2.12,
    `broadcast_buffers` defaults to True and nothing warns. pyreducer takes both new arguments
    on every torch (after the installed DDP's own), with the installed DDP's default and
    warnings for `broadcast_buffers`. torch 2.15 added `lazy_bucket_allocation` (buckets
    allocated during backward, given back after it); pyreducer takes it on every torch too
    (csrc/reducer.h, Note [Lazy bucket allocation]).
  - torch 2.11's DDP fails with delay_all_reduce_named_params and a fractional bucket_cap_mb
    (DDP_DELAY_TAKES_FRACTIONAL_CAP below); pyreducer does not.
  - torch 2.13 made autograd nodes intrusive_ptr-owned (std::shared_ptr up to 2.12): the C++ side
    takes the type from torch (csrc/reducer.cpp, AccumulatorOwners).
"""
import inspect

import torch

from torch.nn.parallel import distributed as _ddp_module
from torch.nn.parallel.distributed import DistributedDataParallel as _TorchDDP

# The oldest torch pyreducer builds against and is tested with (setup.py refuses older ones),
# and the newest it is tested with (newer ones build, with a warning).
OLDEST = (2, 11)
NEWEST_TESTED = (2, 15)

_DDP_ARGUMENTS = inspect.signature(_TorchDDP.__init__).parameters
# The installed DDP's argument names (the parity tests skip a scenario that needs another).
DDP_ARGUMENTS = frozenset(_DDP_ARGUMENTS)

# torch 2.13+: broadcast_buffers is deprecated in favour of forward_sync_buffers.
DDP_HAS_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in _DDP_ARGUMENTS
# torch 2.12+: DDP has batched_grad_copy (pyreducer has it on every torch).
DDP_HAS_BATCHED_GRAD_COPY = "batched_grad_copy" in _DDP_ARGUMENTS
# The installed DDP's default: None from 2.13 (deprecated), True before.
BROADCAST_BUFFERS_DEFAULT = _DDP_ARGUMENTS["broadcast_buffers"].default
# torch 2.11's DDP raises TypeError (in _register_delay_all_reduce_hook's _broadcast_coalesced,
# which takes an int) for delay_all_reduce_named_params with a fractional bucket_cap_mb such as
# 0.1: it hands the float on. torch 2.12 hands on whole MiB (_BucketCapacityConfig, which came
# with the change). pyreducer takes any cap; a test that needs torch's oracle there gives such a
# torch a whole cap.
DDP_DELAY_TAKES_FRACTIONAL_CAP = hasattr(_ddp_module, "_BucketCapacityConfig")


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# torch 2.8 onwards (up to 2.15 at least, the newest checked): ProcessGroupGloo's worker threads
# write the group's status string unlocked, so a sparse all-reduce beside another collective can
# corrupt the heap (pyreducer/wrapper/gloo_race.py; tests/upstream/gloo_sparse_race.py reproduces
# it). pyreducer supports 2.11 onwards: every supported torch has it. Lift by version once fixed.
GLOO_STATUS_RACE = version_tuple(torch.__version__) >= (2, 8)
