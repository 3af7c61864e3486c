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


def _step(model, spec, opt, batch) -> tuple[float, float]:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = spec.loss(model, batch)
    loss.backward()
    opt.step()
    return loss.item(), time.perf_counter() - start


def compare_worker(rank, world_size, model_name, steps, warmup, batch_size, bucket_cap_mb,
                   print_progress=False, keep_timeline=0):
    """Runs warmup + steps interleaved steps of both wrappers; returns per-step losses and times.

    Result (per rank): {"torch": {"loss": [...], "seconds": [...]}, "pyreducer": {...},
    "max_param_diff": float, "params": [final pyreducer parameters], "timelines": pyreducer's
    gathered timelines of the last keep_timeline iterations (rank 0 only)}; timing lists exclude
    warm-up.
    """
    from pyreducer.trace import gather_timelines

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel, models

    spec = models.spec(model_name)
    torch.manual_seed(1234)
    base = spec.build()
    wrapped = {"torch": TorchDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb),
               "pyreducer": DistributedDataParallel(copy.deepcopy(base),
                                                    bucket_cap_mb=bucket_cap_mb)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in wrapped.items()}
    gens = {k: torch.Generator().manual_seed(100 + rank) for k in wrapped}
    out = {k: {"loss": [], "seconds": []} for k in wrapped}
    names = list(wrapped)
    for step in range(warmup + steps):
        line = []
        for name in names if step % 2 == 0 else names[::-1]:  # alternate who goes first
            model = wrapped[name]
            loss, seconds = _step(model, spec, opts[name], spec.batch(gens[name], batch_size))
            if step >= warmup:
                out[name]["loss"].append(loss)
                out[name]["seconds"].append(seconds)
            line.append(f"{name} loss {loss:.5f} {seconds * 1e3:7.1f} ms")
        if print_progress and rank == 0:
            tag = "warm-up" if step < warmup else f"step {step - warmup + 1:3d}/{steps}"
            print(f"  [{tag}] " + " | ".join(line), flush=True)
    pairs = zip(wrapped["torch"].module.parameters(), wrapped["pyreducer"].module.parameters())
    out["max_param_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    out["params"] = [p.detach().clone() for p in wrapped["pyreducer"].module.parameters()]
    out["timelines"] = gather_timelines(wrapped["pyreducer"], keep_timeline) \
        if keep_timeline else None
    return out


def summarize(seconds: list[float]) -> dict:
    """Median and spread of step times, in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return dict(median_ms=statistics.median(ms), p25_ms=quartiles[0], p75_ms=quartiles[2],
                min_ms=ms[0], max_ms=ms[-1], n=len(ms))
