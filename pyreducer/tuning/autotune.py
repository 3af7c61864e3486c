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
  5. the fastest plan (after a close call, the faster of the two confirmed) is applied for good,
     said in one line on rank 0 (announce.py), and remembered (memory.py): a later run with the
     same parameters, world size, backend and link applies it after the probe and times one
     window (`measure_iterations`) instead of 2-5; the search runs if that window is slow.
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

from pyreducer.tuning import announce, memory, planner, stepmodel
from pyreducer.wrapper import sync

logger = logging.getLogger("pyreducer.autotune")


# Note [Probe in pieces]
# A link probe run whole at one forward takes ~1.7 s at 1 Gbit/s (all-reduces up to 16 MiB, 5
# times each, then the contention probe), a step 4-5 times as long as the bench models', which
# puts the 12-step window around it 30-40% above torch DDP's (benchmarks/results/
# tuning_phase_20261128.md). So the probe is small (few repetitions, 16 MiB once:
# control.PROBE_REPS) and runs in pieces of at most ~0.16 s there (2
# MiB moved, one contention sample, the latency under load, the queue), one every `probe_every`
# synced forwards while the starting plan (torch DDP's caps) is measured: its step times exclude
# the pieces (they run inside the tuner), and a 12-step window holds 2 of them (up to ~0.26 s,
# +5% at 0.4 s a step; with one every 4, windows holding 3 read 1.07-1.10 of torch DDP).


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
            plan so far is dropped after those 2; after 1, if that one is slower by twice as
            much (1.2x by default): a trial slower than torch DDP's step is what the tuning
            phase must not show.
        prune_ratio: plans the step model predicts slower than this x the starting plan's
            prediction are not measured (its errors were within 4% median, 20% at most).
        confirm_margin: the two fastest plans are measured `measure_iterations` more each when
            the second is within this fraction of the first.
        cache: where decisions are remembered (pyreducer/tuning/memory.py): True for the default
            file ($PYREDUCER_TUNING_CACHE, else ~/.cache/pyreducer/tuning.json), a path, or
            False for none.
        announce: say each decision in one line on rank 0 (pyreducer/tuning/announce.py).
        probe_every: synced forwards between the link probe's pieces (Note [Probe in pieces]):
            6 keeps 2 pieces in a 12-step window; 1 probes in 7 steps (short runs, tests).
    """
    warmup_iterations: int = 3
    measure_iterations: int = 4
    candidates: int = 4
    caps_mb: tuple[float, ...] = (0.5, 1, 2, 4, 16, 64)
    abandon_ratio: float = 1.10
    confirm_margin: float = 0.03
    prune_ratio: float = 1.15
    cache: bool | str = True
    announce: bool = True
    probe_every: int = 6

    def __post_init__(self):
        checks = [("warmup_iterations >= 1", self.warmup_iterations >= 1),
                  ("measure_iterations >= 2", self.measure_iterations >= 2),
                  ("candidates >= 1", self.candidates >= 1),
                  ("positive caps_mb", all(cap > 0 for cap in self.caps_mb)),
                  ("abandon_ratio > 1", self.abandon_ratio > 1),
                  ("prune_ratio >= 1", self.prune_ratio >= 1),
                  ("probe_every >= 1", self.probe_every >= 1),
                  ("confirm_margin >= 0", self.confirm_margin >= 0)]
        failed = [what for what, ok in checks if not ok]
        if failed:
            raise ValueError(f"AutotuneConfig: expected {', '.join(failed)}; got {self}")


class Phase(enum.Enum):
    WARMUP = "warmup"                    # DDP's schedule, nothing measured yet
    MEASURE_CURRENT = "measure_current"  # the starting plan
    RECALL = "recall"                    # a remembered plan, confirmed in one window
    MEASURE = "measure"                  # one candidate after another
    CONFIRM = "confirm"                  # the two fastest again, after a close call
    DONE = "done"                        # the fastest plan applied for good


MEASURED_PHASES = (Phase.MEASURE_CURRENT, Phase.RECALL, Phase.MEASURE, Phase.CONFIRM)


def enough_samples(samples: list[float], best_s: float, config: AutotuneConfig) -> bool:
    """`measure_iterations` step times of a candidate, or 2 that are both more than
    `abandon_ratio` x the best plan measured so far, or 1 more than twice as far above it: a bad
    candidate (a latency misjudged by the link probe can make the planner choose hundreds of
    buckets) then costs one or two slow steps. Samples are the slowest rank's, the same on every
    rank, so all ranks decide alike."""
    if len(samples) >= config.measure_iterations:
        return True
    if not samples:
        return False
    if len(samples) == 1:
        return samples[0] > (2 * config.abandon_ratio - 1) * best_s
    return min(samples[:2]) > config.abandon_ratio * best_s


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
        self.predicted_ms: dict[str, float] = {}  # the step model's, by plan name
        self.start_plan = None  # torch DDP's caps' plan, the one tuning starts from
        self.recalled: dict | None = None  # the remembered entry in force (memory.py)
        self.memory_key: str | None = None  # this wrapper's cache key, once probed
        self.probing = None  # the link probe in progress (a generator: control.probe_steps)
        self.probe_wait = 0  # synced forwards until its next piece

    @property
    def done(self) -> bool:
        """The plan is chosen for good."""
        return self.phase is Phase.DONE

    @property
    def group(self):
        return self.tuning.params.process_group

    @property
    def phase_name(self) -> str:
        """What autotune does at the coming steps, in words ("buckets: measure cap 1 MB")."""
        if self.phase is Phase.MEASURE and self.candidates:
            return f"buckets: measure {self.candidates[0][0]}"
        if self.phase is Phase.CONFIRM and self.confirming:
            return f"buckets: confirm {self.confirming[0][0]}"
        return "decided" if self.phase is Phase.DONE else f"buckets: {self.phase.value}"

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
            self.start_plan = self.tuning.current_plan()
            self.phase, self.samples = Phase.MEASURE_CURRENT, []
            self.probing, self.probe_wait = self.tuning.probe_steps(), 0
            self._probe_piece()
        elif self.phase is Phase.MEASURE_CURRENT and self.probing is not None:
            self._probe_piece()
        elif self.phase is Phase.RECALL and len(self.samples) >= config.measure_iterations:
            self._confirm_recalled()
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

    def _probe_piece(self) -> None:
        """One piece of the link probe every `probe_every` synced forwards (Note [Probe in
        pieces]); after the last, the link is noted and the tuning cache consulted."""
        self.probe_wait -= 1
        if self.probe_wait > 0:
            return
        self.probe_wait = self.config.probe_every
        try:
            next(self.probing)
            return
        except StopIteration as stop:
            self.link, self.probing = stop.value, None
        except ValueError as error:  # e.g. times that do not grow with size; every rank sees
            self.probing = None        # the slowest's
            self._keep_current(f"link probe unusable: {error}")
            return
        self._note("link", latency_us=self.link.latency_s * 1e6,
                   bandwidth_gbit=self.link.bandwidth_bytes_per_s * 8 / 1e9,
                   contention=self.link.contention)  # latency: under load on CPU
        self._recall()

    @property
    def cache_path(self) -> str | None:
        return memory.cache_path(self.config.cache)

    def _recall(self) -> None:
        """After the probe: rank 0 looks the run up in the cache (memory.py) and broadcasts what
        it found; a remembered plan is applied and timed for one window (Phase.RECALL)."""
        params = self.tuning.params
        import torch.distributed as dist

        hook = "/hook" if self.tuning.reducer.has_comm_hook() else ""
        self.memory_key = memory.model_key(params, dist.get_backend(self.group), hook)
        found = (None, "no cache (off)")
        if params.rank == 0 and self.cache_path is not None:
            try:
                found = memory.recall(self.cache_path, self.memory_key, self.link,
                                      len(params.names))
            except Exception as error:  # noqa: BLE001 - the others wait in the broadcast
                found = (None, f"tuning cache not read: {error}")
        entry, why = sync.from_rank0(found, self.group, params.device)
        if entry is None:
            self._note("not recalled", reason=why, key=self.memory_key)
            return
        self.recalled = entry
        self.tuning.apply_bucket_plan(entry["plan"])
        self.skip_next = self.recompiles()
        self.phase, self.samples = Phase.RECALL, []
        self._note("recalled", buckets=len(entry["plan"]), remembered_ms=entry["step_ms"])

    def _confirm_recalled(self) -> None:
        """After the remembered plan's window: kept if within memory.RECALL_TOLERANCE of its
        remembered step time, else the search runs from torch DDP's caps."""
        measured_ms = statistics.median(self.samples) * 1e3
        remembered_ms = self.recalled["step_ms"]
        if measured_ms <= (1 + memory.RECALL_TOLERANCE) * remembered_ms:
            self.phase = Phase.DONE
            self._note("chosen", plan="remembered", step_ms=measured_ms,
                       buckets=len(self.recalled["plan"]), remembered_ms=remembered_ms)
            if self.config.announce:
                announce.say(self.tuning.params, announce.recalled_plan(
                    self.recalled, measured_ms, self.synced, self.cache_path))
            return
        self._note("recall rejected", step_ms=measured_ms, remembered_ms=remembered_ms)
        self.recalled = None
        self.tuning.apply_bucket_plan(self.start_plan)
        self.skip_next = self.recompiles()
        self.phase, self.samples = Phase.MEASURE_CURRENT, []

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
            start_ms = stepmodel.predict_step_ms(profile, self.tuning.current_plan(), self.link,
                                                 ranks)
            candidates = []
            for name, plan, predicted in scored:
                if all(plan != other for _, other, _ in candidates) and \
                        predicted <= self.config.prune_ratio * start_ms:
                    candidates.append((name, plan, predicted))
            candidates = candidates[:self.config.candidates]
            candidates = [("start", [], start_ms)] + candidates  # its prediction only
        candidates = sync.from_rank0(candidates, self.group, self.tuning.params.device)
        self.predicted_ms = {name: predicted for name, _, predicted in candidates}
        candidates = candidates[1:]
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
        start_ms = statistics.median(self.samples_of["start"]) * 1e3
        if self.config.announce:
            announce.say(self.tuning.params, announce.chosen_plan(
                name, len(plan), self.synced, seconds * 1e3, start_ms, self.predicted_ms))
        if self.tuning.params.rank == 0:  # the plan as the Reducer holds it (the schedule's
            # entry is matched against that: the planner's own lists may order indices otherwise)
            memory.remember(self.cache_path, self.memory_key, plan=self.tuning.current_plan(),
                            step_ms=seconds * 1e3,
                            link=dict(latency_s=self.link.latency_s,
                                      bandwidth_bytes_per_s=self.link.bandwidth_bytes_per_s),
                            name=name, decided_after_steps=self.synced)
