"""Plans and installs an overlapped optimizer's schedule (chunks and launch order) at run time:
what OverlapOptimizer(schedule="auto") delegates to (model: pyreducer/tuning/schedule.py).

At the start of a synced forward, on every rank alike (the counters are synced forwards, the
same everywhere): once `warmup` synced iterations ran with the bucket plan in force (and a
bucket autotune, if any, has decided), the link is probed (collective, once), rank 0 builds an
OverlapProfile from its timeline and the overlap events, picks the schedule predicted fastest
and broadcasts it; every rank installs it before the module runs. A new bucket plan (rebuild,
apply_bucket_plan) resets the Reducer to torch DDP's order, and the schedule is planned again
for it after `warmup` more iterations.
"""
from __future__ import annotations

import logging

from pyreducer import sync
from pyreducer import timeline as timeline_module
from pyreducer.tuning import schedule as schedule_model

logger = logging.getLogger("pyreducer.overlap")

WARMUP_ITERATIONS = 4  # synced iterations recorded with a plan before its schedule is made
PROFILE_ITERATIONS = 3  # of which the profile takes the medians


class ScheduleTuner:
    """schedule="auto" of one OverlapOptimizer."""

    def __init__(self, tuning, events, autotune=None, settle=None,
                 warmup: int = WARMUP_ITERATIONS, chunk_bytes: int | None = None):
        self.tuning, self.events, self.autotune = tuning, events, autotune
        self.settle = settle  # completes what is in flight: the probe must not wait behind it
        self.chunk_bytes = chunk_bytes  # fixed by the user; None: chosen by the model
        self.warmup = warmup
        self.link = None
        self.planned_for = None   # the bucket plan the installed schedule was made for
        self.seen_plan = None     # the plan in force at the last synced forward ...
        self.since_change = 0     # ... and the synced forwards since it came into force
        self.log: list[dict] = []

    @property
    def reducer(self):
        return self.tuning.reducer

    def before_synced_forward(self) -> None:
        """Called at the start of every synced forward, before the module runs."""
        params = self.tuning.params
        if params.world_size < 2 or (self.autotune is not None and not self.autotune.done):
            return
        plan = self.tuning.current_plan()
        if plan != self.seen_plan:
            self.seen_plan, self.since_change = plan, 0
        self.since_change += 1
        if plan == self.planned_for or self.since_change <= self.warmup:
            return
        self.planned_for = plan
        if self.link is None:
            if self.settle is not None:
                self.settle()
            self.link = self.tuning.probe()  # collective: every rank is here at this forward
        choice = self._plan() if params.rank == 0 else None
        choice = sync.from_rank0(choice, params.process_group, params.device)
        if choice is None:  # rank 0 could not profile: keep torch DDP's order
            return
        self.reducer.set_launch_order(choice["order"], choice["chunks"])
        self.log.append(choice)
        if params.rank == 0:
            logger.info("overlap schedule: %s, predicted %.2f ms (torch DDP's order %.2f ms)",
                        choice["describe"], choice["predicted_ms"], choice["fifo_predicted_ms"])

    def _plan(self) -> dict | None:
        """Rank 0: the schedule predicted fastest for the plan in force, or None."""
        params = self.tuning.params
        records = timeline_module.records(params, self.reducer, PROFILE_ITERATIONS + 1,
                                          overlap=self.events)
        if not records:
            return None
        version = records[-1]["plan_version"]
        records = [r for r in records if r["plan_version"] == version]
        try:
            profile = schedule_model.OverlapProfile.from_records(records)
        except ValueError as error:
            logger.warning("overlap schedule not planned: %s", error)
            return None
        profile.max_chunks = self.max_chunks()
        lanes = self.lanes()
        if self.chunk_bytes is None:
            best, options = schedule_model.best_schedule(profile, self.link, params.world_size,
                                                         lanes=lanes)
        else:  # the user's size, in the planned order (fifo predicted alongside, as a reference)
            options = schedule_model.best_schedule(profile, self.link, params.world_size,
                                                   candidates=(self.chunk_bytes,), lanes=lanes)[1]
            best = options[-1]
        return dict(order=best.order, chunks=best.chunks, chunk_bytes=best.chunk_bytes,
                    describe=best.describe(), predicted_ms=best.predicted_ms,
                    fifo_predicted_ms=options[0].predicted_ms,
                    candidates=[dict(chunk_bytes=o.chunk_bytes, all_reduces=len(o.order),
                                     predicted_ms=o.predicted_ms) for o in options],
                    lanes=lanes,
                    link=dict(latency_s=self.link.latency_s,
                              bandwidth_bytes_per_s=self.link.bandwidth_bytes_per_s,
                              contention=self.link.contention))

    def lanes(self) -> int:
        """All-reduces the process group runs at once: Gloo's worker threads (2 unless the
        group was made with other options), one for NCCL (one stream)."""
        import torch.distributed as dist

        return 2 if dist.get_backend(self.tuning.params.process_group) == "gloo" else 1

    def max_chunks(self) -> list[int]:
        """Per bucket, the most chunks it may be cut into (1: sparse, or a communication hook)."""
        params, layout = self.tuning.params, self.reducer.bucket_layout()
        if self.reducer.has_comm_hook():
            return [1] * len(layout)
        result = []
        for bucket in layout:
            first = bucket["param_indices"][0]
            if params.sparse and params.sparse[first]:
                result.append(1)
            else:
                element = params.tensors[first].element_size()
                result.append(max(1, bucket["size_bytes"] // element))
        return result
