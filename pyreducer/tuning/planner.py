"""The bucket plan that minimises the predicted step time (pyreducer.tuning.stepmodel).

Gradients are taken in ready order and cut into contiguous buckets. With f(i) the earliest time
the first i gradients can all be reduced, and c(j, i) the all-reduce time of gradients j+1..i,
    f(i) = min over j < i of  max(ready(i), f(j)) + c(j, i),      f(0) = 0,
since bucket j+1..i is ready when its last gradient is and the channel is free at f(j); the
right side grows with f(j), so optimal prefixes make an optimal whole: this dynamic programme is
exact for the model. With contention k, ready(i) becomes ready(i) + k * wire(gradients 1..j):
the delay depends on the cut j only, not on how 1..j is split, so the argument still holds. O(n^2) in the number of gradients (vectorised over j). Several (dtype,
device) groups: each group is planned on its own, gradients of other groups ignored.
"""
from __future__ import annotations

import itertools

import numpy as np

from pyreducer.tuning.linkmodel import LinkModel
from pyreducer.tuning.stepmodel import Profile, bucket_done_ms


def _plan_group(order, ready_ms, size_bytes, link, ranks):
    n = len(order)
    ready = np.array([ready_ms[i] for i in order], dtype=float)
    ready = np.maximum.accumulate(ready)  # a bucket is ready when its latest gradient is
    prefix = np.concatenate([[0.0], np.cumsum([size_bytes[i] for i in order], dtype=float)])
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=int)
    for i in range(1, n + 1):
        j = np.arange(i)
        cost_ms = link.allreduce_s(prefix[i] - prefix[j], ranks) * 1e3  # arrays over j
        delay_ms = link.contention * link.wire_s(prefix[j], ranks) * 1e3
        candidates = np.maximum(ready[i - 1] + delay_ms, best[:i]) + cost_ms
        k = int(np.argmin(candidates))
        best[i], cut[i] = candidates[k], k
    plan, i = [], n
    while i > 0:
        plan.append([order[t] for t in range(cut[i], i)])
        i = cut[i]
    return plan[::-1]


def best_plan(profile: Profile, link: LinkModel, ranks: int) -> list[list[int]]:
    """The optimal plan (launch order) under the step model."""
    keys = profile.group_keys or ["all"] * len(profile.size_bytes)
    order = profile.ready_order()
    plans = []
    for key in dict.fromkeys(keys):
        group_order = [i for i in order if keys[i] == key]
        plans += _plan_group(group_order, profile.ready_ms, profile.size_bytes, link, ranks)
    # Launch order across groups: by when each bucket can be ready.
    return sorted(plans, key=lambda b: max(profile.ready_ms[i] for i in b))


def brute_force_plan(profile: Profile, link: LinkModel, ranks: int) -> tuple[list, float]:
    """Every contiguous partition of the ready order (one group; tests use it on small cases)."""
    order = profile.ready_order()
    best, best_ms = None, float("inf")
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        plan, current = [], [order[0]]
        for index, cut in zip(order[1:], cuts):
            if cut:
                plan.append(current)
                current = []
            current.append(index)
        plan.append(current)
        done = bucket_done_ms(profile, plan, link, ranks)[-1]
        if done < best_ms:
            best, best_ms = plan, done
    return best, best_ms
