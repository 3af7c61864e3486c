"""The class a parameter wears while its update is pending (Note [Overlapped step] in
pyreducer/overlap/optimizer.py): a subclass of its own class whose __torch_function__ asks the
overlapped optimizer to update it before any torch operation on it runs, and whose deepcopy copies
the updated value. The optimizer restores the parameter's own class when it updates it."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

_PENDING_CLASSES: dict[type, type] = {}  # a parameter class -> its pending subclass


def pending_class(cls: type) -> type:
    """The subclass of parameter class `cls` that pending parameters wear."""
    if cls not in _PENDING_CLASSES:
        _PENDING_CLASSES[cls] = type(f"Pending{cls.__name__}", (cls,),
                                     {"__torch_function__": classmethod(_pending_torch_function),
                                      "__deepcopy__": _pending_deepcopy,
                                      "_pyreducer_pending": True,
                                      "__module__": __name__})
    return _PENDING_CLASSES[cls]


def wear(param: torch.Tensor, overlap) -> None:
    """`param` wears the pending class: its reads call overlap.update_parameter first."""
    param._pyreducer_overlap = overlap
    param.__class__ = pending_class(type(param))


def take_off(param: torch.Tensor) -> None:
    """`param` wears the class it had again."""
    param.__class__ = type(param).__mro__[1]
    del param._pyreducer_overlap


def _pending_torch_function(cls, func, types, args=(), kwargs=None):
    """Updates the pending parameters among the arguments, then runs `func` on them."""
    kwargs = kwargs or {}
    for value in _tensors_in(args, kwargs):
        overlap = getattr(value, "_pyreducer_overlap", None)
        if overlap is not None:
            overlap.update_parameter(value, func)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _tensors_in(args, kwargs):
    """Every tensor in `args` and `kwargs`, at any depth of lists, tuples and dicts (a library
    function may pass its tensors to handle_torch_function inside a dict)."""
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            yield value


def _pending_deepcopy(self, memo):
    """copy.deepcopy: the updated value, in a parameter of the class it had (Parameter's own
    __deepcopy__ makes the copy of type(self)). Inside an update, where reads pass through, the
    parameter is still pending: its value copied as it is. On CUDA an updated parameter may
    wear the pending class still (fenced, Note [Streams] in pyreducer/overlap/optimizer.py); the
    update made the current stream wait for its fence, so it is copied as its own class."""
    overlap = getattr(self, "_pyreducer_overlap", None)
    if overlap is not None:
        overlap.update_parameter(self)
    cls = type(self)
    if not cls.__dict__.get("_pyreducer_pending"):
        return cls.__deepcopy__(self, memo)
    self.__class__ = cls.__mro__[1]
    try:
        return self.__class__.__deepcopy__(self, memo)
    finally:
        self.__class__ = cls
