"""Cost of timeline recording: pyreducer with recording on (the default timeline_iterations)
vs off (0), interleaved on the same 2 local Gloo ranks, after checking both give the same
parameters. Reports median step times and the overhead in percent (per rank, worst rank).

    python benchmarks/bench_timeline_overhead.py [--models deep_narrow,mlp_large] [--json out.json]

The recording work alone is timed by the C++ program benchmarks/cpp/timeline_recording.cpp
(built by `make cpp-test` as build/cmake/bench_timeline_recording).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyreducer.tools.compare import compare_worker, summarize  # noqa: E402
from pyreducer.testing import run_ranks  # noqa: E402

RECORDING_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "cmake",
                               "bench_timeline_recording")
VARIANTS = (("recording_off", "pyreducer", dict(timeline_iterations=0)),
            ("recording_on", "pyreducer", {}))  # the default timeline_iterations


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deep_narrow,mlp_large",
                        help="comma-separated models of pyreducer.testing.models")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--recording-bench", default=RECORDING_BENCH,
                        help="the C++ recording benchmark (make cpp-test builds it)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.recording_bench):
        raise SystemExit(f"{args.recording_bench} not found: build it with `make cpp-test`")
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
        from pyreducer.testing import models

        num_params = len(list(models.spec(model).build().parameters()))
        num_buckets = len(results[0]["plan"])
        cost_ns = float(subprocess.run([args.recording_bench, str(num_params), str(num_buckets),
                                        "2000"], check=True, capture_output=True,
                                       text=True).stdout)
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
