"""The sharded step's collectives, beside the Reducer's reduce-scatters (Note [Sharded buckets]
in csrc/reducer.h): the parameters' all-gathers, the clip norm's all-reduce, and the state
gathers of a checkpoint. On Gloo they all run on the one-thread backend the reduce-scatters use
(pyreducer/gloo_race.py: a reduce-scatter's op name is long enough for torch's race), so that one
thread issues every sharded collective in one order on every rank; on NCCL, on the group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyreducer import gloo_race, torch_versions


class ShardComm:
    """The sharded collectives of one wrapper's group.

    backend: the one-thread Gloo backend (handed to the Reducer too), or None (the group)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = None
        if self.world_size > 1 and dist.get_backend(group) == "gloo" and \
                torch_versions.GLOO_STATUS_RACE:
            self.backend = gloo_race.one_thread_backend(group, "sharded")  # (collective)

    def all_gather(self, output: torch.Tensor, own: torch.Tensor):
        """Launches the all-gather of every rank's `own` (output's rank-th 1/world_size; in
        place where `own` is that view) into `output`; returns its work."""
        if self.backend is not None:
            return self.backend._allgather_base(output, own)
        return dist.all_gather_into_tensor(output, own, group=self.group, async_op=True)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> None:
        """SUM all-reduce of `tensor` in place, waited for (bounded by the group's timeout);
        `what` names it in an error."""
        if self.backend is not None:
            work = self.backend.allreduce([tensor])
        else:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self.wait(work, what)

    def wait(self, work, what: str) -> None:
        """Waits for `work` (bounded by the group's timeout); a failure names the collective
        and this rank."""
        try:
            work.wait()
        except Exception as error:
            raise RuntimeError(f"pyreducer: the sharded step's {what} failed on rank "
                               f"{self.rank} of {self.world_size}: {error}") from error
