"""Online bucket autotune: `DistributedDataParallel(model, bucket_cap_mb="auto")`.

It starts with torch DDP's schedule, then, at forward time, every rank in step (the numbers are
AutotuneConfig's fields; `bucket_cap_mb=AutotuneConfig(...)` tunes with others):
  1. after `warmup_iterations` synced iterations: probes the link (a few all-reduces, and on
     CPU how much compute a running all-reduce takes away: LinkModel.contention) and measures
     `measure_iterations` of the current plan (step time = time between synced forwards, the
     slowest rank's);
  2. rank 0 builds a profile from its timeline, plans with the exact planner and a ladder of
     caps (`caps_mb`), and broadcasts the `candidates` distinct plans predicted best (the step
     model ranks plans well but not exactly, so the choice among near-equal plans is left to
     measurement);
  3. each candidate is applied and measured for `measure_iterations` (2, if both are far slower
     than the best so far: see enough_samples);
  4. if the two fastest measured plans (the starting one included) are within `confirm_margin`
     of each other, both are measured `measure_iterations` more (a 4-step median moves by a
     few percent here) and compared on all their steps;
  5. the fastest plan (after a close call, the faster of the two confirmed) is applied for good.
Every decision is rank 0's, broadcast, so all ranks apply the same plans at the same forward.
Plans only change which gradients share a bucket, never the arithmetic of a gradient, so the
gradients are those of the untuned run (bit for bit with 2 ranks; with more, all-reduce
summation order can follow the bucket layout, within float rounding). Decisions are logged
(logger "pyreducer.autotune", and model.autotune_log) and each plan change shows as a new
plan_version in the timeline.
"""
from __future__ import annotations

import enum
import logging
import statistics
import time
from dataclasses import dataclass

from pyreducer import sync
from pyreducer.tuning import planner, stepmodel

logger = logging.getLogger("pyreducer.autotune")


@dataclass(frozen=True)
class AutotuneConfig:
    """What online autotune measures and how it decides (defaults: what was tuned on the
    emulated 1-10 Gbit/s hosts of benchmarks/results/).

    Attributes:
        warmup_iterations: synced iterations before anything is measured (the first one uses
            DDP's single bucket, the second rebuilds).
        measure_iterations: synced iterations measured per plan.
        candidates: how many of the distinct plans predicted best are measured.
        caps_mb: the caps (MiB) whose DDP-style plans compete with the planner's optimum.
        abandon_ratio: a candidate whose first 2 steps are both this much slower than the best
            plan so far is dropped after those 2.
        confirm_margin: the two fastest plans are measured `measure_iterations` more each when
            the second is within this fraction of the first.
    """
    warmup_iterations: int = 3
    measure_iterations: int = 4
    candidates: int = 4
    caps_mb: tuple[float, ...] = (0.5, 1, 2, 4, 16, 64)
    abandon_ratio: float = 1.5
    confirm_margin: float = 0.03

    def __post_init__(self):
        checks = [("warmup_iterations >= 1", self.warmup_iterations >= 1),
                  ("measure_iterations >= 2", self.measure_iterations >= 2),
                  ("candidates >= 1", self.candidates >= 1),
                  ("positive caps_mb", all(cap > 0 for cap in self.caps_mb)),
                  ("abandon_ratio > 1", self.abandon_ratio > 1),
                  ("confirm_margin >= 0", self.confirm_margin >= 0)]
        failed = [what for what, ok in checks if not ok]
        if failed:
            raise ValueError(f"AutotuneConfig: expected {', '.join(failed)}; got {self}")


class Phase(enum.Enum):
    WARMUP = "warmup"                    # DDP's schedule, nothing measured yet
    MEASURE_CURRENT = "measure_current"  # the starting plan
    MEASURE = "measure"                  # one candidate after another
    CONFIRM = "confirm"                  # the two fastest again, after a close call
    DONE = "done"                        # the fastest plan applied for good


MEASURED_PHASES = (Phase.MEASURE_CURRENT, Phase.MEASURE, Phase.CONFIRM)


def enough_samples(samples: list[float], best_s: float, config: AutotuneConfig) -> bool:
    """`measure_iterations` step times of a candidate, or 2 that are both more than
    `abandon_ratio` x the best plan measured so far: a bad candidate (a latency misjudged by the
    link probe can make the planner choose hundreds of buckets) then costs two slow steps.
    Samples are the slowest rank's, the same on every rank, so all ranks decide alike."""
    if len(samples) >= config.measure_iterations:
        return True
    return len(samples) >= 2 and min(samples[:2]) > config.abandon_ratio * best_s


def close_call(measured: list[tuple[str, list[list[int]], float]],
               config: AutotuneConfig) -> list:
    """The two fastest (name, plan) of `measured` (name, plan, median seconds) if the second is
    within `confirm_margin` of the first, else []."""
    ranked = sorted(measured, key=lambda m: m[2])
    if len(ranked) >= 2 and ranked[1][2] <= ranked[0][2] * (1 + config.confirm_margin):
        return [(name, plan) for name, plan, _ in ranked[:2]]
    return []


def final_choice(measured: list[tuple[str, list[list[int]], float]],
                 finalists: list[str]) -> tuple[str, list[list[int]], float]:
    """The fastest of `measured` (name, plan, median seconds); after a close call, the faster of
    the `finalists` on all their steps: a third plan measured once must not win because the
    finalists' longer medians moved."""
    among = [m for m in measured if not finalists or m[0] in finalists]
    return min(among, key=lambda m: m[2])


class AutoTuner:
    """Online autotune of one wrapper's buckets through its BucketTuning (tuning/control.py)."""

    def __init__(self, config: AutotuneConfig, tuning, recompiles=lambda: False):
        """recompiles: () -> whether a new plan makes the model recompile (torch.compile:
        pyreducer/compiled): then the first step after each plan change, which pays the
        compilation, is not counted."""
        self.config, self.tuning = config, tuning
        self.recompiles = recompiles
        self.skip_next = False  # the coming step is the first on a new plan, recompiling
        self.phase = Phase.WARMUP
        self.synced = 0
        self.last_forward = None
        self.samples: list[float] = []
        self.candidates: list[tuple[str, list[list[int]]]] = []
        self.plan_of: dict[str, list[list[int]]] = {}  # measured plans by name ...
        self.samples_of: dict[str, list[float]] = {}  # ... and their step times (s)
        self.confirming: list[tuple[str, list[list[int]]]] = []
        self.finalists: list[str] = []  # after a close call: the two plans the choice is between
        self.log: list[dict] = []
        self.link = None

    @property
    def done(self) -> bool:
        """The plan is chosen for good."""
        return self.phase is Phase.DONE

    @property
    def group(self):
        return self.tuning.params.process_group

    def _note(self, event: str, **fields) -> None:
        entry = dict(event=event, iteration=self.synced, **fields)
        self.log.append(entry)
        if self.tuning.params.rank == 0:
            logger.info("%s", entry)

    def before_forward(self) -> None:
        """Called at the start of the first synced forward (grad enabled, sync on) after each
        synced backward, and of the first: on every rank at the same point."""
        if self.phase is Phase.DONE:
            return
        sync.wait_for_device(self.tuning.params.device)  # on CUDA: time the work, not its enqueue
        now = time.perf_counter()
        if self.last_forward is not None and self.phase in MEASURED_PHASES:
            if self.skip_next:  # the same on every rank (the same model, compiled alike)
                self.skip_next = False
            else:
                self.samples.append(sync.slowest(now - self.last_forward, self.group,
                                                 self.tuning.params.device))
        self.synced += 1
        self._advance()
        # The step time is measured from here: time spent in the tuner itself is excluded.
        self.last_forward = time.perf_counter()

    def _advance(self) -> None:
        config = self.config
        if self.phase is Phase.WARMUP and self.synced > config.warmup_iterations:
            if self.tuning.params.world_size < 2:
                self._keep_current("one rank: no communication to tune")
                return
            try:
                self.link = self.tuning.probe()
            except ValueError as error:  # e.g. times that do not grow with size; every rank
                self._keep_current(f"link probe unusable: {error}")  # sees the slowest's
                return
            self._note("link", latency_us=self.link.latency_s * 1e6,
                       bandwidth_gbit=self.link.bandwidth_bytes_per_s * 8 / 1e9,
                       contention=self.link.contention)  # latency: under load on CPU
            self.phase, self.samples = Phase.MEASURE_CURRENT, []
        elif self.phase is Phase.MEASURE_CURRENT and len(self.samples) >= config.measure_iterations:
            self._record("start", self.tuning.current_plan())
            self.candidates = self._plan()
            self._next_candidate()
        elif self.phase is Phase.MEASURE and enough_samples(
                self.samples, min(m[2] for m in self._measured()), config):
            name, plan = self.candidates.pop(0)
            self._record(name, plan)
            self._note("measured", plan=name, step_ms=statistics.median(self.samples) * 1e3,
                       steps=len(self.samples))
            self._next_candidate()
        elif self.phase is Phase.CONFIRM and len(self.samples) >= config.measure_iterations:
            name, plan = self.confirming.pop(0)
            self._record(name, plan)
            pooled = self.samples_of[name]
            self._note("confirmed", plan=name, step_ms=statistics.median(pooled) * 1e3,
                       steps=len(pooled))
            self._next_candidate()

    def _keep_current(self, why: str) -> None:
        """Ends tuning with the plan in force (the same decision on every rank)."""
        self.phase = Phase.DONE
        self._note("chosen", plan="start", reason=why, buckets=len(self.tuning.current_plan()))

    def _record(self, name: str, plan: list[list[int]]) -> None:
        """Adds this phase's step times to plan `name`'s."""
        self.plan_of[name] = plan
        self.samples_of[name] = self.samples_of.get(name, []) + self.samples

    def _measured(self) -> list[tuple[str, list[list[int]], float]]:
        """(name, plan, median step seconds) of every plan measured so far."""
        return [(name, plan, statistics.median(self.samples_of[name]))
                for name, plan in self.plan_of.items()]

    def _plan(self) -> list[tuple[str, list[list[int]]]]:
        """Rank 0 predicts; everyone receives its candidates."""
        candidates = None
        if self.tuning.params.rank == 0:
            profile = self.tuning.profile()
            ranks = self.tuning.params.world_size
            options = [("optimal", planner.best_plan(profile, self.link, ranks))]
            options += [(f"cap {mb} MB", stepmodel.cap_plan(profile, [int(mb * 2**20)]))
                        for mb in self.config.caps_mb]
            scored = sorted(((name, plan, stepmodel.predict_step_ms(profile, plan, self.link,
                                                                     ranks))
                             for name, plan in options), key=lambda o: o[2])
            candidates = []
            for name, plan, predicted in scored:
                if all(plan != other for _, other, _ in candidates):
                    candidates.append((name, plan, predicted))
            candidates = candidates[:self.config.candidates]
        candidates = sync.from_rank0(candidates, self.group, self.tuning.params.device)
        for name, plan, predicted in candidates:
            self._note("candidate", plan=name, buckets=len(plan), predicted_ms=predicted)
        return [(name, plan) for name, plan, _ in candidates]

    def _next_candidate(self) -> None:
        self.samples = []
        if self.candidates:
            self.tuning.apply_bucket_plan(self.candidates[0][1])
            self.skip_next = self.recompiles()
            self.phase = Phase.MEASURE
            return
        if self.phase is Phase.MEASURE:  # all candidates measured once
            self.confirming = close_call(self._measured(), self.config)
            self.finalists = [name for name, _ in self.confirming]
        if self.confirming:
            self.tuning.apply_bucket_plan(self.confirming[0][1])
            self.skip_next = self.recompiles()
            self.phase = Phase.CONFIRM
            return
        name, plan, seconds = final_choice(self._measured(), self.finalists)
        self.tuning.apply_bucket_plan(plan)
        self.phase = Phase.DONE
        self._note("chosen", plan=name, step_ms=seconds * 1e3, buckets=len(plan))
