"""A small Hugging Face Trainer run under torchrun (2 CPU processes, Gloo): a 2-layer GPT-2 built
from a config (no download), on fixed token sequences, with transformers.Trainer (torch DDP
through Accelerate) or pyreducer.transformers.Trainer (tests/multirank/test_hf_trainer.py runs it
both ways and compares):

    torchrun --standalone --nproc-per-node 2 -m pyreducer.testing.train_hf_trainer \
        --trainer pyreducer --out run.pt [--accumulate 2] [--steps 8] [--save-at K] \
        [--resume-from DIR/checkpoint-K] [--warmup-steps W] [--max-grad-norm X] \
        [--optim adamw_torch] [--ddp-options JSON]

--save-at K saves a checkpoint every K steps (in --out + ".trainer"); --resume-from resumes from
one, with the same schedule (max_steps) as the run that saved it. --warmup-steps, --max-grad-norm
and --optim are TrainingArguments' (defaults: the Trainer's). --ddp-options: pyreducer's
Trainer's ddp_options, e.g. '{"shard": true}'. Rank 0 writes {"losses" (the Trainer's logged
loss per step), "grad_norms", "learning_rates" (logged), "params", "wrapper", "buckets",
"optimizer" (the class the AcceleratedOptimizer wraps), "updates_in_forward" (an overlapped
optimizer's bucket updates run during a forward, or None)} to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from pyreducer.wrapper import teardown

VOCAB = 64
SEQUENCE = 16


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences, labels = inputs (the model shifts them)."""

    def __init__(self, samples: int = 256):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (samples, SEQUENCE), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _updates_in_forward(trainer) -> int | None:
    """The overlapped optimizer's bucket updates that ran during a forward (its history)."""
    overlapped = getattr(trainer.accelerator, "overlapped_optimizers", lambda: [])()
    if not overlapped:
        return None
    return sum(1 for iteration in overlapped[0].history.values()
               for event in iteration["updates"] if event["module"] is not None)


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trainer", choices=["torch", "pyreducer"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--save-at", type=int, default=0, help="checkpoint every K steps")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("--ddp-options", default="{}",
                        help="JSON: pyreducer's ddp_options (pyreducer's Trainer only)")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--max-grad-norm", type=float)
    parser.add_argument("--optim")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _arguments(argv)
    chosen = {name: getattr(args, name) for name in ("warmup_steps", "max_grad_norm", "optim")
              if getattr(args, name) is not None}

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    options = {}
    if args.trainer == "torch":
        trainer_class = transformers.Trainer
    else:
        import pyreducer.transformers

        trainer_class = pyreducer.transformers.Trainer
        options = dict(ddp_options=json.loads(args.ddp_options))
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32,
                                       n_layer=2, n_head=2))
    out_dir = os.path.abspath(args.out) + ".trainer"
    training = TrainingArguments(
        output_dir=out_dir, use_cpu=True, ddp_backend="gloo", seed=0, max_steps=args.steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulate,
        learning_rate=1e-3, logging_steps=1, report_to="none", disable_tqdm=True,
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 500,
        dataloader_num_workers=0, **chosen)
    trainer = trainer_class(model=model, args=training, train_dataset=_Tokens(), **options)
    trainer.train(resume_from_checkpoint=args.resume_from)
    wrapped = trainer.model_wrapped
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        plan = wrapped.bucket_plan() if hasattr(wrapped, "bucket_plan") else None
        torch.save(dict(losses=[entry["loss"] for entry in logged],
                        grad_norms=[entry["grad_norm"] for entry in logged],
                        learning_rates=[entry["learning_rate"] for entry in logged],
                        wrapper=type(wrapped).__module__, buckets=plan,
                        optimizer=type(trainer.optimizer.optimizer).__name__,
                        updates_in_forward=_updates_in_forward(trainer),
                        params={k: v.detach().clone() for k, v in model.state_dict().items()}),
                   args.out)
    torch.distributed.barrier()  # all ranks done before Gloo is torn down
    teardown.settle_gloo_threads_at_exit(torch.distributed.group.WORLD)  # torch DDP's runs too
    # The wrapper goes while the group is still registered: torch DDP's Reducer, left holding the
    # last reference to the group, destroys it with the GIL held and can wait forever for a Gloo
    # worker that waits for the GIL (a torch-side resumed run hung so at exit in CI; see Note
    # [Letting the Reducer go without the GIL] in csrc/bindings.cpp).
    trainer.accelerator.free_memory()
    del trainer, wrapped
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
