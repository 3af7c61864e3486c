"""`python -m pyreducer demo`: 2 local Gloo ranks train one model with torch DDP and with
pyreducer from the same seed; prints per-step loss and time of both, then the parity result and
the median step-time ratio."""
from __future__ import annotations

import torch

from pyreducer.tools.compare import compare_worker, summarize
from pyreducer.observe.report import write_report
from pyreducer.testing import run_ranks


def main(nproc: int = 2, steps: int = 20, warmup: int = 3, model: str = "demo",
         bucket_cap_mb: float | None = None, out: str = "run/demo") -> int:
    print(f"pyreducer demo: {nproc} Gloo ranks on this machine, model '{model}', "
          f"{warmup} warm-up + {steps} steps, torch {torch.__version__}")
    print("per-step loss and time on rank 0 (torch DDP | pyreducer):", flush=True)
    results = run_ranks(compare_worker, nproc, timeout_s=600,
                        args=(model, steps, warmup, 32, bucket_cap_mb, True, 5))
    worst = max(r["max_param_diff"] for r in results)
    identical = all(all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"]))
                    for r in results[1:])
    ours = summarize(results[0]["pyreducer"]["seconds"])
    theirs = summarize(results[0]["torch"]["seconds"])
    ratio = ours["median_ms"] / theirs["median_ms"]
    print()
    print(f"parity: max |pyreducer - torch DDP| over all parameters and ranks = {worst:.3g} "
          f"({'PASS' if worst <= 1e-6 else 'FAIL'}, tolerance 1e-6); "
          f"parameters bitwise identical across ranks: {identical}")
    print(f"median step time on rank 0: torch DDP {theirs['median_ms']:.1f} ms, "
          f"pyreducer {ours['median_ms']:.1f} ms, ratio pyreducer / torch DDP = {ratio:.3f}")
    report = write_report(results[0]["timelines"], out, profile=results[0]["profile"])
    print()
    print(report["summary"])
    paths = report["paths"]
    print(f"timeline of pyreducer's last 5 steps on every rank: {paths['trace.json']} "
          f"(open in https://ui.perfetto.dev or chrome://tracing)"
          + (f", plots {paths['gantt.png']} and {paths['overlap.png']}" if "gantt.png" in paths
             else "") + f", step profile {paths['profile.json']} (python -m pyreducer "
          f"simulate --profile {out})")
    for note in report["notes"]:
        print(note)
    return 0 if worst <= 1e-6 and identical else 1
