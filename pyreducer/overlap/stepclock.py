"""Step clocks for the schedule tuner's trial windows (Note [Trial windows] in schedule_tuner.py).

A window is timed between two synced forwards' starts, with nothing synchronized in between: a
per-step collective or device sync would wait behind the reductions left in flight and erase
the overlap being measured.
  - CPU: a step is over when the host is through it: time.perf_counter() at each mark.
  - CUDA: the host runs ahead of the device (an NCCL wait only makes the current stream wait on
    the communication stream), so host times would measure how fast steps are queued, not how
    fast they run. Each mark is a CUDA event recorded on the current stream, where the next
    forward's kernels go; a window is the elapsed time between two of them, read only when the
    trials' windows are gathered (the host waits for the end event then, once). Compiled, not
    run: no GPU has run this (tests/gpu/test_gpu_one_rank.py has its test).
"""
from __future__ import annotations

import time

import torch


class HostClock:
    """Marks are time.perf_counter() readings."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Marks are CUDA events on the current stream of `device`."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time: milliseconds


def for_device(device) -> HostClock | CudaClock:
    """The clock that times steps on `device` (a torch.device or its string)."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()
