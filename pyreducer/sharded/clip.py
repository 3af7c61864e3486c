"""max_grad_norm on shards (Note [Clipping shards]).

Note [Clipping shards]
torch.nn.utils.clip_grad_norm_ takes the norm of each parameter's whole gradient (vector_norm or
_foreach_norm: equal on CPU), the total norm of those norms stacked in parameter order (grouped by
device and dtype), and multiplies every gradient by min(max_norm / (total + 1e-6), 1). The last
step is elementwise; the norms are reductions whose float rounding depends on their order, so
they are taken as torch takes them, over whole gradients:
  - a parameter whose gradient lies in one rank's shard: that rank takes its norm (a 1-D view
    of the same elements in the same memory order reduces to the same value: checked in
    tests/unit/test_sharded_layout.py);
  - a parameter cut by a shard boundary (at most N-1 per bucket): its reduced gradient's pieces
    are all-gathered (each rank's piece padded to the longest) and its lowest owner takes the
    norm of the whole; this is the clip's extra communication;
  - every rank then has every norm (one all-reduce of one float per parameter, each contributed
    by one rank, zeros elsewhere: x + 0 = x), and computes the total and the coefficient as
    torch does, bit for bit.
Which parameters have a gradient (torch's list skips None) is agreed first (an all-reduce of one
flag per parameter): a parameter unused on every rank may have none.
"""
from __future__ import annotations

import torch

from pyreducer.sharded import state as state_module


def clip(pieces, order: list[int], max_norm: float, comm) -> torch.Tensor:
    """Clips the pieces' gradients as clip_grad_norm_(params in `order`, max_norm) clips the whole
    gradients, and returns its total norm. `order`: the optimizer's parameters (indices into
    pieces.params), in its order."""
    layout, params = pieces.layout, pieces.params
    device = params[0].device
    held: dict[int, list[torch.Tensor]] = {}  # param -> this rank's pieces of its gradient
    for piece, tensor in zip(layout.pieces, pieces.tensors):
        if tensor.grad is not None:
            held.setdefault(piece.param, []).append(tensor.grad)
    flags = torch.zeros(len(params), dtype=torch.int32, device=device)
    for param in held:
        flags[param] = 1
    comm.all_reduce_sum(flags, "all-reduce of which parameters have a gradient to clip")
    has_grad = flags.cpu().tolist()
    norms = torch.zeros(len(params), dtype=torch.float64, device=device)  # (x + 0 == x)
    owners = pieces.owners()
    for param in range(len(params)):
        if not has_grad[param]:
            continue
        if len(owners[param]) == 1:  # whole on one rank
            if param in held:
                norms[param] = torch.linalg.vector_norm(held[param][0]).double()
            continue
        states = [{"g": t.grad} if piece.param == param and t.grad is not None else None
                  for piece, t in zip(layout.pieces, pieces.tensors)]
        whole = state_module.gather_param(comm, layout, states, param, "g",
                                          params[param].dtype, device)
        if owners[param][0] == comm.rank:
            norms[param] = torch.linalg.vector_norm(whole).double()
    comm.all_reduce_sum(norms, "all-reduce of the gradients' norms (max_grad_norm)")
    listed = [i for i in dict.fromkeys(order) if has_grad[i]]
    if not listed:
        return torch.tensor(0.0)  # (torch's, for no gradients)
    groups: dict = {}
    for i in listed:  # torch groups by (device, dtype), in order of first appearance
        groups.setdefault((params[i].device, params[i].dtype), []).append(i)
    total = torch.linalg.vector_norm(torch.stack(
        [norms[i].to(params[i].dtype) for key in groups for i in groups[key]]))
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for grads in held.values():
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
    return total
