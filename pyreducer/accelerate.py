"""Hugging Face Accelerate: `accelerator = pyreducer.accelerate.Accelerator(...)` in place of
`accelerate.Accelerator(...)`; the rest of the script is unchanged.

Accelerate builds torch's DistributedDataParallel inside `Accelerator.prepare_model` (one call on
GPUs, one on CPUs) and offers no way to choose the wrapper class. This subclass runs Accelerate's
own prepare_model (device placement, mixed precision, comm hooks, torch.compile last, exactly as
Accelerate orders them) with the name it constructs, `torch.nn.parallel.DistributedDataParallel`,
bound to pyreducer's wrapper for the duration of that one call (Note [One name, one call]), and
replaces the two methods where Accelerate needs a torch DDP by isinstance:

- unwrap_model (save_model, get_state_dict and the HF Trainer rely on it): strips pyreducer's
  wrapper too, so saved weights have the model's own keys.
- trigger_sync_in_backward: Accelerate arms torch DDP's private reducer with no outputs; pyreducer
  arms its reducer with the loss, so inside this context `accelerator.backward(loss)` arms it, and
  leaving the context without such a backward raises instead of leaving gradients unsynchronised.

Everything else (accumulate / no_sync, backward, clip_grad_norm_, save_state / load_state, the
DistributedDataParallelKwargs handler and its comm hooks) works on pyreducer's wrapper as it
does on torch's. pyreducer's own options, which DistributedDataParallelKwargs cannot carry, go in
`ddp_options` (for example `{"bucket_cap_mb": "auto"}`).

Note [One name, one call]
Accelerate looks `torch.nn.parallel.DistributedDataParallel` up when it constructs the wrapper,
so binding that attribute for the duration of `prepare_model` changes what it builds and nothing
else: the binding is undone before prepare_model returns (and on an error), so later isinstance
checks anywhere, torch's own included, see torch's class again. It is a class (a subclass of
pyreducer's wrapper carrying `ddp_options`), so an isinstance check during the call still works.
If a future Accelerate builds its wrapper some other way, prepare_model raises rather than
training with torch DDP unnoticed.

Accelerate is imported here only: `import pyreducer` does not load it.
"""
from __future__ import annotations

import contextlib

import accelerate
import torch
from accelerate.utils import is_compiled_module

from pyreducer.distributed import DistributedDataParallel

@contextlib.contextmanager
def bound(owner, name: str, value):
    """Within this context `owner.name` is `value`; the old value is back afterwards, whatever
    happened (Note [One name, one call])."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _wrapper_class(options: dict):
    """pyreducer's wrapper, constructed as Accelerate constructs torch DDP, plus `options`."""

    class AcceleratePreparedDDP(DistributedDataParallel):
        def __init__(self, module, *args, **kwargs):
            super().__init__(module, *args, **{**kwargs, **options})

    return AcceleratePreparedDDP


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator with pyreducer's DistributedDataParallel: the same arguments, plus
    `ddp_options`, keyword arguments for pyreducer's wrapper beyond DistributedDataParallelKwargs
    (they take precedence over it)."""

    def __init__(self, *args, ddp_options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pyreducer_ddp_options = dict(ddp_options or {})
        self._armed_by_trigger = None  # the wrapper trigger_sync_in_backward waits to arm

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        torch_ddp = torch.nn.parallel.DistributedDataParallel
        with bound(torch.nn.parallel, "DistributedDataParallel",
                   _wrapper_class(self.pyreducer_ddp_options)):
            prepared = super().prepare_model(model, device_placement, evaluation_mode)
        inner = prepared._orig_mod if is_compiled_module(prepared) else prepared
        if isinstance(inner, torch_ddp):
            raise RuntimeError(
                f"pyreducer.accelerate: Accelerate {accelerate.__version__} did not build its "
                f"data-parallel wrapper through torch.nn.parallel.DistributedDataParallel "
                f"(expected pyreducer's DistributedDataParallel, got torch's, from "
                f"{type(inner).__module__}); this Accelerate version is not supported")
        return prepared

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        compiled = model if is_compiled_module(model) else None
        inner = compiled._orig_mod if compiled is not None else model
        if not isinstance(inner, DistributedDataParallel):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        unwrapped = super().unwrap_model(inner.module, keep_fp32_wrapper, keep_torch_compile)
        if compiled is not None and keep_torch_compile:
            compiled._orig_mod = unwrapped  # as Accelerate does for torch.compile(torch DDP)
            return compiled
        return unwrapped

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        inner = model._orig_mod if is_compiled_module(model) else model
        if not isinstance(inner, DistributedDataParallel):
            with super().trigger_sync_in_backward(model):
                yield
            return
        old_sync = inner.require_backward_grad_sync
        inner.require_backward_grad_sync = True
        self._armed_by_trigger = inner
        try:
            yield
            if self._armed_by_trigger is not None:
                raise RuntimeError(
                    "pyreducer.accelerate: no accelerator.backward(loss) ran inside "
                    "trigger_sync_in_backward(model); pyreducer arms its reducer with that loss, "
                    "so the gradients were not synchronised (expected one "
                    "accelerator.backward(loss) inside the context, found none)")
        finally:
            self._armed_by_trigger = None
            inner.require_backward_grad_sync = old_sync

    def backward(self, loss, **kwargs):
        wrapper, self._armed_by_trigger = self._armed_by_trigger, None
        if wrapper is not None and torch.is_grad_enabled():
            loss = wrapper.prepare_for_backward(loss)
        return super().backward(loss, **kwargs)


__all__ = ["Accelerator"]
