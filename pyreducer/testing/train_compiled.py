"""A training script written the way nanoGPT's train.py is, for torchrun (CPU, Gloo):
`torch.compile(model)` and then the wrapper, gradient accumulation through
`require_backward_grad_sync`, gradient clipping, AdamW, and an evaluation on rank 0 alone
(through the wrapper, under no_grad and eval(): no collective may run there).

    torchrun --standalone --nproc-per-node 2 -m pyreducer.testing.train_compiled \\
        --wrapper pyreducer --backend aot_eager

Rank 0 prints `step <i> loss <repr>` per optimizer step and `eval <i> loss <repr>` per
evaluation; tests/multirank/test_compiled_script.py runs it with torch's DDP and with pyreducer's
and compares the curves.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyreducer.testing.models import TinyTransformer


def batch(gen: torch.Generator, size: int, seq: int, vocab: int):
    data = torch.randint(0, vocab, (size, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["torch", "pyreducer"], required=True)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--eval-interval", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if args.wrapper == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from pyreducer import DistributedDataParallel as DDP
    vocab, seq = 512, 32
    torch.manual_seed(1337)  # nanoGPT seeds every rank alike; the data differ by rank
    model = TinyTransformer(vocab=vocab, dim=64, heads=4, layers=3, seq=seq)
    model = torch.compile(model, backend=args.backend)  # nanoGPT: compile, then wrap
    model = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    raw = model.module
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        if step % args.eval_interval == 0 and rank == 0:
            model.eval()
            with torch.no_grad():
                x, y = batch(torch.Generator().manual_seed(7), 8, seq, vocab)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            print(f"eval {step} loss {loss.item()!r}", flush=True)
            model.train()
        for micro in range(args.accumulation):
            model.require_backward_grad_sync = micro == args.accumulation - 1
            x, y = batch(gen, 8, seq, vocab)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item() * args.accumulation!r}", flush=True)
    total = sum(p.double().sum().item() for p in raw.parameters())
    print(f"rank {rank} params {total!r}", flush=True)
    dist.all_reduce(torch.zeros(1))  # a barrier on a CPU tensor: all ranks done before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
