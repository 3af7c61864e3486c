"""pyreducer.DistributedDataParallel: the drop-in replacement for torch's DDP.

Swap `from torch.nn.parallel import DistributedDataParallel as DDP` for
`from pyreducer import DistributedDataParallel as DDP`: same arguments, names and defaults as the
installed torch's DDP. The gradient path (hook, copy into bucket, all-reduce launch, copy back) is
the C++ Reducer (csrc/reducer.cpp); this module builds it and does what DDP does around forward.
"""
from __future__ import annotations

import dataclasses
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.algorithms.join import Join, Joinable

from pyreducer import bucketing, sync
from pyreducer import timeline as timeline_module
from pyreducer._ext import _C
from pyreducer.join import ReducerJoinHook, find_common_rank, vote_backward_sync
from pyreducer.tuning.api import TuningMixin

# Arguments of torch DDP that pyreducer does not serve yet: passing a non-default value raises
# NotImplementedError naming the argument (nothing is ignored silently).
_NOT_YET = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "skip_all_reduce_unused_params": False,
}


class DistributedDataParallel(TuningMixin, nn.Module, Joinable):
    """Data-parallel wrapper: averages gradients across ranks during backward.

    Arguments are torch DDP's (torch 2.13), with DDP's meaning and defaults; see
    torch.nn.parallel.DistributedDataParallel. pyreducer differences: errors name the
    parameters and ranks involved, always; a backward that leaves a parameter without gradient
    raises at its end instead of at the next forward.

    pyreducer's own arguments (keyword-only):
        bucket_plan: replay a saved bucket plan exactly (a JSON path from save_bucket_plan(),
            the list bucket_plan() returns, or lists of parameter names; launch order). The
            plan must be the same on every rank (checked) and is never rebuilt.
        timeline_iterations: how many synced iterations the per-bucket timeline keeps (see
            timeline()); 0 turns recording off.

    bucket_cap_mb="auto" turns on online autotune (pyreducer.tuning.autotune).
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None,
                 *, bucket_plan=None, timeline_iterations=8):
        super().__init__()
        Joinable.__init__(self)
        given = dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                     param_to_hook_all_reduce=param_to_hook_all_reduce,
                     mixed_precision=mixed_precision,
                     skip_all_reduce_unused_params=skip_all_reduce_unused_params)
        for name, default in _NOT_YET.items():
            if given[name] != default:
                raise NotImplementedError(
                    f"pyreducer.DistributedDataParallel does not support {name}={given[name]!r} "
                    f"yet (only the default, {default!r}).")
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in torch DDP) and "
                          "has no effect.", FutureWarning, stacklevel=2)

        self.process_group = _resolve_group(process_group, device_mesh)
        _check_module(module)
        self.module = module
        self.dim = dim
        self.device_ids, self.output_device = _resolve_devices(module, device_ids, output_device)
        self.forward_sync_buffers, init_sync_buffers = _resolve_buffer_sync(
            broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))

        named = _reduced_parameters(module, self.parameters_to_ignore)
        if not named:
            raise RuntimeError(
                "pyreducer.DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient (found none outside the ignored set "
                f"{sorted(self.parameters_to_ignore)}).")
        self._param_names = [name for name, _ in named]
        params = [p for _, p in named]
        self._params = params

        if init_sync:
            sync.verify_same_model(named, self.process_group)
            states = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
            if init_sync_buffers:
                states += self._module_buffers()
            sync.broadcast_coalesced(states, self.process_group)

        self._autotune = None
        if bucket_cap_mb == "auto":
            from pyreducer.tuning.autotune import AutoTuner

            self._autotune, bucket_cap_mb = AutoTuner(), None
        self.bucket_caps_bytes = bucketing.caps_bytes(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap = max(self.bucket_caps_bytes)
        # torch DDP's schedule: with a static graph or without unused-parameter search, one
        # bucket for the first iteration, then a rebuild along the observed ready order.
        rebuild = (static_graph or not find_unused_parameters) and bucket_plan is None
        if bucket_plan is not None:
            plan = bucketing.plan_from_names(bucket_plan, self._param_names)
            sync.verify_same_plan(plan, self.process_group)
        else:
            plan = bucketing.initial_plan(params, self.bucket_caps_bytes,
                                          one_bucket=rebuild and not bucket_cap_mb_list)
        self.reducer = _C.Reducer(params, self._param_names, plan, self.process_group,
                                  self.bucket_caps_bytes if rebuild else [],
                                  find_unused_parameters=find_unused_parameters,
                                  static_graph=static_graph,
                                  gradient_as_bucket_view=gradient_as_bucket_view,
                                  timeline_iterations=timeline_iterations,
                                  batched_grad_copy=batched_grad_copy)

    # -- DDP's forward ---------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("pyreducer.DistributedDataParallel.forward"):
            # The collectives below, in this order, are shadowed by joined ranks (join.py).
            Join.notify_join_context(self)
            if torch.is_grad_enabled():
                self.reducer.rebuild_buckets()  # once, after the first synced backward
                if self._autotune is not None and self.require_backward_grad_sync:
                    if self._join_config.enable:
                        raise NotImplementedError(
                            "bucket_cap_mb='auto' cannot be combined with join(): joined ranks "
                            "would not take part in the autotune's measurements")
                    self._autotune.before_forward(self)
            if self.require_forward_param_sync and self.forward_sync_buffers:
                self._sync_buffers()
            if self._join_config.enable:
                vote_backward_sync(self, joined=False)
            if self.device_ids:
                device = torch.device(self._device_type, self.device_ids[0])
                inputs, kwargs = _to_device(inputs, device), _to_device(kwargs, device)
            output = self.module(*inputs, **kwargs)
            if torch.is_grad_enabled() and self.require_backward_grad_sync:
                self.require_forward_param_sync = True
                tensors = []
                _collect_tensors(output, tensors)
                output = _replace_tensors(output, iter(self.reducer.prepare_for_backward(tensors)))
            else:
                self.require_forward_param_sync = False
                self.reducer.note_unsynced_forward()
            return output

    @contextmanager
    def no_sync(self):
        """Within this context, backward accumulates gradients locally without communication.

        The first forward-backward after the context reduces the accumulated sum.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # -- inspection ------------------------------------------------------------------------------
    def bucket_plan(self) -> list[dict]:
        """The buckets in launch order: parameter names (slot order), dtype, device, bytes."""
        params = dict(zip(self._param_names, self._params))
        plan = []
        for index, bucket in enumerate(self.reducer.bucket_layout()):
            names = [self._param_names[k] for k in bucket["param_indices"]]
            plan.append(dict(index=index, params=names, dtype=str(params[names[0]].dtype),
                             device=str(params[names[0]].device),
                             size_bytes=bucket["size_bytes"]))
        return plan

    # -- communication hooks ---------------------------------------------------------------------
    def register_comm_hook(self, state: object, hook) -> None:
        """torch DDP's interface: hook(state, bucket) -> torch.futures.Future[Tensor].

        `bucket` offers buffer(), index(), is_last(), parameters(), gradients(), set_buffer();
        the future's value is the reduced (averaged) bucket. Register before the first forward,
        once. torch's hooks (torch.distributed.algorithms.ddp_comm_hooks) work unchanged. The
        hook runs with the GIL for its own call; the rest of the path stays in C++.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook expects a callable hook, got {type(hook)}")
        self.reducer.register_comm_hook(state, hook)

    def register_builtin_hook(self, name: str) -> None:
        """A C++ communication hook, no Python per bucket: "fp16" or "bf16" compression.

        The bucket is divided by the world size in its own precision, cast to float16/bfloat16,
        all-reduced, and cast back (torch's Python fp16 hook casts first, then divides).
        """
        self.reducer.register_builtin_hook(self.process_group, name)

    def timeline(self, last: int = 1) -> list[dict]:
        """The last `last` synced iterations' events on this rank (fields: pyreducer.timeline)."""
        return timeline_module.records(self, last)

    def overlap_stats(self, last: int | None = None) -> dict:
        """Overlap of communication with backward, per iteration and averaged, from the
        recorded timeline (definitions: pyreducer.timeline)."""
        return timeline_module.overlap_stats(
            self.timeline(last if last is not None else 1 << 30))

    def save_bucket_plan(self, path) -> None:
        """Writes bucket_plan() as JSON; pass the path as bucket_plan= to replay it."""
        bucketing.save_plan(self.bucket_plan(), path)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore):
        """Excludes parameters and buffers (fully qualified names) from reduction and syncing.

        Same contract as torch DDP's: call on the plain module before wrapping it.
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                param._ddp_ignored = True
        for name, buffer in module.named_buffers():
            if name in params_and_buffers_to_ignore:
                buffer._ddp_ignored = True

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def _device_type(self) -> str:
        return next(self.module.parameters()).device.type

    def _module_buffers(self) -> list[torch.Tensor]:
        # Looked up at every use: modules may reassign their buffers.
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _sync_buffers(self, joined: bool = False) -> None:
        buffers = self._module_buffers()
        if not buffers:
            return
        # Under join(), rank 0 may have joined with stale buffers: the largest training rank
        # is the source instead.
        src = find_common_rank(self, not joined) if self._join_config.enable else 0
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            sync.broadcast_coalesced(buffers, self.process_group, src=src)

    @property
    def _device(self) -> torch.device:
        return self._params[0].device

    def _bucket_shapes(self) -> list[tuple[int, torch.dtype, torch.device]]:
        """(elements, dtype, device) of every bucket, in launch order."""
        shapes = []
        for bucket in self.reducer.bucket_layout():
            first = self._params[bucket["param_indices"][0]]
            shapes.append((bucket["size_bytes"] // first.element_size(), first.dtype,
                           first.device))
        return shapes

    # -- uneven inputs (torch.distributed.algorithms.join protocol) -------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for uneven inputs, as torch DDP's join(); see pyreducer/join.py."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> ReducerJoinHook:
        return ReducerJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group


def _resolve_group(process_group, device_mesh):
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only a 1-D device mesh is supported, got {device_mesh.ndim}-D.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "pyreducer.DistributedDataParallel needs a process group: call "
            "torch.distributed.init_process_group(...) first (or pass process_group=).")
    return dist.group.WORLD


def _check_module(module):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    for name, sub in module.named_modules():
        if isinstance(sub, (DistributedDataParallel, TorchDDP)):
            where = "the module itself" if name == "" else f"its submodule '{name}'"
            raise ValueError(
                f"pyreducer.DistributedDataParallel cannot wrap a module that is already "
                f"wrapped: {where} is a {type(sub).__module__}.{type(sub).__name__}. Wrap the "
                f"plain module once.")
    for name, param in module.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"Parameter {name} is uninitialized (lazy module): run a dummy forward pass "
                f"before wrapping the module.")


def _reduced_parameters(module, ignored):
    """(name, param) of every parameter that requires grad, de-duplicated, in DDP's order."""
    seen, named = set(), []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and fqn not in ignored and param not in seen:
                seen.add(param)
                named.append((fqn, param))
    return named


def _resolve_devices(module, device_ids, output_device):
    devices = {p.device for p in module.parameters()}
    if len({d.type for d in devices}) != 1:
        raise ValueError("pyreducer.DistributedDataParallel's module must be on one type of "
                         f"device, found parameters on {sorted(str(d) for d in devices)}.")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element, "
                         f"got {device_ids}.")
    device_type = next(iter(devices)).type
    if not device_ids or device_type == "cpu" or len(devices) > 1:
        if device_ids or output_device:
            raise ValueError(
                "device_ids and output_device only work with single-device GPU modules; got "
                f"device_ids={device_ids}, output_device={output_device} for a module on "
                f"{sorted(str(d) for d in devices)}.")
        return None, None
    ids = [_device_index(d) for d in device_ids]
    out = ids[0] if output_device is None else _device_index(output_device)
    return ids, out


def _device_index(device) -> int:
    return device if isinstance(device, int) else torch.device(device).index


def _resolve_buffer_sync(broadcast_buffers, forward_sync_buffers):
    """(forward_sync_buffers, init_sync_buffers), exactly as torch 2.13 DDP derives them."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead (as in torch DDP 2.13).", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _collect_tensors(obj, out: list) -> None:
    """Tensors inside a forward's output (tensors, lists, tuples, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect_tensors(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _collect_tensors(getattr(obj, field.name), out)


def _replace_tensors(obj, replacements):
    """The same structure as obj, its tensors taken in order from `replacements`."""
    if isinstance(obj, torch.Tensor):
        return next(replacements)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_replace_tensors(o, replacements) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace_tensors(o, replacements) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _replace_tensors(v, replacements)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replace_tensors(getattr(obj, f.name),
                                                                    replacements)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
