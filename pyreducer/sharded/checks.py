"""What overlap_optimizer(shard=True) accepts, each refusal naming what it found."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyreducer.sharded import state as state_module
from pyreducer.sharded.layout import flat_view

# Optimizers whose update of an element reads that element alone (its parameter value,
# gradient and state) and per-parameter scalars (step): stepping any piece of a parameter
# gives that piece's elements of the whole step, bit for bit (the same elementwise kernels).
# Exact classes: a subclass may override step() with arithmetic across elements.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)


def check_sharded(optimizer, params, schedule, autotune) -> None:
    """Refuses what the sharded step cannot do exactly."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"overlap_optimizer(shard=True): {type(optimizer).__module__}."
            f"{type(optimizer).__name__} is not known to update each element from that element "
            f"alone; only {names} (exactly these classes) are stepped in shards, whose pieces "
            "cut through parameters (an update reading a whole tensor, such as LBFGS or a "
            "LAMB/LARS trust ratio, would differ). Use shard=False")
    if schedule != "fifo":
        raise ValueError(f"overlap_optimizer(shard=True): each bucket is reduce-scattered "
                         f"whole, in order: schedule must be 'fifo', got {schedule!r}")
    if autotune is not None:
        raise ValueError("overlap_optimizer(shard=True) cannot be combined with "
                         "bucket_cap_mb='auto' yet: each new bucket plan moves the optimizer "
                         "state between ranks. Give a bucket_cap_mb (or a plan)")
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError("overlap_optimizer(shard=True): differentiable=True optimizers "
                             "are not stepped in shards")
    if params.tensors and params.device.type != "cpu" and \
            dist.get_backend(params.process_group) == "gloo":
        raise ValueError(f"overlap_optimizer(shard=True): the parameters are on "
                         f"{params.device}, and Gloo's reduce-scatter takes CPU tensors only: "
                         "use NCCL for GPU parameters (or shard=False)")
    reduced = {id(p) for p in params.tensors}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in reduced:
                raise ValueError(
                    f"overlap_optimizer(shard=True): param group {index} holds a parameter of "
                    f"shape {tuple(p.shape)} that the wrapper does not reduce (ignored, "
                    "delayed, or outside the model): a sharded step covers the wrapper's "
                    "buckets only")
    for name, p in zip(params.names, params.tensors):
        try:
            flat_view(p)
        except ValueError:
            raise ValueError(f"overlap_optimizer(shard=True): parameter {name} (strides "
                             f"{p.stride()}) is not dense in memory; shards cut its elements "
                             "in memory order") from None


def whole_state(optimizer, params) -> dict:
    """The state the optimizer holds already (a loaded checkpoint, Adagrad's initial sums), per
    reduced parameter index, as whole states (state.from_torch)."""
    position = {id(p): i for i, p in enumerate(params.tensors)}
    return {position[id(p)]: state_module.from_torch(p, s)
            for p, s in optimizer.state.items() if s and id(p) in position}
