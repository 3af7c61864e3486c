"""torch DDP's constructor arguments, checked and resolved exactly as torch 2.13 DDP does.

Each function takes the user's values and returns what the wrapper keeps, or raises an error
that names the argument, what was expected and what was found.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

# Arguments of torch DDP that pyreducer does not serve yet, with their defaults: passing another
# value raises NotImplementedError naming the argument (nothing is ignored silently).
NOT_YET = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "skip_all_reduce_unused_params": False,
}


def refuse_unsupported(given: dict) -> None:
    """Raises NotImplementedError for the first argument of NOT_YET given a non-default value."""
    for name, default in NOT_YET.items():
        if given[name] != default:
            raise NotImplementedError(
                f"pyreducer.DistributedDataParallel does not support {name}={given[name]!r} "
                f"yet (only the default, {default!r}).")


def resolve_group(process_group, device_mesh):
    """The process group gradients are averaged over (process_group, a 1-D mesh, or WORLD)."""
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


def check_module(module: nn.Module, wrapper_types: tuple) -> None:
    """Refuses a module that is already wrapped, or that has uninitialized (lazy) parameters."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    for name, sub in module.named_modules():
        if isinstance(sub, wrapper_types + (TorchDDP,)):
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


def resolve_devices(module: nn.Module, device_ids, output_device):
    """(device_ids, output_device) as device indices, or (None, None) for CPU and multi-device
    modules, as torch DDP."""
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


def resolve_buffer_sync(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
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
