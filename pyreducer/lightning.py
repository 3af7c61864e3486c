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

Note [Lightning's overlapped step]
`DDPStrategy(overlap_optimizer=True)` (or `shard=True`) turns the one optimizer that
configure_optimizers returns into model.overlap_optimizer(optimizer) once the model is wrapped;
its LR schedulers keep driving it (the two share param_groups). Lightning steps it with a
closure holding the forward (which applies the previous step's updates, bucket by bucket) and
the backward (which leaves this step's reductions in flight): the overlapped step runs the
closure first, then records (OverlapOptimizer.step). Lightning zeroes the gradients after the
closure's forward, when every update is done. Clipping (gradient_clip_val, by norm or by value,
through Lightning's precision plugin) reaches the overlapped optimizer's own clip, which
completes the reductions and clips them exactly without taking the updates out of the overlap
(and on shards, where no rank holds a whole gradient): the strategy's precision plugin is given
clip methods that pass an overlapped optimizer to it and any other to Lightning's. Refused by
name: several optimizers (an overlapped optimizer is the one optimizer of its wrapper), an
overlapped optimizer built in configure_optimizers (the strategy builds it), and with shard=True a
precision plugin with a gradient scaler ("16-mixed": unscaling reads whole gradients).

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
from pyreducer.overlap import adapter_options
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
    (extra keyword arguments go to the wrapper, pyreducer's own included).

    Args:
        overlap_optimizer (bool | dict): True: the optimizer of configure_optimizers becomes
            pyreducer's overlapped optimizer (its updates overlap the next forward); a dict:
            the same, with `model.overlap_optimizer`'s options (`schedule`, `hold_back`).
            Clipping stays Lightning's `gradient_clip_val` (Note [Lightning's overlapped
            step]).
        shard (bool): True: the sharded optimizer (its state and update split across ranks).
    """

    def __init__(self, *args, overlap_optimizer: bool | dict = False, shard: bool = False,
                 **kwargs):
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("pyreducer.lightning.DDPStrategy: model_averaging_period (post-localSGD "
                             "averaging over torch DDP's comm state) is not supported; expected "
                             f"None, got {kwargs['model_averaging_period']!r}")
        _, self._overlap_request = adapter_options.take(
            dict(overlap_optimizer=overlap_optimizer, shard=shard), "pyreducer.lightning.DDPStrategy")
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
                    f"is already an overlapped optimizer (model.overlap_optimizer); expected a "
                    f"plain torch optimizer, got {type(optimizer).__name__}: return the plain "
                    f"one and ask the strategy for the overlap, "
                    f"DDPStrategy(overlap_optimizer=True) (or shard=True)")
        request = self._overlap_request
        if request is None or not isinstance(self.model, DistributedDataParallel):
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"pyreducer.lightning.DDPStrategy: {request.name} takes the one optimizer of "
                f"the model; configure_optimizers returned {len(self.optimizers)} "
                f"({', '.join(type(o).__name__ for o in self.optimizers)}). Expected one "
                f"(param groups may differ in settings), or overlap_optimizer=False")
        scaler = getattr(self.precision_plugin, "scaler", None)
        if request.shard and scaler is not None:
            raise ValueError(
                f"pyreducer.lightning.DDPStrategy: shard=True with precision "
                f"{getattr(self.precision_plugin, 'precision', '?')!r}, whose "
                f"{type(scaler).__name__} unscales whole gradients, which no rank holds with "
                f"the sharded optimizer; use precision='bf16-mixed' (no scaler) or shard=False")
        self.optimizers = [request.make(self.model, self.optimizers[0])]
        _route_clipping(self.precision_plugin)

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
            # an overlapped step's updates this forward did not read, done before the backward
            # adds into their gradients (Note [A backward inside the forward])
            self.model.synchronize()
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


def _route_clipping(precision) -> None:
    """The precision plugin's clips pass an overlapped optimizer to its own clip methods
    (Note [Lightning's overlapped step]); any other optimizer to the plugin's, as before."""
    if getattr(precision, "_pyreducer_clipping", False):
        return
    by_norm, by_value = precision.clip_grad_by_norm, precision.clip_grad_by_value

    def clip_grad_by_norm(optimizer, clip_val) -> None:
        if isinstance(optimizer, OverlapOptimizer):
            optimizer.clip_grad_norm_(clip_val)
        else:
            by_norm(optimizer, clip_val)

    def clip_grad_by_value(optimizer, clip_val) -> None:
        if isinstance(optimizer, OverlapOptimizer):
            optimizer.clip_grad_value_(clip_val)
        else:
            by_value(optimizer, clip_val)

    precision.clip_grad_by_norm, precision.clip_grad_by_value = clip_grad_by_norm, clip_grad_by_value
    precision._pyreducer_clipping = True


StrategyRegistry.register(STRATEGY_NAME, DDPStrategy, override=True,
                          description="Lightning's DDP strategy with pyreducer's "
                                      "DistributedDataParallel")

__all__ = ["DDPStrategy", "STRATEGY_NAME"]
