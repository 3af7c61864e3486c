"""torch DDP's constructor arguments, checked and resolved as torch 2.13 DDP does (and
overlap_optimizer's, last).

The checks run in torch DDP's order, raise torch's exception types, and start their messages
with torch's words; pyreducer adds what it knows after them (which parameter, which devices).
Each function takes the user's values and returns what the wrapper keeps.
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # torch's, even if patched later

from pyreducer.wrapper import torch_versions


def default_group():
    """torch.distributed's default group (dist.group.WORLD), or a clear error without one."""
    if not dist.is_initialized():
        raise RuntimeError("DDP Pickling/Unpickling need the default process group: call "
                           "torch.distributed.init_process_group(...) first.")
    return dist.group.WORLD


def check_picklable(process_group, delayed: bool, overlapped: bool) -> None:
    """What a wrapper needs to be pickled (torch.save, copy.deepcopy), refused by name."""
    if process_group != default_group():
        raise RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group. That is, when you have called init_process_group and have not "
            "passed process_group argument to DDP constructor (pyreducer: this wrapper's "
            f"group has ranks {dist.get_process_group_ranks(process_group)}).")
    if delayed:
        raise RuntimeError("pyreducer: a wrapper with delay_all_reduce_named_params cannot be "
                           "pickled (its hook on param_to_hook_all_reduce would be lost); "
                           "save the module's state_dict instead")
    if overlapped:
        raise RuntimeError("pyreducer: a wrapper with an overlapped optimizer cannot be "
                           "pickled or deep-copied (torch.save, copy.deepcopy; "
                           "swa_utils.AveragedModel copies what it is given): copy model.module, "
                           "or save model.state_dict() and the optimizer's state_dict()")


def autotune_request(bucket_cap_mb):
    """(AutotuneConfig or None, the cap to start with): "auto" tunes with the default config
    and starts from DDP's default caps."""
    from pyreducer.tuning.autotune import AutotuneConfig

    if isinstance(bucket_cap_mb, AutotuneConfig):
        return bucket_cap_mb, None
    if bucket_cap_mb == "auto":
        return AutotuneConfig(), None
    return None, bucket_cap_mb


def check_delay_pairing(delay_all_reduce_named_params, param_to_hook_all_reduce) -> None:
    """torch's pairing check of the delayed all-reduce arguments (ValueError)."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be "
                         "set at the same time.")


def resolve_group(process_group, device_mesh):
    """The process group gradients are averaged over (process_group, a 1-D mesh, or WORLD)."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("Default process group has not been initialized, please make sure to "
                         "call init_process_group. (pyreducer: or pass process_group=)")
    return dist.group.WORLD


def module_parameters(module: nn.Module, ignored, delayed: bool = False
                      ) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the module's parameters that are not ignored, frozen ones included
    (what torch DDP checks devices and initialization on); refuses a module with none that
    requires a gradient, unless their all-reduce is delayed (`delayed`: torch then delays all)."""
    named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
    if not any(p.requires_grad for _, p in named) and not delayed:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter "
            "that requires a gradient. (pyreducer: none outside the ignored set "
            f"{sorted(ignored)})")
    return named


def resolve_devices(named: list, device_ids, output_device):
    """(device_ids, output_device) as device indices, or (None, None) for CPU and multi-device
    modules, as torch DDP."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element. "
                         f"(pyreducer: got {device_ids})")
    if not named:  # every parameter's all-reduce is delayed: nothing for the Reducer
        return None, None
    devices = {p.device for _, p in named}
    device_types = {p.device.type for _, p in named}  # built as torch builds it: same str()
    if len(device_types) != 1:
        raise ValueError("DistributedDataParallel's input module must be on the same type of "
                         f"devices, but input module parameters locate in {device_types}. "
                         f"(pyreducer: devices {sorted(str(d) for d in devices)})")
    if not device_ids or next(iter(device_types)) == "cpu" or len(devices) > 1:
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {devices}.")
        return None, None
    ids = [_device_index(d) for d in device_ids]
    out = ids[0] if output_device is None else _device_index(output_device)
    return ids, out


def _device_index(device) -> int:
    return device if isinstance(device, int) else torch.device(device).index


def resolve_buffer_sync(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
    """(forward_sync_buffers, init_sync_buffers), exactly as torch 2.13 DDP derives them, with
    its warnings where the installed torch deprecates broadcast_buffers (2.13+; before, it
    defaults to True and nothing warns)."""
    if broadcast_buffers is not None and torch_versions.DDP_HAS_FORWARD_SYNC_BUFFERS:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still syncs buffers at init. If you rely "
                          "on buffers NOT being synced at init (e.g. rank-local buffers), keep "
                          "using `broadcast_buffers=False` until `init_sync_buffers` is "
                          "available.", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def warn_check_reduction(check_reduction: bool) -> None:
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)


def check_comm_hook(hook) -> None:
    """torch DDP's checks of a communication hook, with its exception types and messages: a
    callable, whose annotations (if any) are a GradBucket argument named `bucket` and a
    torch.futures.Future[torch.Tensor] result; torch's bf16 hook needs CUDA and NCCL 2.10+."""
    import inspect

    from pyreducer._ext import _C

    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. (pyreducer: got {type(hook)})")
    signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket,
                                                        _C.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty,
                                           torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")
    if getattr(hook, "__name__", "") in ("bf16_compress_hook", "bf16_compress_wrapper_hook"):
        nccl = dist.is_nccl_available() and torch.version.cuda is not None and \
            torch.cuda.nccl.version() >= (2, 10)
        if not nccl:
            raise TypeError("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ "
                            "or XPU and XCCL (pyreducer: its own bf16 hook runs anywhere: "
                            "register_builtin_hook('bf16'))")


def check_sparse_backend(params) -> None:
    """Sparse gradients on NCCL: ProcessGroupNCCL (standard builds) has no sparse all-reduce, and
    torch DDP fails with this message in the middle of backward; pyreducer says it at once."""
    sparse = [n for n, s in zip(params.names, params.sparse) if s]
    if sparse and params.device.type == "cuda" and \
            "nccl" in str(dist.get_backend(params.process_group)):
        raise RuntimeError("NCCL does not support all_reduce with sparse tensors. Please use dense "
                           f"tensors instead. (pyreducer: {sparse} produce sparse gradients: "
                           "nn.Embedding/EmbeddingBag with sparse=True)")


def check_module(module: nn.Module, named: list, wrapper_types: tuple) -> None:
    """Refuses uninitialized (lazy) parameters, as torch DDP; and (pyreducer) a module that is
    already wrapped in a DDP, whose hooks would reduce every gradient twice."""
    for name, param in named:
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with "
                "`DistributedDataParallel`. Run a dummy forward pass to correctly initialize the "
                f"modules (pyreducer: parameter {name} is uninitialized)")
    for name, sub in module.named_modules():
        if isinstance(sub, wrapper_types + (TorchDDP,)):
            where = "the module itself" if name == "" else f"its submodule '{name}'"
            raise ValueError(
                f"pyreducer.DistributedDataParallel cannot wrap a module that is already "
                f"wrapped: {where} is a {type(sub).__module__}.{type(sub).__name__}. Wrap the "
                f"plain module once.")


def check_overlap_optimizer(optimizer, module, hold_back: int, schedule) -> bool:
    """overlap_optimizer's arguments, each refusal naming what it found; returns whether
    `schedule` is a chunk size in MB."""
    if hold_back < 0:
        raise ValueError(f"overlap_optimizer: hold_back must be >= 0, got {hold_back}")
    fixed_mb = isinstance(schedule, (int, float)) and not isinstance(schedule, bool)
    if not (schedule in ("auto", "fifo") or (fixed_mb and schedule > 0)):
        raise ValueError(f"overlap_optimizer: schedule must be 'auto', 'fifo' or a chunk "
                         f"size in MB > 0, got {schedule!r}")
    if hold_back and schedule != "fifo":
        raise ValueError("overlap_optimizer: hold_back applies to schedule='fifo' (the "
                         "'auto' schedule chooses the order itself)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"overlap_optimizer expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if hasattr(optimizer, "schedule_log"):  # an OverlapOptimizer (not imported: a cycle)
        raise TypeError("overlap_optimizer expects the optimizer to overlap, got an overlapped "
                        "optimizer: pass the optimizer it wraps (its .optimizer)")
    scripted = [name or "(root)" for name, m in module.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise ValueError(f"overlap_optimizer: the wrapped module holds TorchScript modules "
                         f"({', '.join(scripted[:4])}): their forward reads parameters in "
                         "C++, where a pending update cannot be caught before the read. Wrap "
                         "the eager module (torch.compile works), or step the optimizer "
                         "itself (torch DDP's step)")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("overlap_optimizer: LBFGS needs a closure that re-evaluates the "
                         "whole model, which cannot be split into per-bucket updates")
    # Not imported here: importing torch.distributed.optim keeps the default process group of
    # that moment alive for good (its threads too, after destroy_process_group()); an instance
    # exists only where the user imported it.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        raise ValueError("overlap_optimizer: ZeroRedundancyOptimizer steps this rank's whole "
                         "shard and broadcasts every parameter in each step(), which cannot be "
                         "split into per-bucket updates (each would step parameters whose "
                         "all-reduce is still in flight). Step it yourself after backward "
                         "(torch DDP's step)")
    replaced = _replaced_step(optimizer)
    if replaced is not None:
        warnings.warn(f"overlap_optimizer: {type(optimizer).__name__}.step was replaced on this "
                      f"optimizer ({getattr(replaced, '__qualname__', replaced)!r}); the "
                      "overlapped optimizer runs the class's step bucket by bucket and never "
                      "calls the replacement. Step hooks (register_step_pre_hook / "
                      "register_step_post_hook) run once per step()", stacklevel=4)
    return fixed_mb


def _replaced_step(optimizer):
    """What replaces the class's step on this optimizer instance, or None; an LR scheduler's
    counting wrapper (it calls the step it wrapped) is looked through."""
    step = vars(optimizer).get("step")
    if step is None:
        return None
    if getattr(step, "_wrapped_by_lr_sched", False):
        step = getattr(step, "__wrapped__", step)
    return None if getattr(step, "__func__", step) is type(optimizer).step else step


def refuse_overlap_with(join: bool, check_finite: bool, shard: bool = False,
                        skip_unused: bool = False) -> None:
    """What the wrapper cannot combine with an overlapped optimizer, refused by name."""
    if join:
        raise ValueError("pyreducer: overlap_optimizer cannot be created inside join()")
    if check_finite:
        raise ValueError("pyreducer: check_finite=True cannot be combined with "
                         "overlap_optimizer yet (updates run as buckets complete)")
    if shard and skip_unused:
        raise ValueError("pyreducer: overlap_optimizer(shard=True) cannot be combined with "
                         "skip_all_reduce_unused_params=True: a skipped bucket has no "
                         "reduce-scattered shard to step (use shard=False, or drop the skip)")
