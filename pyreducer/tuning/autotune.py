"""Online bucket autotune: `DistributedDataParallel(model, bucket_cap_mb="auto")`.

It starts with torch DDP's schedule, then, at forward time, every rank in step:
  1. after WARMUP synced iterations: probes the link (a few all-reduces, and on CPU how much
     compute a running all-reduce takes away: LinkModel.contention) and measures MEASURE
     iterations of the current plan (step time = time between synced forwards, the slowest
     rank's);
  2. rank 0 builds a profile from its timeline, plans with the exact planner and a ladder of
     caps, and broadcasts the TOP distinct plans predicted best (the step model ranks plans
     well but not exactly, so the choice among near-equal plans is left to measurement);
  3. each candidate is applied and measured for MEASURE iterations (2, if both are far slower
     than the best so far: see enough_samples);
  4. if the two fastest measured plans (the starting one included) are within CONFIRM of each
     other, both are measured MEASURE iterations more (a 4-step median moves by a few percent
     here) and compared on all their steps;
  5. the fastest plan is applied for good.
Every decision is rank 0's, broadcast, so all ranks apply the same plans at the same forward.
Plans only change which gradients share a bucket, never the arithmetic of a gradient, so the
gradients are those of the untuned run (bit for bit with 2 ranks; with more, all-reduce
summation order can follow the bucket layout, within float rounding). Decisions are logged
(logger "pyreducer.autotune", and model.autotune_log) and each plan change shows as a new
plan_version in the timeline.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch.distributed as dist

from pyreducer import sync
from pyreducer.tuning import planner, stepmodel
from pyreducer.tuning.linkmodel import probe_contention, probe_link

logger = logging.getLogger("pyreducer.autotune")
WARMUP, MEASURE, TOP, CAPS_MB = 3, 4, 4, (0.5, 1, 2, 4, 16, 64)
ABANDON = 1.5  # a candidate whose first 2 steps are this much slower than the best is dropped
CONFIRM = 0.03  # the two best plans are measured again when this close


def probe(model):
    """The link model of `model`'s process group (collective): latency and bandwidth, and, for
    CPU parameters, the compute a running all-reduce takes and its latency beside compute
    (probe_contention). On GPU the collectives run beside the compute kernels: left as probed."""
    device = next(model.parameters()).device  # NCCL groups take only CUDA tensors
    link, _ = probe_link(model.process_group, device=device)
    if device.type == "cpu":
        link = probe_contention(link, model.process_group)
    return link


def enough_samples(samples: list[float], best_s: float) -> bool:
    """MEASURE step times of a candidate, or 2 that are both more than ABANDON x the best plan
    measured so far: a bad candidate (a latency misjudged by the link probe can make the planner
    choose hundreds of buckets) then costs two slow steps instead of MEASURE. Samples are the
    slowest rank's, the same on every rank, so all ranks decide alike."""
    if len(samples) >= MEASURE:
        return True
    return len(samples) >= 2 and min(samples[:2]) > ABANDON * best_s


def close_call(measured: list[tuple[str, list[list[int]], float]]) -> list:
    """The two fastest (name, plan) of `measured` (name, plan, median seconds) if the second is
    within CONFIRM of the first, else []."""
    ranked = sorted(measured, key=lambda m: m[2])
    if len(ranked) >= 2 and ranked[1][2] <= ranked[0][2] * (1 + CONFIRM):
        return [(name, plan) for name, plan, _ in ranked[:2]]
    return []


class AutoTuner:
    def __init__(self):
        self.phase = "warmup"
        self.synced = 0
        self.last_forward = None
        self.samples: list[float] = []
        self.candidates: list[tuple[str, list[list[int]]]] = []
        self.plan_of: dict[str, list[list[int]]] = {}  # measured plans by name ...
        self.samples_of: dict[str, list[float]] = {}  # ... and their step times (s)
        self.confirming: list[tuple[str, list[list[int]]]] = []
        self.log: list[dict] = []
        self.link = None

    def _note(self, model, event: str, **fields) -> None:
        entry = dict(event=event, iteration=self.synced, **fields)
        self.log.append(entry)
        if dist.get_rank(model.process_group) == 0:
            logger.info("%s", entry)


    def before_forward(self, model) -> None:
        """Called at the start of every synced forward (grad enabled, sync on)."""
        if self.phase == "done":
            return
        now = time.perf_counter()
        if self.last_forward is not None and self.phase in ("measure_current", "measure",
                                                             "confirm"):
            self.samples.append(sync.slowest(now - self.last_forward, model.process_group))
        self.synced += 1
        if self.phase == "warmup" and self.synced > WARMUP:
            self.link = probe(model)
            self._note(model, "link", latency_us=self.link.latency_s * 1e6,
                       bandwidth_gbit=self.link.bandwidth_bytes_per_s * 8 / 1e9,
                       contention=self.link.contention)  # latency: under load on CPU
            self.phase, self.samples = "measure_current", []
        elif self.phase == "measure_current" and len(self.samples) >= MEASURE:
            current = model.reducer.bucket_layout()
            self._record("start", [b["param_indices"] for b in current])
            self.candidates = self._plan(model)
            self._next_candidate(model)
        elif self.phase == "measure" and enough_samples(
                self.samples, min(m[2] for m in self._measured())):
            name, plan = self.candidates.pop(0)
            self._record(name, plan)
            self._note(model, "measured", plan=name, step_ms=statistics.median(self.samples) * 1e3,
                       steps=len(self.samples))
            self._next_candidate(model)
        elif self.phase == "confirm" and len(self.samples) >= MEASURE:
            name, plan = self.confirming.pop(0)
            self._record(name, plan)
            pooled = self.samples_of[name]
            self._note(model, "confirmed", plan=name, step_ms=statistics.median(pooled) * 1e3,
                       steps=len(pooled))
            self._next_candidate(model)
        # The step time is measured from here: time spent in the tuner itself is excluded.
        self.last_forward = time.perf_counter()

    def _record(self, name: str, plan: list[list[int]]) -> None:
        """Adds this phase's step times to plan `name`'s."""
        self.plan_of[name] = plan
        self.samples_of[name] = self.samples_of.get(name, []) + self.samples

    def _measured(self) -> list[tuple[str, list[list[int]], float]]:
        """(name, plan, median step seconds) of every plan measured so far."""
        return [(name, plan, statistics.median(self.samples_of[name]))
                for name, plan in self.plan_of.items()]

    def _plan(self, model) -> list[tuple[str, list[list[int]]]]:
        """Rank 0 predicts; everyone receives its candidates."""
        candidates = None
        if dist.get_rank(model.process_group) == 0:
            profile = model.profile()
            ranks = dist.get_world_size(model.process_group)
            options = [("optimal", planner.best_plan(profile, self.link, ranks))]
            options += [(f"cap {mb} MB", stepmodel.cap_plan(profile, [int(mb * 2**20)]))
                        for mb in CAPS_MB]
            scored = sorted(((name, plan, stepmodel.predict_step_ms(profile, plan, self.link,
                                                                     ranks))
                             for name, plan in options), key=lambda o: o[2])
            candidates = []
            for name, plan, predicted in scored:
                if all(plan != other for _, other, _ in candidates):
                    candidates.append((name, plan, predicted))
            candidates = candidates[:TOP]
        candidates = sync.from_rank0(candidates, model.process_group)
        for name, plan, predicted in candidates:
            self._note(model, "candidate", plan=name, buckets=len(plan), predicted_ms=predicted)
        return [(name, plan) for name, plan, _ in candidates]

    def _next_candidate(self, model) -> None:
        self.samples = []
        if self.candidates:
            model.apply_bucket_plan(self.candidates[0][1])
            self.phase = "measure"
            return
        if self.phase == "measure":  # all candidates measured once
            self.confirming = close_call(self._measured())
        if self.confirming:
            model.apply_bucket_plan(self.confirming[0][1])
            self.phase = "confirm"
            return
        name, plan, seconds = min(self._measured(), key=lambda m: m[2])
        model.apply_bucket_plan(plan)
        self.phase = "done"
        self._note(model, "chosen", plan=name, step_ms=seconds * 1e3, buckets=len(plan))
