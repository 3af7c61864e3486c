"""torch DDP's logging data: `_get_ddp_logging_data()` and `_set_ddp_runtime_logging_sample_rate()`.

Research code and torch's own tests read this dict; pyreducer fills it with torch 2.13's keys,
types and formats (strings first, then integers, each group sorted; booleans as 0/1; a key
appears once something wrote it), from its own measurements: the Reducer's stats of the last
synced backward (csrc/reducer.h BackwardStats) and the forward's start on the same clock.

Runtime stats are sampled as torch samples them: synced iteration k (forwards with grad enabled
and gradient sync on, counted from 1) is recorded if k <= 10 or k % sample_rate == 0 (default
100), and published at the start of the next synced forward, so `iteration` is the last sampled
iteration that finished. Durations are in ns, averages are torch's integer running means over
the sampled iterations, timestamps are Unix-epoch ns (the host clock, shifted once).

Off the CPU, host times are when work was enqueued (NCCL completes a collective's work at
enqueue), so, as torch's logger takes its durations from CUDA events there (reducer_cuda.cpp's
CudaTimer), backward_compute_time, backward_comm_time and backward_compute_comm_overlap_time
(and their averages) come from the device timeline's record of that iteration (Note [Device
timeline] in csrc/device_timeline.h: CUDA events, device times anchored at the host's backward
start): the backward from its start (the device timeline's anchor, where torch starts at the
forward's end) to its end, the communication from the first bucket's launch to the last
gradient written back (with deferred completion, an overlapped optimizer's: the last bucket's
reduction done on the device). Where no such record exists (timeline_iterations=0, parameters on
several devices, events that could not be read) they are 0, not measured, as torch leaves a
duration whose events were not recorded. forward_compute_time stays the host's (no device event
marks the forward's start), and timestamps are the host's, as torch's are (its Timer keeps the
host time of each event). Compiled, not run on a GPU: no GPU here.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from pyreducer.wrapper import params as params_module

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_ENV_KEYS = {"master_port": "MASTER_PORT", "master_addr": "MASTER_ADDR",
             "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
             "cuda_visible_devices": "CUDA_VISIBLE_DEVICES"}
_NCCL_KEYS = {"nccl_socket_ifname": ("NCCL_SOCKET_IFNAME",),
              "nccl_blocking_wait": ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
              "nccl_async_error_handling": ("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                            "NCCL_ASYNC_ERROR_HANDLING"),
              "nccl_debug": ("NCCL_DEBUG",), "nccl_nthreads": ("NCCL_NTHREADS",),
              "nccl_ib_timeout": ("NCCL_IB_TIMEOUT",)}
# (duration key, start event, end event) as torch's Logger::set_runtime_stats_and_log
_DURATIONS = (("forward_compute_time", "forward_start_ns", "backward_start_ns"),
              ("backward_compute_time", "backward_start_ns", "backward_end_ns"),
              ("backward_comm_time", "comm_start_ns", "comm_end_ns"),
              ("backward_compute_comm_overlap_time", "comm_start_ns", "backward_end_ns"))
# Timed on the device off the CPU (see the module's docstring).
_DEVICE_TIMED = ("backward_compute_time", "backward_comm_time",
                 "backward_compute_comm_overlap_time")
_TIMESTAMPS = (("forward_compute_time_start", "forward_start_ns"),
               ("backward_compute_time_start", "backward_start_ns"),
               ("backward_comm_time_start", "comm_start_ns"),
               ("backward_compute_time_end", "backward_end_ns"),
               ("backward_comm_time_end", "comm_end_ns"))


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's TypeMeta name: float, double, c10::Half, c10::BFloat16, ..."""
    names = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
             torch.bfloat16: "c10::BFloat16", torch.complex64: "c10::complex<float>",
             torch.complex128: "c10::complex<double>"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def _env(names) -> str:
    for name in names:
        if os.environ.get(name) is not None:
            return os.environ[name]
    return "N/A"


class DDPLogger:
    """The logging data of one wrapper. `reducer` is its C++ Reducer (stats, iterations, errors,
    timeline); `off_cpu`: its parameters are off the CPU (durations from the device timeline,
    see the module's docstring). The wrapper calls construction_data() once,
    before_synced_forward() at the start of every synced forward, and set_error() when it
    raises."""

    def __init__(self, reducer, now_ns, sizes_bytes, off_cpu: bool):
        self.reducer, self._now_ns, self._sizes = reducer, now_ns, list(sizes_bytes)
        self.strs: dict[str, str] = {}
        self.ints: dict[str, int] = {}
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self._sampled = 0
        self._forward_start_ns = {}  # iteration -> host ns of its forward's start
        self._epoch_offset_ns = time.time_ns() - now_ns()
        self._seen_error = ""
        self._off_cpu = off_cpu

    def should_collect(self, iteration: int) -> bool:
        return iteration > 0 and (iteration <= 10 or iteration % self.sample_rate == 0)

    def construction_data(self, module, params, device_ids, output_device,
                          broadcast_buffers: bool, find_unused: bool, bucket_view: bool,
                          static_graph: bool, bucket_cap_bytes: int) -> None:
        """torch's Logger::set_construction_data_and_log."""
        group = params.process_group
        tensors = params.tensors
        sizes = self.reducer.bucket_layout()
        ints = dict(world_size=params.world_size, rank=params.rank, iteration=0,
                    is_multi_device_module=int(len({t.device for t in tensors}) > 1),
                    num_parameter_tensors=len(tensors),
                    total_parameter_size_bytes=sum(params.sizes_bytes),
                    output_device=-1 if output_device is None else output_device,
                    broadcast_buffers=int(broadcast_buffers),
                    has_sync_bn=int(any(isinstance(m, torch.nn.SyncBatchNorm)
                                        for m in module.modules())),
                    bucket_cap_bytes=bucket_cap_bytes, find_unused_parameters=int(find_unused),
                    gradient_as_bucket_view=int(bucket_view))
        strs = dict(module_name=type(module).__name__,
                    dtypes=", ".join(sorted({_dtype_name(t.dtype) for t in tensors})),
                    bucket_sizes=", ".join(str(b["size_bytes"]) for b in sizes),
                    device_ids=", ".join(str(i) for i in device_ids or []),
                    backend_name=params_module.backend_name(group))
        strs.update({key: _env([var]) for key, var in _ENV_KEYS.items()})
        if strs["backend_name"] == "nccl":
            strs.update({key: _env(names) for key, names in _NCCL_KEYS.items()})
        if strs["backend_name"] == "gloo":
            strs["gloo_socket_ifname"] = _env(["GLOO_SOCKET_IFNAME"])
            strs["gloo_device_transport"] = _env(["GLOO_DEVICE_TRANSPORT"])
            ints["gloo_num_threads"] = _gloo_threads(group)
        if static_graph:
            ints["static_graph"] = 1
        self.ints.update(ints)
        self.strs.update(strs)

    def set_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            message = "DDP runtime logging sample rate should be equal or greater than 1"
            self.set_error(f"{ValueError}: {message}")
            raise ValueError(message)
        self.sample_rate = int(sample_rate)

    def before_synced_forward(self, has_rebuilt: bool) -> None:
        """At the start of a synced forward (grad enabled, sync on), before it counts: publishes
        the last iteration's stats if it was sampled, and times this forward if it will be."""
        iteration = self.reducer.num_iterations
        if self.should_collect(iteration):
            self._publish(iteration, has_rebuilt)
        if self.should_collect(iteration + 1):
            self._forward_start_ns = {iteration + 1: self._now_ns()}

    def _publish(self, iteration: int, has_rebuilt: bool) -> None:
        stats = self.reducer.backward_stats()
        self._sampled += 1
        ints, strs = self.ints, self.strs
        ints["iteration"] = iteration
        ints["num_buckets_reduced"] = stats["buckets_reduced"]
        ints["unused_parameter_size"] = sum(self._sizes[i] for i in stats["unused"])
        if ints.get("has_rebuilt_buckets") != int(has_rebuilt):
            ints["has_rebuilt_buckets"] = int(has_rebuilt)
            if has_rebuilt:
                rebuilt_layout = self.reducer.bucket_layout()
                strs["rebuilt_bucket_sizes"] = ", ".join(str(b["size_bytes"])
                                                         for b in rebuilt_layout)
                strs["rebuilt_per_bucket_param_indices"] = ", ".join(
                    " ".join(str(i) for i in b["param_indices"]) for b in rebuilt_layout)
        if stats["ready_order"]:
            strs["prev_iteration_grad_ready_order_indices"] = ", ".join(
                str(i) for i in stats["ready_order"])
        times = dict(stats, forward_start_ns=self._forward_start_ns.get(stats["iteration"], 0))
        if stats["iteration"] != iteration:  # the backward of that forward never finished
            times = {key: 0 for key in times}
        device = self._device_times(iteration) if self._off_cpu and times["backward_start_ns"] \
            else None
        for key, start, end in _DURATIONS:
            ints[key] = 0
            avg = ints.setdefault(f"avg_{key}", 0)  # written even if not measured, as torch's
            span = device if self._off_cpu and key in _DEVICE_TIMED else times
            if span and span[start] and span[end] and span[end] >= span[start]:
                ints[key] = span[end] - span[start]
                ints[f"avg_{key}"] = (ints[key] + avg * (self._sampled - 1)) // self._sampled
        for key, event in _TIMESTAMPS:
            ints[key] = times[event] + self._epoch_offset_ns if times[event] else 0

    def _device_times(self, iteration: int) -> dict | None:
        """The device timeline's times of synced iteration `iteration` (its last completed
        record; reading it waits for its events, as torch's CudaTimer does at the same point),
        under _DURATIONS' names; None where it holds none on the device's clock."""
        records = self.reducer.timeline(1)
        if not records or records[-1]["iteration"] != iteration or \
                records[-1]["clock"] != "device":
            return None
        record = records[-1]
        launched = [b["launch_ns"] for b in record["buckets"] if b["launch_ns"]]
        done = [b["done_ns"] for b in record["buckets"] if b["done_ns"]]
        # the backward waited for its buckets (wait_end): every gradient was written back at
        # its end; else (deferred completion) the reductions completed later, on the device
        # when the last bucket's was done
        comm_end = record["finalize_end_ns"] if record["wait_end_ns"] else max(done, default=0)
        return dict(backward_start_ns=record["backward_start_ns"],
                    backward_end_ns=record["backward_end_ns"],
                    comm_start_ns=min(launched, default=0), comm_end_ns=comm_end)

    def set_comm_hook(self, name: str) -> None:
        self.strs["comm_hook"] = name

    def set_join(self) -> None:
        self.ints["join_uneven_inputs"] = 1

    def set_static_graph(self) -> None:
        self.ints["static_graph"] = 1

    def set_error(self, message: str) -> None:
        """torch's Logger::set_error_and_log."""
        self.ints["has_error"] = 1
        self.strs["error"] = message
        self.ints["iteration"] = self.reducer.num_iterations

    def data(self) -> dict:
        """torch's _get_ddp_logging_data(): strings, then integers, each sorted by key."""
        error = self.reducer.last_error()
        if error and error != self._seen_error:  # raised inside the C++ Reducer
            self._seen_error = error
            self.set_error(error)
        return {**dict(sorted(self.strs.items())), **dict(sorted(self.ints.items()))}


def _gloo_threads(group) -> int:
    """ProcessGroupGloo's thread count (its options' _threads; torch's default is 2)."""
    return int(group._get_backend(torch.device("cpu")).options._threads)
