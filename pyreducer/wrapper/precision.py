"""torch DDP's `mixed_precision` (torch.nn.parallel.distributed._MixedPrecision), with its numerics.

What torch DDP does with `mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`:
buffers are cast to `buffer_dtype` once, at construction; every forward runs on copies of the
parameters in `param_dtype`, with floating-point inputs cast to `param_dtype`; the gradients
(in `param_dtype`) are copied into the buckets without scaling, cast to `reduce_dtype`,
all-reduced (SUM), divided by the world size in `reduce_dtype`, and written into the
full-precision parameters' `.grad`, so the optimizer steps in full precision.

Note [Mixed precision]
pyreducer runs the forward with each parameter of the module
replaced by a differentiable cast `param.to(param_dtype)` (torch.func.functional_call, tied
parameters cast once), so autograd itself hands the full-precision parameter the low-precision
gradient, cast up exactly (every `param_dtype` value is a full-precision value); the Reducer's
hooks stay on the parameters' own AccumulateGrad nodes. The communication is a built-in C++
hook ("mixed precision": cast to `reduce_dtype`, SUM, divide by the world size), as torch's
`_reducer_allreduce_and_upcast_hook`. So `.grad` holds the same values as torch DDP's, bit for bit
where the collective sums in the same order. torch's own implementation needs CUDA (it records
stream events); this one runs on any device. Where they differ: torch swaps `param.data`, so
`module.weight.dtype` is `param_dtype` inside forward here too, but parameters read through
`named_parameters()` outside forward are always the full-precision ones; and gradients
accumulated across iterations (no_sync, zero_grad(set_to_none=False)) add up in full precision
(torch casts the accumulated `.grad` down to `param_dtype` before each forward).

Not supported (they raise, never compute silently in the wrong precision): recurrent modules
(nn.RNN/LSTM/GRU keep their own list of weight tensors, which a per-forward replacement does not
reach: refused at construction), and activation checkpointing, whose recomputation during
backward runs after the low-precision copies are gone (torch then raises a dtype error or its
"recomputed tensors differ" error). torch's own swaps `param.data` until the end of backward;
doing the same here needs the Reducer to re-hook the parameters' AccumulateGrad nodes every
iteration (a follow-up).
"""
from __future__ import annotations

import torch
from torch import nn

from pyreducer.wrapper import nested


def check_config(config) -> None:
    """A _MixedPrecision-like config: param_dtype must be a floating dtype; reduce_dtype and
    buffer_dtype may be None (reduce in param_dtype; leave buffers as they are)."""
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        if not hasattr(config, field):
            raise TypeError("mixed_precision expects a torch.nn.parallel.distributed."
                            f"_MixedPrecision (param_dtype, reduce_dtype, buffer_dtype); {config!r} "
                            f"has no {field}")
    if not isinstance(config.param_dtype, torch.dtype) or not config.param_dtype.is_floating_point:
        raise ValueError("mixed_precision.param_dtype must be a floating-point torch.dtype, got "
                         f"{config.param_dtype!r}")


def reduce_dtype(config) -> torch.dtype:
    return config.reduce_dtype if config.reduce_dtype is not None else config.param_dtype


def averaging(mixed_precision, predivide_factor, reduce_dtype_, world_size: int) -> dict | None:
    """Settings of the built-in averaging hook (csrc/comm_hook.h AveragingHook) for a wrapper's
    precision options, or None for torch DDP's own scheme (1/world_size in the copy-in, SUM).
    mixed_precision: cast to its reduce_dtype, SUM, divide by the world size (torch's
    _reducer_allreduce_and_upcast_hook). gradient_predivide_factor f and/or reduce_dtype: x 1/f,
    SUM, x f/world_size, in reduce_dtype (Apex's allreduce_bucket)."""
    if mixed_precision is not None:
        if predivide_factor is not None or reduce_dtype_ is not None:
            raise ValueError("pyreducer: mixed_precision sets how buckets are reduced; it cannot "
                             "be combined with gradient_predivide_factor or reduce_dtype")
        return dict(reduce_dtype=reduce_dtype(mixed_precision), pre_multiplier=1.0,
                    post="divide", post_value=float(world_size), name="mixed precision")
    if predivide_factor is None and reduce_dtype_ is None:
        return None
    factor = 1.0 if predivide_factor is None else float(predivide_factor)
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {predivide_factor}")
    return dict(reduce_dtype=reduce_dtype_, pre_multiplier=1.0 / factor, post="multiply",
                post_value=factor / world_size, name="predivide/reduce_dtype")


class MixedPrecisionForward:
    """Runs a module's forward on `param_dtype` copies of its (not ignored) parameters."""

    def __init__(self, config, module: nn.Module):
        check_config(config)
        recurrent = [name for name, m in module.named_modules() if isinstance(m, nn.RNNBase)]
        if recurrent:
            raise NotImplementedError(
                f"pyreducer: mixed_precision with recurrent modules ({recurrent}) is not "
                "supported: they keep their own list of weight tensors, which the per-forward "
                "low-precision copies do not reach")
        # torch casts every parameter and buffer except those ignored by
        # _set_params_and_buffers_to_ignore_for_model (delayed ones too)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.config, self.module = config, module
        self.names = [name for name, _ in module.named_parameters() if name not in ignored]
        self.copies: dict = {}  # during a forward: id(copy) -> its parameter (pyreducer/compiled)
        if config.buffer_dtype is not None:
            for name, buffer in module.named_buffers():
                if name not in ignored and buffer.is_floating_point():
                    buffer.data = buffer.to(config.buffer_dtype)

    def __call__(self, *inputs, _pyreducer_call=None, **kwargs):
        """The module's forward on low-precision copies; `_pyreducer_call(fn, *args)` makes the
        call that runs the module (pyreducer/compiled: with torch.compile's callback on for it
        alone)."""
        dtype = self.config.param_dtype
        params = dict(self.module.named_parameters())
        low = {name: params[name].to(dtype) for name in self.names}
        inputs, kwargs = cast_inputs(dtype, inputs), cast_inputs(dtype, kwargs)
        self.copies = {id(low[name]): params[name] for name in self.names}
        try:
            call = _pyreducer_call or (lambda fn, *args, **options: fn(*args, **options))
            return call(torch.func.functional_call, self.module, low, inputs, kwargs,
                        strict=False, tie_weights=True)
        finally:
            self.copies = {}


def cast_inputs(dtype: torch.dtype, obj):
    """Floating-point tensors in `obj` cast to `dtype` (torch's _cast_forward_inputs)."""
    return nested.map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)
