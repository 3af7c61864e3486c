"""The tuning methods of pyreducer.DistributedDataParallel (profile, plan, apply, autotune log)."""
from __future__ import annotations

import torch.distributed as dist

from pyreducer import bucketing, sync


class TuningMixin:
    """Mixed into DistributedDataParallel; uses its reducer, parameters and process group."""

    @property
    def autotune_log(self) -> list[dict]:
        return self._autotune.log if self._autotune is not None else []

    def profile(self, forward_ms: float = 0.0, optimizer_ms: float = 0.0, last: int = 3):
        """This rank's step profile (gradient ready times, sizes) from the last iterations."""
        from pyreducer.tuning.stepmodel import Profile

        records = self.timeline(last)
        if not records:
            raise RuntimeError("profile(): no recorded iteration yet (run a synced step first, "
                               "with timeline_iterations > 0)")
        return Profile.from_timeline(records, [p.numel() * p.element_size() for p in self._params],
                                     forward_ms, optimizer_ms,
                                     [bucketing.group_key(p) for p in self._params])

    def plan_buckets(self, link=None, forward_ms: float = 0.0, optimizer_ms: float = 0.0) -> dict:
        """The plan that minimises the predicted step time, next to the current plan's and torch
        DDP's default; call on every rank (probes the link, and on CPU its contention, unless
        `link` is given; rank 0's answer is broadcast). Apply it with apply_bucket_plan(result["plan"]) or save it."""
        from pyreducer.tuning import autotune, planner, stepmodel

        if link is None:
            link = autotune.probe(self)
        result = None
        if dist.get_rank(self.process_group) == 0:
            ranks = dist.get_world_size(self.process_group)
            prof = self.profile(forward_ms, optimizer_ms)
            best = planner.best_plan(prof, link, ranks)
            current = [b["param_indices"] for b in self.reducer.bucket_layout()]
            default = stepmodel.cap_plan(prof, bucketing.caps_bytes(None, None))
            names = self._param_names
            result = dict(
                plan=[[names[i] for i in b] for b in best],
                predicted_ms=stepmodel.predict_step_ms(prof, best, link, ranks),
                current_predicted_ms=stepmodel.predict_step_ms(prof, current, link, ranks),
                ddp_default_predicted_ms=stepmodel.predict_step_ms(prof, default, link, ranks),
                link=dict(latency_s=link.latency_s,
                          bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                          contention=link.contention))
        return sync.from_rank0(result, self.process_group)

    def apply_bucket_plan(self, plan) -> None:
        """Uses `plan` (parameter indices or names per bucket, launch order) from now on; call on
        every rank between iterations; rank 0's plan is the one applied."""
        if plan and plan[0] and isinstance(plan[0][0], str):
            plan = bucketing.plan_from_names(plan, self._param_names)
        self.reducer.apply_plan(sync.from_rank0(plan, self.process_group))

