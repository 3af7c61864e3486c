# layout: long because the public methods carry the API reference's docstrings
# (docs/pages/reference/ddp.md renders them).
"""pyreducer.DistributedDataParallel: the drop-in replacement for torch's DDP.

Swap `from torch.nn.parallel import DistributedDataParallel as DDP` for
`from pyreducer import DistributedDataParallel as DDP`: same arguments, names and defaults as the
installed torch's DDP. The gradient path (hook, copy into bucket, all-reduce launch, copy back) is
the C++ Reducer (csrc/reducer.cpp); this module builds it and does what DDP does around forward.
It is the only module that reads the wrapper's private attributes: the modules beside it (join,
timeline, tuning, tracing) get the ReducedParams (pyreducer.wrapper.params) built here.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from pyreducer._ext import _C
from pyreducer.compiled import CompiledSplits, frames
from pyreducer.overlap import OverlapOptimizer
from pyreducer.sharded import ShardedOptimizer
from pyreducer.tuning import announce
from pyreducer.tuning.autotune import AutoTuner
from pyreducer.tuning.control import BucketTuning
from pyreducer.wrapper import (arguments, bucketing, failures, nested, precision, sync, teardown,
                               torch_versions)
from pyreducer.wrapper import pending_buffers
from pyreducer.wrapper import timeline as timeline_module
from pyreducer.wrapper.ddp_logging import DDPLogger
from pyreducer.wrapper.delayed import DelayedAllReduce
from pyreducer.wrapper.join import (ReducerJoinHook, find_common_rank, refuse_unjoinable,
                                    vote_backward_sync)
from pyreducer.wrapper.params import ReducedParams, reduced_parameters
from pyreducer.wrapper.watch import ParameterWatch

# The signature's timeline_iterations=8 and check_finite=False are the Reducer's defaults
# (csrc/reducer.h ReducerOptions), written out for the API reference's readers
# (tests/unit/test_layout.py compares them).
TRACE_ENV = "PYREDUCER_TRACE"  # =<dir>: every wrapper records its timeline there (observe/recorder)


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper: averages gradients across ranks during backward.

    Arguments are the installed torch DDP's, in its order, with its meaning and defaults (see
    `torch.nn.parallel.DistributedDataParallel`); torch 2.12-2.15's `batched_grad_copy`,
    `forward_sync_buffers` and `lazy_bucket_allocation` also on older torch
    (`pyreducer/wrapper/torch_versions.py`).
    pyreducer differences: errors name the parameters and ranks involved, always; a backward
    that leaves a parameter without gradient raises at its end instead of at the next forward;
    `mixed_precision` runs on any device (`pyreducer/wrapper/precision.py`).

    The arguments below are pyreducer's own (keyword-only, after torch DDP's), and
    `bucket_cap_mb`, which takes more than torch DDP's cap.

    Args:
        bucket_cap_mb (float | str | AutotuneConfig | None): torch DDP's bucket cap in MiB;
            or `"auto"` (or a `pyreducer.tuning.AutotuneConfig`): online autotune
            (`pyreducer/tuning/autotune.py`).
        bucket_plan (str | list | None): replay a saved bucket plan exactly (a JSON path
            from `save_bucket_plan()`, the list `bucket_plan()` returns, or lists of parameter
            names; launch order). The plan must be the same on every rank (checked) and is
            never rebuilt.
        timeline_iterations (int): how many synced iterations the per-bucket timeline keeps
            (see `timeline()`); 0 turns recording off.
        gradient_predivide_factor (float | None): f: each bucket is multiplied by 1/f before
            the all-reduce and by f/world_size after it (Apex's scheme; with fp16/bf16 at large
            world sizes, between overflow of the sum and underflow of a pre-divided gradient).
        reduce_dtype (torch.dtype | None): reduce each bucket in this dtype (e.g.
            `torch.float32` for float16/bfloat16 gradients), cast back afterwards; averaged
            after the sum, as with a predivide factor of 1. Neither can be combined with a
            communication hook or `mixed_precision`.
        check_finite (bool): a NaN or Inf in an averaged gradient makes backward raise on
            every rank, naming the parameters and the ranks it came from
            (`csrc/reducer_finite.cpp`).
    """

    _buffer_group = None  # overlap_optimizer(): Note [Buffers beside deferred reductions]
    _buffer_broadcast = None  # ... and Note [Buffers awaited where read] (pending_buffers.py)
    _compiled = None  # CompiledSplits; none where every parameter's all-reduce is delayed

    # A subclass whose replicas must build the same buckets without a collective (pyreducer.torchft:
    # a replica that restarts and heals) sets this: see _build_reducer.
    _never_rebuild = False

    def __init__(self, module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=torch_versions.BROADCAST_BUFFERS_DEFAULT, init_sync=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 lazy_bucket_allocation=False, *, bucket_plan=None, timeline_iterations=8,
                 gradient_predivide_factor=None, reduce_dtype=None, check_finite=False):
        super().__init__()
        Joinable.__init__(self)
        # torch DDP's checks, in its order (arguments.py).
        arguments.check_delay_pairing(delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.process_group = arguments.resolve_group(process_group, device_mesh)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore |= {name for name, _ in delay_all_reduce_named_params or ()}
        named = arguments.module_parameters(module, self.parameters_to_ignore,
                                           delayed=delay_all_reduce_named_params is not None)
        self.device_ids, self.output_device = arguments.resolve_devices(named, device_ids,
                                                                        output_device)
        self.dim = dim
        self.module = module
        self.forward_sync_buffers, init_sync_buffers = arguments.resolve_buffer_sync(
            broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.lazy_bucket_allocation = lazy_bucket_allocation
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.mixed_precision = mixed_precision
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._training_ranks = None  # join: this forward's count of training ranks (a work)
        self._overlap = None  # overlap_optimizer()
        arguments.warn_check_reduction(check_reduction)
        arguments.check_module(module, named, (DistributedDataParallel,))
        self._delayed = DelayedAllReduce.create(delay_all_reduce_named_params,
                                                param_to_hook_all_reduce, self.process_group,
                                                check_finite=bool(check_finite))
        # torch DDP: with every reduced parameter delayed there is no Reducer at all.
        self._delay_all_reduce_all_params = not any(p.requires_grad for _, p in named)
        if self._delay_all_reduce_all_params:
            return
        self._params = self._collect_params()
        arguments.check_sparse_backend(self._params)
        self._failures = self._lost_ranks()  # names lost ranks in errors
        with self._failures.phase("construction"):
            if init_sync:
                self._sync_at_construction(init_sync_buffers)
            self._configure_buckets(bucket_cap_mb, bucket_cap_mb_list, bucket_plan)
        self._reducer_settings.update(batched_grad_copy=batched_grad_copy,
                                      timeline_iterations=timeline_iterations,
                                      check_finite=bool(check_finite))
        self._averaging = self._averaging_settings(gradient_predivide_factor, reduce_dtype)
        self._mixed = precision.MixedPrecisionForward(mixed_precision, module) \
            if mixed_precision is not None else None
        self._build_engine()
        teardown.settle_gloo_threads_at_exit(self.process_group)
        self._recorder = self._start_recorder_if_asked()

    # -- construction steps ----------------------------------------------------------------------
    def _collect_params(self) -> ReducedParams:
        named, sparse = reduced_parameters(self.module, self.parameters_to_ignore)
        return ReducedParams.of(named, self.process_group, self.module,
                                frozenset(self.parameters_to_ignore), sparse)

    def _lost_ranks(self, copy: bool = False):
        """What names the lost ranks in a collective's error (failures.py)."""
        return failures.LostRanks(self.process_group, copy)

    def _sync_at_construction(self, with_buffers: bool) -> None:
        """As torch DDP: the same model on every rank (checked), then rank 0's state on all."""
        sync.verify_same_model(list(zip(self._params.names, self._params.tensors)),
                               self.process_group, self._params.device)
        sync.broadcast_coalesced(self._params.states(with_buffers), self.process_group)

    def _configure_buckets(self, bucket_cap_mb, bucket_cap_mb_list, bucket_plan) -> None:
        """Caps (or autotune), and a given plan, checked to be the same on every rank."""
        self._autotune_config, bucket_cap_mb = arguments.autotune_request(bucket_cap_mb)
        self.bucket_caps_bytes = bucketing.caps_bytes(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap = max(self.bucket_caps_bytes)
        if bucket_plan is not None:  # every rank learns of any rank's unusable plan
            bucket_plan, problem = bucketing.read_plan(bucket_plan, self._params.names)
            sync.verify_same_plan(bucket_plan, self.process_group, self._params.device, problem)
        # What a pickled copy needs to build its Reducer again (see __setstate__).
        self._reducer_settings = dict(plan=bucket_plan, caps_per_bucket=bool(bucket_cap_mb_list))

    def _averaging_settings(self, predivide_factor, reduce_dtype) -> dict | None:
        """The built-in averaging hook's settings (csrc/comm_hook.h AveragingHook), or None for
        torch DDP's own scheme (1/world_size in the copy-in, SUM). Subclasses (pyreducer.apex)
        may average differently."""
        return precision.averaging(self.mixed_precision, predivide_factor, reduce_dtype,
                                   dist.get_world_size(self.process_group))

    def _build_engine(self) -> None:
        """The Reducer and what works on it (averaging, logging, bucket tuning, autotune); no
        collective."""
        self.reducer = self._build_reducer(**self._reducer_settings)
        self.reducer.set_failure_context(self._failures.describe)
        if self._averaging is not None:
            self.reducer.register_averaging_hook(self.process_group, **self._averaging)
        self._has_rebuilt_buckets = False
        self._tune_now, self._tuned_after = False, -1  # see _pre_forward
        self._watch = ParameterWatch(self.module, self._params)  # changed after wrapping: error
        self._logger = DDPLogger(self.reducer, _C.Reducer.now_ns, self._params.sizes_bytes,
                                 off_cpu=any(t.device.type != "cpu" for t in self._params.tensors))
        hook = self._own_comm_hook()
        if hook is not None:
            self.reducer.register_cpp_hook(hook)
            self._logger.set_comm_hook(hook.name())
        self._logger.construction_data(
            self.module, self._params, self.device_ids, self.output_device,
            self.forward_sync_buffers, self.find_unused_parameters, self.gradient_as_bucket_view,
            self.static_graph, self.bucket_bytes_cap)
        self._compiled = CompiledSplits(self._params, self.reducer, self._mixed)  # compiled/
        self._tuning = BucketTuning(self._params, self.reducer, self._compiled.active)
        self._compiled.install(self.module)
        self._autotune = AutoTuner(self._autotune_config, self._tuning, self._compiled.active) \
            if self._autotune_config else None

    def _own_comm_hook(self):
        """A subclass's own C++ communication hook (an _C.CommHook, such as pyreducer.torchft's
        QuorumHook), installed at construction; None: none (or the averaging hook)."""
        return None

    def _build_reducer(self, plan, caps_per_bucket: bool, **options):
        """The C++ Reducer (bucketing.build_reducer) with this wrapper's DDP options; where
        `_never_rebuild`, without a plan: the caps along the reverse of the parameters'
        definition order (what torch DDP's rebuild finds for layers run in that order), from
        the model alone, never rebuilt."""
        if plan is None and self._never_rebuild:
            plan = bucketing.assign_buckets(self._params.sizes_bytes, self._params.group_keys,
                                            self.bucket_caps_bytes, sparse=self._params.sparse)
        return bucketing.build_reducer(
            self._params, self.process_group, self.bucket_caps_bytes, plan, caps_per_bucket,
            find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            lazy_bucket_allocation=bool(self.lazy_bucket_allocation),
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params, **options)

    # -- pickling (torch.save, copy.deepcopy), as torch DDP ----------------------------------------
    def __getstate__(self):
        """The wrapper without its process group and engine, which __setstate__ builds again
        (on the default group: only a wrapper on the default group can be pickled, as in DDP)."""
        arguments.check_picklable(self.process_group, self._delayed is not None,
                                  self._overlap is not None)
        state = dict(self.__dict__)
        for name in ("process_group", "reducer", "_params", "_tuning", "_autotune", "_recorder",
                     "_logger", "_watch", "_failures", "_compiled"):
            state.pop(name)
        if self._recorder is not None:  # its forward hooks belong to this process's recording
            state["_forward_pre_hooks"] = self._recorder.without_hooks(self._forward_pre_hooks)
            state["_forward_hooks"] = self._recorder.without_hooks(self._forward_hooks)
        return state

    def __setstate__(self, state):
        """A wrapper on the default process group with a fresh Reducer (torch DDP's schedule
        from the start: one bucket, then a rebuild), its parameters neither checked nor
        broadcast across ranks (as torch DDP: unpickling is not collective), and no recording."""
        self.process_group = arguments.default_group()
        super().__setstate__(state)
        self.__dict__.setdefault("lazy_bucket_allocation", False)  # pickled before it existed
        self._params = self._collect_params()
        self._failures = self._lost_ranks(copy=True)
        self._build_engine()
        self._recorder = None

    def _start_recorder_if_asked(self):
        out_dir = os.environ.get(TRACE_ENV)
        if not out_dir:
            return None
        from pyreducer.observe.recorder import Recorder  # a tool: loaded only when asked for

        return Recorder.attach(self, self._params, self.reducer, out_dir, compiled=self._compiled)

    # -- DDP's forward ---------------------------------------------------------------------------
    @frames.run_eagerly  # never traced: Note [The wrapper's forward under torch.compile]
    def forward(self, *inputs, **kwargs):
        """Runs the wrapped module, with what torch DDP does around it, in its order on every
        rank: the bucket rebuild after the first synced backward, rank 0's buffers broadcast
        (`forward_sync_buffers`), inputs moved to `device_ids[0]`, and, when grad is enabled
        and gradients sync (not under `no_sync()`), the reducer armed for the backward through
        the returned output. Never traced by `torch.compile`: the module inside is compiled,
        split at the buckets (`pyreducer/compiled`)."""
        outer = frames.swap_callback(None)  # first: no frame below compiled but the module's
        try:
            with torch.autograd.profiler.record_function("pyreducer.DistributedDataParallel.forward"):
                if self._delay_all_reduce_all_params:  # no Reducer (torch DDP: the same)
                    output = CompiledSplits.call_unsplit(outer, self.module, inputs, kwargs)
                    self._delayed.reset_grads()
                    return output
                with self._failures.phase(f"forward of iteration {self.reducer.num_iterations + 1}"):
                    inputs, kwargs = self._pre_forward(inputs, kwargs)
                with nullcontext() if self._overlap is None else self._overlap.around_forward(
                        self._tune_now):
                    try:
                        output = self._compiled.call(outer, self.module, inputs, kwargs)
                    finally:  # no buffer stays pending outside the forward
                        if self._buffer_broadcast is not None:
                            self._buffer_broadcast.complete()
                return self._post_forward(output)
        finally:
            frames.swap_callback(outer)

    def _pre_forward(self, inputs, kwargs):
        """DDP's collectives before the module runs, in this order on every rank; joined ranks
        shadow them (join.py: ReducerJoinHook.main_hook)."""
        self._watch.check(self._params.rank)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        # The tuners act (collectively) at the first synced forward after each synced backward:
        # at every one, a forward with grad on one rank alone put its collectives out of step.
        self._tune_now = synced and self.reducer.num_backwards != self._tuned_after
        if self._tune_now:
            self._tuned_after = self.reducer.num_backwards
        joined_work = Join.notify_join_context(self)
        if synced:
            self._logger.before_synced_forward(self._has_rebuilt_buckets)
        if torch.is_grad_enabled() and self.reducer.rebuild_pending() and self._overlap:
            self._overlap.before_plan_change()
        if torch.is_grad_enabled() and self.reducer.rebuild_buckets():  # once, after the
            self._has_rebuilt_buckets = True                             # first synced backward
        if self.require_forward_param_sync and self.forward_sync_buffers:
            self._sync_buffers()
        self._training_ranks = None
        if self._join_config.enable:
            # Votes "backward will sync" only when it will (torch votes require_backward_grad_sync
            # even under no_grad, where joined ranks then shadow a backward that never comes).
            vote_backward_sync(self._params, synced, joined=False)
            if synced and joined_work is not None and not self._divide_by_initial_world_size:
                self._training_ranks = joined_work  # the all-reduce of ones: ranks training
        if self._tune_now and self._autotune is not None:
            self._autotune.before_forward()
        if self.device_ids:
            device = torch.device(self._params.device.type, self.device_ids[0])
            inputs, kwargs = nested.to_device(inputs, device), nested.to_device(kwargs, device)
        return inputs, kwargs

    def _post_forward(self, output):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            output = self.prepare_for_backward(output)
        else:
            self.require_forward_param_sync = False
            self.reducer.note_unsynced_forward()
        if self._delayed is not None:
            self._delayed.reset_grads()
        return output

    def prepare_for_backward(self, output):
        """Arms the reducer for a backward through the returned `output` (its tensors through
        the reducer's sink). `forward()` calls it; call it yourself only for a loss whose
        backward runs inside the forward (`pyreducer.lightning`'s manual optimisation)."""
        self.require_forward_param_sync = True
        training_ranks, self._training_ranks = self._training_ranks, None
        if training_ranks is not None:  # join(divide_by_initial_world_size=False)
            training_ranks.wait()
            self.reducer.divide_next_backward_by(int(training_ranks.result()[0].item()))
        sunk = self.reducer.prepare_for_backward(nested.tensors(output))
        return nested.replace_tensors(output, sunk)

    @contextmanager
    def no_sync(self):
        """Within this context, backward accumulates gradients locally without communication;
        the first forward-backward after it reduces the accumulated sum.

        Setting `model.require_backward_grad_sync = False` does the same (nanoGPT's style).
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @property
    def broadcast_buffers(self) -> bool:
        """torch DDP's older name for `forward_sync_buffers` (read and set): whether each
        forward starts by broadcasting rank 0's buffers."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _sync_buffers(self) -> None:
        # Under join(), rank 0 may have joined with stale buffers: the largest training rank
        # is the source instead (joined ranks shadow this in ReducerJoinHook.main_hook).
        buffers = self._params.buffers()
        if not buffers:
            return
        src = find_common_rank(self._params, True) if self._join_config.enable else 0
        if self._buffer_broadcast is not None:
            self._buffer_broadcast.complete()  # (a forward that never reached its end)
            if not self._compiled.active() and pending_buffers.eligible(
                    buffers, list(self.module.modules())):
                self._buffer_broadcast.launch(buffers, src,
                                              defer=bool(self.reducer.pending_buckets()))
                return
        sync.sync_buffers(self._params, src, group=self._buffer_group)

    # -- inspection ------------------------------------------------------------------------------
    def bucket_plan(self) -> list[dict]:
        """The buckets in launch order: parameter names (slot order), dtype, device, bytes.

        The same on every rank; `save_bucket_plan()` writes it, and `bucket_plan=` (the
        constructor's) or `apply_bucket_plan()` takes it back.
        """
        return bucketing.describe_plan(self._params.names, self._params.tensors,
                                       self.reducer.bucket_layout())

    def save_bucket_plan(self, path) -> None:
        """Writes `bucket_plan()` as JSON; pass the path as `bucket_plan=` to replay it.

        Args:
            path (str | os.PathLike): the JSON file to write.
        """
        bucketing.save_plan(self.bucket_plan(), path)

    def compiled_summary(self) -> dict:
        """Under `torch.compile`: the compiled modules given pyreducer's splitting forward, and
        per captured graph the pieces it was split into at this plan's buckets
        (`pyreducer/compiled`); empty without `torch.compile`."""
        return self._compiled.summary() if self._compiled is not None else {}

    def timeline(self, last: int = 1) -> list[dict]:
        """The last `last` synced iterations' events on this rank, oldest first (fields:
        `pyreducer/wrapper/timeline.py`).

        Each record holds the iteration, the bucket plan's version, the backward's start and
        end, each gradient's ready time, and per bucket its ready, launch and done times
        (nanoseconds, this host's monotonic clock); with an overlapped optimizer, also the next
        forward and each bucket's update ("overlap").

        Args:
            last: how many iterations, at most `timeline_iterations` (the constructor's).
        """
        return timeline_module.records(self._params, self.reducer, last,
                                       overlap=self._overlap.events if self._overlap else None)

    def overlap_stats(self, last: int | None = None) -> dict:
        """Overlap of communication with backward, per iteration and averaged
        (`pyreducer/wrapper/timeline.py`).

        Fields in milliseconds: `backward_ms`, `comm_ms` per bucket, `comm_busy_ms`,
        `hidden_comm_ms`, `exposed_comm_ms`, `wait_ms`, `last_bucket_bound_ms`, and
        `overlap_fraction` (hidden / busy; 1.0: all communication hidden).

        Args:
            last: how many of the recorded iterations; None: all of them.
        """
        return timeline_module.overlap_stats(
            self.timeline(last if last is not None else 1 << 30))

    # -- communication hooks ---------------------------------------------------------------------
    def register_comm_hook(self, state: object, hook) -> None:
        """Registers a communication hook, torch DDP's interface: torch's hooks work unchanged.

        Before the first forward, once. The hook runs with the GIL for its own call; the rest
        of the path stays in C++.

        Args:
            state: passed to every call of the hook (for example a PowerSGD state).
            hook (Callable): `hook(state, bucket) -> torch.futures.Future[Tensor]`; `bucket` offers
                `buffer()`, `index()`, `is_last()`, `parameters()`, `gradients()`,
                `set_buffer()`; the future's value is the averaged bucket.
        """
        try:
            arguments.check_comm_hook(hook)
            if self._reducer_settings["check_finite"]:  # Note [Finite check]
                raise ValueError("pyreducer: check_finite=True cannot be combined with a Python "
                                 "communication hook (it may reduce within subgroups or not at "
                                 "all); the built-in hooks (register_builtin_hook) can")
        except (TypeError, ValueError) as error:
            self._logger.set_error(f"{type(error)}: {error}")
            raise
        self.reducer.register_comm_hook(state, hook)
        self._logger.set_comm_hook(getattr(hook, "__qualname__", repr(hook)))

    def register_builtin_hook(self, name: str) -> None:
        """Registers a C++ communication hook, no Python per bucket: fp16 or bf16 compression.

        The bucket is divided by the world size in its own precision, cast to float16/bfloat16,
        all-reduced, and cast back (torch's Python fp16 hook casts first, then divides).

        Args:
            name: `"fp16"` or `"bf16"`.
        """
        sparse = [n for n, s in zip(self._params.names, self._params.sparse) if s]
        if sparse:
            raise ValueError(f"register_builtin_hook({name!r}) compresses dense buckets; "
                             f"{sparse} produce sparse gradients. Use a Python hook (torch's "
                             "fp16_compress_hook handles sparse buckets) or none.")
        self.reducer.register_builtin_hook(self.process_group, name)
        self._logger.set_comm_hook(f"builtin {name}")

    # -- bucket tuning (pyreducer/tuning/control.py) ---------------------------------------------
    def profile(self, forward_ms: float = 0.0, optimizer_ms: float = 0.0, last: int = 3):
        """This rank's step profile (gradient ready times, sizes) from the last iterations: a
        `pyreducer.tuning.Profile`, the step model's input.

        Args:
            forward_ms: the forward's time, added to every predicted step.
            optimizer_ms: the optimizer step's time, added to every predicted step.
            last: how many recorded iterations (median of each gradient's ready time).
        """
        return self._tuning.profile(forward_ms, optimizer_ms, last)

    def plan_buckets(self, link=None, forward_ms: float = 0.0, optimizer_ms: float = 0.0) -> dict:
        """The plan of least predicted step time, beside the current plan's and torch DDP's; on
        every rank (probes the link unless given; rank 0's answer). `apply_bucket_plan` applies
        it.

        Args:
            link (LinkModel | None): a `pyreducer.tuning.LinkModel`; None: probed now (collective).
            forward_ms: the forward's time, as in `profile()`.
            optimizer_ms: the optimizer step's time, as in `profile()`.

        Returns:
            `"plan"` (parameter names per bucket, launch order) and its `"predicted_ms"`,
                beside `"current_predicted_ms"` (the plan in force) and
                `"ddp_default_predicted_ms"` (torch DDP's default caps); `"link"`: the link
                model's numbers.
        """
        return self._tuning.plan_buckets(link, forward_ms, optimizer_ms)

    def apply_bucket_plan(self, plan) -> None:
        """Uses `plan` from now on; call on every rank between iterations; rank 0's plan is the
        one applied.

        Args:
            plan (list[list[int]] | list[list[str]]): parameter indices or names per bucket,
                in launch order (`plan_buckets()`'s `"plan"`, or the names from
                `bucket_plan()`).
        """
        self._overlap.before_plan_change() if self._overlap else None
        self._tuning.apply_bucket_plan(plan)

    @property
    def autotune_log(self) -> list[dict]:
        """Online autotune's decisions so far (empty without `bucket_cap_mb="auto"`)."""
        return self._autotune.log if self._autotune is not None else []

    def tuning_phase(self) -> tuple[str, dict]:
        """What the tuners do in the coming steps, in words (`pyreducer.tuning.announce.phase`),
        and their logs (`"buckets"`: `autotune_log`, `"schedule"`: the overlapped optimizer's
        `schedule_log`)."""
        logs = dict(buckets=self._autotune, schedule=getattr(self._overlap, "tuner", None))
        logs = {what: tuner.log for what, tuner in logs.items() if tuner is not None}
        return announce.phase(self._autotune, self._overlap), logs

    # -- uneven inputs (torch.distributed.algorithms.join protocol) -------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for uneven inputs, as torch DDP's `join()`: ranks that run out of
        data shadow the others' collectives (`pyreducer/wrapper/join.py`).

        Args:
            divide_by_initial_world_size: True: divide gradients by the world size at the
                start; False: by the ranks still training.
            enable: False: the context does nothing.
            throw_on_early_termination: raise on every rank once one runs out of data.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> ReducerJoinHook:
        """torch's `Joinable` interface; `divide_by_initial_world_size=False` divides each
        iteration's gradients by the ranks still training (the join notification's sum)."""
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        refuse_unjoinable(self.skip_all_reduce_unused_params, self._delayed is not None,
                          self._overlap is not None, self._reducer_settings["check_finite"])
        self._logger.set_join()
        return ReducerJoinHook(self, self._params, self._autotune)

    @property
    def join_device(self) -> torch.device:
        """torch's `Joinable` interface: the device of the join's collectives."""
        return self._params.device

    @property
    def join_process_group(self):
        """torch's `Joinable` interface: the process group of the join's collectives."""
        return self.process_group

    # -- the overlapped optimizer (pyreducer/overlap/) --------------------------------------------
    def overlap_optimizer(self, optimizer, shard: bool = False, **options) -> OverlapOptimizer:
        """An optimizer whose updates overlap the next forward (Note [Overlapped step],
        `pyreducer/overlap/optimizer.py`). Called again, it replaces the previous one.

        `**options` are `OverlapOptimizer`'s: `max_grad_norm`, `hold_back`, `schedule`.

        Args:
            optimizer (torch.optim.Optimizer): a torch optimizer over the model's parameters.
            shard: True: its state and update sharded across the ranks (Note [Sharded step],
                `pyreducer/sharded`).

        Returns:
            An `OverlapOptimizer` (a `ShardedOptimizer` with `shard=True`) to step in place
                of `optimizer`.
        """
        arguments.refuse_overlap_with(join=self._join_config.enable,
                                      check_finite=self._reducer_settings["check_finite"],
                                      shard=shard,
                                      skip_unused=self.skip_all_reduce_unused_params)
        self._overlap = (ShardedOptimizer if shard else OverlapOptimizer)(
            optimizer, self.reducer, self._params, self.module, tuning=self._tuning,
            autotune=self._autotune, replacing=self._overlap, **options)
        if self._params.buffers() and self._params.world_size > 1:
            self._buffer_group = sync.side_group(self._params.process_group, self._params.device)
            if self._buffer_group is not None:
                self._buffer_broadcast = pending_buffers.BufferBroadcast(self._buffer_group)
        return self._overlap

    def synchronize(self) -> None:
        """Completes every pending reduction and update of an overlapped optimizer (nothing
        otherwise): parameters and gradients are then final, as after a DDP step."""
        if self._buffer_broadcast is not None:
            self._buffer_broadcast.complete()
        if self._overlap is not None:
            self._overlap.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`nn.Module.zero_grad`. With an overlapped optimizer, a gradient whose update is
        pending is zeroed right after it (read now, the update would run now: no overlap)."""
        if self._overlap is None:
            return super().zero_grad(set_to_none)
        self._overlap.zero_grad(set_to_none, params=list(self.parameters()))

    # -- torch DDP's private API that research code calls ----------------------------------------
    def _set_static_graph(self) -> None:
        """static_graph=True after construction (the classic workaround for activation
        checkpointing); before the first synced forward only, as torch DDP."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        self.reducer.set_static_graph(rebuild=self._reducer_settings["plan"] is None)
        self.static_graph = True
        self._logger.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2)

    def _get_ddp_logging_data(self) -> dict:
        """torch DDP's logging data, with its keys, from pyreducer's measurements
        (pyreducer/wrapper/ddp_logging.py)."""
        return self._logger.data()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Runtime stats are recorded for iterations 1-10 and every sample_rate-th after."""
        self._logger.set_sample_rate(sample_rate)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """Excludes parameters and buffers (fully qualified names) from reduction and syncing;
        torch DDP's contract: call on the plain module before wrapping it."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                param._ddp_ignored = True
        for name, buffer in module.named_buffers():
            if name in params_and_buffers_to_ignore:
                buffer._ddp_ignored = True
