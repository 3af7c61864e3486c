"""Plain DDP (pyreducer's or torch's), one rank per emulated host under torchrun: the baselines of
benchmarks/bench_torchft.py, on torchft_replica's model and data (rank r's batch at step s is
replica r's), logging each step as torchft_replica does (a jsonl line: step, start, end, ...).

Every --checkpoint-every steps rank 0 writes a checkpoint (pyreducer.testing.elastic_train's
save_checkpoint: atomic, with pyreducer's bucket plan); a worker that torchrun restarts
(--max-restarts) resumes from it, replaying the plan. --fail-rank R --fail-step S: rank R's first
life SIGKILLs itself from the first layer's gradient hook at step S (the other buckets'
all-reduces in flight), as torchft_replica's "sigkill". Events (start, kill, checkpoint, with
time.time()) go to rank<R>.events.jsonl beside the step log rank<R>.jsonl in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyreducer.testing.elastic_train import save_checkpoint, wrap  # noqa: E402
from pyreducer.testing.torchft_replica import batch, build_model, build_optimizer  # noqa: E402
from pyreducer.wrapper import teardown  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="logs and checkpoint (shared by the ranks)")
    parser.add_argument("--impl", choices=("pyreducer", "torch"), default="pyreducer")
    parser.add_argument("--model", default="mlp_16mb")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    return parser.parse_args(argv)


def event(path: str, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(dict(fields, time=time.time())) + "\n")


def lives_before(events: str) -> int:
    """How many lives of this rank started before this one (their "start" events)."""
    if not os.path.exists(events):
        return 0
    with open(events) as f:
        return sum(1 for line in f if json.loads(line)["event"] == "start")


def build(args, checkpoint):
    """The model (torchft_replica's, or the checkpoint's state), its wrapper and optimizer."""
    return wrap(build_model(args.model), args, checkpoint, build_optimizer)


def arm_failure(model, args, rank: int, attempt: int, at: dict, events: str) -> None:
    """Rank --fail-rank's first life: SIGKILL from the first layer's gradient hook at
    --fail-step (the first layer's bucket is the last launched)."""
    if attempt != 0 or rank != args.fail_rank:
        return

    def hook(grad):
        if at["step"] == args.fail_step:
            event(events, event="kill", step=at["step"], attempt=attempt)
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model.module[0].weight.register_hook(hook)


def train(args, model, optimizer, start: int, rank: int, attempt: int, events: str) -> None:
    at = dict(step=start)
    arm_failure(model, args, rank, attempt, at, events)
    world = dist.get_world_size()
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    with open(os.path.join(args.out, f"rank{rank}.jsonl"), "a") as log:
        for step in range(start, args.steps):
            at["step"] = step
            started = time.time()
            optimizer.zero_grad()
            x, y = batch(rank, step, args.model)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            log.write(json.dumps(dict(replica=rank, attempt=attempt, step=step,
                                      participants=world, participating=True, committed=True,
                                      loss=loss.item(), start=started, end=time.time())) + "\n")
            log.flush()
            if (step + 1) % args.checkpoint_every == 0 and rank == 0:
                save_checkpoint(checkpoint, model, optimizer, step + 1, args.impl)
                event(events, event="checkpoint", steps_done=step + 1, attempt=attempt)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    events = os.path.join(args.out, f"rank{os.environ.get('RANK', '0')}.events.jsonl")
    # this rank's life: torchrun's TORCHELASTIC_RESTART_COUNT counts only the restarts of the
    # failed host's agent (the others restart their workers as a membership change)
    attempt = lives_before(events)
    event(events, event="start", attempt=attempt)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    teardown.settle_gloo_threads_at_exit(dist.group.WORLD)  # as elastic_train: Gloo at exit
    rank = dist.get_rank()
    path = os.path.join(args.out, "checkpoint.pt")
    checkpoint = torch.load(path, weights_only=False) if os.path.exists(path) else None
    start = checkpoint["steps_done"] if checkpoint is not None else 0
    model, optimizer = build(args, checkpoint)
    event(events, event="resume", attempt=attempt, step=start)
    train(args, model, optimizer, start, rank, attempt, events)
    dist.all_reduce(torch.zeros(1))  # every rank done before the group is torn down
    del model, optimizer  # before the group: see elastic_train.main
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
