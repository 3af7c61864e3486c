"""Compiled models keep their overlap: torch.compile's graphs are split at pyreducer's buckets.

Both ways in are handled:
- `DDP(torch.compile(model))` (nanoGPT's order), or compiled submodules anywhere in the model: at
  construction the wrapper gives every compiled module a forward that compiles with pyreducer's
  splitting backend around the user's (pyreducer/compiled/dynamo.py SplitForward).
- `torch.compile(DDP(model))`: the wrapper's forward runs eagerly (Note [The wrapper's forward under
  torch.compile], pyreducer/compiled/frames.py) and calls the wrapped module under the user's
  compile with the splitting backend in place of the user's.

Each captured graph is split where a bucket's parameters are first used (Note [Splitting a compiled
graph at buckets], split.py) and each piece compiled by the user's backend (Note [Compiling the
pieces], backend.py), for the plan in force; a plan that changes which parameters share a bucket
(autotune, apply_plan) makes dynamo capture again, once per plan.

Note [What compiled models get]
- Graph breaks: each graph dynamo captures is split on its own, at the first uses (in that graph)
  of each bucket's parameters; eager code between graphs needs no split.
- Dynamic shapes and recompilation: the pieces are compiled inside dynamo's compile with its fake
  mode (Note [Compiling the pieces]), so dynamic dimensions stay dynamic and every guard a piece
  adds is checked; a recompile (new shapes, a guard failing) splits the new graph the same way.
  A new plan is a new backend: dynamo compiles once more per plan (its per-code recompile limit,
  8 by default, bounds how many plans an autotune run may try compiled); autotune does not count
  the step that recompiles (AutoTuner's recompiles, CompiledSplits.active), and plans from a
  profile whose bucket landings are spread over their pieces (a piece hands over its gradients
  together: stepmodel.spread_compiled_landings).
- fullgraph=True works both ways: the split happens inside the backend (dynamo still sees one
  graph), and in `torch.compile(DDP(model), fullgraph=True)` the wrapper's forward is skipped, not
  traced, so the wrapped module's graph is the one graph (torch DDP fails there: dynamo cannot
  trace its forward's logger).
- Under torch.compile(DDP(model)) dynamo captures at one small frame of pyreducer's
  (frames.captured_call), shared by every wrapper in the process as OptimizedModule's own
  wrapper frame is by every compiled module: many different models in one process share its
  recompile limit.
- A user's own backend (a callable, or a name) compiles each piece as it would the whole graph;
  pieces hold the graph's nodes in order, with their inputs as placeholders.
- Compiled autograd (torch._dynamo.config.compiled_autograd) traces backward into one graph,
  where the Reducer's C++ hooks cannot run: refused with a message (torch DDP switches to a Python
  reducer there).
- mixed_precision: the forward runs on low-precision copies of the parameters; the graph is
  split at the first uses of the copies of each bucket's parameters (the casts' backward runs
  right after their piece's).

Note [Eager until the rebuild]
Like torch DDP, pyreducer starts with a provisional plan (one bucket without
find_unused_parameters) and rebuilds the buckets along the order gradients became ready in the
first synced backward. A compiled backward hands over all its gradients at once, in an order that
says nothing of when they were computed: a rebuild along it put the first layer's weight in the
first bucket, which then waited for the whole backward, and overlap fell to 3-6% (8 Linear layers,
1 MB caps, measured). So while the rebuild is pending (`Reducer.rebuild_pending()`), a forward with
grad enabled runs the model eagerly: the rebuild observes eager backward's order, the buckets torch
DDP would build eagerly, and dynamo captures once, with the final plan, instead of once per plan.
"""
from __future__ import annotations

import sys

import torch

from pyreducer.compiled import frames


class CompiledSplits:
    """One wrapper's splitting backends, one per (bucket plan, user backend), and what they did.

    Args:
        params: the wrapper's ReducedParams.
        reducer: its C++ Reducer (plan_version(), bucket_layout()).
        mixed: the wrapper's precision.MixedPrecisionForward, or None: during its forward the
            graph sees its low-precision copies, which `mixed.copies` maps to the parameters.
    """

    def __init__(self, params, reducer, mixed=None):
        self._reduced = params
        self._reducer = reducer
        self._precision = mixed
        self._version = None
        self._plan_key = None
        self._bucket_of = {}
        self._backends = {}  # (plan key, id(compiler)) -> SplitBackend
        self._callbacks = {}  # (id(outer callback), id(backend)) -> (outer, split callback)
        self.installed = []  # names of the compiled modules given a splitting forward

    def install(self, module) -> None:
        """Gives every torch.compile'd module inside `module` a forward that splits at buckets.
        No compiled module without torch._dynamo loaded: then nothing to do (and no import)."""
        if "torch._dynamo" not in sys.modules:
            return
        from pyreducer.compiled import dynamo

        for name, optimized in dynamo.compiled_modules(module):
            if isinstance(optimized.__dict__.get("forward"), dynamo.SplitForward):
                continue
            optimized.forward = dynamo.SplitForward(optimized, self)
            self.installed.append(name or "<the wrapped module>")

    def active(self) -> bool:
        """Whether this wrapper's model is compiled (a compiled module inside, or a forward
        under torch.compile seen): a new plan then recompiles it."""
        return bool(self.installed or self._callbacks)

    def provisional(self) -> bool:
        """Whether this forward runs eagerly (Note [Eager until the rebuild])."""
        return torch.is_grad_enabled() and self._reducer.rebuild_pending()

    def backend_for(self, compiler):
        """The SplitBackend around `compiler` for the plan in force."""
        from pyreducer.compiled.backend import SplitBackend

        version = self._reducer.plan_version()
        if version != self._version:
            layout = self._reducer.bucket_layout()
            self._plan_key = tuple(sorted(tuple(sorted(b["param_indices"])) for b in layout))
            self._bucket_of = {id(self._reduced.tensors[i]): b
                               for b, bucket in enumerate(layout) for i in bucket["param_indices"]}
            self._version = version
        key = (self._plan_key, id(compiler))
        backend = self._backends.get(key)
        if backend is None:
            backend = self._backends[key] = SplitBackend(
                compiler, dict(self._bucket_of), list(self._reduced.tensors),
                list(self._reduced.names),
                aliases=(lambda: self._precision.copies) if self._precision is not None else dict)
        return backend

    def call(self, outer, module, inputs, kwargs):
        """The wrapped module's call (through mixed precision's copies, if any) under `outer`,
        the frame callback the wrapper's forward found: torch.compile's with the splitting
        backend in its place; anything else (None: eager; False: run compiled code only) as it
        was. The callback is on for the module's call alone, never for pyreducer's own code."""
        if frames.is_compiling_callback(outer) or self.installed:
            _refuse_compiled_autograd()
        if self.provisional():
            callback = None  # eager (and a compiled module's SplitForward runs its module as is)
        elif frames.is_compiling_callback(outer):
            callback = self._split_callback(outer)
        else:
            callback = outer

        def under_callback(fn, *args, **options):
            return _run_under(callback, fn, *args, **options)
        if self._precision is not None:
            return self._precision(*inputs, _pyreducer_call=under_callback, **kwargs)
        return _run_under(callback, module, *inputs, **kwargs)

    def _split_callback(self, outer):
        """torch.compile's callback `outer` with the splitting backend for the plan in force."""
        from pyreducer.compiled import dynamo

        backend = self.backend_for(dynamo.user_backend(outer))
        key = (id(outer), id(backend))
        entry = self._callbacks.get(key)
        if entry is None or entry[0] is not outer:
            entry = self._callbacks[key] = (outer, dynamo.split_callback(outer, backend))
        return entry[1]

    @staticmethod
    def call_unsplit(outer, module, inputs, kwargs):
        """module(*inputs, **kwargs) under the frame callback `outer` as it is (no buckets to
        split at: every parameter's all-reduce is delayed)."""
        return _run_under(outer, module, *inputs, **kwargs)

    def summary(self) -> dict:
        """What the splitting backends did: per captured graph, its pieces (compute nodes, the
        buckets and first-used parameters that open each), across every plan seen."""
        graphs = []
        for (plan, _), backend in self._backends.items():
            for split in backend.splits:
                graphs.append(dict(pieces=split.pieces, nodes=split.nodes,
                                   buckets=split.buckets, params=split.params,
                                   compiler=split.compiler, plan_buckets=len(plan)))
        return dict(compiled_modules=list(self.installed), graphs=graphs)


def _run_under(callback, fn, *args, **kwargs):
    """fn(*args, **kwargs) in pyreducer's capture frame with `callback` on, then off again (the
    wrapper's forward runs with none: Note [The wrapper's forward under torch.compile])."""
    frames.swap_callback(callback)
    try:
        return frames.captured_call(fn, *args, **kwargs)
    finally:
        frames.swap_callback(None)


def _refuse_compiled_autograd() -> None:
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    if config is not None and getattr(config, "compiled_autograd", False):
        raise NotImplementedError(
            "pyreducer: torch._dynamo.config.compiled_autograd is on: compiled autograd traces "
            "backward into one graph, where pyreducer's C++ gradient hooks cannot run (expected "
            "it off for a pyreducer model; torch DDP switches to a Python reducer there). Turn "
            "it off: torch.compile still compiles forward and backward, split at the buckets")


__all__ = ["CompiledSplits", "frames"]
