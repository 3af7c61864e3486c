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
`ddp_options` (for example `{"bucket_cap_mb": "auto"}`), and so do the two options of the
overlapped and sharded optimizers, `overlap_optimizer` and `shard` (pyreducer/overlap/
adapter_options.py; Note [Accelerate's overlapped step]).

Note [One name, one call]
Accelerate looks `torch.nn.parallel.DistributedDataParallel` up when it constructs the wrapper,
so binding that attribute for the duration of `prepare_model` changes what it builds and nothing
else: the binding is undone before prepare_model returns (and on an error), so later isinstance
checks anywhere, torch's own included, see torch's class again. It is a class (a subclass of
pyreducer's wrapper carrying `ddp_options`), so an isinstance check during the call still works.
If a future Accelerate builds its wrapper some other way, prepare_model raises rather than
training with torch DDP unnoticed.

Note [Accelerate's overlapped step]
With `ddp_options={"overlap_optimizer": True}` (or `"shard": True`), prepare_optimizer turns each
optimizer into `model.overlap_optimizer(optimizer)` on the pyreducer wrapper that holds its
parameters, and wraps that in Accelerate's AcceleratedOptimizer, which steps and zeroes it only
on the steps that synchronise (accumulate()). Accelerate prepares objects in the order given, so
prepare() puts models before optimizers (the wrapper must exist first; the results come back in
the order given); an LR scheduler built on the plain optimizer keeps driving it (the two share
param_groups). One overlapped optimizer per wrapper: a second one over the same model is
refused (its step would replace the first). clip_grad_norm_ / clip_grad_value_ over the
optimizer's parameters (those that require grad, in any order, e.g. model.parameters()) go to
the optimizer's own clip, which completes the reductions and clips exactly what torch's clip
would, in the caller's order, without taking the updates out of the overlap; over other
parameters, Accelerate's clip reads .grad, which is correct (each read waits for its bucket) and
loses that step's overlap; with shard=True no rank holds whole gradients, so that is refused.
Checkpoints: save_state calls every optimizer's state_dict() on every rank (Accelerate's
save_accelerator_state; the sharded optimizer's is collective) and rank 0 writes torch's format,
which a plain optimizer loads. A GradScaler (fp16 on GPUs) unscales whole gradients: refused with
shard=True; bf16 needs none. On one process Accelerate wraps no model, and optimizers stay plain.

Accelerate is imported here only: `import pyreducer` does not load it.
"""
from __future__ import annotations

import contextlib

import accelerate
import torch
from accelerate.utils import DistributedType, is_compiled_module

from pyreducer.distributed import DistributedDataParallel
from pyreducer.overlap import adapter_options
from pyreducer.overlap.optimizer import OverlapOptimizer
from pyreducer.sharded import ShardedOptimizer

WHERE = "pyreducer.accelerate.Accelerator"  # (how refusals name the adapter)


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
    (they take precedence over it), and the overlapped optimizer's two options:

    Args:
        ddp_options (dict): the wrapper's keyword arguments (e.g. `{"bucket_cap_mb": "auto"}`),
            and `"overlap_optimizer"` (True, or a dict of `model.overlap_optimizer`'s
            `schedule` / `hold_back`): prepared optimizers become pyreducer's overlapped
            optimizer; `"shard"` (True): the sharded one (Note [Accelerate's overlapped step]).
    """

    def __init__(self, *args, ddp_options: dict | None = None, **kwargs):
        wrapper_options, self.pyreducer_overlap = adapter_options.take(dict(ddp_options or {}),
                                                                       WHERE)
        super().__init__(*args, **kwargs)
        self.pyreducer_ddp_options = wrapper_options
        self._armed_by_trigger = None  # the wrapper trigger_sync_in_backward waits to arm
        self._wrappers: list[DistributedDataParallel] = []  # built by prepare_model (Accelerate
        # keeps the unwrapped models)

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
        if isinstance(inner, DistributedDataParallel):
            self._wrappers.append(inner)
        return prepared

    def free_memory(self, *objects):
        self._wrappers = []
        return super().free_memory(*objects)

    # -- the overlapped optimizer (Note [Accelerate's overlapped step]) --------------------------
    def prepare(self, *args, device_placement=None):
        """Accelerate's prepare; with an overlapped optimizer requested, models are prepared
        before optimizers (each optimizer needs its model's wrapper), and the results come
        back in the order given."""
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], torch.nn.Module))
        if self.pyreducer_overlap is None or order == list(range(len(args))) or \
                (device_placement is not None and len(device_placement) != len(args)):
            return super().prepare(*args, device_placement=device_placement)
        placement = None if device_placement is None else [device_placement[i] for i in order]
        prepared = super().prepare(*[args[i] for i in order], device_placement=placement)
        result = [None] * len(args)
        for position, index in enumerate(order):
            result[index] = prepared[position]
        return tuple(result)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        request = self.pyreducer_overlap
        if request is None or getattr(optimizer, "_is_accelerate_prepared", False) or \
                self.distributed_type == DistributedType.NO:
            return super().prepare_optimizer(optimizer, device_placement)
        if request.shard and self.scaler is not None:
            raise ValueError(
                f"{WHERE}: shard=True with mixed_precision={self.mixed_precision!r}, whose "
                f"{type(self.scaler).__name__} unscales whole gradients, which no rank holds "
                "with the sharded optimizer; expected no gradient scaler: use "
                "mixed_precision='bf16' (no scaler) or shard=False")
        wrapper = self._wrapper_of(optimizer)
        held = {id(p) for p in wrapper.parameters()}
        for other in self.overlapped_optimizers():
            if any(id(p) in held for group in other.param_groups for p in group["params"]):
                raise ValueError(
                    f"{WHERE}: a second optimizer ({type(optimizer).__name__}) over the model "
                    f"that {request.name} ({type(other.optimizer).__name__}) already steps; "
                    "expected one optimizer per model with overlap_optimizer/shard (param "
                    "groups may differ in settings): its step would replace the first's")
        return super().prepare_optimizer(request.make(wrapper, optimizer), device_placement)

    def _wrapper_of(self, optimizer) -> DistributedDataParallel:
        """The prepared pyreducer wrapper holding every parameter of `optimizer`."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for wrapper in self._wrappers:
            if wanted <= {id(p) for p in wrapper.parameters()}:
                return wrapper
        raise ValueError(
            f"{WHERE}: {self.pyreducer_overlap.name} steps a model's parameters on pyreducer's "
            f"wrapper, but none of the {len(self._wrappers)} wrapped model(s) holds every "
            f"parameter of this {type(optimizer).__name__} (distributed type "
            f"{self.distributed_type}); expected its model prepared first, or in the same "
            "prepare() call")

    def prepare_scheduler(self, scheduler):
        """Accelerate's; a scheduler built on the plain optimizer is tied to the prepared
        overlapped one that wraps it (Accelerate would find no match and tie it to all)."""
        prepared = super().prepare_scheduler(scheduler)
        for accelerated in self._optimizers:
            inner = getattr(accelerated, "optimizer", None)
            if isinstance(inner, OverlapOptimizer) and \
                    getattr(scheduler, "optimizer", None) is inner.optimizer:
                prepared.optimizers = [accelerated]
        return prepared

    def overlapped_optimizers(self) -> list[OverlapOptimizer]:
        """The overlapped (or sharded) optimizers that prepare made, in the order prepared."""
        return [o.optimizer for o in self._optimizers
                if isinstance(getattr(o, "optimizer", None), OverlapOptimizer)]

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        target = self._clip_target(parameters, "clip_grad_norm_")
        if target is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        optimizer, order = target
        self.unscale_gradients()  # (a GradScaler, shard=False: its reads complete the buckets)
        return optimizer.clip_grad_norm_(max_norm, norm_type, parameters=order)

    def clip_grad_value_(self, parameters, clip_value):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        target = self._clip_target(parameters, "clip_grad_value_")
        if target is None:
            return super().clip_grad_value_(parameters, clip_value)
        self.unscale_gradients()
        target[0].clip_grad_value_(clip_value)

    def _clip_target(self, parameters: list, what: str):
        """(the overlapped optimizer, the order for its clip) when the parameters that require
        grad among `parameters` are that optimizer's; None for Accelerate's own clip (other
        parameters; refused with shard=True where they share some). requires_grad is read
        with torch functions off: on a pending parameter a read would complete its bucket."""
        with torch._C.DisableTorchFunctionSubclass():
            trained = [p for p in parameters if p.requires_grad]
            for optimizer in self.overlapped_optimizers():
                own = [p for g in optimizer.param_groups for p in g["params"]]
                own_trained = {id(p) for p in own if p.requires_grad}
                given = {id(p) for p in trained}
                if given == own_trained:
                    return optimizer, trained + [p for p in own if id(p) not in given]
                if given & own_trained and isinstance(optimizer, ShardedOptimizer):
                    raise ValueError(
                        f"{WHERE}: {what} over {len(given)} parameters, "
                        f"{len(given & own_trained)} of them among the sharded optimizer's "
                        f"{len(own_trained)}; with shard=True no rank holds whole gradients, "
                        "so a clip goes through the optimizer, over exactly its parameters: "
                        "expected those (e.g. model.parameters()), or shard=False")
        return None

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
