"""A small Accelerate training run under torchrun (2 CPU processes, Gloo), with Accelerate's own
Accelerator (torch DDP) or pyreducer's (tests/multirank/test_accelerate.py runs it both ways and
compares):

    torchrun --standalone --nproc-per-node 2 -m pyreducer.testing.train_accelerate \
        --accelerator pyreducer --out run.pt [--accumulate 2] [--trigger] [--steps 12] \
        [--save DIR] [--resume DIR]

--accumulate N: `accelerator.accumulate(model)` with gradient_accumulation_steps=N.
--trigger: Accelerate's trigger_sync_in_backward pattern, two forwards under no_sync and the
second loss's backward synchronised; at the end, pyreducer's Accelerator is also given a
trigger_sync_in_backward with a plain loss.backward() inside, whose error is recorded.
--save / --resume: `save_state` after the run, `load_state` before it (the data loader skips the
batches already seen). Rank 0 writes {"losses", "params"
(from unwrap_model), "wrapper", "saved_keys" (of save_model), "misuse"} to --out.
"""
from __future__ import annotations

import argparse
import gc
import os

import torch
from torch import nn

from pyreducer.wrapper import teardown


def _data(samples: int = 1024):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    y = torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(samples, 4, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def _accelerator(which: str, accumulate: int):
    if which == "torch":
        from accelerate import Accelerator
    else:
        from pyreducer.accelerate import Accelerator
    return Accelerator(cpu=True, gradient_accumulation_steps=accumulate)


def _step(accelerator, model, opt, batch, losses, trigger: bool) -> None:
    x, y = batch
    if trigger:  # Accelerate's documented pattern: two forwards, the second backward syncs
        half = x.shape[0] // 2
        with accelerator.no_sync(model):
            loss_a = nn.functional.mse_loss(model(x[:half]), y[:half])
            loss_b = nn.functional.mse_loss(model(x[half:]), y[half:])
        accelerator.backward(loss_a)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        losses.append((loss_a.item() + loss_b.item()) / 2)
    else:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return
    opt.step()
    opt.zero_grad()


def _misuse(accelerator, model, batch) -> str | None:
    """A backward inside trigger_sync_in_backward that is not accelerator.backward: the error."""
    x, y = batch
    with accelerator.no_sync(model):
        loss = nn.functional.mse_loss(model(x), y)
    try:
        with accelerator.trigger_sync_in_backward(model):
            loss.backward()
    except RuntimeError as error:
        return str(error)
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accelerator", choices=["torch", "pyreducer"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--trigger", action="store_true")
    parser.add_argument("--steps", type=int, default=12, help="batches per rank")
    parser.add_argument("--save", help="save_state here at the end")
    parser.add_argument("--resume", help="load_state from here first")
    args = parser.parse_args(argv)

    accelerator = _accelerator(args.accelerator, args.accumulate)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    done = 0
    if args.resume:
        accelerator.load_state(args.resume)
        done = int(open(os.path.join(args.resume, "batches_done")).read())
        loader = accelerator.skip_first_batches(loader, done)
    losses = []
    for index, batch in enumerate(loader):
        if done + index >= args.steps:
            break
        _step(accelerator, model, opt, batch, losses, args.trigger)
    misuse = None
    if args.trigger and args.accelerator == "pyreducer":
        misuse = _misuse(accelerator, model, batch)
        opt.zero_grad()
    if args.save:
        accelerator.save_state(args.save)
        if accelerator.is_main_process:
            with open(os.path.join(args.save, "batches_done"), "w") as f:
                f.write(str(args.steps))
    accelerator.wait_for_everyone()
    saved_dir = args.out + ".model"
    accelerator.save_model(model, saved_dir, safe_serialization=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        saved = torch.load(os.path.join(saved_dir, "pytorch_model.bin"))
        torch.save(dict(losses=losses, wrapper=type(model).__module__,
                        unwrapped=type(unwrapped).__name__, saved_keys=sorted(saved), misuse=misuse,
                        params={k: v.detach().clone() for k, v in unwrapped.state_dict().items()}),
                   args.out)
    accelerator.wait_for_everyone()  # all ranks done before Gloo is torn down
    teardown.settle_gloo_threads_at_exit(torch.distributed.group.WORLD)  # torch DDP's runs too
    # The wrapper goes before the group (as in train_hf_trainer.py: torch DDP's Reducer holding
    # the last reference to the group can hang at exit).
    accelerator.free_memory()
    del model, opt
    gc.collect()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
