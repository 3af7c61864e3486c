"""What the overlapped optimizer costs where its tuner keeps torch DDP's step barrier: pyreducer
with the plain optimizer against the same model, buckets and data with `overlap_optimizer`
held at the barrier (its hooks on every module stay installed), on 2 local Gloo ranks
(loopback: compute-bound, so any per-forward cost shows), after which all must hold the same
parameters; a third variant waits for the buffers' broadcast at the forward's start instead of
where a buffer is read. Blocks of steps alternate, the order
reversed every round; the ratio is the median of the paired blocks' ratios (rank 0's clock).

    python benchmarks/bench_barrier_cost.py [--model hf_bert] [--steps 6] [--rounds 8] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CAP_MB = 2.0  # every variant: fixed caps, so that only the optimizer differs
VARIANTS = ("plain", "overlapped_at_barrier", "overlapped_sync_buffers")


def _worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec(args.model)
    batch = args.batch or models.BENCH_BATCH.get(args.model, 8)
    built = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = DistributedDataParallel(spec.build(), bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if name != "plain":
            opt = model.overlap_optimizer(opt, schedule="fifo")
            opt._set_barrier(True)  # what the schedule tuner does when it keeps the barrier
            if name == "overlapped_sync_buffers":  # the buffers' broadcast waited at the start
                model._buffer_broadcast = None     # (on the side group), not where read
        built[name] = (model, opt)
    # the same batches for every variant, so that they must end with the same parameters (checked)
    gens = {name: torch.Generator().manual_seed(rank) for name in built}

    def block(name: str, steps: int) -> float:
        model, opt = built[name]
        batches = [spec.batch(gens[name], batch) for _ in range(steps)]
        dist.barrier()
        start = time.perf_counter()
        for b in batches:
            opt.zero_grad()
            spec.loss(model, b).backward()
            opt.step()
        return (time.perf_counter() - start) / steps * 1e3

    for name in built:
        block(name, args.warmup)
    times = {name: [] for name in built}
    for r in range(args.rounds):
        for name in (list(built) if r % 2 == 0 else list(built)[::-1]):
            times[name].append(block(name, args.steps))
    same = all(torch.equal(a, b) for name in VARIANTS[1:]
               for a, b in zip(built["plain"][0].parameters(), built[name][0].parameters()))
    if rank == 0:
        pairs = {name: [b / a for a, b in zip(times["plain"], times[name])]
                 for name in VARIANTS[1:]}
        with open(out, "w") as f:
            json.dump(dict(model=args.model, batch=batch, cap_mb=CAP_MB, steps=args.steps,
                           rounds=args.rounds, times_ms=times, pair_ratios=pairs,
                           ratio={k: statistics.median(v) for k, v in pairs.items()},
                           same_parameters=same, torch=torch.__version__), f, indent=1)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf_bert")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    out = args.json or os.path.join("/tmp", f"bench_barrier_cost_{os.getpid()}.json")
    print(f"[{args.model}] {args.rounds} rounds of {args.steps}-step blocks, 2 local ranks",
          flush=True)
    mp.spawn(_worker, args=(args, 29600 + os.getpid() % 300, out), nprocs=2)
    with open(out) as f:
        result = json.load(f)
    print(f"plain {statistics.median(result['times_ms']['plain']):.1f} ms; same parameters: "
          f"{result['same_parameters']}")
    for name in VARIANTS[1:]:
        print(f"{name} {statistics.median(result['times_ms'][name]):.1f} ms; paired ratio to "
              f"plain {result['ratio'][name]:.3f} (blocks: "
              f"{', '.join(f'{p:.3f}' for p in result['pair_ratios'][name])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
