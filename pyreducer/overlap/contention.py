"""Contention: the compute a running all-reduce takes from its rank, measured in place.

Used for: the step model's compute model (advance) with c from probe_contention, and the
in-place measurement (measure_in_place), which the schedule tuner logs beside it. The model
takes the probe's c: on runs 4-7 of benchmarks/results/overlap_inplace_20261125.md, with the
held iterations' compute, the probe's c predicted the tuner's trials within 10% for 63 of 80
schedules, the in-place c for 56 (in run 7 the iterations it came from were slow: c 0.73 in
place against 0.17 probed, and predictions 1.3-1.45x).

The model (pyreducer/overlap/schedule.py): while any all-reduce of the rank is running, its compute
advances at 1 - c of its speed (c = LinkModel.contention; probe_contention measures the same c as
1 - alone / beside one all-reduce). With one core per emulated host, Gloo's threads and the
kernel's network stack run on the core the compute holds: c was 0.15-0.6.

Measured in place (measure_in_place): the schedule tuner times a few iterations of the plan in
force with every all-reduce held to the backward's end and completed before the next forward
(schedule_tuner.ScheduleTuner._hold): their backward and forward are the compute alone. Beside
the iterations recorded before, with the all-reduces overlapping backward and forward, the
compute that took B0 alone took B on the wall clock, of which O with communication running:
B0 = (B - O) + (1 - c) * O, so, pooling the backward (B) and the forward's compute (F: between
its waits for reductions),
    c = (B - B0 + F - F0) / (O_backward + O_forward).

Why not the probe's c alone: it times a matrix product beside one large all-reduce, not the
model's backward beside its own schedule. And a profile recorded beside communication already
holds contention, which the model then charged again: on vgg at 1 Gbit/s its forward's compute
measured 111-139 ms beside torch DDP's order (73 alone), and the step was predicted 1.12-1.29x
too long (benchmarks/results/overlap_calibrated_20261124.md, run 3).
"""
from __future__ import annotations

import statistics

MIN_BUSY_MS = 1.0  # less communication beside compute than this tells nothing about c
MAX_CONTENTION = 0.9


def merge(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_length(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of [start, end] the merged intervals `busy` cover."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in busy)


def advance(t: float, work: float, busy: list[tuple[float, float]], contention: float) -> float:
    """When `work` of compute started at `t` ends, if it runs at 1 - contention of its speed
    inside the merged intervals `busy` and at full speed outside them."""
    if work <= 0:
        return t
    if contention <= 0:
        return t + work
    rate = 1.0 - contention
    for s, e in busy:
        if e <= t:
            continue
        if s > t:
            if work <= s - t:
                return t + work
            work -= s - t
            t = s
        if work <= (e - t) * rate:
            return t + work / rate
        work -= (e - t) * rate
        t = e
    return t + work


def measure_in_place(loaded: list[dict], held: list[dict]) -> dict | None:
    """c from timeline records (pyreducer.wrapper.timeline, with "overlap" events of the forward
    that followed each backward): `loaded` recorded with all-reduces beside the compute, `held` with
    none beside it (module doc). Returns {"contention", "backward_ms", "forward_ms" (the held
    medians), "loaded_backward_ms", "loaded_forward_ms", "busy_backward_ms", "busy_forward_ms"
    (the loaded medians), "held_records", "loaded_records"}, or None if either set has no
    complete record or the communication overlapped less than MIN_BUSY_MS of compute."""
    ms = 1e-6
    held = [r for r in held if has_forward(r)]
    loaded = [r for r in loaded if has_forward(r)]
    if not held or not loaded:
        return None
    busy = merge((b["launch_ns"] * ms, b["done_ns"] * ms) for r in loaded for b in r["buckets"]
                 if b.get("launch_ns") and b.get("done_ns"))
    rows = []
    for r in loaded:
        start, end = r["backward_start_ns"] * ms, r["backward_end_ns"] * ms
        windows = compute_windows(r)
        rows.append((end - start, overlap_length(busy, start, end),
                     sum(e - s for s, e in windows),
                     sum(overlap_length(busy, s, e) for s, e in windows)))
    med = statistics.median
    result = dict(backward_ms=med((r["backward_end_ns"] - r["backward_start_ns"]) * ms
                                  for r in held),
                  forward_ms=med(sum(e - s for s, e in compute_windows(r)) for r in held),
                  loaded_backward_ms=med(x[0] for x in rows),
                  busy_backward_ms=med(x[1] for x in rows),
                  loaded_forward_ms=med(x[2] for x in rows),
                  busy_forward_ms=med(x[3] for x in rows))
    result.update(held_records=len(held), loaded_records=len(loaded))
    busy_ms = result["busy_backward_ms"] + result["busy_forward_ms"]
    if busy_ms < MIN_BUSY_MS:
        return None
    lost = (result["loaded_backward_ms"] - result["backward_ms"]
            + result["loaded_forward_ms"] - result["forward_ms"])
    result["contention"] = min(MAX_CONTENTION, max(0.0, lost / busy_ms))
    return result


def has_forward(record: dict) -> bool:
    overlap = record.get("overlap")
    return bool(overlap and overlap["forward_start_ns"] and overlap["forward_end_ns"])


def compute_windows(record: dict) -> list[tuple[float, float]]:
    """The forward's compute (ms): from its start to its end, less each read's wait for its
    reduction and its update."""
    ms = 1e-6
    overlap = record["overlap"]
    start, end = overlap["forward_start_ns"] * ms, overlap["forward_end_ns"] * ms
    taken = merge((u["read_ns"] * ms, max(u["reduced_ns"], u["updated_ns"]) * ms)
                  for u in overlap["updates"])
    windows, t = [], start
    for s, e in taken:
        if s > t:
            windows.append((t, min(s, end)))
        t = max(t, e)
        if t >= end:
            break
    if t < end:
        windows.append((t, end))
    return [(s, e) for s, e in windows if e > s]
