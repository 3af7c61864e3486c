"""Reads of a parameter that do not go through the class it wears while pending (Note [Reads
around the pending class]).

Note [Reads around the pending class]
A pending parameter's update runs when a torch function reads it (pending.py): any torch
function, custom and extension ops called through torch.ops included. Some reads reach its
memory without a torch function on the parameter itself, and would see the value before the
update; each is made correct here, or said in the guide where it cannot be seen:
  - an alias taken before step(): a view or .data kept in a module's attribute or buffer
    (`self.w = self.weight[:, :k]`, read by another module), which shares the parameter's
    memory and is a plain tensor. At step(), the attributes and buffers of the wrapped
    module's modules (as they were when the overlapped optimizer was made: those its forward
    hooks are on), tensors and tensors in lists, tuples and dicts, are searched for tensors
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


_SKIPPED = frozenset(("_parameters", "_modules"))  # (the _buffers dict is searched)


def aliased(modules: list[nn.Module], params: list[torch.Tensor],
            ignore: list[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The parameters among `params` whose memory an attribute or buffer of one of `modules`
    shares (a view or .data of it, not a parameter, not one of `ignore`), in `params`' order:
    attributes holding a tensor, or tensors in a list, tuple or dict. Runs at every step():
    kept to one pass over the modules' attributes (0.8 ms for a 12-layer GPT-2's 164 modules,
    on this project's 2-core machine). Also asked of buffers (pending_buffers.py: `params`
    the buffers, `ignore` them too)."""
    ignored = {id(t) for t in ignore}
    held: list[torch.Tensor] = []
    for m in modules:
        for key, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                held.append(value)
            elif value and isinstance(value, (list, tuple, dict)) and key not in _SKIPPED:
                held.extend(v for v in (value.values() if isinstance(value, dict) else value)
                            if isinstance(v, torch.Tensor))
    found: dict[int, torch.Tensor] = {}
    # (no pending parameter's update runs for these reads of where memory is)
    with torch._C.DisableTorchFunctionSubclass():
        where: dict[int, list[torch.Tensor]] = {}
        for p in params:
            if p.numel():
                where.setdefault(p.untyped_storage().data_ptr(), []).append(p)
        for tensor in held:
            if tensor.numel() and not isinstance(tensor, nn.Parameter) \
                    and id(tensor) not in ignored:
                for p in where.get(tensor.untyped_storage().data_ptr(), ()):
                    found[id(p)] = p
    return [p for p in params if id(p) in found]
