"""Cost of timeline recording: pyreducer with recording on (timeline_iterations=8, the default)
vs off (0), interleaved on the same 2 local Gloo ranks, after checking both give the same
parameters. Reports median step times and the overhead in percent (per rank, worst rank).

    python benchmarks/bench_timeline_overhead.py [--models deep_narrow,mlp_large] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyreducer.bench import compare_worker, summarize  # noqa: E402
from pyreducer.testing import run_ranks  # noqa: E402

VARIANTS = (("recording_off", "pyreducer", dict(timeline_iterations=0)),
            ("recording_on", "pyreducer", dict(timeline_iterations=8)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deep_narrow,mlp_large")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        results = run_ranks(compare_worker, 2, timeout_s=1200,
                            args=(model, args.steps, args.warmup, 32, None, False, 0, VARIANTS))
        if max(r["max_param_diff"] for r in results) != 0.0:
            raise SystemExit(f"{model}: recording changed the results")
        per_rank = []
        for rank, r in enumerate(results):
            off, on = summarize(r["recording_off"]["seconds"]), summarize(r["recording_on"]["seconds"])
            per_rank.append(dict(rank=rank, off=off, on=on,
                                 overhead_pct=100 * (on["median_ms"] / off["median_ms"] - 1)))
            print(f"{model:12s} rank {rank}: off {off['median_ms']:7.2f} ms  on "
                  f"{on['median_ms']:7.2f} ms  overhead {per_rank[-1]['overhead_pct']:+.2f}%",
                  flush=True)
        # Direct: the recording work alone, for this model's parameter and bucket counts.
        from pyreducer import models
        from pyreducer._ext import _C

        num_params = len(list(models.spec(model).build().parameters()))
        num_buckets = len(results[0]["plan"])
        cost_ns = _C.measure_recording_cost_ns(num_params, num_buckets, 2000)
        step_ms = min(p["off"]["median_ms"] for p in per_rank)
        direct_pct = 100 * cost_ns / (step_ms * 1e6)
        print(f"{model:12s} direct: recording costs {cost_ns / 1e3:.2f} us per iteration "
              f"({num_params} params, {num_buckets} buckets) = {direct_pct:.4f}% of a "
              f"{step_ms:.1f} ms step", flush=True)
        rows.append(dict(model=model, per_rank=per_rank, num_params=num_params,
                         num_buckets=num_buckets, recording_cost_us=cost_ns / 1e3,
                         direct_overhead_pct=direct_pct,
                         end_to_end_overhead_pct=max(p["overhead_pct"] for p in per_rank)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(steps=args.steps, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
