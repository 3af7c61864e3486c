"""Where pyreducer's splitting backend enters torch.compile: the one module that reaches into
dynamo's objects (version-checked for torch 2.11 to 2.15; torch._dynamo is imported here, only when
a compiled model is at hand).

A compiled callable holds a frame callback (`CatchErrorsWrapper` around `ConvertFrame`) that holds
the user's backend; `ConvertFrame._clone_with_backend(fn)` makes the same callback with another
backend (dynamo's own DDPOptimizer enters this way). pyreducer makes one such callback per bucket
plan: dynamo keeps compiled code per backend, so a plan that changes which parameters share a bucket
finds no compiled code and captures again (split at the new buckets); a plan seen before finds its
code.
"""
from __future__ import annotations

import copy

import torch._dynamo  # noqa: F401: imported only once a model is compiled
from torch._dynamo import convert_frame
from torch._dynamo.eval_frame import OptimizedModule

from pyreducer.compiled.backend import SplitBackend


def user_backend(callback):
    """The user's compiler inside a torch.compile frame callback, or an error naming what was
    found instead."""
    convert = getattr(callback, "_torchdynamo_orig_backend", None)
    if convert is None or not hasattr(convert, "_clone_with_backend") \
            or not hasattr(convert, "_torchdynamo_orig_backend"):
        raise TypeError(
            "pyreducer: expected torch.compile's frame callback (a CatchErrorsWrapper around a "
            f"ConvertFrame with _clone_with_backend), found {type(callback).__name__} around "
            f"{type(convert).__name__}: this torch's dynamo is not one pyreducer knows "
            "(torch 2.11 to 2.15 are)")
    return convert._torchdynamo_orig_backend


def split_callback(callback, backend: SplitBackend):
    """callback with `backend` (which wraps callback's own backend) in its place."""
    convert = callback._torchdynamo_orig_backend
    hooks = getattr(callback, "hooks", None) or getattr(convert, "_hooks", None)
    return convert_frame.catch_errors_wrapper(convert._clone_with_backend(backend), hooks)


def compiled_modules(module: torch.nn.Module) -> list[tuple[str, OptimizedModule]]:
    """(name, module) of every torch.compile'd module in the tree, outermost first."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, OptimizedModule)]


class SplitForward:
    """Replaces an OptimizedModule's forward: calls its module under a callback that splits at
    the buckets of the plan in force (`plans.backend_for(compiler)`), one per plan."""

    def __init__(self, optimized: OptimizedModule, plans):
        self.optimized = optimized
        self.plans = plans
        self.ctx = optimized.dynamo_ctx
        self.compiler = user_backend(self.ctx.callback)
        self.original_forward = optimized.forward
        self.forwards = {}  # SplitBackend -> the module's forward under its callback

    def __call__(self, *args, **kwargs):
        if self.plans.provisional():  # Note [Eager until the rebuild]
            return self.optimized._orig_mod(*args, **kwargs)
        backend = self.plans.backend_for(self.compiler)
        forward = self.forwards.get(id(backend))
        if forward is None:
            forward = self.forwards[id(backend)] = self._forward_with(backend)
        return forward(*args, **kwargs)

    def _forward_with(self, backend):
        """OptimizedModule._initialize's forward, made with a copy of its context whose callback
        carries `backend`."""
        ctx = copy.copy(self.ctx)
        ctx.callback = split_callback(self.ctx.callback, backend)
        optimized = self.optimized
        saved = optimized.__dict__.get("forward"), optimized.dynamo_ctx
        try:
            optimized.dynamo_ctx = ctx
            optimized._initialize()
            return optimized.__dict__["forward"]
        finally:
            optimized.dynamo_ctx = saved[1]
            optimized.__dict__["forward"] = saved[0]
