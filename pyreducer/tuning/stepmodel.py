"""Step model: predicted step time of any bucket plan from one recorded profile.

A profile holds, per parameter, its gradient's ready time (ns after backward start, from the
timeline), its size and group; plus the backward's end and the forward and optimizer times.
Buckets are launched in order on one communication channel: bucket i starts when its last
gradient is ready and bucket i-1 is done, and takes link.allreduce_s(bytes). Then
    step = forward + max(backward_end, last bucket done) + optimizer.
Contention (link.contention = k > 0, e.g. one core per rank that also runs the network stack):
each bucket's all-reduce takes k x its wire time from compute, so every gradient after it (and
the backward's end) is ready that much later:
    ready'(g) = ready(g) + k * sum of wire_s(bucket) over the buckets launched before g's,
    backward_end' = backward_end + k * sum of wire_s over all buckets but the last.
(It charges a bucket also when its all-reduce runs after backward has ended, which matters
little: those are the communication-bound steps, where the channel decides.)
What it leaves out: copy costs beyond what the profile recorded, stragglers, hierarchical
topologies, concurrent collectives.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from pyreducer.tuning.linkmodel import LinkModel


@dataclass
class Profile:
    """One rank's recorded step, the step model's input (`model.profile()` makes it from the
    timeline).

    Attributes:
        ready_ms: per parameter, when its gradient was ready, in ms after backward start.
        size_bytes: per parameter, its gradient's size in bytes.
        backward_ms: backward start to the end of autograd's compute.
        forward_ms: the forward's time, added to every predicted step.
        optimizer_ms: the optimizer step's time, added to every predicted step.
        names: per parameter, its name.
        group_keys: per parameter, its (dtype, device) group; gradients of different groups
            never share a bucket.
    """
    ready_ms: list[float]        # per parameter, after backward start
    size_bytes: list[int]        # per parameter
    backward_ms: float           # backward start to the end of autograd's compute
    forward_ms: float = 0.0
    optimizer_ms: float = 0.0
    names: list[str] = field(default_factory=list)
    group_keys: list[str] = field(default_factory=list)

    def ready_order(self) -> list[int]:
        """Parameter indices in the order their gradients became ready."""
        return sorted(range(len(self.ready_ms)), key=lambda i: (self.ready_ms[i], -i))

    @staticmethod
    def from_timeline(records: list[dict], sizes_bytes: list[int], forward_ms: float = 0.0,
                      optimizer_ms: float = 0.0, group_keys=None) -> "Profile":
        """Median over the records (one rank's timeline) of each gradient's ready offset."""
        ready, backward = [], []
        for r in records:
            start = r["backward_start_ns"]
            ready.append([(g["ready_ns"] - start) / 1e6 if g["ready_ns"] else 0.0
                          for g in r["grads"]])
            backward.append((r["backward_end_ns"] - start) / 1e6)
        return Profile(ready_ms=[statistics.median(col) for col in zip(*ready)],
                       size_bytes=list(sizes_bytes), backward_ms=statistics.median(backward),
                       forward_ms=forward_ms, optimizer_ms=optimizer_ms,
                       names=[g["name"] for g in records[0]["grads"]],
                       group_keys=list(group_keys) if group_keys else [])


def spread_compiled_landings(profile: Profile, plan: list[list[int]]) -> Profile:
    """`profile`, recorded under torch.compile split at `plan`'s buckets (pyreducer/compiled), with
    each gradient's ready time as it would be if the backward were split at every gradient.

    A compiled piece hands over all its gradients when its backward returns: recorded, a bucket's
    gradients land together at the end of its piece, so the profile says nothing about where,
    inside the piece, each was computed, and every finer plan is predicted to gain nothing (the
    planner then kept 3 buckets for mlp_large under compile where it chose 6 eagerly). Estimate:
    the piece's compute (from the previous bucket's last landing to this bucket's first) is spread
    over its gradients in the bucket's order (the eager backward order the buckets were built
    along) in proportion to their bytes, as a Linear layer's backward costs in proportion to its
    weight; each keeps its recorded lag after the first landing (hooks, copies). The last gradient
    of a bucket keeps about its recorded time, so `plan` itself is predicted as recorded. Eager
    stretches between graphs are spread the same way: gradients that land one by one there move by
    less than the gap between their landings."""
    ready = list(profile.ready_ms)
    piece_start_ms = 0.0
    for bucket in plan:
        landed_ms = min(profile.ready_ms[i] for i in bucket)
        start_ms = min(piece_start_ms, landed_ms)
        total = sum(profile.size_bytes[i] for i in bucket) or 1
        done = 0
        for i in bucket:
            done += profile.size_bytes[i]
            lag_ms = profile.ready_ms[i] - landed_ms
            ready[i] = start_ms + (landed_ms - start_ms) * done / total + lag_ms
        piece_start_ms = max(piece_start_ms, max(profile.ready_ms[i] for i in bucket))
    return dataclasses.replace(profile, ready_ms=ready)


def bucket_done_ms(profile: Profile, plan: list[list[int]], link: LinkModel, ranks: int,
                   start_ms: float = 0.0) -> list[float]:
    """Completion time of each bucket (launch order) under the one-channel model."""
    return _schedule(profile, plan, link, ranks, start_ms)[0]


def _schedule(profile, plan, link, ranks, start_ms=0.0) -> tuple[list[float], float]:
    """(done time per bucket, contention delay before the last bucket's launch)."""
    done, channel_free, delay_ms, delay_before_last = [], start_ms, 0.0, 0.0
    for bucket in plan:
        ready = max(profile.ready_ms[i] for i in bucket) + delay_ms
        size = sum(profile.size_bytes[i] for i in bucket)
        channel_free = max(ready, channel_free) + link.allreduce_s(size, ranks) * 1e3
        done.append(channel_free)
        delay_before_last = delay_ms
        delay_ms += link.contention * link.wire_s(size, ranks) * 1e3
    return done, delay_before_last


def predict_step_ms(profile: Profile, plan: list[list[int]], link: LinkModel, ranks: int) -> float:
    """The step time the model predicts for `plan` (parameter indices per bucket, launch
    order): forward + max(backward end, last bucket done) + optimizer, in ms, with the
    contention delays of the module docstring."""
    done, delay_ms = _schedule(profile, plan, link, ranks)
    last = done[-1] if done else 0.0
    backward = profile.backward_ms + delay_ms  # every bucket but the last delays it
    return profile.forward_ms + max(backward, last) + profile.optimizer_ms


def cap_plan(profile: Profile, caps_bytes: list[int]) -> list[list[int]]:
    """The plan DDP's rebuild makes: walk the ready order, close buckets at the caps."""
    from pyreducer._ext import _C

    keys = profile.group_keys or ["all"] * len(profile.size_bytes)
    plan = _C.assign_buckets(list(profile.size_bytes), keys, profile.ready_order(),
                             list(caps_bytes))
    return [b["param_indices"] for b in plan]
