"""Fused bucket copy-in/copy-out (torch.ops.pyreducer.bucket_copy_in/out) vs one copy per tensor.

Cases: a bucket of 500 small gradients (1,000 floats each) and one of 4 large ones (1M floats).
Per-tensor reference: slot.copy_(grad) then one flat div_ (torch DDP's batched_grad_copy), and
slot.mul_out per tensor (DDP's default copy-in); copy-out: grad.copy_(slot) per tensor.
Results are checked equal before timing; median and quartiles of REPEATS timings of one bucket.

    python benchmarks/bench_copy.py [--device cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import pyreducer  # noqa: E402, F401

REPEATS = 200
CASES = {"500 small (1k floats)": [1000] * 500, "4 large (1M floats)": [1_000_000] * 4}


def _time(fn, device):
    for _ in range(10):
        fn()
    samples = []
    for _ in range(REPEATS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    q = statistics.quantiles(samples, n=4)
    return dict(median_us=statistics.median(samples), p25_us=q[0], p75_us=q[2])


def bench_case(sizes, device, divisor=2.0):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(device) for n in sizes]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    flat = torch.empty(sum(sizes), device=device)
    slots = [flat[o:o + g.numel()] for g, o in zip(grads, offsets)]
    factor = torch.tensor(1.0 / divisor, dtype=torch.float64)

    def fused_in():
        torch.ops.pyreducer.bucket_copy_in(flat, grads, offsets, divisor)

    def per_tensor_in_batched():  # DDP batched_grad_copy: copies, then one div_
        for s, g in zip(slots, grads):
            s.copy_(g)
        flat.div_(divisor)

    def per_tensor_in_scaled():  # DDP default: one mul_out per gradient as it arrives
        for s, g in zip(slots, grads):
            torch.mul(g, factor.item(), out=s)

    def fused_out():
        torch.ops.pyreducer.bucket_copy_out(flat, grads, offsets)

    def per_tensor_out():
        for s, g in zip(slots, grads):
            g.copy_(s)

    fused_in()
    expected = torch.cat([g / divisor for g in grads])
    if not torch.equal(flat, expected):
        raise SystemExit("fused copy-in disagrees with the reference; not timing")
    return {"copy_in_fused": _time(fused_in, device),
            "copy_in_per_tensor_then_div": _time(per_tensor_in_batched, device),
            "copy_in_per_tensor_mul": _time(per_tensor_in_scaled, device),
            "copy_out_fused": _time(fused_out, device),
            "copy_out_per_tensor": _time(per_tensor_out, device)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = dict(environment=dict(torch=torch.__version__, device=args.device,
                                   threads=args.threads, cores=os.cpu_count(),
                                   machine=platform.machine(), repeats=REPEATS), cases={})
    for name, sizes in CASES.items():
        result = bench_case(sizes, args.device)
        report["cases"][name] = result
        print(f"== {name}")
        for variant, t in result.items():
            print(f"   {variant:30s} {t['median_us']:10.1f} us  [{t['p25_us']:.1f}, {t['p75_us']:.1f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
