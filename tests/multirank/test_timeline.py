"""The per-bucket timeline on real 2-rank runs: event invariants, overlap statistics against the
raw events (recomputed independently by sampling), torch.profiler ranges, and the trace command's
files (Chrome trace JSON with every rank and bucket, non-empty PNGs)."""
import json
import subprocess
import sys

import pytest
import torch

from pyreducer.testing import subprocess_env

KEEP = 4


def timeline_worker(rank, world_size):
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=0.2, timeline_iterations=KEEP)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        spec.loss(model, spec.batch(gen, 16)).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        spec.loss(model, spec.batch(gen, 16)).backward()
    names = sorted({e.name for e in prof.events() if e.name.startswith("pyreducer.allreduce")})
    return dict(timeline=model.timeline(last=KEEP + 3), stats=model.overlap_stats(),
                plan=model.bucket_plan(), profiler_ranges=names)


@pytest.fixture(scope="module")
def runs(ranks_once):
    return ranks_once(timeline_worker, 2, ())


def test_keeps_the_last_k_iterations(runs):
    for r in runs:
        assert [rec["iteration"] for rec in r["timeline"]] == [4, 5, 6, 7]


def test_event_invariants(runs):
    for r in runs:
        for rec in r["timeline"]:
            start, end = rec["backward_start_ns"], rec["backward_end_ns"]
            assert 0 < start < end <= rec["wait_start_ns"] <= rec["wait_end_ns"] \
                <= rec["finalize_end_ns"]
            ready = {g["name"]: g["ready_ns"] for g in rec["grads"]}
            assert all(start <= t <= end for t in ready.values()), "gradient outside backward"
            assert [b["params"] for b in rec["buckets"]] == [b["params"] for b in r["plan"]]
            launches = [b["launch_ns"] for b in rec["buckets"]]
            assert launches == sorted(launches), "buckets launched out of order"
            for b in rec["buckets"]:
                assert b["ready_ns"] == max(b["ready_ns"], *(ready[n] for n in b["params"]))
                assert start <= b["ready_ns"] <= b["launch_ns"] <= end
                assert b["launch_ns"] < b["done_ns"] <= rec["wait_end_ns"]


def _sampled(rec, step_ns=5_000):
    """Hidden and busy communication by sampling time on a grid (independent of the stats code)."""
    spans = [(b["launch_ns"], b["done_ns"]) for b in rec["buckets"]]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    busy = hidden = 0
    for t in range(lo, hi, step_ns):
        if any(a <= t < b for a, b in spans):
            busy += step_ns
            if rec["backward_start_ns"] <= t < rec["backward_end_ns"]:
                hidden += step_ns
    return busy / 1e6, hidden / 1e6


def test_overlap_stats_agree_with_raw_events(runs):
    for r in runs:
        for rec, stats in zip(r["timeline"], r["stats"]["iterations"]):
            busy, hidden = _sampled(rec)
            assert stats["comm_busy_ms"] == pytest.approx(busy, abs=0.02 * len(rec["buckets"]))
            assert stats["hidden_comm_ms"] == pytest.approx(hidden, abs=0.02 * len(rec["buckets"]))
            last_done = max(b["done_ns"] for b in rec["buckets"])
            assert stats["exposed_comm_ms"] == pytest.approx(
                max(0, last_done - rec["backward_end_ns"]) / 1e6)
            assert stats["backward_ms"] == pytest.approx(
                (rec["backward_end_ns"] - rec["backward_start_ns"]) / 1e6)
            assert 0.0 <= stats["overlap_fraction"] <= 1.0
            assert stats["last_bucket_bound_ms"] <= stats["comm_ms"][-1] + 1e-9


def test_profiler_shows_every_bucket(runs):
    for r in runs:
        assert r["profiler_ranges"] == [f"pyreducer.allreduce.bucket_{b}"
                                        for b in sorted(range(len(r["plan"])), key=str)]


def test_trace_command_writes_trace_plots_and_summary(tmp_path):
    out = tmp_path / "run"
    # The same pyreducer this test imported (the in-tree build, or make cuda-check's).
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, "-m", "pyreducer", "trace", "--model", "mlp", "--nproc", "2",
         "--bucket-cap-mb", "0.2", "--steps", "5", "--keep", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "overlap" in result.stdout
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= e.keys()
        if e["ph"] != "M":
            assert isinstance(e["ts"], float)
        if e["ph"] == "X":
            assert e["dur"] >= 0
    assert {e["pid"] for e in events} == {0, 1}
    timelines = json.loads((out / "timeline.json").read_text())
    for rank in (0, 1):
        buckets = {e["name"] for e in events if e["pid"] == rank and e.get("cat") == "comm"}
        assert buckets == {f"all-reduce bucket {b['index']}"
                           for b in timelines[rank][-1]["buckets"]}
        assert sum(1 for e in events if e["pid"] == rank and e.get("cat") == "compute") == 3
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * sum(len(r["buckets"]) for tl in timelines for r in tl)
    for name in ("gantt.png", "overlap.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "hidden" in (out / "summary.txt").read_text()


# A finished step's timeline is final when backward returns (Note [Completion stamps] in
# csrc/timeline.h). c10's Future wakes its waiters before it runs its callbacks, and callbacks
# registered before the Reducer's run first: a slow one there holds the Reducer's stamp back
# past the end of backward. Each hook below registers one (SLOW_S) before returning its future.
SLOW_S = 0.3


def _slow_callback(_future):
    import time

    time.sleep(SLOW_S)


def _threaded_hook(state, bucket):
    """The future completes on a thread of the hook's own, after the all-reduce."""
    import threading

    import torch.distributed as dist

    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, async_op=True)  # launched here: the same order on every rank
    future = torch.futures.Future()
    future.add_done_callback(_slow_callback)

    def complete():
        work.wait()
        future.set_result(buffer.div_(dist.get_world_size()))

    threading.Thread(target=complete, daemon=True).start()
    return future


def _continuation_hook(state, bucket):
    """The future is a then() continuation of the all-reduce's (as torch's allreduce_hook's and
    the quorum hook's)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    continued = future.then(lambda f: f.value()[0].div_(world))
    continued.add_done_callback(_slow_callback)
    return continued


def late_stamp_worker(rank, world_size, hook_name):
    """For a ring of one slot and of KEEP: the last record read at once after each backward,
    and again once every late callback has run."""
    import time

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    hook = {"threaded": _threaded_hook, "continuation": _continuation_hook}[hook_name]
    spec = models.spec("mlp")
    out = {}
    for keep in (1, KEEP):
        torch.manual_seed(0)
        model = DistributedDataParallel(spec.build(), bucket_cap_mb=0.2,
                                        timeline_iterations=keep)
        model.register_comm_hook(None, hook)
        gen = torch.Generator().manual_seed(rank)
        at_return = []
        for _ in range(3):
            spec.loss(model, spec.batch(gen, 16)).backward()
            at_return.append(model.timeline(last=1)[-1])  # read as soon as backward returned
        time.sleep(4 * SLOW_S * len(model.bucket_plan()))  # every late callback has run now
        out[keep] = dict(at_return=at_return, settled=[model.timeline(last=1)[-1]])
    return out


@pytest.mark.parametrize("hook_name", ["threaded", "continuation"])
def test_completions_are_stamped_before_backward_returns(hook_name):
    """Every launched bucket's done time is there when backward returns, between its launch and
    the end of the wait; a callback that runs later does not change a record (with one slot, the
    next step's)."""
    from pyreducer.testing import run_ranks

    results = run_ranks(late_stamp_worker, 2, args=(hook_name,), timeout_s=180)
    for rank, by_keep in enumerate(results):
        for keep, result in by_keep.items():
            for when in ("at_return", "settled"):
                for rec in result[when]:
                    bad = [(b["index"], b["launch_ns"], b["done_ns"]) for b in rec["buckets"]
                           if not 0 < b["launch_ns"] <= b["done_ns"] <= rec["wait_end_ns"]]
                    assert not bad, (f"rank {rank}, {keep} slots, {when}, iteration "
                                     f"{rec['iteration']}: buckets (index, launch_ns, done_ns) "
                                     f"outside (0, wait_end_ns={rec['wait_end_ns']}]: {bad}")
            assert result["settled"][-1] == result["at_return"][-1], \
                f"rank {rank}, {keep} slots: the last record changed after backward returned"
