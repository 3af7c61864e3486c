"""The overlapped optimizer's clips between backward and step(), for the frameworks' loops
(Lightning's gradient_clip_val, Accelerate's clip_grad_norm_, the HF Trainer's max_grad_norm)
and for max_grad_norm=: torch's clip arithmetic on the reduced gradients, with the updates left
pending (Note [Overlapped step] in pyreducer/overlap/optimizer.py). A mixin of OverlapOptimizer:
it works on the optimizer's reducer, fences and `busy` flag (reads pass through while set)."""
from __future__ import annotations

import torch


class Clipping:
    """OverlapOptimizer's clips (ShardedOptimizer overrides the public two: its gradients are
    shards, Note [Clipping shards] in pyreducer/sharded/clip.py)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        parameters=None) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over this optimizer's parameters, bit for bit, on
        the averaged gradients of the last backward, without taking this step's updates out of
        the overlap: every reduction is completed now (as `max_grad_norm=` completes them
        before the first update) and the parameters stay pending. For loops that clip between
        backward and step() (Lightning's gradient_clip_val, Accelerate's clip_grad_norm_, the
        HF Trainer's max_grad_norm). Returns the total norm, as torch's.

        `parameters`: the optimizer's parameters in the order torch's clip would get them
        (default: the optimizer's order). torch stacks the per-parameter norms in that order,
        and the total's rounding can depend on it: a loop that clips `model.parameters()`
        while the optimizer's param groups list them otherwise (the HF Trainer's decay and
        no-decay groups) passes that order to get torch's norm bit for bit."""
        order = self._clip_order(parameters, "clip_grad_norm_")
        return self._clip_now(
            lambda params: torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type), order)

    def clip_grad_value_(self, clip_value: float) -> None:
        """`torch.nn.utils.clip_grad_value_` over this optimizer's parameters, as
        clip_grad_norm_ does (the reductions completed, the updates still overlapped)."""
        self._clip_now(lambda params: torch.nn.utils.clip_grad_value_(params, clip_value),
                       self._clip_order(None, "clip_grad_value_"))

    def _clip_order(self, parameters, what: str) -> list[torch.Tensor]:
        """The optimizer's parameters, in the order of `parameters` if given (each of them
        once, in any order; checked by identity: nothing is read)."""
        own = [p for g in self.optimizer.param_groups for p in g["params"]]
        if parameters is None:
            return own
        order = list(parameters)
        given, mine = {id(p) for p in order}, {id(p) for p in own}
        if len(given) != len(order) or given != mine:
            raise ValueError(
                f"overlap_optimizer: {what}(parameters=...) takes this optimizer's "
                f"{len(own)} parameters, each once, in any order; got {len(order)}: "
                f"{len(given - mine)} not the optimizer's, {len(mine - given)} of its missing, "
                f"{len(order) - len(given)} repeated")
        return order

    @torch.no_grad()
    def _clip_now(self, clip_fn, order: list[torch.Tensor]):
        """`clip_fn(the parameters of order with a gradient)` on the reduced gradients; after
        step() (a clip of gradients already used), the pending updates run first, as torch's
        order has it."""
        self._check_not_removed()
        if self.stepped:
            self.synchronize()
        busy, self.busy = self.busy, True
        try:
            self.reducer.complete_all()
            self.fences.wait_all()  # gradients written back on other streams
            result = clip_fn([p for p in order if p.grad is not None])
            self.fences.fence_clip()
        finally:
            self.busy = busy
        return result

    def _clip(self) -> None:
        """clip_grad_norm_ over the optimizer's parameters, once every bucket is reduced (the
        pending ones stay pending for their update: their reads pass through meanwhile)."""
        busy, self.busy = self.busy, True
        try:
            self.reducer.complete_all()
            self.fences.wait_all()  # gradients written back on other streams
            params = [p for g in self.optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            self.fences.fence_clip()
        finally:
            self.busy = busy
