"""The sharded step's collectives, beside the Reducer's reduce-scatters (Note [Sharded buckets]
in csrc/reducer.h): the parameters' all-gathers, the clip norm's all-reduce, and the state
gathers of a checkpoint. On NCCL, on the group. On Gloo, the buckets' reduce-scatters and
all-gathers travel in rings of sends and receives (Note [Ring collectives on Gloo] in
csrc/ring.h: Gloo's own reduce-scatter costs an all-reduce, and may sum in another order than
its all-reduce, torch DDP's; the rings sum in that order), on a Gloo backend of their own; the
rest runs on a one-thread Gloo backend (pyreducer/wrapper/gloo_race.py: torch's race on long op
names), as do the reduce-scatters and all-gathers beyond the rings' world sizes (RingCollectives.
max_world_size, 64 ranks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pyreducer._ext import _C
from pyreducer.wrapper import gloo_race, torch_versions



class ShardComm:
    """The sharded collectives of one wrapper's group.

    backend: the one-thread Gloo backend (handed to the Reducer too), or None (the group)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = self.ring = None
        if self.world_size > 1 and dist.get_backend(group) == "gloo":  # (collective: backends)
            if torch_versions.GLOO_STATUS_RACE:
                self.backend = gloo_race.one_thread_backend(group, "sharded")
            if self.world_size <= _C.RingCollectives.max_world_size:
                timeout_ms = int(gloo_race.group_timeout(group).total_seconds() * 1000)
                self.ring = _C.RingCollectives(gloo_race.one_thread_backend(group, "ring"),
                                               timeout_ms)

    def all_gather(self, output: torch.Tensor, own: torch.Tensor):
        """Launches the all-gather of every rank's `own` (output's rank-th 1/world_size; in
        place where `own` is that view) into `output`; returns its work."""
        if self.ring is not None:  # in place: `own` goes to output's rank-th chunk first
            place = output.narrow(0, self.rank * own.numel(), own.numel())
            if place.data_ptr() != own.data_ptr():
                place.copy_(own)
            return self.ring.all_gather(output, "all-gather of a bucket's parameters")
        if self.backend is not None:
            return self.backend._allgather_base(output, own)
        return dist.all_gather_into_tensor(output, own, group=self.group, async_op=True)

    def gather_bucket(self, flat: torch.Tensor, own: torch.Tensor, plan,
                      current_stream) -> "PlannedGather | WholeGather":
        """Starts bucket `flat`'s all-gather as `plan` (gather_plan.GatherPlan) orders it: in
        rings, each piece of this rank's own region (`own`) sent once marked ready; with
        plan.order "whole", the whole buffer, launched once every segment is (see
        Note [Gathers in read order]). `current_stream()`: the stream a wait is for (None
        where streams do not apply, on CPU; Note [Streams of a sharded step] in
        pyreducer/sharded/optimizer.py)."""
        if self.ring is not None and plan.order != "whole":
            job = self.ring.all_gather_planned(flat, list(plan.begins), list(plan.ends),
                                               list(plan.sends[self.rank]),
                                               list(plan.receives(self.rank)),
                                               PlannedGather.WHAT)
            return PlannedGather(self, job)
        return WholeGather(self, flat, own, len(plan.segments), current_stream)

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


class PlannedGather:
    """A bucket's all-gather in rings, piece by piece in read order (csrc/ring.h: a planned
    RingCollectives.all_gather). Gloo's, on CPU tensors: a wait is the host's, no stream's."""

    WHAT = "all-gather of a bucket's parameters"

    def __init__(self, comm: ShardComm, job):
        self.comm, self.job = comm, job
        self.streams = ()  # (no stream waits for it: see WholeGather.streams)

    def ready(self, begin: int, end: int) -> None:
        """This rank's elements in [begin, end) are stepped: they may go."""
        self.job.mark_ready(begin, end)

    def wait(self, begin: int, end: int) -> None:
        """Until elements [begin, end) are here (bounded by the group's timeout)."""
        self.comm.wait(_Range(self.job, begin, end), self.WHAT)

    def wait_all(self) -> None:
        self.comm.wait(self.job, self.WHAT)

    def done_ns(self) -> int:
        """When the whole gather was there (the timeline's clock), once waited for."""
        return self.job.done_ns()

    def cancel(self, why: str) -> None:
        """No more segments will be ready (this rank failed): the gather fails, not hangs here."""
        self.job.cancel(why)


class _Range:
    """Part of a planned gather, waited for as a work is."""

    def __init__(self, job, begin: int, end: int):
        self.job, self.begin, self.end = job, begin, end

    def wait(self) -> None:
        self.job.wait_range(self.begin, self.end)


class WholeGather:
    """A bucket's all-gather as one collective of the group (NCCL; Gloo beyond the rings' world
    sizes, or at world size 1): launched once all of its `segments` are ready, waited for whole.

    On NCCL a wait makes only the current stream wait for the gather, so every stream that reads
    the buffer waits for it itself: the work is kept, and waited for once per stream
    (`current_stream()`; None on CPU, where the first wait is the host's and covers every later
    read). `streams`: the streams that waited, on which the buffer is recorded before it is
    released (Note [Streams of a sharded step] in pyreducer/sharded/optimizer.py)."""

    def __init__(self, comm: ShardComm, flat: torch.Tensor, own: torch.Tensor, segments: int,
                 current_stream):
        self.comm, self.flat, self.own, self.left = comm, flat, own, segments
        self.current_stream = current_stream
        self.work, self.waited_ns, self.streams = None, 0, []

    def ready(self, begin: int, end: int) -> None:
        self.left -= 1
        if self.left == 0:
            self.work = self.comm.all_gather(self.flat, self.own)

    def wait(self, begin: int, end: int) -> None:
        self.wait_all()

    def wait_all(self) -> None:
        if self.left > 0:
            raise RuntimeError(f"pyreducer: the sharded step's all-gather on rank "
                               f"{self.comm.rank} was waited for with {self.left} segments not "
                               "stepped")
        stream = self.current_stream()
        if self.work is not None and stream not in self.streams:
            self.comm.wait(self.work, PlannedGather.WHAT)  # (NCCL: this stream waits)
            self.streams.append(stream)
            if not self.waited_ns:
                self.waited_ns = _C.Reducer.now_ns()

    def done_ns(self) -> int:
        """When the whole gather was first waited for (the timeline's clock)."""
        return self.waited_ns

    def cancel(self, why: str) -> None:
        """Not launched yet: nothing to stop."""
