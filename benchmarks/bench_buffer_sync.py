"""How long the next forward waits for the buffers' broadcast under an overlapped optimizer: on
a second process group (pyreducer: Note [Buffers beside deferred reductions] in
pyreducer/wrapper/sync.py) against on the wrapper's own group, behind the previous backward's
reductions still in flight there (the A/B switch: the wrapper's `_buffer_group` set to None).

vgg_bn (VGG-like with BatchNorm, 10 MB of gradients) with a fixed schedule of 2 MB chunks (the
overlap always on: no tuner to fall back to the barrier), rounds alternating the two, each a
whole loop of steps; the broadcast's wait is timed around the wrapper's buffer sync, on every
rank, and the slowest rank's loop counts. Run on emulated hosts (pyreducer.tools.netem):

    python -m pyreducer netem --hosts 2 --rate 1gbit -- \\
        .venv/bin/python benchmarks/bench_buffer_sync.py --json out.json
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

from benchmarks.bench import cpu_model  # noqa: E402
from pyreducer import DistributedDataParallel  # noqa: E402
from pyreducer.testing import models  # noqa: E402

CHUNK_MB = 2


def build(side: bool):
    torch.manual_seed(0)
    spec = models.spec("vgg_bn")
    model = DistributedDataParallel(spec.build())
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  schedule=CHUNK_MB)
    if not side:
        model._buffer_group = None  # the broadcast queues behind the reductions in flight
    waits = []
    sync_buffers = model._sync_buffers

    def timed():
        start = time.perf_counter()
        sync_buffers()
        waits.append(time.perf_counter() - start)

    model._sync_buffers = timed
    return spec, model, opt, waits


def loop(spec, model, opt, gen, batch: int, steps: int) -> float:
    """Mean step (s) of `steps` back to back, the slowest rank's (the last updates included)."""
    batches = [spec.batch(gen, batch) for _ in range(steps)]
    dist.barrier()
    start = time.perf_counter()
    for x in batches:
        spec.loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    mean = torch.tensor([(time.perf_counter() - start) / steps])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return mean.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=models.BENCH_BATCH["vgg_bn"])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    built = {side: build(side) for side in (True, False)}
    gens = {side: torch.Generator().manual_seed(rank) for side in built}
    steps = {side: [] for side in built}
    for side, (spec, model, opt, waits) in built.items():  # warm-up: the rebuild, then steady
        loop(spec, model, opt, gens[side], args.batch, 3)
        waits.clear()
    for r in range(args.rounds):
        for side in ((True, False) if r % 2 == 0 else (False, True)):
            spec, model, opt, _ = built[side]
            steps[side].append(loop(spec, model, opt, gens[side], args.batch, args.steps))
            if rank == 0:
                print(f"round {r + 1}/{args.rounds} {'second group' if side else 'own group'}:"
                      f" {steps[side][-1] * 1e3:.1f} ms/step", flush=True)
    result = {}
    for side, (_, model, _, waits) in built.items():
        name = "second_group" if side else "own_group"
        result[name] = dict(step_ms=[s * 1e3 for s in steps[side]],
                            median_step_ms=statistics.median(steps[side]) * 1e3,
                            broadcast_wait_ms=statistics.median(waits) * 1e3,
                            broadcasts=len(waits))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        doc = dict(environment=dict(torch=torch.__version__, cores=os.cpu_count(), cpu=cpu_model(),
                                    hosts=dist.get_world_size(), chunk_mb=CHUNK_MB,
                                    batch=args.batch, steps=args.steps, rounds=args.rounds,
                                    date=time.strftime("%Y-%m-%d %H:%M:%S")),
                   ranks=gathered)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        for name in ("second_group", "own_group"):
            print(f"{name}: median step {result[name]['median_step_ms']:.1f} ms; broadcast wait "
                  f"per rank (median) " + ", ".join(f"{g[name]['broadcast_wait_ms']:.1f} ms"
                                                    for g in gathered), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
