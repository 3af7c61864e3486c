"""Profile, plan and apply bucket plans for one wrapper: what DistributedDataParallel's
profile(), plan_buckets(), apply_bucket_plan() and autotune delegate to."""
from __future__ import annotations

import warnings

from pyreducer.tuning import planner, stepmodel
from pyreducer.wrapper import bucketing, sync
from pyreducer.wrapper import timeline as timeline_module
from pyreducer.tuning.linkmodel import (LinkModel, probe_contention_steps, probe_link_steps,
                                        run_steps)

# The probe's all-reduce sizes and repetitions. probe_link's own (5 of each up to 16 MiB, each
# warmed up) and the contention probe took ~1.7 s at 1 Gbit/s in one step, +35% on a 12-step
# window of the bench models (benchmarks/results/tuning_phase_20261128.md). Up to 4 MiB only, the
# fitted bandwidth was 1.6 Gbit/s on the emulated 1 Gbit/s link (tc's burst), so 16 MiB stays, once;
# the pieces (PIECE_BYTES moved, or one contention sample) cost 0.05-0.16 s each there (with 8 MiB
# pieces the window holding the first three read 1.07-1.09 of torch DDP on mlp_large, over the 1.10
# aimed at).
PROBE_REPS = {1 << 12: 3, 1 << 18: 3, 1 << 20: 2, 1 << 22: 2, 1 << 24: 1}  # size: repetitions
PIECE_BYTES = 2 << 20
CONTENTION_REPS = 2


class BucketTuning:
    """Bucket tuning of one Reducer over its ReducedParams (pyreducer.wrapper.params)."""

    def __init__(self, params, reducer, compiled=lambda: False):
        """compiled: () -> whether the model runs under torch.compile, split at the buckets
        (CompiledSplits.active): profiles then spread each bucket's landings
        (stepmodel.spread_compiled_landings)."""
        self.params, self.reducer = params, reducer
        self.compiled = compiled

    def current_plan(self) -> list[list[int]]:
        """Parameter indices per bucket of the plan in force, launch order."""
        return [b["param_indices"] for b in self.reducer.bucket_layout()]

    def profile(self, forward_ms: float = 0.0, optimizer_ms: float = 0.0,
                last: int = 3) -> stepmodel.Profile:
        """This rank's step profile (gradient ready times, sizes) from the last iterations."""
        records = timeline_module.records(self.params, self.reducer, last)
        if not records:
            raise RuntimeError("profile(): no recorded iteration yet (run a synced step first, "
                               "with timeline_iterations > 0)")
        if self.params.device.type != "cpu" and any(r.get("clock") != "device" for r in records):
            warnings.warn("profile(): the device timeline could not be read (its events did not "
                          "complete in time), so this profile holds host enqueue times, which "
                          "understate communication on a GPU; plans made from it may be poor",
                          RuntimeWarning, stacklevel=2)
        compiled = self.compiled()
        if compiled:  # only the landings of the plan in force can be spread along it
            version = self.reducer.plan_version()
            records = [r for r in records if r.get("plan_version") == version]
            if not records:
                raise RuntimeError(f"profile(): under torch.compile a profile needs an iteration "
                                   f"of the bucket plan in force (plan version {version}); the "
                                   f"last {last} recorded ran earlier plans")
        profile = stepmodel.Profile.from_timeline(records, self.params.sizes_bytes, forward_ms,
                                                  optimizer_ms, self.params.group_keys)
        if compiled:
            profile = stepmodel.spread_compiled_landings(profile, self.current_plan())
        return profile

    def probe(self) -> LinkModel:
        """The link model of the process group (collective): latency and bandwidth, and, for
        CPU parameters, the compute a running all-reduce takes and its latency beside compute
        (probe_contention). On GPU the collectives run beside the compute kernels: left as
        probed."""
        return run_steps(self.probe_steps())

    def probe_steps(self):
        """probe() in pieces: a generator that runs one piece (about 0.05-0.25 s at 1 Gbit/s)
        per next(), collectively, and returns the LinkModel; autotune runs a piece every few
        steps instead of the whole probe in one (Note [Probe in pieces] in autotune.py)."""
        device = self.params.device  # NCCL groups take only CUDA tensors
        group = self.params.process_group
        link, _ = yield from probe_link_steps(group, tuple(PROBE_REPS), PROBE_REPS, device,
                                              warm_each=False, piece_bytes=PIECE_BYTES)
        if device.type == "cpu":
            link = yield from probe_contention_steps(link, group, reps=CONTENTION_REPS)
        return link

    def plan_buckets(self, link=None, forward_ms: float = 0.0, optimizer_ms: float = 0.0) -> dict:
        """See DistributedDataParallel.plan_buckets."""
        if link is None:
            link = self.probe()
        result = None
        if self.params.rank == 0:
            ranks = self.params.world_size
            prof = self.profile(forward_ms, optimizer_ms)
            best = planner.best_plan(prof, link, ranks)
            default = stepmodel.cap_plan(prof, bucketing.caps_bytes(None, None))
            names = self.params.names
            result = dict(
                plan=[[names[i] for i in b] for b in best],
                predicted_ms=stepmodel.predict_step_ms(prof, best, link, ranks),
                current_predicted_ms=stepmodel.predict_step_ms(prof, self.current_plan(), link,
                                                               ranks),
                ddp_default_predicted_ms=stepmodel.predict_step_ms(prof, default, link, ranks),
                link=dict(latency_s=link.latency_s,
                          bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                          contention=link.contention))
        return sync.from_rank0(result, self.params.process_group, self.params.device)

    def apply_bucket_plan(self, plan) -> None:
        """See DistributedDataParallel.apply_bucket_plan."""
        problem = None
        if plan and plan[0] and isinstance(plan[0][0], str):
            plan, problem = bucketing.read_plan(plan, self.params.names)
        # rank 0's plan, or its problem, on every rank: none is left waiting in the broadcast
        plan, problem = sync.from_rank0((plan, problem), self.params.process_group,
                                        self.params.device)
        if problem is not None:
            raise ValueError(f"apply_bucket_plan: rank 0's plan cannot be used: {problem}")
        self.reducer.apply_plan(plan)
