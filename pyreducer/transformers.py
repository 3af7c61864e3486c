"""The Hugging Face Trainer: `pyreducer.transformers.Trainer(...)` in place of
`transformers.Trainer(...)`, with the same arguments (TrainingArguments' ddp_* options included)
plus `ddp_options` for pyreducer's own (for example `{"bucket_cap_mb": "auto"}`, or
`{"overlap_optimizer": True}` / `{"shard": True}`: Note [The Trainer's overlapped step]).

The Trainer wraps its model for data parallelism through Accelerate only: it creates its
Accelerator in create_accelerator_and_postprocess, by the name `Accelerator` of its own module.
This subclass runs the Trainer's create_accelerator_and_postprocess with that name bound to
pyreducer.accelerate.Accelerator for the duration of the call (Note [One name, one call] in
pyreducer/accelerate.py), so the Trainer's prepare, its gradient accumulation (no_sync), its
unwrapping (label smoothing, saving, the model-card) and its checkpoints go through pyreducer's
wrapper. If a future Trainer creates its Accelerator some other way, the constructor raises
rather than training with torch DDP unnoticed.

Note [The Trainer's overlapped step]
The Trainer prepares its own optimizer with its model (`accelerator.prepare(model, optimizer)`),
so with `overlap_optimizer` or `shard` in ddp_options the optimizer becomes the overlapped or
sharded one there (Note [Accelerate's overlapped step] in pyreducer/accelerate.py), and the LR
scheduler the Trainer builds after it drives it. The Trainer clips through
`accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`, which reaches the optimizer's
own clip (in model.parameters()' order, as torch's clip takes the norm). Four places of the
Trainer would read the parameters or the optimizer's state on some ranks only, or read the
gradients, and one reads every parameter's metadata, so this subclass changes them:
  - after every backward the Trainer counts the model's parameters (floating_point_ops: each
    parameter's requires_grad and numel()); a read of a parameter whose update is pending
    completes its bucket first (the shape does not need it, but every torch function on it is
    caught), which would take every bucket out of the overlap, so the count runs with torch
    functions off for the subclass that pending parameters wear;
  - before its first clip the Trainer reads every .grad once to look for gradients on several
    device meshes (DTensor): pyreducer's wrapper reduces plain tensors, and the read would
    complete every bucket (or, sharded, be refused), so with an overlapped optimizer the answer
    is no without reading;
  - it writes optimizer.pt on the saving rank only, calling the optimizer's state_dict() there:
    the sharded optimizer's is collective, so every rank gathers it and the saving rank writes
    that (torch's format: a plain AdamW, and the stock Trainer resuming, load it);
  - before a checkpoint and at the end of train(), every rank completes its pending updates
    (synchronize(): the sharded optimizer's updates all-gather the parameters), so that the
    saving rank's state_dict() of the model, or a script's after train(), reads final values
    without a collective.

transformers and Accelerate are imported here only: `import pyreducer` loads neither.
"""
from __future__ import annotations

import torch
import transformers
import transformers.trainer

import pyreducer.accelerate
from pyreducer.accelerate import bound
from pyreducer.sharded import ShardedOptimizer


class _GatheredOptimizer:
    """Stands for the sharded optimizer while the Trainer saves it on its saving rank: its
    state_dict() is the whole state every rank gathered (Note [The Trainer's overlapped step])."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


class Trainer(transformers.Trainer):
    """transformers.Trainer whose Accelerator builds pyreducer's DistributedDataParallel.

    Args:
        ddp_options (dict): pyreducer's wrapper options, and `"overlap_optimizer"` /
            `"shard"`: the Trainer's optimizer becomes the overlapped / sharded one (Note [The
            Trainer's overlapped step]).
    """

    def __init__(self, *args, ddp_options: dict | None = None, **kwargs):
        self.pyreducer_ddp_options = dict(ddp_options or {})
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        options = self.pyreducer_ddp_options

        class TrainerAccelerator(pyreducer.accelerate.Accelerator):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, ddp_options=options, **kwargs)

        with bound(transformers.trainer, "Accelerator", TrainerAccelerator):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, pyreducer.accelerate.Accelerator):
            raise RuntimeError(
                f"pyreducer.transformers: transformers {transformers.__version__} did not create "
                f"its Accelerator through transformers.trainer.Accelerator (expected "
                f"pyreducer.accelerate.Accelerator, got {type(self.accelerator).__name__}); this "
                f"transformers version is not supported")

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        self._synchronize()
        return result

    def _synchronize(self) -> None:
        """Every pending update done, on every rank (collective with the sharded optimizer)."""
        for optimizer in self.accelerator.overlapped_optimizers():
            optimizer.synchronize()

    def floating_point_ops(self, inputs) -> int:
        if not self.accelerator.overlapped_optimizers():
            return super().floating_point_ops(inputs)
        with torch._C.DisableTorchFunctionSubclass():  # (metadata only: Note [The Trainer's
            return super().floating_point_ops(inputs)  # overlapped step])

    def _has_mixed_mesh_grads(self, model) -> bool:
        if self.accelerator.overlapped_optimizers():
            return False
        return super()._has_mixed_mesh_grads(model)

    def _save_checkpoint(self, model, trial) -> None:
        self._synchronize()
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not any(isinstance(optimizer, ShardedOptimizer)
                   for optimizer in self.accelerator.overlapped_optimizers()):
            return super()._save_optimizer_and_scheduler(output_dir)
        whole = self.optimizer.state_dict()  # collective: every rank gathers the whole state
        with bound(self, "optimizer", _GatheredOptimizer(whole)):
            super()._save_optimizer_and_scheduler(output_dir)


__all__ = ["Trainer"]
