"""Parameters changed after wrapping: the wrapper reduces the parameters it was built with, so a
parameter registered, replaced or removed later in the wrapped module (`m.fc = nn.Linear(...)`,
`m.fc.weight = nn.Parameter(...)`, `seq.append(...)`), or resized in place (`p.data = ...`), would
leave gradients un-averaged or a bucket slot of the wrong size. torch DDP goes on silently; here
the next forward raises, naming the parameter and the rank.

Registrations are seen by torch's global module/parameter registration hooks (installed once, on
the first wrapper); they cost nothing per forward. The check at each forward is a flag test and,
for resizes, one shape comparison per parameter against the shapes recorded at wrapping. A
change made on one rank only raises there; the others then wait in their next collective until
the process group's timeout.
"""
from __future__ import annotations

import weakref

import torch

_watched: "weakref.WeakSet" = weakref.WeakSet()  # the live watches
_installed = False


class ModelChanged(RuntimeError):
    pass


class ParameterWatch:
    """Watches `module` (the wrapped module) whose reduced parameters are `params`."""

    def __init__(self, module, params):
        global _installed
        if not _installed:
            torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter)
            torch.nn.modules.module.register_module_module_registration_hook(_on_module)
            _installed = True
        self.params = params
        self.names = {id(m): name for name, m in module.named_modules()}
        self.ids = {id(p) for p in params.tensors}
        self.shapes = [tuple(p.shape) for p in params.tensors]
        self.change: str | None = None
        _watched.add(self)

    def qualified(self, module, name: str) -> str:
        prefix = self.names[id(module)]
        return f"{prefix}.{name}" if prefix else name

    def check(self, rank: int) -> None:
        """Raises ModelChanged if the module's parameters changed since wrapping."""
        change = self.change
        # Without __torch_function__: reading .shape of a parameter whose overlapped update is
        # pending would run that update here (pyreducer/overlap/optimizer.py), before the forward.
        with torch._C.DisableTorchFunctionSubclass():
            for name, p, shape in zip(self.params.names, self.params.tensors, self.shapes):
                if change is not None:
                    break
                if p.shape != shape:
                    change = f"parameter {name!r} was resized from {shape} to {tuple(p.shape)}"
        if change is not None:
            raise ModelChanged(f"pyreducer: on rank {rank}, {change} after the model was "
                               f"wrapped; the wrapper reduces the parameters it was built with "
                               f"(their gradients would be left un-averaged or misplaced). "
                               f"Change the model first, then wrap it again.")


def _on_parameter(module, name, param):
    for w in list(_watched):
        if id(module) in w.names and w.change is None:
            old = module._parameters.get(name)
            if param is old or (param is not None and id(param) in w.ids and old is None):
                continue  # the same parameter set again
            what = "removed" if param is None else "replaced" if old is not None else "added"
            w.change = f"parameter {w.qualified(module, name)!r} was {what}"
    return None


def _on_module(module, name, submodule):
    for w in list(_watched):
        if id(module) in w.names and w.change is None:
            old = module._modules.get(name)
            if submodule is old:
                continue
            if any(True for _ in (submodule.parameters() if submodule is not None else ())) or \
                    (old is not None and any(True for _ in old.parameters())):
                w.change = (f"submodule {w.qualified(module, name)!r} with parameters was "
                            f"{'added' if old is None else 'replaced'}")
    return None
