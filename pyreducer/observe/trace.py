"""One Chrome trace-event JSON for all ranks (opens in Perfetto and chrome://tracing).

    pyreducer.observe.trace.export_chrome_trace(model, "trace.json", last=5)   # call on every rank

Every rank sends its timeline (pyreducer.wrapper.timeline) to rank 0 through the model's process
group; rank 0 writes the file. Layout: a process per rank; in it a "backward compute" track (one
slice per iteration, an instant per gradient), a "final wait" track, and one track per bucket with
its all-reduce from launch to completion; a flow arrow runs from the moment a bucket's last gradient
arrived to its launch.

Clock alignment: ranks have separate monotonic clocks. Before gathering, all ranks pass
CLOCK_ROUNDS barriers and read their clock right after each; rank r's offset is the median of
(its reading - rank 0's reading). On one host the clocks agree and the offsets measure only the
skew of barrier exits; across hosts the error is about one barrier's exit skew (a network
latency), far below bucket all-reduce times.
"""
from __future__ import annotations

import json
import statistics

import torch
import torch.distributed as dist

from pyreducer.wrapper.sync import all_gather_object, barrier

CLOCK_ROUNDS = 7
COMPUTE_TID, WAIT_TID, BUCKET_TID0 = 0, 1, 10


def clock_offsets_ns(group, device="cpu") -> list[int]:
    """Per rank, its monotonic clock minus rank 0's (see the module docstring). Collective; the
    readings travel on `device` (an NCCL group takes CUDA tensors only)."""
    from pyreducer._ext import _C

    world = dist.get_world_size(group)
    samples: list[list[int]] = [[] for _ in range(world)]
    for _ in range(CLOCK_ROUNDS):
        barrier(group, device)
        now = torch.tensor([_C.Reducer.now_ns()], dtype=torch.int64, device=device)
        gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(gathered, now, group=group)
        for r in range(world):
            samples[r].append(int(gathered[r].item() - gathered[0].item()))
    return [int(statistics.median(s)) for s in samples]


def gather_timelines(model, last: int) -> list[list[dict]] | None:
    """Every rank's timeline, clock-aligned to rank 0, on rank 0 (None elsewhere). Collective."""
    group = model.process_group
    device = next(model.parameters()).device
    offsets = clock_offsets_ns(group, device)
    gathered = all_gather_object(model.timeline(last), group, device)
    if dist.get_rank(group) != 0:
        return None
    return [[shift_record(record, -offsets[rank]) for record in timeline]
            for rank, timeline in enumerate(gathered)]


def shift_record(record: dict, delta: int) -> dict:
    """A timeline record with every host time moved by delta ns (0 stays 0: not recorded)."""
    out = {k: (v + delta if k.endswith("_ns") and v else v) for k, v in record.items()}
    out["grads"] = [dict(g, ready_ns=g["ready_ns"] + delta if g["ready_ns"] else 0)
                    for g in record["grads"]]
    out["buckets"] = [{k: (v + delta if k.endswith("_ns") and v else v) for k, v in b.items()}
                      for b in record["buckets"]]
    if "host" in record:  # device-clock records keep their host times too
        out["host"] = shift_record(record["host"], delta)
    if "overlap" in record:  # an overlapped optimizer's next-forward span and updates
        out["overlap"] = {k: (v + delta if k.endswith("_ns") and v else v)
                          for k, v in record["overlap"].items()}
        out["overlap"]["updates"] = [{k: (v + delta if k.endswith("_ns") and v else v)
                                      for k, v in u.items()}
                                     for u in record["overlap"]["updates"]]
    return out


def chrome_trace(timelines: list[list[dict]]) -> dict:
    """The trace-event document for gathered, aligned timelines (one list per rank)."""
    starts = [r["backward_start_ns"] for tl in timelines for r in tl]
    origin = min(starts) if starts else 0

    def us(ns):
        return (ns - origin) / 1e3

    events = []
    flow_id = 0
    for rank, timeline in enumerate(timelines):
        events.append(dict(ph="M", name="process_name", pid=rank, tid=0,
                           args=dict(name=f"rank {rank}")))
        events.append(dict(ph="M", name="thread_name", pid=rank, tid=COMPUTE_TID,
                           args=dict(name="backward compute")))
        events.append(dict(ph="M", name="thread_name", pid=rank, tid=WAIT_TID,
                           args=dict(name="final wait")))
        buckets_seen = max((len(r["buckets"]) for r in timeline), default=0)
        for b in range(buckets_seen):
            events.append(dict(ph="M", name="thread_name", pid=rank, tid=BUCKET_TID0 + b,
                               args=dict(name=f"bucket {b} all-reduce")))
        for record in timeline:
            it = record["iteration"]
            events.append(dict(ph="X", name=f"backward (iteration {it})", cat="compute",
                               pid=rank, tid=COMPUTE_TID, ts=us(record["backward_start_ns"]),
                               dur=(record["backward_end_ns"] - record["backward_start_ns"]) / 1e3))
            for grad in record["grads"]:
                if grad["ready_ns"]:
                    events.append(dict(ph="i", s="t", name=f"grad {grad['name']}", cat="grad",
                                       pid=rank, tid=COMPUTE_TID, ts=us(grad["ready_ns"])))
            events.append(dict(ph="X", name="final wait", cat="wait", pid=rank, tid=WAIT_TID,
                               ts=us(record["wait_start_ns"]),
                               dur=(record["wait_end_ns"] - record["wait_start_ns"]) / 1e3))
            events.append(dict(ph="X", name="copy back", cat="wait", pid=rank, tid=WAIT_TID,
                               ts=us(record["wait_end_ns"]),
                               dur=(record["finalize_end_ns"] - record["wait_end_ns"]) / 1e3))
            for bucket in record["buckets"]:
                tid = BUCKET_TID0 + bucket["index"]
                events.append(dict(
                    ph="X", name=f"all-reduce bucket {bucket['index']}", cat="comm", pid=rank,
                    tid=tid, ts=us(bucket["launch_ns"]),
                    dur=(bucket["done_ns"] - bucket["launch_ns"]) / 1e3,
                    args=dict(iteration=it, bytes=bucket["size_bytes"],
                              params=len(bucket["params"]),
                              queued_us=(bucket["launch_ns"] - bucket["ready_ns"]) / 1e3)))
                flow_id += 1
                events.append(dict(ph="s", id=flow_id, name="ready -> launch", cat="bucket",
                                   pid=rank, tid=COMPUTE_TID, ts=us(bucket["ready_ns"])))
                events.append(dict(ph="f", bp="e", id=flow_id, name="ready -> launch",
                                   cat="bucket", pid=rank, tid=tid, ts=us(bucket["launch_ns"])))
            events += _overlap_events(record, rank, us)
    return dict(traceEvents=events, displayTimeUnit="ms",
                otherData=dict(producer="pyreducer", clock="monotonic, aligned to rank 0"))


def _overlap_events(record: dict, rank: int, us) -> list[dict]:
    """An overlapped optimizer's next forward (on the compute row, after this backward), and per
    bucket the forward's wait for its all-reduce and its update (on the wait row)."""
    overlap = record.get("overlap")
    if not overlap or not overlap["forward_start_ns"] or not overlap["forward_end_ns"]:
        return []
    it = record["iteration"]
    events = [dict(ph="X", name=f"next forward (updates of iteration {it})", cat="compute",
                   pid=rank, tid=COMPUTE_TID, ts=us(overlap["forward_start_ns"]),
                   dur=(overlap["forward_end_ns"] - overlap["forward_start_ns"]) / 1e3)]
    for u in overlap["updates"]:
        where = f" in {u['module']}" if u.get("module") else ""
        events.append(dict(ph="X", name=f"wait bucket {u['bucket']}{where}", cat="wait",
                           pid=rank, tid=WAIT_TID, ts=us(u["read_ns"]),
                           dur=(u["reduced_ns"] - u["read_ns"]) / 1e3,
                           args=dict(bucket=u["bucket"], module=u.get("module"))))
        if u["updated_ns"]:
            events.append(dict(ph="X", name=f"update bucket {u['bucket']}", cat="update",
                               pid=rank, tid=WAIT_TID, ts=us(u["reduced_ns"]),
                               dur=(u["updated_ns"] - u["reduced_ns"]) / 1e3))
    return events


def export_chrome_trace(model, path, last: int = 5) -> str | None:
    """Writes all ranks' last `last` iterations to `path` (on rank 0); call on every rank.

    Returns the path on rank 0 and None elsewhere.
    """
    timelines = gather_timelines(model, last)
    if timelines is None:
        return None
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)
    return str(path)
