"""Uneven inputs: `with model.join(): ...`, torch's Join protocol, as torch DDP implements it.

Ranks that run out of data "join": until every rank has, each joined rank shadows, in the same
order, every collective that a training rank issues per iteration (join notification, bucket
rebuild, buffer broadcast, the "does backward sync" vote, one all-reduce of zeros per bucket,
and the used-parameter map). Joined ranks contribute zero gradients; gradients are divided by
the initial world size, as DDP's default. At the end the last rank to join broadcasts its
model to all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from pyreducer import sync


class ReducerJoinHook(JoinHook):
    def __init__(self, ddp, divide_by_initial_world_size: bool = True):
        if not divide_by_initial_world_size:
            raise NotImplementedError(
                "pyreducer's join() supports divide_by_initial_world_size=True only (torch DDP's "
                "default): gradients are averaged over the initial world size.")
        self.ddp = ddp

    def main_hook(self) -> None:
        """Shadows one iteration of a training rank's collectives."""
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and ddp._module_buffers():
            ddp._sync_buffers(joined=True)
        should_sync = vote_backward_sync(ddp, joined=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        works = [dist.all_reduce(torch.zeros(numel, dtype=dtype, device=device),
                                 group=ddp.process_group, async_op=True)
                 for numel, dtype, device in ddp._bucket_shapes()]
        for work in works:
            work.wait()
        if ddp.find_unused_parameters and not ddp.static_graph:
            used = torch.zeros(len(ddp._params), dtype=torch.int32, device=ddp._device)
            dist.all_reduce(used, group=ddp.process_group)
        ddp.reducer.complete_ready_order()  # a shadowed backward counts for the rebuild

    def post_hook(self, is_last_joiner: bool) -> None:
        """The last rank to join holds the authoritative model: broadcast it to all."""
        ddp = self.ddp
        src = find_common_rank(ddp, is_last_joiner)
        states = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        if ddp.forward_sync_buffers:
            states += ddp._module_buffers()
        sync.broadcast_coalesced(states, ddp.process_group, src=src)


def vote_backward_sync(ddp, joined: bool) -> bool | None:
    """All-reduce of "I will sync gradients"; a joined rank waits and learns the answer."""
    flag = torch.ones(1, device=ddp._device) if not joined and ddp.require_backward_grad_sync \
        else torch.zeros(1, device=ddp._device)
    work = dist.all_reduce(flag, group=ddp.process_group, async_op=True)
    if not joined:
        return None
    work.wait()
    return flag.item() != 0


def find_common_rank(ddp, candidate: bool) -> int:
    """The largest group rank among the candidates (all ranks must call it)."""
    rank = torch.tensor([dist.get_rank(ddp.process_group) if candidate else -1],
                        device=ddp._device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    if rank.item() < 0:
        raise RuntimeError("pyreducer join: no rank qualified as the authoritative copy")
    return int(rank.item())
