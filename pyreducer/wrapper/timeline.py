"""The Reducer's per-iteration timeline as Python data, and overlap statistics.

`model.timeline(last=1)` returns one dict per recorded synced iteration (oldest first):

    iteration          synced iteration number (1-based) on this rank
    plan_version       which bucket plan was in force (0 = initial; +1 per rebuild/apply)
    rank               this rank in the model's process group
    backward_start_ns  outer backward began (the output sink's backward ran)
    backward_end_ns    autograd's compute ended (the end-of-backward callback started)
    wait_start_ns, wait_end_ns   the final wait for all buckets (without find_unused_parameters
                       it includes writing back earlier buckets while later ones are in flight)
    finalize_end_ns    averaged gradients written into param.grad
    grads              [{"name", "ready_ns"}] per parameter, parameter order (0: no gradient)
    buckets            [{"index", "params", "size_bytes", "ready_ns", "launch_ns", "done_ns"}]
                       by bucket index, which is torch DDP's launch order (an overlapped
                       optimizer's schedule may launch them in another: sort by launch_ns):
                       last gradient in, all-reduce issued (its first chunk), all-reduce
                       completed (its last chunk; from the work's future, on the communication
                       thread)

    clock              "host" or "device" (below)
    host               with clock "device": the same fields (grads, buckets, *_ns) on the host

All times are nanoseconds on this host's monotonic clock (time.monotonic_ns's clock), 0 where an
event did not happen. On a GPU (CUDA builds, parameters on one CUDA device), host times are when
work was enqueued, not when it ran (NCCL's work completes at enqueue): there the record's times
are the device's instead (clock "device"), from CUDA events, anchored at the host's backward
start (csrc/device_timeline.h, Note [Device timeline]); ready and done are when the copy and the
communication finished on the GPU. Everything below (overlap statistics, profile(), the planner,
autotune) then uses device times. That path is compiled, not run: no GPU has run it yet.

`model.overlap_stats()` derives, per iteration and averaged (milliseconds):

    backward_ms        backward_end - backward_start: autograd's compute, hooks included
    comm_ms            per bucket, done - launch (includes queueing behind earlier buckets);
                       NaN where the completion was not recorded
    comm_busy_ms       length of the union of all [launch, done] intervals
    hidden_comm_ms     the part of that union inside [backward_start, backward_end]
    exposed_comm_ms    max(0, last done - backward_end): communication left after compute
    overlap_fraction   hidden_comm_ms / comm_busy_ms (1.0: all communication hidden)
    wait_ms            wait_end - wait_start: the final wait (with earlier buckets' write-back)
    last_bucket_bound_ms  the last launched bucket's own all-reduce time, done_last -
                       max(launch_last, done of the bucket launched before it): no schedule can
                       expose less than this, since that bucket cannot start before its last
                       gradient

With an overlapped optimizer (model.overlap_optimizer) a record also has "overlap": the span of
the forward that followed its backward ("forward_start_ns", "forward_end_ns") and per bucket its
update ("bucket", "read_ns", "reduced_ns", "updated_ns", "module": the module whose forward read
it; pyreducer/overlap/optimizer.py; a sharded optimizer adds "gather_launch_ns", "first_ready_ns"
and "gathered_ns", its parameters' all-gather launched, the first read's elements there and the
whole gather there, see Note [Gathers in read order], and per record "memory": this rank's bytes
by what holds them, ShardedOptimizer.memory_bytes()); then also:

    hidden_forward_comm_ms  the part of the communication union inside that next forward's
                       compute: its span minus its waits for all-reduces (communication during a
                       wait is not hidden, the forward is stalled on it)
    exposed_comm_ms    communication under neither backward nor the next forward's compute
    forward_wait_ms    time the next forward waited for all-reduces (sum of reduced - read;
                       a read outside any forward, e.g. state_dict() between step() and the
                       forward, counts too, under OUTSIDE in the per-module split)
    forward_wait_by_module_ms  the same per module that read the parameters ({name: ms})
    update_ms          time spent in the per-bucket optimizer updates (sum of updated - reduced)
"""
from __future__ import annotations

import statistics


def records(params, reducer, last: int = 1, rank: int | None = None, overlap=None) -> list[dict]:
    """See the module docstring: the last `last` records of `reducer` (a pyreducer._C.Reducer)
    over `params` (its pyreducer.wrapper.params.ReducedParams). `rank` defaults to this process's
    rank in the params' group (pass it where that group may already be destroyed). `overlap`: an
    overlapped optimizer's events(iteration), attached to each record as "overlap"."""
    rank = params.rank if rank is None else rank
    result = []
    for raw in reducer.timeline(last):
        record = dict(iteration=raw["iteration"], rank=rank, plan_version=raw["plan_version"],
                      clock=raw["clock"], **_event_times(raw, params))
        if "host" in raw:
            record["host"] = _event_times(raw["host"], params)
        events = overlap(raw["iteration"]) if overlap is not None else None
        if events is not None:
            record["overlap"] = events
        result.append(record)
    return result


def _event_times(raw: dict, params) -> dict:
    names, sizes = params.names, params.sizes_bytes
    buckets = [dict(index=b, params=[names[i] for i in bucket["param_indices"]],
                    size_bytes=sum(sizes[i] for i in bucket["param_indices"]),
                    ready_ns=bucket["ready_ns"], launch_ns=bucket["launch_ns"],
                    done_ns=bucket["done_ns"])
               for b, bucket in enumerate(raw["buckets"])]
    return dict(backward_start_ns=raw["backward_start_ns"], backward_end_ns=raw["backward_end_ns"],
                wait_start_ns=raw["wait_start_ns"], wait_end_ns=raw["wait_end_ns"],
                finalize_end_ns=raw["finalize_end_ns"],
                grads=[dict(name=n, ready_ns=t) for n, t in zip(names, raw["grad_ready_ns"])],
                buckets=buckets)


def _union_length(intervals) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _clip(intervals, low, high):
    return [(max(a, low), min(b, high)) for a, b in intervals if min(b, high) > max(a, low)]


def iteration_stats(record: dict) -> dict:
    """Overlap statistics of one timeline record (definitions in the module docstring)."""
    ms = 1e-6
    start, end = record["backward_start_ns"], record["backward_end_ns"]
    buckets = record["buckets"]
    # A completion is in the record once the bucket was waited for (Note [Completion stamps]);
    # under deferred completion a record is complete before its buckets are: a bucket without
    # one (0) counts as not recorded, not as a negative span.
    spans = [(b["launch_ns"], b["done_ns"]) for b in buckets]
    recorded = [(launch, done) for launch, done in spans if launch and done >= launch]
    busy = _union_length(recorded)
    hidden = _union_length(_clip(recorded, start, end))
    last_done = max((done for _, done in recorded), default=end)
    # The last launched bucket's own done, not last_done: completion callbacks run on
    # communication threads and can stamp an earlier bucket a little after the last one.
    launched = sorted((launch, done) for launch, done in spans if launch)
    last_service = 0
    if launched and launched[-1] in recorded:
        previous_done = launched[-2][1] if len(launched) > 1 else 0
        last_service = launched[-1][1] - max(launched[-1][0], previous_done)
    extra = {}
    overlap = record.get("overlap")
    if overlap and overlap["forward_start_ns"] and overlap["forward_end_ns"]:
        updates = overlap["updates"]
        in_forward = _clip(recorded, overlap["forward_start_ns"], overlap["forward_end_ns"])
        stalled = sum(_union_length(_clip(in_forward, u["read_ns"], u["reduced_ns"]))
                      for u in updates)  # waits run one after another: disjoint
        forward = max(0, _union_length(in_forward) - stalled)
        extra = dict(hidden_forward_comm_ms=forward * ms,
                     exposed_comm_ms=max(0, busy - hidden - forward) * ms,
                     forward_wait_ms=sum(u["reduced_ns"] - u["read_ns"] for u in updates) * ms,
                     update_ms=sum(u["updated_ns"] - u["reduced_ns"] for u in updates
                                   if u["updated_ns"]) * ms,
                     forward_wait_by_module_ms=_waits_by_module(updates))
    return {**dict(
        iteration=record["iteration"], rank=record["rank"],
        backward_ms=(end - start) * ms,
        comm_ms=[(done - launch) * ms if (launch, done) in recorded else float("nan")
                 for launch, done in spans],
        comm_busy_ms=busy * ms, hidden_comm_ms=hidden * ms,
        exposed_comm_ms=max(0, last_done - end) * ms,
        overlap_fraction=hidden / busy if busy > 0 else 1.0,
        wait_ms=(record["wait_end_ns"] - record["wait_start_ns"]) * ms,
        last_bucket_bound_ms=max(0, last_service) * ms,
        num_buckets=len(buckets)), **extra}  # overlapped: exposed_comm_ms is redefined


def _waits_by_module(updates: list[dict]) -> dict[str, float]:
    """ms the next forward waited, per module that read (events without one: OUTSIDE)."""
    waits: dict[str, float] = {}
    for u in updates:
        name = u.get("module") or OUTSIDE
        waits[name] = waits.get(name, 0.0) + (u["reduced_ns"] - u["read_ns"]) * 1e-6
    return waits


OUTSIDE = "(no module: completed at the forward's end, or read outside a forward)"


def overlap_stats(timeline: list[dict]) -> dict:
    """{"iterations": [per-iteration stats], "mean": {scalar stats averaged}}; with an
    overlapped optimizer also "forward_wait_by_module_ms": {module: mean ms per iteration the
    next forward waited in it for all-reduces}, largest first."""
    per_iteration = [iteration_stats(r) for r in timeline]
    scalars = ["backward_ms", "comm_busy_ms", "hidden_comm_ms", "exposed_comm_ms",
               "overlap_fraction", "wait_ms", "last_bucket_bound_ms", "hidden_forward_comm_ms",
               "forward_wait_ms", "update_ms"]
    # With an overlapped optimizer, the iterations whose next forward ran (their exposed time is
    # defined against it); the last one's is still to come.
    averaged = [s for s in per_iteration if "hidden_forward_comm_ms" in s] or per_iteration
    mean = {k: statistics.fmean(s[k] for s in averaged) for k in scalars
            if all(k in s for s in averaged)} if averaged else {}
    result = dict(iterations=per_iteration, mean=mean)
    by_module = [s["forward_wait_by_module_ms"] for s in averaged
                 if "forward_wait_by_module_ms" in s]
    if by_module:
        names = {name for waits in by_module for name in waits}
        means = {name: sum(w.get(name, 0.0) for w in by_module) / len(by_module)
                 for name in names}
        result["forward_wait_by_module_ms"] = dict(sorted(means.items(), key=lambda kv: -kv[1]))
    return result
