"""`from pyreducer.apex import DistributedDataParallel as DDP`: NVIDIA Apex's DDP, on pyreducer.

Apex's `apex.parallel.DistributedDataParallel` is gone from current Apex, and research code that
imports it no longer runs. This class takes Apex's last constructor (the deprecated version
removed in 2025) and maps each option onto pyreducer's engine; an option pyreducer cannot honour
raises, naming it. Numerics are Apex's (its `allreduce_bucket`): per bucket, the flat gradients,
cast to float32 with `allreduce_always_fp32`, multiplied by `1 / gradient_predivide_factor`,
all-reduced (SUM), multiplied by `gradient_predivide_factor / world_size` with
`gradient_average`, and copied back into the gradients' dtype.

Differences from Apex, all deliberate:
  - buckets are pyreducer's (torch DDP's schedule): one bucket per dtype in the first iteration,
    then buckets along the observed gradient order, closed at `message_size` elements (converted
    to bytes with the first parameter's element size), launched strictly in order;
  - it runs on CPU (Gloo) as well as on GPUs (NCCL); Apex needed CUDA;
  - the parameter set is fixed at construction (Apex rebuilt its buckets when the set of
    parameters requiring grad changed);
  - `prof` adds nothing: pyreducer always emits profiler ranges per bucket.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from pyreducer import distributed
from pyreducer.compiled import frames

# Apex's message for shared_param, which it deprecated and then refused.
SHARED_PARAM_MESSAGE = (
    "shared_param is no longer supported as an option.  It was misleadingly named from the "
    "start.  It turns out overlapping communication with computation should work fine with "
    "shared parameters.  If you still wish to delay communication to the end of the backward "
    "pass, use delay_allreduce=True|False instead.")


class DistributedDataParallel(distributed.DistributedDataParallel):
    """Apex's DistributedDataParallel (its last signature) on pyreducer's Reducer.

    The arguments are Apex's, with Apex's defaults.

    Args:
        message_size (int): bucket cap in elements (default 10,000,000).
        delay_allreduce (bool): one all-reduce per dtype after backward, no overlap.
        shared_param (None): refused, as Apex does.
        allreduce_trigger_params (list | None): buckets close after these parameters'
            gradients (in the order observed in the first iteration); message_size is then
            ignored.
        retain_allreduce_buffers (bool): gradients stay views of the flat buffers
            (allreduce_buffers).
        allreduce_always_fp32 (bool): reduce float16/bfloat16 (and float64) buckets in float32.
        num_allreduce_streams (int): several CUDA streams: not supported (pyreducer issues one
            ordered stream of collectives); 1 only.
        allreduce_communicators (None): several communicators: not supported, as
            num_allreduce_streams.
        gradient_average (bool): divide by the world size (default True).
        gradient_predivide_factor (float): multiply by 1/f before the all-reduce, by
            f/world_size after.
        gradient_average_split_factor (None): ignored, as in Apex (deprecated there).
        prof (bool): accepted; pyreducer always records profiler ranges.
    """

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1,
                 allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False):
        _check_apex_arguments(delay_allreduce, shared_param, allreduce_trigger_params,
                              num_allreduce_streams, allreduce_communicators,
                              gradient_average_split_factor)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                               "any parameter that requires a gradient.")
        # Apex's settings first: the engine built by the base class reads them
        # (_averaging_settings).
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.prof = prof
        self.trigger_params = ({id(p) for p in allreduce_trigger_params}
                               if allreduce_trigger_params is not None else None)
        cap_mb = message_size * params[0].element_size() / 2**20
        with warnings.catch_warnings():  # Apex never synced buffers: torch's spelling of that
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(
                module, broadcast_buffers=False, bucket_cap_mb=cap_mb,
                gradient_as_bucket_view=retain_allreduce_buffers,
                bucket_plan=_per_dtype_plan(module) if delay_allreduce or allreduce_trigger_params
                else None)

    def _averaging_settings(self, predivide_factor, reduce_dtype) -> dict:
        """Apex's allreduce_bucket: float32 if allreduce_always_fp32, x 1/f if f != 1, SUM,
        x f/world_size if gradient_average (csrc/comm_hook.h AveragingHook)."""
        factor = float(self.gradient_predivide_factor)
        return dict(reduce_dtype=torch.float32 if self.allreduce_always_fp32 else None,
                    pre_multiplier=1.0 / factor,
                    post="multiply" if self.gradient_average else "none",
                    post_value=factor / dist.get_world_size(self.process_group),
                    name="apex allreduce_bucket")

    @frames.run_eagerly  # as the wrapper's (Note [The wrapper's forward under torch.compile])
    def forward(self, *inputs, **kwargs):
        """pyreducer's forward; with allreduce_trigger_params, the synced forward after the
        first iteration applies `trigger_plan()` first (on every rank: rank 0's)."""
        if self.trigger_params is not None and self.require_backward_grad_sync and \
                torch.is_grad_enabled() and self.reducer.num_iterations == 1:
            self.apply_bucket_plan(self.trigger_plan())  # rank 0's, on every rank
            self.trigger_params = None
        return super().forward(*inputs, **kwargs)

    def enable_allreduce(self) -> None:
        """Apex: backward all-reduces again (pyreducer: require_backward_grad_sync = True)."""
        self.require_backward_grad_sync = True

    def disable_allreduce(self) -> None:
        """Apex: backward accumulates locally (pyreducer: require_backward_grad_sync = False,
        as under no_sync())."""
        self.require_backward_grad_sync = False

    @property
    def allreduce_buffers(self) -> list[torch.Tensor]:
        """With retain_allreduce_buffers: the flat, reduced buffers, which .grad views."""
        return self.reducer.bucket_buffers() if self.retain_allreduce_buffers else []

    def trigger_plan(self) -> list[list[str]]:
        """The first iteration's gradient order, per (dtype, device), cut after each trigger
        parameter (Apex's allreduce_trigger_params buckets), as parameter names."""
        names = {}  # parameter index -> name, from the current plan
        for indices, bucket in zip((b["param_indices"] for b in self.reducer.bucket_layout()),
                                   self.bucket_plan()):
            names.update(zip(indices, bucket["params"]))
        params = dict(self.module.named_parameters())
        order = list(dict.fromkeys(self.reducer.backward_stats()["ready_order"]))  # first firing
        ready = set(order)
        order += [i for i in names if i not in ready]  # never ready: last, as DDP's rebuild
        plan, open_by_key = [], {}
        for index in order:
            param = params[names[index]]
            key = (param.dtype, param.device)
            open_by_key.setdefault(key, []).append(names[index])
            if id(param) in self.trigger_params:
                plan.append(open_by_key.pop(key))
        return plan + [bucket for bucket in open_by_key.values() if bucket]


def _check_apex_arguments(delay_allreduce, shared_param, allreduce_trigger_params,
                          num_allreduce_streams, allreduce_communicators,
                          gradient_average_split_factor) -> None:
    """Apex's own refusals with its messages, then what pyreducer cannot honour."""
    if num_allreduce_streams > 1 and delay_allreduce:
        raise ValueError("self.allreduce_different_streams may only be used if "
                         "delay_allreduce=False.")
    if shared_param is not None:
        raise ValueError(SHARED_PARAM_MESSAGE)
    if allreduce_trigger_params is not None and delay_allreduce:
        raise ValueError("Setting allreduce_trigger_params is only valid if "
                         "delay_allreduce=False.")
    if num_allreduce_streams != 1:
        raise NotImplementedError(
            f"pyreducer.apex.DistributedDataParallel does not support num_allreduce_streams="
            f"{num_allreduce_streams}: pyreducer issues its collectives in one ordered stream "
            "(use 1, Apex's default)")
    if allreduce_communicators is not None:
        raise NotImplementedError(
            "pyreducer.apex.DistributedDataParallel does not support allreduce_communicators: "
            "pyreducer communicates on the default process group's one communicator")
    if gradient_average_split_factor is not None:
        warnings.warn("gradient_average_split_factor is deprecated and ignored (as in Apex); use "
                      "gradient_predivide_factor", FutureWarning, stacklevel=3)
    if not dist.is_initialized():
        raise RuntimeError("pyreducer.apex.DistributedDataParallel: call "
                           "torch.distributed.init_process_group(...) first")


def _per_dtype_plan(module) -> list[list[str]]:
    """One bucket per (dtype, device) of the parameters that require grad, in parameter order
    (Apex's first-iteration and delay_allreduce buckets)."""
    groups: dict = {}
    for name, param in module.named_parameters():  # tied parameters once, under the first name
        if param.requires_grad:
            groups.setdefault((param.dtype, param.device), []).append(name)
    return list(groups.values())
