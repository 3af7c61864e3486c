"""Reads of a parameter that do not go through the class it wears while pending (Note [Reads
around the pending class]).

Note [Reads around the pending class]
A pending parameter's update runs when a torch function reads it (pending.py): any torch
function, custom and extension ops called through torch.ops included. Some reads reach its
memory without a torch function on the parameter itself, and would see the value before the
update; each is made correct here, or said in the guide where it cannot be seen:
  - an alias taken before step(): a view or .data kept in a module's attribute or buffer
    (`self.w = self.weight[:, :k]`, read by another module), which shares the parameter's
    memory and is a plain tensor. At step(), the wrapped module's attributes (tensors, and
    tensors in lists, tuples and dicts one level down) and buffers are searched for tensors
    sharing a reduced parameter's memory; those parameters are updated at once (their buckets'
    overlap is given up, their values are torch DDP's after step()). An alias taken after
    step() is taken by a torch function on the parameter, which updates it first.
  - a TorchScript module inside the wrapped one reads its parameters inside TorchScript: it is
    refused when the overlapped optimizer is made (wrapper/arguments.py).
  - not seen: an alias held elsewhere (a variable of the training script, a closure), and a C++
    function given the parameter through pybind11 rather than the dispatcher. Call
    model.synchronize() after step() before such a read (docs: the overlap guide).
"""
from __future__ import annotations

import torch
from torch import nn


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's memory is, without running a pending parameter's update."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage().data_ptr() if tensor.numel() else 0


def _held_tensors(value):
    """The tensors in an attribute's value: itself, or in a list, tuple or dict one level down."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def aliased(module: nn.Module, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters among `params` whose memory a module attribute or buffer of `module`
    shares (a view or .data of it, not the parameter itself), in `params`' order."""
    where = {}
    for p in params:
        ptr = _storage(p)
        if ptr:
            where.setdefault(ptr, []).append(p)
    found: dict[int, torch.Tensor] = {}
    for m in module.modules():
        # (vars(m) holds its _parameters and _buffers dicts too)
        for tensor in (t for value in vars(m).values() for t in _held_tensors(value)):
            for p in where.get(_storage(tensor), ()):
                if tensor is not p:
                    found[id(p)] = p
    return [p for p in params if id(p) in found]
