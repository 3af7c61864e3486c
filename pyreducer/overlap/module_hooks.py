"""The hooks the overlapped optimizer puts on the user's modules (pyreducer/overlap/optimizer.py):
they call the optimizer while it lives, and hold it weakly; a copy of the module gets hooks that
do nothing."""
from __future__ import annotations

import weakref


class ModuleHook:
    """A hook the overlapped optimizer puts on the user's modules: calls `method` of the
    optimizer while it lives. A copy of the module (copy.deepcopy, torch.save of the module)
    gets a hook that does nothing: the copy is not overlapped, and the optimizer is neither
    pickled nor copied with it."""

    def __init__(self, method):
        self.method = weakref.WeakMethod(method)

    def __call__(self, *args, **kwargs):
        method = self.method()
        return None if method is None else method(*args, **kwargs)

    def __reduce__(self):
        return (InertHook, ())


class InertHook:
    """What a ModuleHook becomes in a copy of the module."""

    def __call__(self, *args, **kwargs):
        return None
