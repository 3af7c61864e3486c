"""One walker for the tensors inside nested forward inputs and outputs.

The wrapper needs the tensors of a forward's output (to thread them through the Reducer's sink
node) and moves inputs to the module's device (to_device); both walk the same containers the
same way: tensors; lists and tuples (named tuples keep their type); dicts (their own type,
subclasses included, keys kept); dataclass instances (fields that __init__ takes, rebuilt with
dataclasses.replace). Anything else is a leaf and comes back unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
from torch.nn.utils.rnn import PackedSequence


def map_tensors(obj, fn: Callable, units: tuple = ()):
    """`obj` with every tensor inside it replaced by fn(tensor), in depth-first order (the
    order tensors() lists them). Instances of `units` are passed to fn whole, not walked."""
    if isinstance(obj, torch.Tensor) or (units and isinstance(obj, units)):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(item, fn, units) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(item, fn, units) for item in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict's type (OrderedDict, defaultdict, ...)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn, units)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, units)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_device(obj, device: torch.device):
    """`obj` with its tensors on `device`, as torch DDP moves forward inputs
    (torch.distributed.utils._recursive_to): a PackedSequence moves whole, with its own .to(),
    which keeps batch_sizes on the CPU as RNNs require; a copy from the CPU blocks (the caller
    may refill its pinned input buffers as soon as forward returns); a copy from another GPU runs
    on a side stream that the current stream then waits for, and the copy is recorded on the
    current stream so the allocator does not reuse it early (that GPU-to-GPU path has not run on
    a GPU yet)."""
    return map_tensors(obj, lambda t: _move(t, device), units=(PackedSequence,))


_copy_streams: dict = {}  # per target device, as torch's _get_stream


def _move(obj, device: torch.device):
    source = obj.data.device if isinstance(obj, PackedSequence) else obj.device
    if source == device:
        return obj
    if source.type != "cuda" or device.type != "cuda":
        return obj.to(device)
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        moved = obj.to(device)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    (moved.data if isinstance(moved, PackedSequence) else moved).record_stream(current)
    return moved


def tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside `obj`, depth first."""
    found: list[torch.Tensor] = []

    def collect(tensor):
        found.append(tensor)
        return tensor

    map_tensors(obj, collect)
    return found


def replace_tensors(obj, replacements: list[torch.Tensor]):
    """`obj` with its tensors, in tensors() order, replaced by `replacements`."""
    supply = iter(replacements)
    missing = object()

    def take(_):
        tensor = next(supply, missing)
        if tensor is missing:
            raise ValueError(f"replace_tensors: {len(replacements)} replacements for more "
                             f"tensors in the object")
        return tensor

    result = map_tensors(obj, take)
    if next(supply, missing) is not missing:
        raise ValueError("replace_tensors: more replacements than tensors in the object")
    return result
