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
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable


class DelayedAllReduce:
    """The delayed parameters of one wrapper, their flat gradient buffer and the hook."""

    def __init__(self, named_params, hook_param, process_group):
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
        self._work = None
        self._handle = hook_param.register_hook(self._all_reduce)

    @staticmethod
    def create(named_params, hook_param, process_group) -> "DelayedAllReduce | None":
        """torch DDP's delayed all-reduce of `named_params`, their values broadcast from rank 0
        now (before the model check, as torch DDP), or None without named_params."""
        if named_params is None:
            return None
        delayed = DelayedAllReduce(list(named_params), hook_param, process_group)
        delayed.broadcast_from_rank0()
        return delayed

    def broadcast_from_rank0(self) -> None:
        """Rank 0's values of the delayed parameters on every rank (collective; construction)."""
        from pyreducer import sync

        sync.broadcast_coalesced([p.detach() for p in self.params], self.process_group)

    def reset_grads(self) -> None:
        """After a forward: a parameter whose .grad is None gets its view of the buffer back (the
        whole buffer is zeroed if all were None; else the view alone), as torch DDP does."""
        all_none = all(p.grad is None for p in self.params)
        for param, view in zip(self.params, self.views):
            if param.grad is None:
                param.grad = view
                if not all_none:
                    param.grad.zero_()
        if all_none:
            self.buffer.zero_()

    def _all_reduce(self, grad):
        self.buffer.div_(dist.get_world_size(self.process_group))
        self._work = dist.all_reduce(self.buffer, group=self.process_group, async_op=True)
        Variable._execution_engine.queue_callback(self._wait)
        return grad

    def _wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def remove(self) -> None:
        self._handle.remove()
