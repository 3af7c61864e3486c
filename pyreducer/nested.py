"""One walker for the tensors inside nested forward inputs and outputs.

The wrapper needs the tensors of a forward's output (to thread them through the Reducer's sink
node) and moves inputs to the module's device; both walk the same containers the same way:
tensors; lists and tuples (named tuples keep their type); dicts (their own type, subclasses
included, keys kept); dataclass instances (fields that __init__ takes, rebuilt with
dataclasses.replace). Anything else is a leaf and comes back unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch


def map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """`obj` with every tensor inside it replaced by fn(tensor), in depth-first order (the
    order tensors() lists them)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict's type (OrderedDict, defaultdict, ...)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


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
