"""The overlapped and sharded optimizers through the frameworks' adapters (pyreducer.lightning,
pyreducer.accelerate, pyreducer.transformers): the two options each adapter takes beside the
wrapper's own, read in one place so that they mean the same everywhere.

    overlap_optimizer  False (default): the framework's optimizer, stepped as torch DDP's loop
                       steps it. True: it becomes `model.overlap_optimizer(optimizer)`. A dict:
                       the same, with model.overlap_optimizer's options (`schedule`, `hold_back`).
    shard              False (default). True: `model.overlap_optimizer(optimizer, shard=True)`,
                       the sharded optimizer (an overlapped one: overlap_optimizer may be left
                       out).

`max_grad_norm` is not an option here: the framework's own clipping setting (Lightning's
gradient_clip_val, Accelerate's clip_grad_norm_, the Trainer's max_grad_norm) drives the
optimizer's clip (OverlapOptimizer.clip_grad_norm_), so that a script's clipping is configured
where the framework configures it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OPTION_NAMES = ("overlap_optimizer", "shard")
OVERLAP_KEYS = ("schedule", "hold_back")  # model.overlap_optimizer's options an adapter passes


@dataclass(frozen=True)
class OverlapRequest:
    """What an adapter was asked for: the sharded optimizer or the overlapped one, and the
    options of model.overlap_optimizer."""
    shard: bool = False
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "the sharded optimizer" if self.shard else "the overlapped optimizer"

    def make(self, model, optimizer):
        """`optimizer` (plain, over `model`'s parameters) made overlapped or sharded on `model`
        (pyreducer's DistributedDataParallel)."""
        return model.overlap_optimizer(optimizer, shard=self.shard, **self.options)


def take(options: dict, where: str) -> tuple[dict, OverlapRequest | None]:
    """Splits an adapter's options into the wrapper's keyword arguments and the overlap
    request (None: the plain optimizer). `where` names the adapter in a refusal."""
    rest = {k: v for k, v in options.items() if k not in OPTION_NAMES}
    overlap, shard = options.get("overlap_optimizer", False), options.get("shard", False)
    if not isinstance(shard, bool):
        raise TypeError(f"{where}: shard must be True or False, got {shard!r}")
    if isinstance(overlap, dict):
        unknown = sorted(set(overlap) - set(OVERLAP_KEYS))
        if "max_grad_norm" in unknown:
            raise ValueError(
                f"{where}: overlap_optimizer={{'max_grad_norm': ...}} is not taken here: set "
                "the framework's own clipping (Lightning's gradient_clip_val, Accelerate's "
                "accelerator.clip_grad_norm_, the Trainer's max_grad_norm), which clips the "
                "overlapped optimizer's reduced gradients exactly")
        if unknown:
            raise ValueError(f"{where}: overlap_optimizer options must be among "
                             f"{', '.join(OVERLAP_KEYS)}; got {', '.join(unknown)}")
        settings = dict(overlap)
    elif isinstance(overlap, bool):
        settings = {}
    else:
        raise TypeError(f"{where}: overlap_optimizer must be True, False or a dict of "
                        f"model.overlap_optimizer's options, got {overlap!r}")
    if not (overlap or shard):
        return rest, None
    return rest, OverlapRequest(shard=shard, options=settings)


__all__ = ["OPTION_NAMES", "OverlapRequest", "take"]
