"""A small Hugging Face Trainer run under torchrun (2 CPU processes, Gloo): a 2-layer GPT-2 built
from a config (no download), on fixed token sequences, with transformers.Trainer (torch DDP
through Accelerate) or pyreducer.transformers.Trainer (tests/multirank/test_hf_trainer.py runs it
both ways and compares):

    torchrun --standalone --nproc-per-node 2 -m pyreducer.testing.train_hf_trainer \
        --trainer pyreducer --out run.pt [--accumulate 2] [--steps 8] [--save-at K] \
        [--resume-from DIR/checkpoint-K]

--save-at K saves a checkpoint every K steps (in --out + ".trainer"); --resume-from resumes from
one, with the same schedule (max_steps) as the run that saved it. Rank 0 writes {"losses" (the
Trainer's logged loss per step), "params", "wrapper", "buckets"} to --out.
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trainer", choices=["torch", "pyreducer"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--save-at", type=int, default=0, help="checkpoint every K steps")
    parser.add_argument("--resume-from", help="a checkpoint directory to resume from")
    parser.add_argument("--ddp-options", default="{}",
                        help="JSON: pyreducer's ddp_options (pyreducer's Trainer only)")
    args = parser.parse_args(argv)

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
        dataloader_num_workers=0)
    trainer = trainer_class(model=model, args=training, train_dataset=_Tokens(), **options)
    trainer.train(resume_from_checkpoint=args.resume_from)
    wrapped = trainer.model_wrapped
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        plan = wrapped.bucket_plan() if hasattr(wrapped, "bucket_plan") else None
        torch.save(dict(losses=losses, wrapper=type(wrapped).__module__, buckets=plan,
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
