"""One rank of benchmarks/bench_frameworks.py, started by torchrun on an emulated host
(pyreducer.tools.netem): a GPT-2 built from a config trained by the Hugging Face Trainer or by
Lightning, with the framework's own torch DDP ("stock") or pyreducer's ("overlap": the
overlapped optimizer, "shard": the sharded one), through the one-line swaps of the README:

    hf         transformers.Trainer, or pyreducer.transformers.Trainer(ddp_options=
               {"overlap_optimizer": True} / {"shard": True}); the Trainer's own AdamW
               (TrainingArguments' default optim), linear schedule with LR_WARMUP_STEPS of
               warm-up, max_grad_norm 1.0
    lightning  the same GPT-2 in a LightningModule: torch.optim.AdamW with the same linear
               schedule, gradient_clip_val 1.0; Lightning's DDPStrategy, or
               pyreducer.lightning.DDPStrategy(overlap_optimizer=True / shard=True)

Every run is --warmup + --steps optimizer steps on the same data (seed 0). A callback takes the
wall clock at each step's end (HF: on_step_end, Lightning: on_train_batch_end) and at its start;
the timed steps are the last --steps intervals between consecutive step ends (everything the
framework does per step: data, forward, backward, clipping, step, logging). Each rank writes
rank<R>.json to --out: those intervals, the step at which an overlapped optimizer's schedule
tuner had decided, the optimizer-state bytes of this rank (the sharded optimizer: its
memory_bytes(); else its state tensors), the rise of the peak RSS from just before the model is
built to the end of training, the wrapper and optimizer classes, and (rank 0) the loss of every
step; rank 0 also writes the final parameters to params.pt.
    torchrun ... benchmarks/frameworks_worker.py --framework hf --variant shard --out DIR
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# (sharded_worker imports netem_worker, which sets PYREDUCER_TUNING_CACHE=off: every run tunes
# from scratch, as a first run does)
from sharded_worker import reset_peak_rss, storage_bytes  # noqa: E402
from pyreducer.wrapper import teardown  # noqa: E402

FRAMEWORKS = ("hf", "lightning")
VARIANTS = ("stock", "overlap", "shard", "shard_4mb")
REFERENCE = "stock"
# pyreducer's options per variant: ddp_options of the Trainer, DDPStrategy's keyword arguments
# (shard_4mb: the bucket size the sharded optimizer's guide recommends, "Choosing the bucket size")
OPTIONS = {"stock": None, "overlap": {"overlap_optimizer": True}, "shard": {"shard": True},
           "shard_4mb": {"shard": True, "bucket_cap_mb": 4}}
# The GPT-2s (GPT2Config, built from the config: nothing is downloaded), and why each.
MODELS = {"default": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                          batch=4),
          "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=32, batch=4)}
WHY = {"default": "the largest of the sizes tried whose runs (120 steps each) fit the "
                  "benchmark's ~15 minutes on 2 cores: one step of it took 0.25 s of compute on "
                  "one idle core (forward, backward, AdamW), 0.55-0.6 s per step with 2 ranks at "
                  "1 Gbit/s on a busy machine; 6 layers x 384 (13.8 M parameters, 53 MiB of "
                  "gradients) took 0.6 s of compute alone, 2.4 times as long. A vocabulary of "
                  "8192 rather than GPT-2's 50257 keeps the tied embedding from dominating "
                  "compute and gradients.",
       "tiny": "a smoke run's: it checks that everything runs, not how fast."}
LR, LR_WARMUP_STEPS, MAX_GRAD_NORM, WEIGHT_DECAY = 5e-4, 10, 1.0, 0.0
SAMPLES = 1024  # distinct sequences; the loader wraps around past them


class Tokens(torch.utils.data.Dataset):
    """Token sequences of a noisy affine chain (next = 5 * token + 3 + noise in 0..2, mod the
    vocabulary): a GPT-2 can learn them (loss towards log 3), so the loss curve says something.
    Items are {"input_ids", "labels"} (labels = inputs: the model shifts them)."""

    def __init__(self, vocab: int, length: int, samples: int = SAMPLES):
        gen = torch.Generator().manual_seed(0)
        ids = torch.empty(samples, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (samples,), generator=gen)
        noise = torch.randint(0, 3, (samples, length), generator=gen)
        for t in range(1, length):
            ids[:, t] = (5 * ids[:, t - 1] + 3 + noise[:, t]) % vocab
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def gpt2(spec: dict):
    """The GPT-2 of `spec` (seed 0): no download, bos/eos inside the vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = {k: v for k, v in spec.items() if k not in ("batch", "clip")}
    return GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **config))


class StepClock:
    """Wall-clock times of every step's start and end; `optimizer` (a callable, set once the
    framework has built it) gives the optimizer whose schedule tuner is watched."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.begins, self.ends = [], []
        self.decided_at = None  # the first step after which the tuner had decided
        self.optimizer = lambda: None

    def begin(self) -> None:
        self.begins.append(time.perf_counter())

    def end(self, step: int) -> None:
        self.ends.append(time.perf_counter())
        tuner = getattr(self.optimizer(), "tuner", None)
        if self.decided_at is None and (tuner is None or tuner_done(tuner)):
            self.decided_at = step
        if dist.get_rank() == 0 and (step % 10 == 0 or step == self.total):
            last = self.ends[-1] - self.ends[-2] if len(self.ends) > 1 else float("nan")
            phase = f" ({tuner.phase_name})" if tuner is not None else ""
            print(f"[{self.label}] step {step}/{self.total}: {last * 1e3:.0f} ms{phase}",
                  file=sys.stderr, flush=True)


def tuner_done(tuner) -> bool:
    """Whether an overlapped optimizer's schedule tuner has installed its schedule for good:
    decided, after a schedule was chosen (or planning gave up); its `decided` alone is also
    true before it has begun."""
    return tuner.decided and any(e.get("event") in ("chosen", "not planned")
                                 for e in tuner.log)


def hf_run(spec: dict, variant: str, total: int, clock: StepClock, out: str) -> dict:
    """The HF Trainer's run (its output_dir under `out`: nothing is saved); returns the model,
    the optimizer, the wrapper's module and the logged losses."""
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end(state.global_step)

    trainer_class, options = transformers.Trainer, {}
    if OPTIONS[variant] is not None:
        import pyreducer.transformers

        trainer_class = pyreducer.transformers.Trainer
        options = dict(ddp_options=OPTIONS[variant])
    model = gpt2(spec)
    training = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), use_cpu=True, ddp_backend="gloo",
        seed=0, max_steps=total, per_device_train_batch_size=spec["batch"], learning_rate=LR,
        weight_decay=WEIGHT_DECAY, warmup_steps=LR_WARMUP_STEPS, max_grad_norm=spec["clip"],
        logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
        dataloader_num_workers=0)
    trainer = trainer_class(model=model, args=training, callbacks=[Clock()], **options,
                            train_dataset=Tokens(spec["vocab_size"], spec["n_positions"]))
    clock.optimizer = functools.partial(hf_optimizer, trainer)
    trainer.train()
    result = dict(model=model, optimizer=hf_optimizer(trainer),
                  wrapper=type(trainer.model_wrapped).__module__,
                  losses=[e["loss"] for e in trainer.state.log_history if "loss" in e])
    dist.barrier()
    teardown.settle_gloo_threads_at_exit(dist.group.WORLD)
    # the wrapper goes while the group is registered (as pyreducer/testing/train_hf_trainer.py)
    trainer.accelerator.free_memory()
    clock.optimizer = lambda: None
    del trainer
    return result


def hf_optimizer(trainer):
    """The optimizer the Trainer's AcceleratedOptimizer wraps (stock: torch's AdamW; else the
    overlapped or sharded optimizer around it)."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def lightning_module(spec: dict, total: int):
    """The GPT-2 in a LightningModule: AdamW, linear warm-up then decay, per step."""
    import lightning.pytorch as pl
    from transformers import get_linear_schedule_with_warmup

    class LitGPT2(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2(spec)
            self.losses = []

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.detach())
            self.wrapper = type(self.trainer.strategy.model).__module__  # during fit
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            schedule = get_linear_schedule_with_warmup(opt, LR_WARMUP_STEPS, total)
            return dict(optimizer=opt, lr_scheduler=dict(scheduler=schedule, interval="step"))

    return LitGPT2()


def lightning_run(spec: dict, variant: str, total: int, clock: StepClock, out: str) -> dict:
    """Lightning's run under torchrun (its TorchElasticEnvironment: one process per node)."""
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.end(trainer.global_step)

    if OPTIONS[variant] is None:
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo")
    else:
        import pyreducer.lightning

        strategy = pyreducer.lightning.DDPStrategy(process_group_backend="gloo",
                                                   **OPTIONS[variant])
    pl.seed_everything(0, verbose=False)
    module = lightning_module(spec, total)
    loader = torch.utils.data.DataLoader(Tokens(spec["vocab_size"], spec["n_positions"]),
                                         batch_size=spec["batch"], shuffle=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]),
                         strategy=strategy, max_steps=total,
                         gradient_clip_val=spec["clip"] or None, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()], default_root_dir=out)
    clock.optimizer = lambda: trainer.strategy.optimizers[0] if trainer.strategy.optimizers \
        else None
    trainer.fit(module, loader)
    teardown.settle_gloo_threads_at_exit(dist.group.WORLD)
    return dict(model=module.model, optimizer=clock.optimizer(), wrapper=module.wrapper,
                losses=[loss.item() for loss in module.losses])


def optimizer_memory(opt) -> dict:
    """This rank's optimizer-state bytes: the sharded optimizer's own account (memory_bytes(),
    kept whole), else the bytes of the state tensors."""
    if hasattr(opt, "memory_bytes"):
        reported = opt.memory_bytes()
        return dict(optimizer_state_bytes=int(reported["optimizer_state"]),
                    memory_bytes=reported)
    state = opt.state  # (an overlapped optimizer shares its optimizer's)
    return dict(optimizer_state_bytes=storage_bytes(
        v for entry in state.values() for v in entry.values() if isinstance(v, torch.Tensor)),
        memory_bytes=None)


def chosen_schedule(opt) -> dict | None:
    """The schedule an overlapped optimizer's tuner installed last, or None."""
    chosen = [e for e in getattr(opt, "schedule_log", []) if e.get("event") == "chosen"]
    if not chosen:
        return None
    return {k: chosen[-1][k] for k in ("describe", "predicted_ms", "measured_ms")
            if k in chosen[-1]}


def report(args, result: dict, clock: StepClock, rss_rise_kib: int, seconds: float) -> dict:
    """This rank's record (bytes, seconds)."""
    opt = result["optimizer"]
    ends = clock.ends[-(args.steps + 1):]
    spans = [e - b for b, e in zip(clock.begins, clock.ends)][-args.steps:]
    return dict(rank=dist.get_rank(), world_size=dist.get_world_size(),
                framework=args.framework, variant=args.variant, model=args.model,
                total_steps=len(clock.ends), timed_steps=len(ends) - 1,
                intervals_s=[b - a for a, b in zip(ends, ends[1:])], begin_to_end_s=spans,
                decided_at=clock.decided_at, schedule=chosen_schedule(opt),
                wrapper=result["wrapper"], optimizer=type(opt).__name__,
                inner_optimizer=type(getattr(opt, "optimizer", opt)).__name__,
                fused=bool(getattr(opt, "defaults", {}).get("fused")),
                peak_rss_rise_bytes=rss_rise_kib * 1024,
                losses=result["losses"] if dist.get_rank() == 0 else None,
                seconds=seconds, **optimizer_memory(opt))


def preload(framework: str) -> None:
    """Imports what the runs import (every variant alike), so that the peak-RSS rise counts
    the model and its training, not the frameworks' modules."""
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    if framework == "hf":
        import transformers.trainer  # noqa: F401

        import pyreducer.transformers  # noqa: F401
    else:
        import lightning.pytorch  # noqa: F401

        import pyreducer.lightning  # noqa: F401


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, required=True)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (the last ones)")
    parser.add_argument("--warmup", type=int, default=90, help="steps before them")
    parser.add_argument("--clip", type=float, default=MAX_GRAD_NORM,
                        help="clipping by norm (HF max_grad_norm, Lightning gradient_clip_val); "
                             "0: none")
    parser.add_argument("--out", required=True, help="directory for rank<R>.json, params.pt")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    total = args.warmup + args.steps
    clock = StepClock(f"{args.framework}/{args.variant}", total)
    preload(args.framework)
    start_kib = reset_peak_rss()  # the high-water mark from here: the model and its training
    start = time.monotonic()
    run = hf_run if args.framework == "hf" else lightning_run
    result = run(dict(MODELS[args.model], clip=args.clip), args.variant, total, clock, args.out)
    seconds = time.monotonic() - start
    # on every rank: an overlapped optimizer's pending updates completed (collective for the
    # sharded one) before the parameters are read
    if hasattr(result["optimizer"], "synchronize"):
        result["optimizer"].synchronize()
    rss_rise_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_kib  # (before
    # the copy of the parameters below)
    params = {k: v.detach().clone() for k, v in result["model"].state_dict().items()}
    record = report(args, result, clock, rss_rise_kib, seconds)
    rank = dist.get_rank()
    if rank == 0:
        torch.save(params, os.path.join(args.out, "params.pt"))
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # (whole or absent: the driver reads what exists)
    dist.barrier()
    del result, params
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
