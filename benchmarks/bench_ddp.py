"""pyreducer vs torch DDP at the same bucket cap, on local Gloo ranks (loopback).

For each model both wrappers train interleaved on the same ranks (see pyreducer/tools/compare.py); the
script first checks that their parameters agree, then reports the median and spread of the
step time on every rank and the ratio pyreducer / torch DDP (computed per rank from medians;
the reported ratio is the worst rank's).

    python benchmarks/bench_ddp.py --json out.json [--models mlp_large,deep_narrow] [--steps 40]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pyreducer.tools.compare import compare_worker, summarize  # noqa: E402
from pyreducer.testing import run_ranks  # noqa: E402


def environment(nproc: int) -> dict:
    return dict(torch=torch.__version__, python=platform.python_version(),
                machine=platform.machine(), cores=os.cpu_count(), ranks=nproc,
                threads_per_rank=1, backend="gloo", link="loopback (127.0.0.1)",
                date=time.strftime("%Y-%m-%d %H:%M:%S"))


def bench_model(model, nproc, steps, warmup, batch, bucket_cap_mb):
    print(f"== {model}: {nproc} ranks, {warmup} warm-up + {steps} interleaved steps, "
          f"bucket_cap_mb={bucket_cap_mb}", flush=True)
    results = run_ranks(compare_worker, nproc, timeout_s=1200,
                        args=(model, steps, warmup, batch, bucket_cap_mb, False))
    worst_diff = max(r["max_param_diff"] for r in results)
    if worst_diff > 1e-6:
        raise SystemExit(f"{model}: results disagree (max param diff {worst_diff:.3g}); not timing")
    per_rank = []
    for rank, r in enumerate(results):
        theirs, ours = summarize(r["torch"]["seconds"]), summarize(r["pyreducer"]["seconds"])
        per_rank.append(dict(rank=rank, torch_ddp=theirs, pyreducer=ours,
                             ratio=ours["median_ms"] / theirs["median_ms"]))
        print(f"   rank {rank}: torch DDP {theirs['median_ms']:8.2f} ms "
              f"[{theirs['p25_ms']:.2f}, {theirs['p75_ms']:.2f}]   pyreducer "
              f"{ours['median_ms']:8.2f} ms [{ours['p25_ms']:.2f}, {ours['p75_ms']:.2f}]   "
              f"ratio {per_rank[-1]['ratio']:.3f}", flush=True)
    return dict(model=model, max_param_diff=worst_diff, per_rank=per_rank,
                ratio=max(p["ratio"] for p in per_rank))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp_large,deep_narrow")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="same cap for both (default: DDP's default, 25 MiB)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    report = dict(environment=environment(args.nproc), bucket_cap_mb=args.bucket_cap_mb,
                  results=[bench_model(m, args.nproc, args.steps, args.warmup, args.batch,
                                       args.bucket_cap_mb) for m in args.models.split(",")])
    print("\nmodel            ratio pyreducer / torch DDP (median step time, worst rank)")
    for r in report["results"]:
        print(f"{r['model']:16s} {r['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
