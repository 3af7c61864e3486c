"""PyTorch Lightning: `Trainer(strategy=pyreducer.lightning.DDPStrategy(...))`, or the string
"pyreducer_ddp" once this module is imported.

Lightning's own DDPStrategy builds torch's DistributedDataParallel in one place (_setup_model) and
forwards every extra argument to it; this subclass builds pyreducer's instead, with the same
arguments (pyreducer's own too: `bucket_cap_mb="auto"`, `mixed_precision=`, ...), and replaces the
few places where Lightning reaches into torch DDP's private reducer:

Note [Lightning's manual optimisation]
With `automatic_optimization = False`, Lightning runs `training_step` inside the wrapper's forward
(its _ForwardRedirection), so `self.manual_backward(loss)` runs before that forward returns: the
wrapper has not armed its reducer for a backward yet. Lightning arms torch's reducer in
pre_backward through torch-private calls (reducer._rebuild_buckets, prepare_for_backward) behind an
isinstance check that pyreducer's wrapper does not pass: unreplaced, the backward would run with
the reducer disarmed and pyreducer would refuse the gradients (a backward no forward preceded).
Here backward() arms pyreducer with the loss (DistributedDataParallel.prepare_for_backward) and
backpropagates the returned loss; the forward redirection then turns sync off for the rest of that
forward, as Lightning's does for torch DDP, so the wrapper does not arm a second time.

The overlapped optimizer (model.overlap_optimizer) is refused by name when configure_optimizers
returns one: Lightning steps every optimizer with a closure (its forward and backward run inside
step(), manual optimisation included), and an overlapped step splits the update into buckets run
during the next forward, which step(closure) cannot serve.

Comm hooks are registered on every device (Lightning registers them only on CUDA, where it also
asserts a torch DDP); post-localSGD model averaging (a torch-DDP comm state) is refused by name.
Lightning is imported here only: `import pyreducer` does not load it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from pyreducer.distributed import DistributedDataParallel
from pyreducer.overlap.optimizer import OverlapOptimizer

STRATEGY_NAME = "pyreducer_ddp"


class _ManualOptimisationRedirection(_ForwardRedirection):
    """Lightning's DDP forward redirection, for pyreducer's wrapper (Note [Lightning's manual
    optimisation])."""

    def on_after_inner_forward(self, wrapper_module, original_module) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) \
                and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module, original_module) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) \
                and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDPStrategy with pyreducer's DistributedDataParallel: the same arguments
    (extra keyword arguments go to the wrapper, pyreducer's own included)."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("pyreducer.lightning.DDPStrategy: model_averaging_period (post-localSGD "
                             "averaging over torch DDP's comm state) is not supported; expected "
                             f"None, got {kwargs['model_averaging_period']!r}")
        super().__init__(*args, **kwargs)
        self._forward_redirection = _ManualOptimisationRedirection()

    def _setup_model(self, model):
        device_ids = self.determine_ddp_device_ids()
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:  # as Lightning's: the wrapper's broadcasts on a side stream on CUDA
            return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        for index, optimizer in enumerate(self.optimizers):
            if isinstance(optimizer, OverlapOptimizer):
                raise ValueError(
                    f"pyreducer.lightning.DDPStrategy: optimizer {index} from configure_optimizers "
                    f"is an overlapped optimizer (model.overlap_optimizer), which Lightning's "
                    f"loop cannot drive: Lightning calls step(closure) with the forward and "
                    f"backward inside it, and an overlapped step runs during the next forward. "
                    f"Expected a plain torch optimizer, got {type(optimizer).__name__}; for the "
                    f"overlap, train with pyreducer.DistributedDataParallel in your own loop")

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook,
                                    ddp_comm_wrapper=self._ddp_comm_wrapper)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel) and module is not None \
                and not module.automatic_optimization and torch.is_grad_enabled() \
                and self.model.require_backward_grad_sync:
            closure_loss = self.model.prepare_for_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def pre_backward(self, closure_loss) -> None:
        """Nothing: backward() arms pyreducer (Lightning's arms torch DDP's reducer here)."""

    def post_backward(self, closure_loss) -> None:
        """Nothing: pyreducer's static_graph needs no delayed all-reduce call."""

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as Lightning's does for torch DDP
        super().teardown()


StrategyRegistry.register(STRATEGY_NAME, DDPStrategy, override=True,
                          description="Lightning's DDP strategy with pyreducer's "
                                      "DistributedDataParallel")

__all__ = ["DDPStrategy", "STRATEGY_NAME"]
