"""Uneven inputs: `with model.join(): ...`, torch's Join protocol, as torch DDP implements it.

Ranks that run out of data "join": until every rank has, each joined rank shadows, in the same
order, every collective that a training rank issues per iteration (join notification, bucket
rebuild, buffer broadcast, the "does backward sync" vote, then, if the training ranks sync, the
autotune's measurements (bucket_cap_mb="auto") and the Reducer's shadow_backward: each bucket
zeroed and reduced as the training ranks reduce it, through the communication hook if one is
registered, and the used-parameter map where they all-reduce one). Joined ranks contribute zero
gradients; gradients are divided by the initial world size (DDP's default), or with
divide_by_initial_world_size=False by the ranks still training (the wrapper reads their number
from the join notification's all-reduce). At the end the last rank to join broadcasts its model
to all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from pyreducer.wrapper import sync


class ReducerJoinHook(JoinHook):
    """torch's JoinHook for one wrapper: `ddp` for its public state (reducer, sync flags),
    `params` (its ReducedParams) for everything else, and its `autotune` (or None), whose
    measurements a joined rank takes part in."""

    def __init__(self, ddp, params, autotune=None):
        self.ddp, self.params, self.autotune = ddp, params, autotune

    def main_hook(self) -> None:
        """Shadows one iteration of a training rank's collectives."""
        ddp, params = self.ddp, self.params
        ddp.reducer.rebuild_buckets()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and params.buffers():
            sync.sync_buffers(params, src=find_common_rank(params, candidate=False))
        should_sync = vote_backward_sync(params, will_sync=False, joined=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        if self.autotune is not None:
            self.autotune.before_forward()
        ddp.reducer.shadow_backward()  # the buckets (through the comm hook), the used map

    def post_hook(self, is_last_joiner: bool) -> None:
        """The last rank to join holds the authoritative model: broadcast it to all."""
        src = find_common_rank(self.params, is_last_joiner)
        sync.broadcast_coalesced(self.params.states(with_buffers=self.ddp.forward_sync_buffers),
                                 self.params.process_group, src=src)


def refuse_unjoinable(skip_unused: bool, delayed: bool, overlapped: bool = False,
                      check_finite: bool = False) -> None:
    """What join() cannot shadow, refused with the reason (torch DDP hangs on the first two):
    the buckets skipped by skip_all_reduce_unused_params (a joined rank cannot know which), the
    delayed all-reduce (issued from a gradient hook, it has no shadow), and an overlapped
    optimizer (not supported with uneven inputs yet)."""
    for refused, why in ((skip_unused, "skip_all_reduce_unused_params (joined ranks cannot know "
                                       "which buckets the training ranks skip)"),
                         (delayed, "delay_all_reduce_named_params (its all-reduce, issued from "
                                   "a gradient hook, has no shadow on joined ranks)"),
                         (overlapped, "an overlapped optimizer (model.overlap_optimizer)"),
                         (check_finite, "check_finite=True (joined ranks shadow backward "
                                        "without the check; Note [Finite check])")):
        if refused:
            raise ValueError(f"pyreducer: join() cannot be combined with {why}")


def vote_backward_sync(params, will_sync: bool, joined: bool) -> bool | None:
    """All-reduce of "I will sync gradients"; a joined rank waits and learns the answer."""
    flag = torch.ones(1, device=params.device) if will_sync and not joined \
        else torch.zeros(1, device=params.device)
    work = dist.all_reduce(flag, group=params.process_group, async_op=True)
    if not joined:
        return None
    work.wait()
    return flag.item() != 0


def find_common_rank(params, candidate: bool) -> int:
    """The largest group rank among the candidates (all ranks must call it)."""
    rank = torch.tensor([params.rank if candidate else -1], device=params.device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=params.process_group)
    if rank.item() < 0:
        raise RuntimeError("pyreducer join: no rank qualified as the authoritative copy")
    return int(rank.item())
