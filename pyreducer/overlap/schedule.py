"""Overlap schedule: chunk sizes and launch order for an overlapped optimizer, and the step
time they give (Note [Launch order] in csrc/reducer.h; pyreducer/overlap/optimizer.py).

Across the step barrier, the next forward reads the first layers' parameters first, but their
bucket is full last in backward: launched last behind one FIFO of all-reduces, it is reduced
last, and the forward waits for the whole communication before its first layer (the record
benchmarks/results/overlap_20261124.md measured exactly this). Chunks and priority fix it:

  - every bucket is split into chunks of about `chunk_bytes`;
  - the launch order is the one a priority scheduler would issue if it launched a chunk
    whenever the bytes in flight leave room under a budget (by default: each time the link is
    idle), choosing among the chunks whose bucket is full the one the next forward reads
    first (list scheduling on the profile's ready times and the link model). Early in
    backward only the last layers' chunks are ready and they keep the link busy; when the
    first layers' bucket fills, at most the budget is ahead of it.
Chunk size and budget are chosen by the model (best_schedule tries a grid), then by timing
(pyreducer/overlap/schedule_tuner.py). The order is computed once, by rank 0, and installed on
every rank: at run time each entry launches when its bucket is full and the entry before it
has launched, whatever the timing. So the budget lives in the order: the bytes actually in
flight follow the ranks' timing (a run-time limit would need launches from completion
callbacks, on the backend's threads; not done).

The step model of an overlapped step (`predict_ms`), per iteration:
    forward: for each bucket in the order the forward reads them, its compute segment, then a
             wait until that bucket's reduction of the previous backward is done, then its
             update; then the forward's tail;
    backward: bucket b is full ready_ms[b] after it starts; chunks enter the channel in the
             launch order, each entry at max(its bucket full, the previous entry launched); the
             channel runs at most `lanes` all-reduces at once (Gloo: 2, its worker threads), each
             taking the link's latency, then its bytes at the bandwidth shared with the others
             on the wire (channel_done_ms);
    then the gap (step(), zero_grad(), loading the batch) before the next forward.
Contention (link.contention = c, pyreducer/overlap/contention.py): while any reduction runs, the
compute (backward, the forward's segments, updates, the gap) advances at 1 - c of its speed;
a backward's reductions move its own buckets' full times (solved in launch order: _backward).
The profile's compute should be contention-free (OverlapProfile.with_compute_of): a profile
recorded beside communication holds contention already, which the model would charge again.
Iterated until the period settles (the reductions carry over from one iteration to the next).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from pyreducer.overlap import contention
from pyreducer.tuning.linkmodel import LinkModel

CHUNK_CANDIDATES_BYTES = (None, 8 << 20, 4 << 20, 2 << 20, 1 << 20, 512 << 10, 256 << 10)
# in-flight budgets the planner tries with each chunk size (None: one chunk at a time)
BUDGET_CANDIDATES_BYTES = (None, 4 << 20, 16 << 20)
ITERATIONS = 8  # simulated iterations; the period is the last one's


@dataclass
class OverlapProfile:
    """One rank's overlapped iteration, per bucket (launch-index order), times in ms."""
    ready_ms: list[float]      # bucket full, after backward start
    size_bytes: list[int]
    backward_ms: float         # backward start to the end of autograd's compute
    read_order: list[int]      # buckets in the order the next forward reads them
    segment_ms: list[float]    # the forward's compute before the read of read_order[k]
    tail_ms: float             # the forward's compute after its last read
    update_ms: list[float]     # per bucket: the optimizer's step of its parameters
    gap_ms: float              # backward end to the next forward's start
    max_chunks: list[int] | None = None  # per bucket (1: cannot be split); None: no limit

    @staticmethod
    def from_records(records: list[dict]) -> "OverlapProfile":
        """Medians over timeline records (pyreducer.wrapper.timeline) that carry "overlap" events of
        the forward that followed their backward; raises ValueError if none does."""
        usable = [r for r in records if _complete_overlap(r)]
        if not usable:
            raise ValueError("overlap profile: no recorded iteration has its next forward's "
                             "events yet (run a few overlapped steps first)")
        count = len(usable[0]["buckets"])
        per = [_one_iteration(r, count) for r in usable if len(r["buckets"]) == count]
        med = statistics.median
        read_order = per[-1]["read_order"]
        return OverlapProfile(
            ready_ms=[med(p["ready_ms"][b] for p in per) for b in range(count)],
            size_bytes=[b["size_bytes"] for b in usable[0]["buckets"]],
            backward_ms=med(p["backward_ms"] for p in per),
            read_order=read_order,
            segment_ms=[med(p["segment_ms"].get(b, 0.0) for p in per) for b in read_order],
            tail_ms=med(p["tail_ms"] for p in per),
            update_ms=[med(p["update_ms"].get(b, 0.0) for p in per) for b in range(count)],
            gap_ms=med(p["gap_ms"] for p in per))

    def with_compute_of(self, held: list[dict]) -> "OverlapProfile":
        """This profile with the compute of `held` timeline records, iterations with no
        communication beside their compute (contention.measure_in_place): their medians of
        each bucket's full time, of the backward and of each bucket's update, and the forward's
        segments scaled to sum to their forward's compute. The gap (step(), zero_grad(), the
        next batch) stays as recorded: in the held iterations it holds the wait for all
        communication. Raises ValueError if no held record is complete."""
        count = len(self.ready_ms)
        held = [r for r in held if contention.has_forward(r) and len(r["buckets"]) == count]
        if not held:
            raise ValueError("overlap profile: no held iteration has its next forward's events")
        med, ms = statistics.median, 1e-6
        ready = [med((r["buckets"][b]["ready_ns"] - r["backward_start_ns"]) * ms for r in held)
                 for b in range(count)]
        forward = med(sum(e - s for s, e in contention.compute_windows(r)) for r in held)
        scale = forward / max(sum(self.segment_ms) + self.tail_ms, 1e-9)
        update = list(self.update_ms)  # the held iterations' updates ran with nothing in flight
        for b in range(count):
            times = [(u["updated_ns"] - u["reduced_ns"]) * ms for r in held
                     for u in r["overlap"]["updates"] if u["bucket"] == b and u["updated_ns"]]
            if times:
                update[b] = med(times)
        return dataclasses.replace(
            self, ready_ms=ready, update_ms=update,
            backward_ms=med((r["backward_end_ns"] - r["backward_start_ns"]) * ms for r in held),
            segment_ms=[x * scale for x in self.segment_ms], tail_ms=self.tail_ms * scale)


def _complete_overlap(record: dict) -> bool:
    return contention.has_forward(record) and bool(record["overlap"]["updates"])


def _one_iteration(record: dict, count: int) -> dict:
    ms = 1e-6
    start = record["backward_start_ns"]
    overlap = record["overlap"]
    ready = [(b["ready_ns"] - start) * ms if b["ready_ns"] else 0.0 for b in record["buckets"]]
    updates = sorted(overlap["updates"], key=lambda u: u["read_ns"])
    read_order = [u["bucket"] for u in updates]
    read_order += [b for b in range(count) if b not in read_order]  # never read: at the end
    segment, update, previous_end = {}, {}, overlap["forward_start_ns"]
    for u in updates:
        segment[u["bucket"]] = max(0, u["read_ns"] - previous_end) * ms
        end = max(u["reduced_ns"], u["updated_ns"])
        update[u["bucket"]] = max(0, u["updated_ns"] - u["reduced_ns"]) * ms if u["updated_ns"] \
            else 0.0
        previous_end = max(previous_end, end)
    return dict(ready_ms=ready, backward_ms=(record["backward_end_ns"] - start) * ms,
                read_order=read_order, segment_ms=segment, update_ms=update,
                tail_ms=max(0, overlap["forward_end_ns"] - previous_end) * ms,
                gap_ms=max(0, overlap["forward_start_ns"] - record["backward_end_ns"]) * ms)


@dataclass
class Schedule:
    order: list[int]    # buckets, once per chunk (Reducer.set_launch_order)
    chunks: list[int]   # per bucket
    chunk_bytes: int | None  # None: whole buckets
    predicted_ms: float = 0.0
    budget_bytes: int | None = None  # the planner's in-flight budget (priority_order)
    barrier: bool = False  # torch DDP's step: every reduction completes at backward's end

    def predict(self, profile: "OverlapProfile", link: LinkModel, ranks: int,
                lanes: int = 1) -> "Schedule":
        """Sets predicted_ms (predict_ms) and returns this schedule."""
        predict = predict_barrier_ms if self.barrier else predict_ms
        self.predicted_ms = predict(profile, self.order, self.chunks, link, ranks, lanes)
        return self

    def describe(self) -> str:
        if self.barrier:
            return "torch DDP's step barrier (no overlap)"
        budget = "" if self.budget_bytes is None else \
            f", up to {self.budget_bytes / 2**20:g} MB in flight"
        if self.chunk_bytes is None:  # two orders of whole buckets may be candidates
            order = "torch DDP's order" if self.order == sorted(self.order) else \
                "first read first"
            return f"whole buckets, {order}, {len(self.order)} all-reduces{budget}"
        return f"chunks of {self.chunk_bytes / 2**20:g} MB, {len(self.order)} all-reduces{budget}"


def chunk_counts(profile: OverlapProfile, chunk_bytes: int | None) -> list[int]:
    """Chunks per bucket for chunks of about `chunk_bytes` (None: one per bucket)."""
    counts = []
    for b, size in enumerate(profile.size_bytes):
        n = 1 if chunk_bytes is None else max(1, math.ceil(size / chunk_bytes))
        if profile.max_chunks is not None:
            n = min(n, profile.max_chunks[b])
        counts.append(n)
    return counts


def priority_order(profile: OverlapProfile, chunks: list[int], link: LinkModel,
                   ranks: int, budget_bytes: int | None = None) -> list[int]:
    """The launch sequence of a priority scheduler on the profile (see the module doc): it
    issues a ready chunk, the one whose bucket the next forward reads first, whenever the bytes
    in flight (issued, not yet done on a link that runs one all-reduce after the other) leave
    room for it under `budget_bytes`, or nothing is in flight. None: one chunk at a time (each
    time the link is idle). A larger budget keeps more of the early buckets' chunks queued
    (the link never waits between them) at the price of more bytes ahead of the first layers'
    bucket when it fills."""
    priority = {b: k for k, b in enumerate(profile.read_order)}
    left = list(chunks)
    order, now, link_free = [], 0.0, 0.0
    flight: list[tuple[float, float]] = []  # (done, bytes) of the chunks issued
    while any(left):
        flight = [(done, size) for done, size in flight if done > now]
        ready = [b for b, n in enumerate(left) if n and profile.ready_ms[b] <= now]
        b = min(ready, key=lambda c: (priority.get(c, len(priority)), c)) if ready else None
        size = profile.size_bytes[b] / chunks[b] if ready else 0.0
        in_flight = sum(s for _, s in flight)
        if b is None or flight and (budget_bytes is None or in_flight + size > budget_bytes):
            later = [profile.ready_ms[c] for c, n in enumerate(left)
                     if n and profile.ready_ms[c] > now]
            now = min([done for done, _ in flight] + later)  # the next event
            continue
        order.append(b)
        left[b] -= 1
        link_free = max(now, link_free) + link.allreduce_s(size, ranks) * 1e3
        flight.append((link_free, size))
    return order


def channel_done_ms(launch_ms: list[float], wire_ms: list[float], latency_ms: float,
                    lanes: int, queue_ms: float = 0.0) -> list[float]:
    """Completion times of all-reduces entering the channel in list order at `launch_ms`: at most
    `lanes` run at once (Gloo runs 2 by default, ProcessGroupGloo's worker threads; NCCL one per
    stream), each spends `latency_ms` without using the wire, then its `wire_ms` of bytes,
    sharing the link's bandwidth equally with the others on the wire. One that starts while
    another is on the wire first waits behind the bytes already queued for it (LinkModel.queue_s):
    `queue_ms` more latency, at most the longest wire time left among the others."""
    done = [0.0] * len(launch_ms)
    active: list[list] = []  # [index, latency left, wire left]
    t, admitted = -math.inf, 0
    while admitted < len(launch_ms) or active:
        while admitted < len(launch_ms) and len(active) < lanes and launch_ms[admitted] <= t:
            behind = max((a[2] for a in active if a[1] <= 0), default=0.0)
            active.append([admitted, latency_ms + min(queue_ms, behind), wire_ms[admitted]])
            admitted += 1
        if not active:
            t = launch_ms[admitted]
            continue
        on_wire = sum(1 for a in active if a[1] <= 0)
        step = min((a[1] if a[1] > 0 else a[2] * on_wire) for a in active)
        if admitted < len(launch_ms) and len(active) < lanes:
            step = min(step, launch_ms[admitted] - t)
        t += step
        for a in active:
            if a[1] > 0:
                a[1] -= step
            else:
                a[2] -= step / on_wire
        for a in [a for a in active if a[1] <= 1e-12 and a[2] <= 1e-12]:
            done[a[0]] = t
            active.remove(a)
        for a in active:
            a[1] = 0.0 if a[1] <= 1e-12 else a[1]
    return done


LINK_SCALES = tuple(k / 100 for k in range(25, 151))  # bandwidth multipliers loaded_link tries


def loaded_link(records: list[dict], link: LinkModel, ranks: int, lanes: int,
                order: list[int], chunks: list[int]) -> tuple[LinkModel, float]:
    """The link as the recorded backwards saw it: `link` with its bandwidth scaled (by one of
    LINK_SCALES) so that the channel (channel_done_ms), fed each record's launches, completes
    its buckets when the record says they did (least squares; the median scale over records).
    Returns (that link, the scale); (link, 1.0) if no record has launch and done times.

    The probe times all-reduces on an idle rank; beside backward, Gloo's threads and the
    kernel's network stack wait for the core the compute holds: on the emulated hosts the link
    delivered 0.67-0.96 of the probed rate at 1 Gbit/s, 0.28-0.44 at 10 Gbit/s
    (benchmarks/results/overlap_calibrated_20261124.md). A planner that trusts the probe sends
    too much ahead of the first layers' bucket and predicts steps 8-15% short. The records are
    the iterations the profile was made from (launched in `order` with `chunks`, the schedule
    then installed): chunk k of the sequence launched when its bucket was full and chunk k-1
    had launched, the Reducer's rule."""
    scales = []
    for record in records:
        fitted = _record_scale(record, link, ranks, lanes, order, chunks)
        if fitted is not None:
            scales.append(fitted)
    if not scales:
        return link, 1.0
    scale = statistics.median(scales)
    return dataclasses.replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * scale), \
        scale


def _record_scale(record: dict, link: LinkModel, ranks: int, lanes: int, order: list[int],
                  chunks: list[int]) -> float | None:
    buckets = record["buckets"]
    if len(buckets) != len(chunks) or ranks < 2:
        return None
    start = record["backward_start_ns"]
    measured = {b: (x["done_ns"] - start) * 1e-6 for b, x in enumerate(buckets)
                if x.get("launch_ns") and x.get("done_ns")}
    if not measured:
        return None
    launches, entries, previous = [], [], -math.inf
    for b in order:
        if b not in measured:
            continue  # skipped (unused everywhere) or not recorded
        previous = max(previous, (buckets[b]["launch_ns"] - start) * 1e-6)
        launches.append(previous)
        entries.append(b)
    latency_ms = link.latency_s * 1e3

    def error(scale: float) -> float:
        wires = [link.wire_s(buckets[b]["size_bytes"] / chunks[b], ranks) * 1e3 / scale
                 for b in entries]
        done: dict[int, float] = {}
        for b, finished in zip(entries, channel_done_ms(launches, wires, latency_ms, lanes,
                                                        link.queue_s * 1e3)):
            done[b] = max(done.get(b, -math.inf), finished)
        return sum((done[b] - measured[b]) ** 2 for b in done)

    return min(LINK_SCALES, key=error)


def _backward(profile: OverlapProfile, order: list[int], chunks: list[int], link: LinkModel,
              ranks: int, lanes: int, backward_start: float) -> tuple[list[float], float, list]:
    """One backward from `backward_start`, with no reduction running then (the forward before
    it read, so waited for, every bucket): (done per bucket, the backward's end, the merged
    intervals its own reductions run). Its compute runs at 1 - link.contention of its speed
    while any reduction runs (contention.advance), so each bucket fills later for every
    reduction launched before it. Solved in launch order: a bucket's full time depends only on
    the reductions launched before its first entry (the later ones start after it), and up to
    that time those run as they would alone on the channel."""
    count = len(profile.size_bytes)
    latency_ms = link.latency_s * 1e3 if ranks > 1 else 0.0
    queue_ms, c = link.queue_s * 1e3, link.contention
    wires = [link.wire_s(profile.size_bytes[b] / chunks[b], ranks) * 1e3 for b in order]
    launches, full, previous = [], {}, -math.inf
    for k, b in enumerate(order):
        if b not in full:
            busy = []
            if c > 0 and k:
                done = channel_done_ms(launches, wires[:k], latency_ms, lanes, queue_ms)
                busy = contention.merge(zip(launches, done))
            full[b] = contention.advance(backward_start, profile.ready_ms[b], busy, c)
        previous = max(previous, full[b])
        launches.append(previous)
    finished = channel_done_ms(launches, wires, latency_ms, lanes, queue_ms)
    own = contention.merge(zip(launches, finished))
    end = contention.advance(backward_start, profile.backward_ms, own, c)
    done = [-math.inf] * count
    for b, t in zip(order, finished):
        done[b] = max(done[b], t)
    return done, end, own


def predict_ms(profile: OverlapProfile, order: list[int], chunks: list[int], link: LinkModel,
               ranks: int, lanes: int = 1) -> float:
    """The overlapped step's period under the step model of the module doc, on a channel of
    `lanes` (channel_done_ms)."""
    count = len(profile.size_bytes)
    c = link.contention
    done = [-math.inf] * count  # the previous backward's reductions ...
    busy: list[tuple[float, float]] = []  # ... and when they ran
    start, starts = 0.0, []
    for _ in range(ITERATIONS):
        starts.append(start)
        t = start
        for k, b in enumerate(profile.read_order):
            t = max(contention.advance(t, profile.segment_ms[k], busy, c), done[b])
            t = contention.advance(t, profile.update_ms[b], busy, c)
        backward_start = contention.advance(t, profile.tail_ms, busy, c)
        done, end, busy = _backward(profile, order, chunks, link, ranks, lanes, backward_start)
        start = contention.advance(end, profile.gap_ms, busy, c)
    return starts[-1] - starts[-2]


def predict_barrier_ms(profile: OverlapProfile, order: list[int], chunks: list[int],
                       link: LinkModel, ranks: int, lanes: int = 1) -> float:
    """torch DDP's step under the same model: the forward's compute and updates without waits,
    the backward, then whatever communication is left (nothing crosses the step)."""
    forward = sum(profile.segment_ms) + profile.tail_ms + sum(profile.update_ms)
    done, end, _ = _backward(profile, order, chunks, link, ranks, lanes, 0.0)
    return forward + max([end] + done) + profile.gap_ms


def barrier_schedule(profile: OverlapProfile) -> Schedule:
    """torch DDP's order and its step barrier: what the overlapped step must beat."""
    count = len(profile.size_bytes)
    return Schedule(order=list(range(count)), chunks=[1] * count, chunk_bytes=None,
                    barrier=True)


def fifo_schedule(profile: OverlapProfile) -> Schedule:
    """torch DDP's order, whole buckets."""
    count = len(profile.size_bytes)
    return Schedule(order=list(range(count)), chunks=[1] * count, chunk_bytes=None)


def planned_schedule(profile: OverlapProfile, chunk_bytes: int | None, link: LinkModel,
                     ranks: int, lanes: int = 1, budget_bytes: int | None = None) -> Schedule:
    """Chunks of about `chunk_bytes` (None: whole buckets) in their priority order under the
    in-flight budget `budget_bytes` (priority_order), predicted."""
    chunks = chunk_counts(profile, chunk_bytes)
    order = priority_order(profile, chunks, link, ranks, budget_bytes)
    return Schedule(order, chunks, chunk_bytes, budget_bytes=budget_bytes).predict(
        profile, link, ranks, lanes)


def best_schedule(profile: OverlapProfile, link: LinkModel, ranks: int,
                  candidates=CHUNK_CANDIDATES_BYTES, lanes: int = 1,
                  budgets=BUDGET_CANDIDATES_BYTES) -> tuple[Schedule, list[Schedule]]:
    """The schedule predicted fastest among the chunk sizes `candidates`, each with its
    priority order under each in-flight budget of `budgets`, on a channel of `lanes`, and all
    the distinct ones (order and chunks), torch DDP's order first."""
    options = [fifo_schedule(profile).predict(profile, link, ranks, lanes)]
    for chunk_bytes in candidates:
        for budget_bytes in budgets:
            option = planned_schedule(profile, chunk_bytes, link, ranks, lanes, budget_bytes)
            if all((option.order, option.chunks) != (s.order, s.chunks) for s in options):
                options.append(option)
    # fewer all-reduces first among equals: a 1% predicted gain is not worth more launches
    best = min(options, key=lambda s: (round(s.predicted_ms / max(options[0].predicted_ms,
                                                                    1e-9), 2), len(s.order)))
    return best, options
