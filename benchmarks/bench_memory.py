"""Peak memory with and without gradient_as_bucket_view (pyreducer), 2 local Gloo ranks.

Each configuration runs in fresh processes; a rank reports its peak resident memory (VmHWM) after
a few training steps, minus its resident memory before the model was built, and the bytes of
distinct storages behind param.grad plus the reducer's buckets (what gradients cost).

    python benchmarks/bench_memory.py [--model mlp_large] [--steps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyreducer.testing import run_ranks  # noqa: E402


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(rank, world_size, model_name, steps, as_view, set_to_none):
    import torch

    from pyreducer import DistributedDataParallel
    from pyreducer._ext import _C
    from pyreducer.testing import models

    before_kib = _status_kib("VmRSS")
    spec = models.spec(model_name)
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        spec.loss(model, spec.batch(gen, 32)).backward()
        opt.step()
    storages = {}
    for p in model.parameters():
        if p.grad is not None:
            st = p.grad.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    for flat in model.reducer.bucket_buffers():
        storages[flat.untyped_storage().data_ptr()] = flat.untyped_storage().nbytes()
    return dict(peak_over_start_mib=(_status_kib("VmHWM") - before_kib) / 1024,
                grad_and_bucket_mib=sum(storages.values()) / 2**20,
                param_mib=sum(_C.size_bytes(p) for p in model.parameters()) / 2**20)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp_large")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for set_to_none in (True, False):
        for as_view in (False, True):
            results = run_ranks(memory_worker, 2, timeout_s=300,
                                args=(args.model, args.steps, as_view, set_to_none))
            row = dict(gradient_as_bucket_view=as_view, set_to_none=set_to_none,
                       peak_over_start_mib=max(r["peak_over_start_mib"] for r in results),
                       grad_and_bucket_mib=results[0]["grad_and_bucket_mib"],
                       param_mib=results[0]["param_mib"])
            rows.append(row)
            print(f"zero_grad(set_to_none={set_to_none!s:5}) gradient_as_bucket_view="
                  f"{as_view!s:5}: peak RSS over start {row['peak_over_start_mib']:7.1f} MiB, "
                  f"grads+buckets {row['grad_and_bucket_mib']:6.1f} MiB "
                  f"(parameters {row['param_mib']:.1f} MiB)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, steps=args.steps, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
