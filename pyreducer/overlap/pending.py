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


# Reads of a tensor's metadata alone (no element): they pass without an update (a framework
# counting parameters or checking requires_grad between backward and step() would otherwise
# complete every bucket then). data_ptr() and untyped_storage() are not among them: what reads
# memory through them (a C++ extension) must see the updated values.
_METADATA = (torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__,
             torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.size, torch.Tensor.dim,
             torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.element_size,
             torch.Tensor.is_floating_point, torch.Tensor.get_device,
             torch.Tensor.storage_offset, torch.Tensor.__len__)
# The __torch_function__ of torch.Tensor and nn.Parameter: a class that keeps either has no
# behaviour of its own to run (run_own below).
_PLAIN = (torch._C._disabled_torch_function_impl, torch.Tensor.__torch_function__.__func__)


def is_metadata(func) -> bool:
    """Whether torch function `func` reads a tensor's metadata only."""
    return any(func == m for m in _METADATA)  # (a new method-wrapper per access: ==, not is)


def _pending_torch_function(cls, func, types, args=(), kwargs=None):
    """Updates the pending parameters among the arguments (unless `func` reads metadata only),
    then runs `func` on them as their own class would: a parameter class with a
    __torch_function__ of its own (a quantized or float8 parameter) keeps it while pending."""
    kwargs = kwargs or {}
    if not is_metadata(func):
        for value in tensors_in(args, kwargs):
            overlap = getattr(value, "_pyreducer_overlap", None)
            if overlap is not None:
                overlap.update_parameter(value, func)
    own_types = tuple(_own_class(t) for t in types)
    for own in own_types:  # torch's order: subclasses first, then as the arguments come
        handler = getattr(own.__torch_function__, "__func__", own.__torch_function__)
        if handler not in _PLAIN:
            return own.__torch_function__(func, own_types, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _own_class(cls: type) -> type:
    """The class a pending class stands for (`cls` itself if it is not one)."""
    return cls.__mro__[1] if cls.__dict__.get("_pyreducer_pending") else cls


def tensors_in(args, kwargs):
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
