"""A training script for torchrun across hosts, with the checkpoint-and-resume recipe of the
docs/pages/guides/many-hosts.md ("Restart with nothing lost"): run it with torchrun on every host,

    torchrun --nnodes=4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 \\
        --max-restarts=1 -m pyreducer.testing.elastic_train --out DIR

(tests/netem/test_torchrun.py does, once per emulated host). A DistributedSampler feeds a small
MLP trained with SGD and momentum. Every `--checkpoint-every` steps rank 0 writes, atomically,
everything the next attempt needs to continue exactly: the module's state, the optimizer's state,
the number of steps done (the data position follows from it) and pyreducer's bucket plan. When
torchrun restarts the workers, each resumes from that checkpoint and replays the bucket plan
(`bucket_plan=`), so that the restarted run sums each gradient in the same order as the
uninterrupted one and ends bit for bit equal to it. `--die-rank R --die-at-step S` makes rank R
leave with os._exit(1) after the backward of step S, once per output folder (a marker file).
At the end each rank writes its parameters to DIR/final_rank<R>.pt.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pyreducer.wrapper import teardown

CHECKPOINT = "checkpoint.pt"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint and result folder (shared)")
    parser.add_argument("--impl", choices=("pyreducer", "torch"), default="pyreducer")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.01)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-at-step", type=int, default=-1)
    return parser.parse_args(argv)


def build(args, checkpoint):
    """The model (seed 0, or the checkpoint's state), its wrapper and optimizer."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                 torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return wrap(module, args, checkpoint,
                lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False))


def wrap(module, args, checkpoint, make_optimizer):
    """`module` (the checkpoint's state loaded into it) wrapped as args.impl says (pyreducer's
    wrapper replaying the checkpoint's bucket plan, or torch DDP), and its optimizer
    (make_optimizer(parameters), the checkpoint's state loaded)."""
    if checkpoint is not None:
        module.load_state_dict(checkpoint["model"])
    if args.impl == "pyreducer":
        from pyreducer import DistributedDataParallel
        plan = checkpoint["bucket_plan"] if checkpoint is not None else None
        model = DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb, bucket_plan=plan)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = make_optimizer(model.parameters())
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    return model, optimizer


def batches(start_step: int, batch_size: int = 8):
    """(step, (x, y)) from start_step on: the same batches, in the same order, whatever step an
    attempt starts at (epochs through DistributedSampler.set_epoch)."""
    gen = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(96, 32, generator=gen), torch.randn(96, 4, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    steps_per_epoch = len(loader)
    for epoch in itertools.count(start_step // steps_per_epoch):
        sampler.set_epoch(epoch)
        skip = start_step - epoch * steps_per_epoch if epoch * steps_per_epoch < start_step else 0
        for index, batch in enumerate(itertools.islice(loader, skip, None), start=skip):
            yield epoch * steps_per_epoch + index, batch


def save_checkpoint(path: str, model, optimizer, steps_done: int, impl: str) -> None:
    """Rank 0 writes the checkpoint atomically: a temporary file, flushed to disk, renamed over
    the old one (a reader sees the old checkpoint or the new one, never half of one)."""
    state = dict(model=model.module.state_dict(), optimizer=optimizer.state_dict(),
                 steps_done=steps_done,
                 bucket_plan=model.bucket_plan() if impl == "pyreducer" else None)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def die_once(args, rank: int, step: int) -> None:
    marker = os.path.join(args.out, "died")
    if rank == args.die_rank and step == args.die_at_step and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"rank {rank} left after the backward of step {step}\n")
        os._exit(1)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # torch DDP's run too: torch's Gloo can abort at exit (see pyreducer/wrapper/teardown.py)
    teardown.settle_gloo_threads_at_exit(dist.group.WORLD)
    rank = dist.get_rank()
    path = os.path.join(args.out, CHECKPOINT)
    checkpoint = torch.load(path, weights_only=False) if os.path.exists(path) else None
    start = checkpoint["steps_done"] if checkpoint is not None else 0
    model, optimizer = build(args, checkpoint)
    for step, (x, y) in itertools.takewhile(lambda item: item[0] < args.steps, batches(start)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        die_once(args, rank, step)
        optimizer.step()
        if (step + 1) % args.checkpoint_every == 0 and rank == 0:
            save_checkpoint(path, model, optimizer, step + 1, args.impl)
    torch.save({name: p.detach().clone() for name, p in model.module.named_parameters()},
               os.path.join(args.out, f"final_rank{rank}.pt"))
    with open(os.path.join(args.out, f"info_rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world_size=dist.get_world_size(), resumed_at_step=start,
                       hostname=socket.gethostname(),
                       interface=os.environ.get("GLOO_SOCKET_IFNAME", ""),
                       restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))), f)
    dist.all_reduce(torch.zeros(1))  # every rank done before the group is torn down
    # The model goes while the group is still registered: torch DDP's Reducer, left holding the
    # last reference to the group, destroys it with the GIL held and can wait forever for a Gloo
    # worker that waits for the GIL (see Note [Letting the Reducer go without the GIL] in
    # csrc/bindings.cpp; pyreducer's own Reducer lets go without the GIL).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
