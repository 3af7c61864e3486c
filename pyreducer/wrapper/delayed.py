"""torch DDP's delayed all-reduce: `delay_all_reduce_named_params` and `param_to_hook_all_reduce`.

The named parameters leave the Reducer (they are ignored by it, as torch DDP adds them to
`parameters_to_ignore`). Their gradients live in one flat buffer, of which each parameter's
`.grad` is a view (set after every forward where `.grad` is None). When autograd computes the
gradient of `param_to_hook_all_reduce` (a tensor hook, so before it is accumulated), the
buffer is divided by the world size and all-reduced (SUM), asynchronously, as torch DDP does:
the hooked parameter should be the one whose gradient comes last (the model's first layer), so
that the delayed gradients are complete by then.

One difference from torch DDP, which never waits for this all-reduce (the optimizer may read the
buffer before it is reduced): pyreducer waits for it at the end of backward, so `optimizer.step()`
always sees the averaged gradients. Like torch's, the hook also all-reduces under `no_sync()`.
One collective per backward, issued from the hook; the wait is bounded by the process group's
timeout.

With check_finite=True (Note [Finite check] in csrc/reducer_finite.cpp) the reduced buffer is
checked after the wait, as the Reducer checks its buckets: every rank holds the same sums, so
every rank reaches the same verdict; only when it fails do the ranks exchange their local flags
(taken before the reduction) to name the ranks the values came from, and backward raises on
every rank naming the delayed parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable


class DelayedAllReduce:
    """The delayed parameters of one wrapper, their flat gradient buffer and the hook."""

    def __init__(self, named_params, hook_param, process_group, check_finite: bool = False):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError("delay_all_reduce_named_params: the delayed parameters share one "
                             "gradient buffer, so they need one dtype and one device; got "
                             f"{sorted(str(d) for d in dtypes)} on "
                             f"{sorted(str(d) for d in devices)} (parameters {self.names})")
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError("param_to_hook_all_reduce must be a parameter that requires a "
                             f"gradient, got {type(hook_param).__name__}")
        self.process_group = process_group
        self.buffer = torch.zeros(sum(p.numel() for p in self.params),
                                  dtype=self.params[0].dtype, device=self.params[0].device)
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.buffer[offset:offset + param.numel()].view(param.shape))
            offset += param.numel()
        self.check_finite = check_finite
        self._local_nonfinite = None  # check_finite: this rank's buffer before the reduction
        self._work = None
        self._handle = hook_param.register_hook(self._all_reduce)

    @staticmethod
    def create(named_params, hook_param, process_group,
               check_finite: bool = False) -> "DelayedAllReduce | None":
        """torch DDP's delayed all-reduce of `named_params`, their values broadcast from rank 0
        now (before the model check, as torch DDP), or None without named_params."""
        if named_params is None:
            return None
        delayed = DelayedAllReduce(list(named_params), hook_param, process_group, check_finite)
        delayed.broadcast_from_rank0()
        return delayed

    def broadcast_from_rank0(self) -> None:
        """Rank 0's values of the delayed parameters on every rank (collective; construction)."""
        from pyreducer.wrapper import sync

        sync.broadcast_coalesced([p.detach() for p in self.params], self.process_group)

    def reset_grads(self) -> None:
        """After a forward: a parameter whose .grad is None gets its view of the buffer back (the
        whole buffer is zeroed if all were None; else the view alone), as torch DDP does."""
        self._finish()  # a backward that raised before its end may have left it in flight
        all_none = all(p.grad is None for p in self.params)
        for param, view in zip(self.params, self.views):
            if param.grad is None:
                param.grad = view
                if not all_none:
                    param.grad.zero_()
        if all_none:
            self.buffer.zero_()

    def _all_reduce(self, grad):
        if self.check_finite:
            self._local_nonfinite = torch.isfinite(self.buffer).all().logical_not()
        self.buffer.div_(dist.get_world_size(self.process_group))
        self._work = dist.all_reduce(self.buffer, group=self.process_group, async_op=True)
        Variable._execution_engine.queue_callback(self._wait)
        return grad

    def _finish(self) -> bool:
        """Waits for the all-reduce in flight; False if there was none."""
        work, self._work = self._work, None
        if work is None:
            return False
        work.wait()
        return True

    def _wait(self) -> None:
        """End of backward: the all-reduce complete and, with check_finite, checked."""
        if self._finish() and self.check_finite and not bool(torch.isfinite(self.buffer).all()):
            raise RuntimeError(self._nonfinite_message())

    def _nonfinite_message(self) -> str:
        """The check_finite error (every rank builds it: the exchange of flags is collective)."""
        group = self.process_group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = self._local_nonfinite.to(torch.int64).reshape(1)
        flags = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(flags, mine, group=group)
        ranks = [str(r) for r, flag in enumerate(flags) if flag.item()]
        names = [name + (" (NaN)" if torch.isnan(view).any() else " (Inf)")
                 for name, view in zip(self.names, self.views) if not torch.isfinite(view).all()]
        source = f"from rank(s) {', '.join(ranks)} (their own gradients were non-finite before " \
            "the reduction)" if ranks else "every rank's own gradient was finite: the sum " \
            f"overflowed in {self.buffer.dtype}"
        return (f"pyreducer: check_finite: non-finite averaged gradients of the delayed "
                f"all-reduce (delay_all_reduce_named_params) after backward (seen on rank {rank} "
                f"of {world}; every rank raises this): parameter(s) {', '.join(names)}: {source};"
                " the gradients are written back, but no optimizer should step on them.")

    def remove(self) -> None:
        self._handle.remove()
