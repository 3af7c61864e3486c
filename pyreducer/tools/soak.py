"""`python -m pyreducer soak`: a long run of a small model at world size 2 (`make soak`: 10,000
steps), watching what a long job would leak.

Every rank trains the same MLP with pyreducer (timeline recording on, as by default) and SGD
with momentum on its own data, and samples every `--every` steps: resident memory (VmRSS),
open file descriptors and OS threads of its process. After `--warmup` steps the first sample is
the baseline. The run passes when, at the end, the parameters are bitwise identical on every
rank, resident memory grew by less than `--max-growth-mb` over the baseline, and descriptors and
threads equal the baseline's. `--overlap` soaks the overlapped optimizer instead of the plain
step. Progress is printed by rank 0; `--json` and `--plot` write the samples.
"""
from __future__ import annotations

import json
import os
import time

LIMITS = dict(max_growth_mb=5.0)


def _process_sample() -> dict:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return dict(rss_mb=int(status["VmRSS"].split()[0]) / 1024,
                fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")))


def soak_worker(rank: int, world_size: int, steps: int, every: int, overlap: bool) -> dict:
    """One rank's run: the samples (step, seconds, rss_mb, fds, threads) and final parameters."""
    import torch

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                 torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = DistributedDataParallel(module, bucket_cap_mb=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if overlap:
        optimizer = model.overlap_optimizer(optimizer)
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen))
            for _ in range(32)]
    samples, start = [], time.monotonic()
    for step in range(1, steps + 1):
        x, y = data[step % len(data)]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % every == 0 or step == steps:
            if overlap:
                model.synchronize()  # updates in flight hold buffers: sample a settled state
            samples.append(dict(step=step, seconds=time.monotonic() - start, **_process_sample()))
            if rank == 0:
                last = samples[-1]
                print(f"soak: step {step}/{steps}, {last['seconds']:.0f} s, "
                      f"rss {last['rss_mb']:.1f} MB, fds {last['fds']}, threads {last['threads']}",
                      flush=True)
    model.synchronize()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return dict(samples=samples, params=params)


def judge(per_rank: list[dict], warmup: int, max_growth_mb: float) -> dict:
    """The verdict from every rank's samples and parameters (see the module docstring)."""
    import torch

    checks = dict(identical=all(torch.equal(r["params"], per_rank[0]["params"])
                                for r in per_rank))
    ranks = []
    for rank, result in enumerate(per_rank):
        after = [s for s in result["samples"] if s["step"] >= warmup] or result["samples"][-1:]
        base, last = after[0], result["samples"][-1]
        ranks.append(dict(rank=rank, baseline_step=base["step"],
                          rss_growth_mb=round(last["rss_mb"] - base["rss_mb"], 2),
                          rss_max_growth_mb=round(max(s["rss_mb"] for s in after)
                                                  - base["rss_mb"], 2),
                          fds=(base["fds"], last["fds"]), threads=(base["threads"],
                                                                    last["threads"])))
    checks["rss"] = all(r["rss_growth_mb"] < max_growth_mb for r in ranks)
    checks["fds"] = all(r["fds"][0] == r["fds"][1] for r in ranks)
    checks["threads"] = all(r["threads"][0] == r["threads"][1] for r in ranks)
    return dict(ok=all(checks.values()), checks=checks, ranks=ranks)


def plot(per_rank: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for rank, result in enumerate(per_rank):
        steps = [s["step"] for s in result["samples"]]
        axes[0].plot(steps, [s["rss_mb"] for s in result["samples"]], label=f"rank {rank}")
        axes[1].plot(steps, [s["threads"] for s in result["samples"]], label=f"threads {rank}")
        axes[1].plot(steps, [s["fds"] for s in result["samples"]], "--", label=f"fds {rank}")
    axes[0].set(xlabel="step", ylabel="resident memory (MB)", title="soak: memory")
    axes[1].set(xlabel="step", ylabel="count", title="soak: threads and descriptors")
    for axis in axes:
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(steps: int, every: int, warmup: int, overlap: bool, json_path: str | None = None,
         plot_path: str | None = None, max_growth_mb: float = LIMITS["max_growth_mb"]) -> int:
    from pyreducer.testing import run_ranks

    if warmup >= steps:
        raise ValueError(f"--warmup ({warmup}) must be below --steps ({steps})")
    print(f"soak: {steps} steps at world size 2 ({'overlapped optimizer' if overlap else 'step'})"
          f", sampling every {every}, baseline after {warmup}", flush=True)
    start = time.monotonic()
    per_rank = run_ranks(soak_worker, 2, (steps, every, overlap), timeout_s=120 + steps * 0.1)
    verdict = judge(per_rank, warmup, max_growth_mb)
    for r in verdict["ranks"]:
        print(f"soak: rank {r['rank']}: rss +{r['rss_growth_mb']} MB from step "
              f"{r['baseline_step']} (max +{r['rss_max_growth_mb']}), fds {r['fds'][0]} -> "
              f"{r['fds'][1]}, threads {r['threads'][0]} -> {r['threads'][1]}")
    print(f"soak: {'PASS' if verdict['ok'] else 'FAIL'} {verdict['checks']} "
          f"in {time.monotonic() - start:.0f} s", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(steps=steps, every=every, warmup=warmup, overlap=overlap,
                           max_growth_mb=max_growth_mb, verdict=verdict,
                           samples=[r["samples"] for r in per_rank]), f, indent=1)
    if plot_path:
        plot(per_rank, plot_path)
    return 0 if verdict["ok"] else 1

