"""Side-by-side training of torch DDP and pyreducer on the same ranks (demo and benchmarks).

Both wrappers train their own copy of one model, from the same initial state, on the same data,
with the same optimizer; their steps are interleaved, alternating which goes first, so that
machine noise and ordering effects hit both alike. Each step is timed on every rank from zero_grad to optimizer step.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch


def _step(model, spec, opt, batch) -> tuple[float, float, float, float]:
    """(loss, step seconds, forward seconds, optimizer-step seconds)."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = spec.loss(model, batch)
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    opt.step()
    end = time.perf_counter()
    return loss.item(), end - start, forward_end - start, end - backward_end


DEFAULT_VARIANTS = (("torch", "torch", {}), ("pyreducer", "pyreducer", {}))


def compare_worker(rank, world_size, model_name, steps, warmup, batch_size, bucket_cap_mb,
                   print_progress=False, keep_timeline=0, variants=DEFAULT_VARIANTS):
    """Runs warmup + steps interleaved steps of every variant; returns per-step losses and times.

    Args:
        variants: (label, "torch" | "pyreducer", extra wrapper kwargs) per variant; the first
            is the reference the others' parameters are compared with.
    Result (per rank): {label: {"loss": [...], "seconds": [...], "forward_s": [...],
    "optimizer_s": [...]}, ..., "max_param_diff": max over variants of |variant - reference|,
    "params": [final parameters of the last variant], "timelines": the last pyreducer
    variant's gathered timelines of the last keep_timeline iterations (rank 0 only), "profile":
    its step profile (for `python -m pyreducer simulate`)}; timing lists exclude warm-up.
    """
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models
    from pyreducer.observe.trace import gather_timelines

    classes = {"torch": TorchDDP, "pyreducer": DistributedDataParallel}
    spec = models.spec(model_name)
    torch.manual_seed(1234)
    base = spec.build()
    wrapped = {label: classes[kind](copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, **kwargs)
               for label, kind, kwargs in variants}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in wrapped.items()}
    gens = {k: torch.Generator().manual_seed(100 + rank) for k in wrapped}
    out = {k: {"loss": [], "seconds": [], "forward_s": [], "optimizer_s": []} for k in wrapped}
    names = list(wrapped)
    for step in range(warmup + steps):
        line = {}
        for name in names if step % 2 == 0 else names[::-1]:  # alternate who goes first
            model = wrapped[name]
            loss, seconds, forward_s, optimizer_s = _step(model, spec, opts[name],
                                                          spec.batch(gens[name], batch_size))
            if step >= warmup:
                for key, value in (("loss", loss), ("seconds", seconds), ("forward_s", forward_s),
                                   ("optimizer_s", optimizer_s)):
                    out[name][key].append(value)
            line[name] = f"{name} loss {loss:.5f} {seconds * 1e3:7.1f} ms"
        if print_progress and rank == 0:
            tag = "warm-up" if step < warmup else f"step {step - warmup + 1:3d}/{steps}"
            print(f"  [{tag}] " + " | ".join(line[n] for n in names), flush=True)
    reference = list(wrapped.values())[0].module.parameters()
    reference = [p.detach() for p in reference]
    out["max_param_diff"] = max((a - b.detach()).abs().max().item()
                                for m in list(wrapped.values())[1:]
                                for a, b in zip(reference, m.module.parameters()))
    out["params"] = [p.detach().clone() for p in list(wrapped.values())[-1].module.parameters()]
    ours = [m for (label, kind, _), m in zip(variants, wrapped.values()) if kind == "pyreducer"]
    out["timelines"] = gather_timelines(ours[-1], keep_timeline) if keep_timeline else None
    out["profile"] = None
    if keep_timeline:
        label = [label for label, kind, _ in variants if kind == "pyreducer"][-1]
        out["profile"] = vars(ours[-1].profile(
            statistics.median(out[label]["forward_s"]) * 1e3,
            statistics.median(out[label]["optimizer_s"]) * 1e3, keep_timeline))
    out["plan"] = ours[-1].bucket_plan()
    return out


def summarize(seconds: list[float]) -> dict:
    """Median and spread of step times, in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return dict(median_ms=statistics.median(ms), p25_ms=quartiles[0], p75_ms=quartiles[2],
                min_ms=ms[0], max_ms=ms[-1], n=len(ms))


def paired_ratio(numerator_ms: list[float], denominator_ms: list[float], reps: int = 2000,
                 seed: int = 0) -> dict:
    """Ratio of medians of two paired series (entry i of each measured side by side), with a
    95% bootstrap interval: pairs are resampled together, so drifts that hit both alike cancel.
    """
    import numpy as np

    a, b = np.asarray(numerator_ms, dtype=float), np.asarray(denominator_ms, dtype=float)
    if a.shape != b.shape or a.size < 2:
        raise ValueError(f"paired_ratio needs two series of equal length >= 2, got {a.size} "
                         f"and {b.size}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(reps, a.size))
    samples = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    low, high = np.quantile(samples, [0.025, 0.975])
    return dict(ratio=float(np.median(a) / np.median(b)), ci95=[float(low), float(high)],
                pair_ratio_median=float(np.median(a / b)), n=int(a.size))
