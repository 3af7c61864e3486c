"""Cost of check_finite=True: pyreducer with the check on vs off, interleaved step by step on the
same 2 local Gloo ranks (loopback: communication is cheap, so the check's share of a step is at
its largest here), after checking both give the same parameters. Reports the paired median
ratio (on / off) with a 95% bootstrap interval, per rank; the issue's target is < 2%.

    python benchmarks/bench_check_finite.py [--models deep_narrow,mlp_large] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pyreducer.testing import run_ranks  # noqa: E402
from pyreducer.tools.compare import compare_worker, paired_ratio, summarize  # noqa: E402

VARIANTS = (("check_off", "pyreducer", {}), ("check_on", "pyreducer", dict(check_finite=True)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deep_narrow,mlp_large,transformer",
                        help="comma-separated models of pyreducer.testing.models")
    parser.add_argument("--steps", type=int, default=80, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        print(f"{model}: {args.steps} steps of each variant, interleaved ...", flush=True)
        results = run_ranks(compare_worker, 2, timeout_s=1800,
                            args=(model, args.steps, args.warmup, 32, None, False, 0, VARIANTS))
        if max(r["max_param_diff"] for r in results) != 0.0:
            raise SystemExit(f"{model}: check_finite changed the results")
        per_rank = []
        for rank, r in enumerate(results):
            on_ms = [s * 1e3 for s in r["check_on"]["seconds"]]
            off_ms = [s * 1e3 for s in r["check_off"]["seconds"]]
            ratio = paired_ratio(on_ms, off_ms)
            per_rank.append(dict(rank=rank, off=summarize(r["check_off"]["seconds"]),
                                 on=summarize(r["check_on"]["seconds"]), ratio=ratio))
            print(f"{model:12s} rank {rank}: off {per_rank[-1]['off']['median_ms']:7.2f} ms  on "
                  f"{per_rank[-1]['on']['median_ms']:7.2f} ms  on/off {ratio['ratio']:.4f} "
                  f"(95% {ratio['ci95'][0]:.4f}-{ratio['ci95'][1]:.4f})", flush=True)
        rows.append(dict(model=model, buckets=len(results[0]["plan"]), per_rank=per_rank,
                         overhead_pct=100 * (max(p["ratio"]["ratio"] for p in per_rank) - 1)))
    env = dict(torch=torch.__version__, python=platform.python_version(), cores=os.cpu_count(),
               link="loopback", world_size=2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(steps=args.steps, env=env, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
