"""Plans and installs an overlapped optimizer's schedule (chunks and launch order) at run time:
what OverlapOptimizer(schedule="auto") delegates to (model: pyreducer/overlap/schedule.py).

At the start of a synced forward, on every rank alike (the counters are synced forwards, the
same everywhere): once `warmup` synced iterations ran with the bucket plan in force (and a
bucket autotune, if any, has decided), on CPU parameters HELD_ITERATIONS + 1 iterations run
held (_hold: every all-reduce waits for the bucket full last, and is completed before the next
forward), which time the compute alone; then the link is probed (collective, once), rank 0
builds an OverlapProfile from its timeline and the overlap events (the held iterations' compute;
the contention measured in place, logged: contention.py) and
broadcasts the candidates: the TRIALS schedules the step model predicts fastest (on the probed
link, its bandwidth scaled to what the profiled backwards got from it: schedule.loaded_link),
and torch DDP's step barrier
(deferred completion off: every reduction completes at the backward's end). Every rank then
installs each in turn for 1 + TRIAL_ITERATIONS synced iterations (the first, whose backward ran
under the previous schedule, is not timed), in ROUNDS rounds, every other one in reverse order
so that a drift of the machine's speed weighs on all alike. Each rank times its window of
TRIAL_ITERATIONS steps between its synced forwards (no collective per step: it would wait
behind the reductions in flight and erase the overlap being measured); at the end the ranks
gather their windows, a window counts as its slowest rank's mean step (the benchmark's
measure), and a candidate as the median of its windows (with two rounds, their mean; Note
[Trial windows]). The lowest wins (choose: the barrier, unless an overlapped schedule measured
MARGIN faster), the same on every rank. If an overlapped schedule won, it runs off against
the barrier in RUNOFF_WINDOWS fresh windows each, alternating, and choose decides again on
those alone. Every rank installs the winner for good. The model ranks the schedules (on the
bench models its predictions were within 10% of the trials' times for 12-16 of 20, and of the
benchmark's for 2-5 of 5, in five runs: benchmarks/results/overlap_inplace_20261125.md), and
measurement decides among the best few, as bucket autotune does. With a fixed
chunk size there is one candidate, installed at once. A new bucket plan (rebuild,
apply_bucket_plan) resets the Reducer to torch DDP's order, and the schedule is planned again
for it after `warmup` more iterations.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics

from pyreducer.overlap import contention
from pyreducer.overlap import schedule as schedule_model
from pyreducer.overlap import stepclock
from pyreducer.overlap.schedule_recall import ScheduleRecall
from pyreducer.wrapper import sync
from pyreducer.wrapper import timeline as timeline_module

logger = logging.getLogger("pyreducer.overlap")

WARMUP_ITERATIONS = 4  # synced iterations recorded with a plan before its schedule is made (after
# bucket autotune, which runs under the barrier: Note [Caps tuned for the barrier])
PROFILE_ITERATIONS = 3  # of which the profile takes the medians
HELD_ITERATIONS = 5  # then timed with every all-reduce held to the backward's end (_hold); 5,
# not 3: in run 13 of benchmarks/results/overlap_runoff_20261125.md two of vgg's three held
# backwards were slow (196 and 162 ms against 121), and the model planned on 162
TRIALS = 3  # candidates measured, the model's best first
TRIAL_ITERATIONS = 4  # steps timed per candidate and round (after one to let it take over)
ROUNDS = 2  # rounds over the candidates, every other one in reverse order (drift cancels)
RUNOFF_WINDOWS = 3  # then per side, if an overlap won: barrier, it, it, barrier, barrier, it
MARGIN = 0.02  # an overlapped schedule is kept only if it measured this much faster than the
# barrier

# Note [Trial windows]
# With the step crossed, one rank's step-to-step intervals swing by 10-20% while its lead over
# the other ranks grows and shrinks (measured on mlp_large, 1 Gbit/s, 2 hosts: rank 0's
# intervals under one schedule 285-422 ms, rank 1's 286-453, alternating; under the barrier,
# which ties the ranks every step, both 314-328). The median of single intervals of rank 0 then
# judged schedules by its phase: the tuner's trials and the benchmark's 12-step blocks
# disagreed by up to 20% on the same schedule (runs 6 and 8 of
# benchmarks/results/overlap_inplace_20261125.md). A window's mean step telescopes the swings
# of its inner steps away, and its slowest rank is what bounds the ranks' progress together.
# The run-off: the winner of several noisy estimates is the one whose noise fell lowest, so its
# own time is biased low (in runs 4-9 the chosen overlap's benchmark time was 2-7% above its
# trial time in quiet runs, up to 23% in noisy ones; the barrier's mostly within 3%). Fresh
# windows of the winner against the barrier carry no such selection: the rounds keep the
# barrier outright where no overlap beat it by MARGIN, and otherwise pick which overlap runs off.
# Windows are timed where the steps run (stepclock.py): host time on CPU, CUDA events on the
# current stream on GPU, where the host runs ahead of the device.


# Note [Caps tuned for the barrier]
# Bucket autotune decides first, under torch DDP's step barrier (as bucket_cap_mb="auto" alone),
# so the barrier the trials measure is the autotuned one; the schedules are planned on its
# buckets. Under the overlapped step it kept torch DDP's 3 buckets on Hugging Face's ResNet-18
# where the barrier alone chose 14 (benchmarks/results/third_party_20261207.md).


def slowest_windows(per_rank: list[list[float]]) -> list[float]:
    """One candidate's trial windows as the slowest rank saw each: `per_rank[r][w]` is rank r's
    mean step in window w (Note [Trial windows]). Every rank timed the same windows (its synced
    forwards are counted alike); a mismatch is a bug, named."""
    counts = {len(windows) for windows in per_rank}
    if len(counts) != 1:
        raise RuntimeError(f"overlap schedule: the ranks timed different numbers of trial "
                           f"windows: {[len(w) for w in per_rank]} (expected the same on every "
                           "rank)")
    return [max(column) for column in zip(*per_rank)]


def choose(candidates: list[dict]) -> int:
    """The index of the candidate to keep: the one measured fastest ("measured_ms"), unless it
    crosses the step and the step barrier (a candidate with "barrier" true) measured within
    MARGIN of it: then the barrier (on any device). Trial times wobble by a few percent
    here (runs 4-5 of benchmarks/results/overlap_inplace_20261125.md: an overlap 0.4%
    faster than the barrier in its trials was 5% slower in the benchmark); the barrier is the
    step the overlap must beat, so a tie goes to it."""
    best = min(range(len(candidates)), key=lambda k: candidates[k]["measured_ms"])
    barrier = [k for k, c in enumerate(candidates) if c.get("barrier")]
    if barrier and not candidates[best].get("barrier") and \
            candidates[best]["measured_ms"] > (1 - MARGIN) * candidates[barrier[0]]["measured_ms"]:
        return barrier[0]
    return best


class ScheduleTuner(ScheduleRecall):
    """schedule="auto" (or a fixed chunk size) of one OverlapOptimizer."""

    def __init__(self, tuning, events, autotune=None, settle=None, set_barrier=None,
                 warmup: int = WARMUP_ITERATIONS, chunk_bytes: int | None = None):
        self.tuning, self.events, self.autotune = tuning, events, autotune
        self.settle = settle  # completes what is in flight: the probe must not wait behind it
        self.set_barrier = set_barrier  # set_barrier(True): torch DDP's step, nothing deferred
        self.chunk_bytes = chunk_bytes  # fixed by the user; None: chosen by the model
        self.warmup = warmup
        self.link = None
        self.planned_for = None   # the plan version the installed schedule was made for
        self.seen_plan = None     # the plan version in force at the last synced forward ...
        self.since_change = 0     # ... and the synced forwards since it came into force
        self.candidates: list[dict] = []  # the schedules being measured (every rank alike)
        self.trials: list[int] = []  # candidates still to be measured in this round/run-off
        self.trial: int | None = None  # the one being measured
        self.round = 0
        self.runoff: tuple[int, int] | None = None  # (overlapped winner, barrier) running off
        self.clock = stepclock.for_device(tuning.params.device)
        self.samples: list[list[tuple]] = []  # per candidate, this rank's windows: (start, end)
        self.marks: list = []  # the clock's marks of the window being timed
        self.log: list[dict] = []
        self.held_left = 0      # synced forwards left in the held phase (_hold)
        self.held_for = None    # the plan version it holds for ...
        self.held_from = None   # ... and its first held backward's iteration
        self.held_profiled = None  # the schedule the records before it were made under
        self.loaded: list[dict] = []  # rank 0: those records (_last_full_bucket)
        self.recalling = False  # timing a schedule remembered by the tuning cache (memory.py)
        self.recall_rejected_for = None  # the plan version whose remembered schedule was slow

    @property
    def reducer(self):
        return self.tuning.reducer

    @property
    def decided(self) -> bool:
        """Whether the schedule of the bucket plan in force is installed for good (planned and
        its trials over, or planning failed and torch DDP's order stays), the same on every
        rank; True with one rank (nothing to plan)."""
        if self.tuning.params.world_size < 2:
            return True
        return (self.autotune is None or self.autotune.done) and self.trial is None \
            and not self.held_left and self.planned_for == self.reducer.plan_version()

    @property
    def phase_name(self) -> str:
        """What the schedule tuner does at the coming steps, in words."""
        if self.decided:
            return "decided"
        if self.trial is not None:
            what = "run-off" if self.runoff is not None else "trial"
            return f"schedule: {what} {self.candidates[self.trial]['describe']}"
        return "schedule: held" if self.held_left else "schedule: warmup"

    def before_synced_forward(self) -> None:
        """Called at the start of the first synced forward after each synced backward (and of
        the first), before the module runs: on every rank at the same point."""
        params = self.tuning.params
        if params.world_size < 2:
            return
        if self.autotune is not None and not self.autotune.done:
            if self.set_barrier is not None:  # Note [Caps tuned for the barrier]
                self.set_barrier(True)
            return
        plan = self.reducer.plan_version()  # a new plan resets the Reducer's launch order
        if self.trial is not None and plan != self.planned_for:  # a new plan: start again
            self.trial, self.trials, self.runoff = None, [], None
        if plan != self.planned_for and self.set_barrier is not None:
            self.set_barrier(False)  # the profile needs overlapped iterations
        if self.trial is not None:
            self._measure()
            return
        if self.held_left and plan != self.held_for:  # a new plan: profile it from the start
            self.held_left = 0
        if self.held_left:  # the compute alone: nothing in flight beside the next forward
            self.settle()
            self.held_left -= 1
            if self.held_left:
                return
        else:
            if plan != self.seen_plan:
                self.seen_plan, self.since_change = plan, 0
            self.since_change += 1
            if plan == self.planned_for or self.since_change <= self.warmup:
                return
            if self._recall(plan) or self._hold(plan):
                return
        self.planned_for = plan
        if self.link is None and self.autotune is not None and self.autotune.link is not None:
            self.link = self.autotune.link  # probed by bucket autotune: the same group and link
        if self.link is None:  # (a second probe, ~1.7 s at 1 Gbit/s, was a slow stretch)
            if self.settle is not None:
                self.settle()
            try:
                self.link = self.tuning.probe()  # collective: every rank is here at this forward
            except ValueError as error:  # times that do not grow with size (a loaded machine):
                logger.warning("overlap schedule not planned: link probe unusable: %s", error)
                self.log.append(dict(event="not planned", reason=f"link probe unusable: {error}"))
                self._keep_order(plan)  # every rank fits the slowest rank's times: all are here
                return
        choice = self._plan_or_none() if params.rank == 0 else None
        choice = sync.from_rank0(choice, params.process_group, params.device)
        if choice is None:  # rank 0 could not profile: keep torch DDP's order
            self._keep_order(plan)
            return
        self.log.append(dict(event="planned", **choice))
        self.candidates = list(choice["trials"])
        if len(self.candidates) == 1:  # nothing to compare
            self._install(self.candidates[0], "chosen")
        else:
            self.trials, self.round = list(range(len(self.candidates))), 0
            self.samples = [[] for _ in self.candidates]
            self._next_trial()

    def _keep_order(self, plan) -> None:
        """No schedule for `plan`: the order the held iterations were profiled under stays
        (torch DDP's), not the held one; a chunk size the user fixed stays in force, its chunks
        in torch DDP's bucket order (the priority order needs the link model)."""
        if self.chunk_bytes is not None:
            layout = self.reducer.bucket_layout()
            chunks = [max(1, min(math.ceil(bucket["size_bytes"] / self.chunk_bytes), most))
                      for bucket, most in zip(layout, self.max_chunks())]
            self.reducer.set_launch_order([b for b, n in enumerate(chunks) for _ in range(n)],
                                          chunks)
            return
        if self.held_for == plan:
            self.reducer.set_launch_order(self.held_profiled["order"],
                                          self.held_profiled["chunks"])

    def _hold(self, plan) -> bool:
        """Starts the held phase, if the compute is to be measured alone (CPU parameters, the
        model choosing): for HELD_ITERATIONS + 1 backwards every all-reduce waits for the
        bucket full last (launched first), and each next forward starts with everything
        completed and updated (settle), so those iterations time the compute with no
        communication beside it. Returns whether it started (every rank alike: rank 0 picks the
        bucket and broadcasts it). Rank 0 keeps the records before it (self.loaded), whose next
        forward ran: the timeline may not hold them by the time of planning, and the forward
        starting now waits in this broadcast behind the reductions in flight."""
        params = self.tuning.params
        if self.chunk_bytes is not None or self.settle is None or params.device.type != "cpu":
            return False
        last = None
        if params.rank == 0:
            try:
                last = self._last_full_bucket()
            except Exception:  # noqa: BLE001 - the other ranks are waiting in the broadcast
                logger.exception("overlap schedule: held iterations skipped")
        last = sync.from_rank0(last, params.process_group, params.device)
        if last is None:
            return False
        count = len(self.reducer.bucket_layout())
        self.held_profiled = dict(order=self.reducer.launch_order(),
                                  chunks=self.reducer.launch_chunks())
        self.reducer.set_launch_order([last] + [b for b in range(count) if b != last],
                                      [1] * count)
        self.held_for, self.held_left = plan, HELD_ITERATIONS + 1
        self.held_from = self.reducer.num_iterations + 1  # the coming backward's number
        return True

    def _last_full_bucket(self) -> int | None:
        """Rank 0: the bucket full last in the recorded backwards of the plan in force, whose
        next forward ran (kept as self.loaded), or None if there are none."""
        records = timeline_module.records(self.tuning.params, self.reducer,
                                          PROFILE_ITERATIONS + 1, overlap=self.events)
        self.loaded = [r for r in records if r["plan_version"] == self.reducer.plan_version()
                       and r["iteration"] < self.reducer.num_iterations and r["buckets"]]
        if not self.loaded:
            return None
        count = len(self.loaded[-1]["buckets"])
        ready = [statistics.median(r["buckets"][b]["ready_ns"] - r["backward_start_ns"]
                                   for r in self.loaded if len(r["buckets"]) == count)
                 for b in range(count)]
        return max(range(count), key=lambda b: (ready[b], b))

    def _install(self, schedule: dict, event: str, **fields) -> None:
        self.reducer.set_launch_order(schedule["order"], schedule["chunks"])
        if self.set_barrier is not None:
            self.set_barrier(schedule.get("barrier", False))
        entry = {**schedule, "event": event, **fields}
        if event == "chosen":
            self.log.append(entry)
            if self.tuning.params.rank == 0:
                logger.info("overlap schedule: %s (predicted %.2f ms%s)", schedule["describe"],
                            schedule["predicted_ms"], "" if "measured_ms" not in fields
                            else f", measured {fields['measured_ms']:.2f} ms")

    def _next_trial(self) -> None:
        """Installs the next candidate; its steps are timed from the second one (the first
        follows a backward launched under the previous schedule)."""
        self.trial = self.trials.pop(0)
        self._install(self.candidates[self.trial], "trial")
        self.marks = [self.clock.mark()]

    def _measure(self) -> None:
        """At a synced forward during the trials: marks it; after 1 + TRIAL_ITERATIONS steps,
        keeps the window (its marks, read at the gather: stepclock.py) and goes on."""
        self.marks.append(self.clock.mark())
        if len(self.marks) < TRIAL_ITERATIONS + 2:
            return
        self.samples[self.trial].append((self.marks[1], self.marks[-1]))
        self.trial, self.marks = None, []
        if not self.trials and self.runoff is None and self.round + 1 < ROUNDS:
            self.round += 1
            self.trials = list(range(len(self.candidates)))[::-1 if self.round % 2 else 1]
        if self.trials:
            self._next_trial()
            return
        params = self.tuning.params
        mine = [[self.clock.seconds(start, end) / TRIAL_ITERATIONS for start, end in windows]
                for windows in self.samples]  # this rank's mean step per window
        every = sync.all_gather_object(mine, params.process_group, params.device)
        windows = [slowest_windows([ranks[k] for ranks in every])
                   for k in range(len(self.candidates))]
        if self.recalling:
            self._decide_recall(windows)
        elif self.runoff is None:
            self._decide_rounds(windows, every)
        else:
            self._decide_runoff(windows)

    def _decide_rounds(self, windows, every) -> None:
        """After the rounds (the same gathered windows on every rank): the fastest is installed,
        or, if an overlapped schedule beat the barrier, the two run off (Note [Trial
        windows])."""
        for k, candidate in enumerate(self.candidates):
            candidate["measured_ms"] = statistics.median(windows[k]) * 1e3
            self.log.append(dict(event="measured", describe=candidate["describe"],
                                 measured_ms=candidate["measured_ms"],
                                 predicted_ms=candidate["predicted_ms"],
                                 windows_ms=[w * 1e3 for w in windows[k]],
                                 rank0_windows_ms=[w * 1e3 for w in every[0][k]]))
        best = choose(self.candidates)
        barrier = [k for k, c in enumerate(self.candidates) if c.get("barrier")]
        if not barrier or best == barrier[0] or not RUNOFF_WINDOWS:
            chosen = self.candidates[best]
            self._install(chosen, "chosen", measured_ms=chosen["measured_ms"])
            self._announce(chosen, self.candidates)
            return
        self.runoff = (best, barrier[0])
        self.samples = [[] for _ in self.candidates]
        pair = [best, barrier[0]]
        self.trials = [k for w in range(RUNOFF_WINDOWS) for k in (pair if w % 2 else pair[::-1])]
        self._next_trial()

    def _decide_runoff(self, windows) -> None:
        """After the run-off: the overlapped winner against the barrier on fresh windows only
        (choose, with its margin); the winner is installed for good."""
        best, barrier = self.runoff
        self.runoff = None
        fresh = [dict(self.candidates[k], measured_ms=statistics.median(windows[k]) * 1e3)
                 for k in (best, barrier)]
        self.log.append(dict(event="runoff", describe=fresh[0]["describe"],
                             measured_ms=fresh[0]["measured_ms"],
                             barrier_ms=fresh[1]["measured_ms"],
                             windows_ms=[w * 1e3 for w in windows[best]],
                             barrier_windows_ms=[w * 1e3 for w in windows[barrier]]))
        pick = choose(fresh)
        self._install(self.candidates[(best, barrier)[pick]], "chosen",
                      measured_ms=fresh[pick]["measured_ms"])
        self._announce(fresh[pick], fresh)

    def _plan_or_none(self) -> dict | None:
        """_plan(), or None if it fails: the other ranks are waiting in the broadcast."""
        try:
            return self._plan()
        except Exception:  # noqa: BLE001 - any failure here must not leave the others waiting
            logger.exception("overlap schedule not planned (torch DDP's order kept)")
            return None

    def _plan(self) -> dict | None:
        """Rank 0: the schedules to try for the plan in force (the model's best TRIALS; with a
        fixed chunk size, that one), or None."""
        params = self.tuning.params
        found = self._profile()
        if found is None:
            return None
        profile, link, link_fields, measured, profiled = found
        lanes = self.lanes()
        ranks = params.world_size
        if self.chunk_bytes is None:  # the model's best few (distinct), to be measured
            options = schedule_model.best_schedule(profile, link, ranks, lanes=lanes)[1]
            trials = sorted(options, key=lambda o: o.predicted_ms)[:TRIALS]
            if self.set_barrier is not None:  # and the step it replaces: never slower than it
                barrier = schedule_model.barrier_schedule(profile).predict(
                    profile, link, ranks, lanes)
                options.append(barrier)
                trials.append(barrier)
        else:  # the user's size, in the planned order (fifo predicted alongside, as a reference)
            options = [schedule_model.fifo_schedule(profile).predict(profile, link, ranks,
                                                                     lanes),
                       schedule_model.planned_schedule(profile, self.chunk_bytes, link,
                                                       ranks, lanes)]
            trials = options[-1:]
        return dict(trials=[dict(order=o.order, chunks=o.chunks, chunk_bytes=o.chunk_bytes,
                                 budget_bytes=o.budget_bytes, barrier=o.barrier,
                                 describe=o.describe(), predicted_ms=o.predicted_ms)
                            for o in trials],
                    fifo_predicted_ms=options[0].predicted_ms,
                    candidates=[dict(chunk_bytes=o.chunk_bytes, budget_bytes=o.budget_bytes,
                                     barrier=o.barrier, all_reduces=len(o.order),
                                     predicted_ms=o.predicted_ms)
                                for o in options],
                    lanes=lanes,
                    # what the model saw, so that its predictions can be checked offline
                    profile=dataclasses.asdict(profile), profiled_schedule=profiled,
                    link=dict(latency_s=link.latency_s,
                              bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                              contention=link.contention, queue_s=link.queue_s,
                              **link_fields),
                    contention_in_place=measured)

    def _profile(self):
        """Rank 0: (profile, link, what to log of the link, the contention measured in place
        or None, the schedule the profile was recorded under) from the timeline, or None. The
        link is the probed one with its bandwidth as the profiled backwards got it
        (loaded_link: the probe ran on idle ranks); where the held phase ran (_hold), the
        profile's compute is the held iterations' and the contention is also measured in place
        (contention.py), for the log."""
        params = self.tuning.params
        version = self.reducer.plan_version()
        records = timeline_module.records(params, self.reducer,
                                          max(PROFILE_ITERATIONS, HELD_ITERATIONS) + 1,
                                          overlap=self.events)
        records = [r for r in records if r["plan_version"] == version]
        held = []
        if self.held_for == version and self.loaded:
            held = [r for r in records if r["iteration"] >= self.held_from]
            records = self.loaded
        if not records:
            return None
        profiled = self.held_profiled if held else dict(order=self.reducer.launch_order(),
                                                        chunks=self.reducer.launch_chunks())
        try:
            profile = schedule_model.OverlapProfile.from_records(records)
            measured = contention.measure_in_place(records, held) if held else None
            if measured is not None:  # and what it came from, to judge the model by offline
                measured.update(loaded_profile=dataclasses.asdict(profile),
                                records=dict(loaded=[_compact(r) for r in records],
                                             held=[_compact(r) for r in held]))
            if held:
                profile = profile.with_compute_of(held)
        except ValueError as error:
            logger.warning("overlap schedule not planned: %s", error)
            return None
        profile.max_chunks = self.max_chunks()
        link, scale = schedule_model.loaded_link(records, self.link, params.world_size,
                                                 self.lanes(), profiled["order"],
                                                 profiled["chunks"])
        # the contention stays the probe's: measured in place it predicted the trials of runs
        # 4-7 within 10% for 56 of 80, the probe's for 63 (benchmarks/results/
        # overlap_inplace_20261125.md); the in-place value is logged beside it
        link_fields = dict(probed_bandwidth_bytes_per_s=self.link.bandwidth_bytes_per_s,
                           probed_contention=self.link.contention, bandwidth_scale=scale)
        return profile, link, link_fields, measured, profiled

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


def _compact(record: dict) -> dict:
    """A timeline record without per-gradient times and names: what the schedule model reads."""
    compact = {k: v for k, v in record.items() if k not in ("grads", "host", "buckets")}
    compact["buckets"] = [{k: v for k, v in b.items() if k != "params"}
                          for b in record["buckets"]]
    return compact
