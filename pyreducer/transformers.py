"""The Hugging Face Trainer: `pyreducer.transformers.Trainer(...)` in place of
`transformers.Trainer(...)`, with the same arguments (TrainingArguments' ddp_* options included)
plus `ddp_options` for pyreducer's own (for example `{"bucket_cap_mb": "auto"}`).

The Trainer wraps its model for data parallelism through Accelerate only: it creates its
Accelerator in create_accelerator_and_postprocess, by the name `Accelerator` of its own module.
This subclass runs the Trainer's create_accelerator_and_postprocess with that name bound to
pyreducer.accelerate.Accelerator for the duration of the call (Note [One name, one call] in
pyreducer/accelerate.py), so the Trainer's prepare, its gradient accumulation (no_sync), its
unwrapping (label smoothing, saving, the model-card) and its checkpoints go through pyreducer's
wrapper. If a future Trainer creates its Accelerator some other way, the constructor raises
rather than training with torch DDP unnoticed.

transformers and Accelerate are imported here only: `import pyreducer` loads neither.
"""
from __future__ import annotations

import transformers
import transformers.trainer

import pyreducer.accelerate
from pyreducer.accelerate import bound


class Trainer(transformers.Trainer):
    """transformers.Trainer whose Accelerator builds pyreducer's DistributedDataParallel."""

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


__all__ = ["Trainer"]
