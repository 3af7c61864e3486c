"""A small Accelerate training run under torchrun (2 CPU processes, Gloo), with Accelerate's own
Accelerator (torch DDP) or pyreducer's (tests/multirank/test_accelerate.py runs it both ways and
compares):

    torchrun --standalone --nproc-per-node 2 -m pyreducer.testing.train_accelerate \
        --accelerator pyreducer --out run.pt [--accumulate 2] [--trigger] [--steps 12] \
        [--save DIR [--save-at K]] [--resume DIR] [--overlap overlap|shard] [--adamw] \
        [--scheduler] [--clip-norm X] [--clip-value V] [--clip-subset X] \
        [--mixed-precision bf16] [--optimizer-first] [--misuse-shard]

--accumulate N: `accelerator.accumulate(model)` with gradient_accumulation_steps=N.
--trigger: Accelerate's trigger_sync_in_backward pattern, two forwards under no_sync and the
second loss's backward synchronised; at the end, pyreducer's Accelerator is also given a
trigger_sync_in_backward with a plain loss.backward() inside, whose error is recorded.
--save / --resume: `save_state` after the run (after K batches with --save-at K, the run going
on), `load_state` before it (the data loader skips the batches already seen).
--overlap: pyreducer's Accelerator with ddp_options {"overlap_optimizer": True} or
{"shard": True}. --adamw: AdamW with two param groups (weights with weight decay, then biases
without: not model.parameters()'s order); --scheduler: a warm-up LambdaLR built on the plain
optimizer and prepared with it. On the steps that synchronise: --clip-value V
`accelerator.clip_grad_value_(model.parameters(), V)`, --clip-subset X
`accelerator.clip_grad_norm_(first layer's parameters, X)`, then --clip-norm X
`accelerator.clip_grad_norm_(model.parameters(), X)`; the norms returned are recorded.
--optimizer-first: prepare(optimizer, model, loader, scheduler). --misuse-shard: at the end,
what pyreducer's Accelerator refuses with shard=True, each error recorded.
Rank 0 writes {"losses", "params" (from unwrap_model), "wrapper", "unwrapped", "saved_keys" (of
save_model), "misuse", "norms", "subset_norms", "lrs", "optimizer" (the class the
AcceleratedOptimizer wraps), "updates_in_forward" (the overlapped optimizer's bucket updates run
during a forward)} to --out.
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


def _accelerator(args):
    options = dict(cpu=True, gradient_accumulation_steps=args.accumulate)
    if args.mixed_precision:
        options["mixed_precision"] = args.mixed_precision
    if args.accelerator == "torch":
        from accelerate import Accelerator
        return Accelerator(**options)
    from pyreducer.accelerate import Accelerator
    ddp_options = {"overlap": {"overlap_optimizer": True}, "shard": {"shard": True}}
    return Accelerator(**options, ddp_options=ddp_options.get(args.overlap, {}))


def _optimizer(model, adamw: bool):
    if not adamw:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    return torch.optim.AdamW([{"params": weights, "weight_decay": 0.01},
                              {"params": biases, "weight_decay": 0.0}], lr=0.01)


def _step(accelerator, model, opt, scheduler, batch, record, args) -> None:
    x, y = batch
    if args.trigger:  # Accelerate's documented pattern: two forwards, the second backward syncs
        half = x.shape[0] // 2
        with accelerator.no_sync(model):
            loss_a = nn.functional.mse_loss(model(x[:half]), y[:half])
            loss_b = nn.functional.mse_loss(model(x[half:]), y[half:])
        accelerator.backward(loss_a)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        record["losses"].append((loss_a.item() + loss_b.item()) / 2)
        opt.step()
        opt.zero_grad()
        return
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        record["losses"].append(loss.item())
        if accelerator.sync_gradients:
            _clip(accelerator, model, record, args)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
    if accelerator.sync_gradients:
        record["lrs"].append([group["lr"] for group in opt.param_groups])


def _clip(accelerator, model, record, args) -> None:
    if args.clip_value:
        accelerator.clip_grad_value_(model.parameters(), args.clip_value)
    if args.clip_subset:
        first = accelerator.unwrap_model(model)[0]
        record["subset_norms"].append(
            accelerator.clip_grad_norm_(first.parameters(), args.clip_subset).clone())
    if args.clip_norm:
        record["norms"].append(
            accelerator.clip_grad_norm_(model.parameters(), args.clip_norm).clone())


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


def _misuse_shard(accelerator, model, opt, batch) -> dict:
    """What pyreducer's Accelerator (and the sharded optimizer's clip) refuses with shard=True
    (each error's message; None where nothing was refused). No step is taken: the parameters
    stay those of the run."""
    errors = dict(second_optimizer=None, clip_subset=None, grad_scaler=None, clip_order=None)
    try:
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as error:
        errors["second_optimizer"] = str(error)
    # Accelerate makes a GradScaler for fp16 on GPUs only (on CPU, fp16 makes none): given one
    # as it would there, an optimizer prepared with shard=True
    accelerator.scaler = torch.amp.GradScaler("cpu")
    try:
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as error:
        errors["grad_scaler"] = str(error)
    finally:
        accelerator.scaler = None
    x, y = batch  # a synced backward, then a clip over the first layer's parameters only
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    try:
        accelerator.clip_grad_norm_(accelerator.unwrap_model(model)[0].parameters(), 1.0)
    except ValueError as error:
        errors["clip_subset"] = str(error)
    first = list(accelerator.unwrap_model(model)[0].parameters())
    try:  # the optimizer's own clip, given an order that is not a reordering of its parameters
        accelerator.overlapped_optimizers()[0].clip_grad_norm_(1.0, parameters=first)
    except ValueError as error:
        errors["clip_order"] = str(error)
    opt.zero_grad()  # (the shards dropped: no step)
    return errors


def _save(accelerator, directory: str, batches: int) -> None:
    accelerator.save_state(directory, safe_serialization=False)
    if accelerator.is_main_process:
        with open(os.path.join(directory, "batches_done"), "w") as f:
            f.write(str(batches))


def _updates_in_forward(accelerator) -> int | None:
    """The overlapped optimizer's bucket updates that ran during a forward (its history)."""
    overlapped = getattr(accelerator, "overlapped_optimizers", lambda: [])()
    if not overlapped:
        return None
    return sum(1 for iteration in overlapped[0].history.values()
               for event in iteration["updates"] if event["module"] is not None)


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accelerator", choices=["torch", "pyreducer"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--trigger", action="store_true")
    parser.add_argument("--steps", type=int, default=12, help="batches per rank")
    parser.add_argument("--save", help="save_state here at the end (or at --save-at)")
    parser.add_argument("--save-at", type=int, default=0, help="save after this many batches")
    parser.add_argument("--resume", help="load_state from here first")
    parser.add_argument("--overlap", choices=["overlap", "shard"])
    parser.add_argument("--adamw", action="store_true")
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--clip-norm", type=float, default=0.0)
    parser.add_argument("--clip-value", type=float, default=0.0)
    parser.add_argument("--clip-subset", type=float, default=0.0)
    parser.add_argument("--mixed-precision", choices=["bf16"])
    parser.add_argument("--optimizer-first", action="store_true")
    parser.add_argument("--misuse-shard", action="store_true")
    return parser.parse_args(argv)


def _prepared(accelerator, args) -> dict:
    """The model, optimizer, loader and (--scheduler) LR scheduler, prepared in one call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = _optimizer(model, args.adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 6)) \
        if args.scheduler else None
    loader = torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=False)
    objects = dict(model=model, opt=opt, loader=loader, scheduler=scheduler)
    names = (["opt", "model"] if args.optimizer_first else ["model", "opt"]) + ["loader"] + \
        (["scheduler"] if scheduler is not None else [])
    prepared = dict(zip(names, accelerator.prepare(*[objects[name] for name in names])))
    return {"scheduler": None, **prepared}


def _write(accelerator, model, opt, record: dict, args) -> None:
    """save_model on every rank; rank 0 writes the run's results to --out."""
    accelerator.wait_for_everyone()
    saved_dir = args.out + ".model"
    accelerator.save_model(model, saved_dir, safe_serialization=False)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        saved = torch.load(os.path.join(saved_dir, "pytorch_model.bin"))
        torch.save(dict(**record, wrapper=type(model).__module__,
                        unwrapped=type(unwrapped).__name__, saved_keys=sorted(saved),
                        optimizer=type(opt.optimizer).__name__,
                        updates_in_forward=_updates_in_forward(accelerator),
                        params={k: v.detach().clone()
                                for k, v in unwrapped.state_dict().items()}),
                   args.out)
    accelerator.wait_for_everyone()  # all ranks done before Gloo is torn down


def main(argv=None) -> None:
    args = _arguments(argv)
    accelerator = _accelerator(args)
    prepared = _prepared(accelerator, args)
    model, opt, loader = prepared["model"], prepared["opt"], prepared["loader"]
    done = 0
    if args.resume:
        accelerator.load_state(args.resume)
        done = int(open(os.path.join(args.resume, "batches_done")).read())
        loader = accelerator.skip_first_batches(loader, done)
    record = dict(losses=[], norms=[], subset_norms=[], lrs=[], misuse=None)
    for index, batch in enumerate(loader):
        if done + index >= args.steps:
            break
        _step(accelerator, model, opt, prepared["scheduler"], batch, record, args)
        if args.save and args.save_at == done + index + 1:
            _save(accelerator, args.save, args.save_at)
    if args.trigger and args.accelerator == "pyreducer":
        record["misuse"] = _misuse(accelerator, model, batch)
        opt.zero_grad()
    if args.misuse_shard:
        record["misuse"] = _misuse_shard(accelerator, model, opt, batch)
    if args.save and not args.save_at:
        _save(accelerator, args.save, args.steps)
    _write(accelerator, model, opt, record, args)
    teardown.settle_gloo_threads_at_exit(torch.distributed.group.WORLD)  # torch DDP's runs too
    # The wrapper goes before the group (as in train_hf_trainer.py: torch DDP's Reducer holding
    # the last reference to the group can hang at exit).
    accelerator.free_memory()
    del model, opt, prepared
    gc.collect()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
