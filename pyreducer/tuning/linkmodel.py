"""Link model: all-reduce time = latency + ring factor * bytes / bandwidth.

A ring all-reduce over N ranks moves 2(N-1)/N of the buffer over each rank's link, so
    time(bytes, N) = latency_s + 2(N-1)/N * bytes / bandwidth_bytes_per_s.
`probe_link` measures a few message sizes on the live process group (all ranks must call it);
`fit_link_model` fits the two numbers by least squares. The probe includes a 4 KiB message, whose
time is almost all latency: without it the latency is an extrapolated intercept, and was seen
fitted as 0 us on links where an all-reduce costs ~1 ms, which made the planner choose one
bucket per gradient (400 all-reduces, a 10x slower step).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from pyreducer.wrapper.sync import barrier, slowest, wait_for_device


@dataclass(frozen=True)
class LinkModel:
    """The link of a process group, as the step model sees it: a ring all-reduce of `bytes`
    over N ranks takes `latency_s + 2(N-1)/N * bytes / bandwidth_bytes_per_s`.

    Attributes:
        latency_s: the fixed cost of one all-reduce, in seconds.
        bandwidth_bytes_per_s: each rank's link rate, in bytes per second.
        contention: fraction of the rank's compute that a running all-reduce takes away (0:
            communication is free for compute, as with NCCL or a host with spare cores; see
            probe_contention).
        queue_s: how long an all-reduce that starts while another is streaming waits behind
            the bytes that one has queued for the wire first (Gloo's concurrent all-reduces
            share one TCP connection per peer): up to the socket buffers' depth; 0 where
            collectives do not share a queue.
    """
    latency_s: float
    bandwidth_bytes_per_s: float
    contention: float = 0.0
    queue_s: float = 0.0

    def allreduce_s(self, size_bytes: float, ranks: int) -> float:
        """The predicted time of one all-reduce of `size_bytes` over `ranks` ranks, in seconds
        (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        return self.latency_s + self.wire_s(size_bytes, ranks)

    def wire_s(self, size_bytes: float, ranks: int) -> float:
        """The bandwidth part of allreduce_s (the time the data is on the wire)."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * size_bytes / self.bandwidth_bytes_per_s

    @staticmethod
    def from_rate(rate: str, latency_s: float = 50e-6) -> "LinkModel":
        """A nominal link, e.g. "1gbit", "10gbit", "100gbit" (bits per second)."""
        units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
        for unit, scale in units.items():
            if rate.lower().endswith(unit):
                return LinkModel(latency_s, float(rate[:-len(unit)]) * scale / 8)
        raise ValueError(f"rate must look like 1gbit, 100mbit, ...; got {rate!r}")


def fit_link_model(sizes_bytes, seconds, ranks: int) -> LinkModel:
    """Least-squares fit of latency and bandwidth to measured all-reduce times, in relative
    error (each row weighted by 1/time): in absolute error the largest message dominates, and
    its wobble (1% of a 140 ms all-reduce is 1.4 ms) lands in the fitted latency."""
    factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    x = np.asarray(sizes_bytes, dtype=float) * factor
    y = np.asarray(seconds, dtype=float)
    if np.any(y <= 0):
        raise ValueError(f"link fit needs positive times, got {list(y)}")
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if inverse_bandwidth <= 0:
        raise ValueError(f"link fit failed: times do not grow with size ({list(y)})")
    return LinkModel(max(0.0, float(latency)), float(1.0 / inverse_bandwidth))


def run_steps(steps):
    """Runs a probe generator (probe_link_steps, probe_contention_steps) to its end; returns
    what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def probe_link(group=None, sizes_bytes=(1 << 12, 1 << 18, 1 << 20, 1 << 22, 1 << 24),
               reps: int = 5, device="cpu") -> tuple[LinkModel, dict]:
    """Times all-reduces of a few sizes on `group` (collective) and fits the link model.

    Returns (model, {size: median seconds}); times are the slowest rank's.
    """
    return run_steps(probe_link_steps(group, sizes_bytes, reps, device))


def probe_link_steps(group=None, sizes_bytes=(1 << 12, 1 << 18, 1 << 20, 1 << 22, 1 << 24),
                     reps=5, device="cpu", warm_each: bool = True, piece_bytes: int = 0):
    """probe_link as a generator that yields after each size, or once the sizes since the last
    yield moved `piece_bytes` (all-reduced bytes times repetitions): the pieces may run at
    separate training steps (every rank alike). `reps`: an int, or {size: reps}; warm_each:
    False warms up with the first size only. Returns (model, {size: median seconds})."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    medians = {}
    moved = 0
    for k, size in enumerate(sizes_bytes):
        data = torch.ones(size // 4, device=device)
        if warm_each or k == 0:
            dist.all_reduce(data, group=group)  # warm-up
        samples = []
        count = reps.get(size, 1) if isinstance(reps, dict) else reps
        for _ in range(count):
            barrier(group, device)
            start = time.perf_counter()
            dist.all_reduce(data, group=group)
            wait_for_device(device)  # on CUDA the call returns at enqueue
            samples.append(slowest(time.perf_counter() - start, group, device))
        medians[size] = statistics.median(samples)
        moved += size * count
        if moved >= piece_bytes:
            moved = 0
            yield size
    return fit_link_model(list(medians), list(medians.values()), ranks), medians


def probe_contention(link: LinkModel, group=None, reps: int = 3, work_s: float = 0.02,
                     small_ops: int = 16) -> LinkModel:
    """`link` as it behaves beside compute on this host (collective; CPU tensors): returns it
    with `contention` and a `latency_s` measured under load; how: probe_contention_steps in
    `pyreducer/tuning/linkmodel.py`."""
    return run_steps(probe_contention_steps(link, group, reps, work_s, small_ops))


def probe_contention_steps(link: LinkModel, group=None, reps: int = 3, work_s: float = 0.02,
                           small_ops: int = 16):
    """probe_contention as a generator that yields after each contention sample and after the
    latency under load (the queue comes last); returns the LinkModel.

    contention: a fixed compute kernel (matrix products, ~work_s) is timed alone, then while an
    all-reduce big enough to outlast it runs; contention = 1 - alone / with, clamped to [0, 0.9].
    Latency under load: `small_ops` 4 KiB all-reduces are queued while the kernel keeps the core
    busy, and the time until the last completes, per all-reduce, replaces latency_s if larger.
    With one core per rank (the emulated hosts here) Gloo's threads and the kernel's network
    stack share the core with backward: contention was 0.15-0.5, and an all-reduce waited for a
    scheduler slice (~2 ms instead of the 0.2 ms it takes on an idle host), which a planner that
    trusts the idle latency pays for with hundreds of buckets. Times are the slowest rank's.
    """
    import dataclasses

    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    # the kernel's operands from a generator of its own: drawing from torch's default one would
    # move the training's random stream (dropout masks) away from an untuned run's
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))

    def kernel(count):
        start = time.perf_counter()
        for _ in range(count):
            torch.mm(a, a)
        return time.perf_counter() - start

    one = statistics.median(kernel(5) for _ in range(3)) / 5
    per_ms = max(1, int(round(slowest(1e-3 / max(one, 1e-7), group))))  # the same kernel on every rank
    count = max(1, int(work_s * 1e3)) * per_ms
    size_bytes = int(min(64 << 20, max(1 << 20, 2 * work_s * link.bandwidth_bytes_per_s
                                          / max(2 * (ranks - 1) / ranks, 1e-9))))
    data = torch.ones(size_bytes // 4)
    alone, loaded = [], []
    for _ in range(reps):
        barrier(group, "cpu")
        alone.append(slowest(kernel(count), group))
        barrier(group, "cpu")
        work = dist.all_reduce(data, group=group, async_op=True)
        elapsed = kernel(count)
        work.wait()
        loaded.append(slowest(elapsed, group))
        yield "contention sample"
    contention = min(0.9, max(0.0, 1.0 - statistics.median(alone) / statistics.median(loaded)))
    latency = max(link.latency_s,
                  _probe_loaded_latency(lambda: kernel(per_ms), group, reps, small_ops))
    yield "latency under load"
    queue = _probe_queue(data, torch.ones(1024), link, group, reps)
    return dataclasses.replace(link, contention=float(contention), latency_s=float(latency),
                               queue_s=float(queue))


def _probe_loaded_latency(busy_ms, group, reps: int, small_ops: int) -> float:
    """Per all-reduce, the time `small_ops` 4 KiB all-reduces queued at once take to complete
    while `busy_ms()` (about 1 ms of compute) keeps the core busy; median, slowest rank's."""
    import torch
    import torch.distributed as dist

    small = [torch.ones(1024) for _ in range(small_ops)]
    latencies = []
    for _ in range(reps):
        barrier(group, "cpu")
        start = time.perf_counter()
        works = [dist.all_reduce(t, group=group, async_op=True) for t in small]
        while not works[-1].is_completed() and time.perf_counter() - start < 2.0:
            busy_ms()  # keep the core busy, as backward does; check about every ms
        elapsed = time.perf_counter() - start
        for w in works:
            w.wait()
        latencies.append(slowest(elapsed, group) / small_ops)
    return statistics.median(latencies)


def _probe_queue(big, small, link: LinkModel, group, reps: int) -> float:
    """queue_s: a small (4 KiB) all-reduce timed alone, then started a third into a big one's
    wire time; the difference of the medians (slowest rank's), at least 0. Measured by hand at
    1 Gbit/s on the emulated hosts, a 155 KB all-reduce took 3.7 ms alone and 24-27 ms beside
    one of 4-16 MB (9.7 beside 2 MB, none beside 1 MB): the socket buffers hold ~25 ms of
    bytes; this probe gave 5-60 ms (benchmarks/results/overlap_inplace_20261125.md)."""
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    head_s = link.wire_s(big.numel() * big.element_size(), ranks) / 3
    alone, beside = [], []
    for _ in range(reps):
        barrier(group, "cpu")
        start = time.perf_counter()
        dist.all_reduce(small, group=group)
        alone.append(slowest(time.perf_counter() - start, group))
        barrier(group, "cpu")
        work = dist.all_reduce(big, group=group, async_op=True)
        time.sleep(head_s)
        start = time.perf_counter()
        dist.all_reduce(small, group=group)
        elapsed = time.perf_counter() - start
        work.wait()
        beside.append(slowest(elapsed, group))
    return max(0.0, statistics.median(beside) - statistics.median(alone))
