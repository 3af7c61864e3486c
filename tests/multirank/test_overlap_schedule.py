"""Chunked all-reduces in a planned launch order (Note [Launch order] in csrc/reducer.h) and the
overlapped optimizer's planned schedule (pyreducer/overlap/schedule_tuner.py), on spawned Gloo
ranks: the same sums as torch DDP (bit for bit at 2 ranks), the same order on every rank
whatever the timing, and clear errors for what cannot be chunked."""
import copy
import statistics

import pytest
import torch
from torch import nn

STEPS = 8
WIDTH = 256
CAP_MB = 0.3
CHUNK_BYTES = 64 << 10


def _model(gen=None):
    from pyreducer.testing.models import Jitter

    layers = []
    for _ in range(8):  # 257 KB each: a first bucket of 1 MB, then one layer per bucket
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh(), Jitter(gen, max_s=0.01)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


def _first_appearances(order):
    """Buckets by their first entry in a launch sequence: the order their first chunks go."""
    return list(dict.fromkeys(order))


def _launched(record):
    """Buckets of a timeline record in the order their first chunk was launched."""
    return sorted(range(len(record["buckets"])), key=lambda b: record["buckets"][b]["launch_ns"])


def _train(model, opt, gen, steps=STEPS):
    for _ in range(steps):
        model(torch.randn(8, WIDTH, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def chunked_barrier_worker(rank, world_size):
    """No overlapped optimizer: a chunked, reordered launch sequence set on the Reducer by hand,
    against torch DDP with the same buckets."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base = _model()
    out = {}
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        model = cls(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
        gen = torch.Generator().manual_seed(rank)
        _train(model, opt, gen, steps=2)  # the rebuild happens at the second forward
        if name == "ours":
            count = len(model.bucket_plan())
            chunks = [1 + b % 4 for b in range(count)]
            order = [b for b in reversed(range(count)) for _ in range(chunks[b])]
            order = order[1:] + order[:1]  # not grouped by bucket at the ends
            model.reducer.set_launch_order(order, chunks)
            out["set"] = (model.reducer.launch_order(), model.reducer.launch_chunks())
        _train(model, opt, gen)
        out[name] = [p.detach().clone() for p in model.parameters()]
    out["records"] = model.timeline(2)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_chunked_launches_give_torch_ddps_sums(ranks_once, world_size):
    results = ranks_once(chunked_barrier_worker, world_size, ())
    for r in results:
        order, chunks = r["set"]
        assert max(chunks) == 4 and len(order) == sum(chunks)
        for ours, theirs in zip(r["ours"], r["torch"]):
            if world_size == 2:  # a + b: the same bits whatever the chunk
                assert torch.equal(ours, theirs)
            else:  # the ring's summation order may follow the chunk's size
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        for rec in r["records"]:
            assert _launched(rec) == _first_appearances(order)
            for b in rec["buckets"]:  # done = the last chunk's
                assert b["launch_ns"] <= b["done_ns"]


def auto_worker(rank, world_size, jitter):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base = _model()
    out = {}
    for name in ("torch", "ours"):
        gen = torch.Generator().manual_seed(100 + rank)
        module = copy.deepcopy(base)
        if jitter:  # the same parameters, a backward slowed at random points on every rank
            module = _model(torch.Generator().manual_seed(rank))
            module.load_state_dict(base.state_dict())
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        model = cls(module, bucket_cap_mb=CAP_MB)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        if name == "ours":  # chunks of 64 KB (4 per layer) whatever the loopback link predicts
            opt = model.overlap_optimizer(opt, schedule=CHUNK_BYTES / 2**20)
        _train(model, opt, gen, steps=12)
        if name == "ours":
            model.synchronize()
            out["log"] = opt.schedule_log
            out["set"] = (model.reducer.launch_order(), model.reducer.launch_chunks())
            out["records"] = model.timeline(3)
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("world_size,jitter", [(2, False), (3, True)])
def test_planned_schedule_is_installed_alike_and_keeps_results(ranks_once, world_size, jitter):
    results = ranks_once(auto_worker, world_size, (jitter,))
    order, chunks = results[0]["set"]
    assert max(chunks) > 1 and sorted(set(order)) == list(range(len(chunks)))
    for r in results:
        planned, chosen = r["log"]  # one candidate (a fixed size): installed at once
        assert planned["event"] == "planned" and planned["lanes"] == 2
        link = planned["link"]  # planned on the rate the profiled backwards got (loaded_link)
        assert 0.25 <= link["bandwidth_scale"] <= 1.5
        assert link["bandwidth_bytes_per_s"] == pytest.approx(
            link["probed_bandwidth_bytes_per_s"] * link["bandwidth_scale"])
        # the profile the model planned from, and the schedule it was recorded under
        assert len(planned["profile"]["ready_ms"]) == len(chunks)
        assert planned["profiled_schedule"] == dict(order=list(range(len(chunks))),
                                                    chunks=[1] * len(chunks))
        assert chosen["event"] == "chosen" and chosen["order"] == order  # rank 0's, everywhere
        assert chosen["chunk_bytes"] == CHUNK_BYTES
        assert r["set"] == (order, chunks)
        for rec in r["records"]:  # recorded after the schedule was installed
            assert _launched(rec) == _first_appearances(order), rec["buckets"]
        for ours, theirs in zip(r["ours"], r["torch"]):
            if world_size == 2:
                assert torch.equal(ours, theirs)
            else:
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # rounding only
    assert order[0] == 0  # the last layers' bucket, full first, starts the backward


def one_rank_eval_worker(rank, world_size):
    """Rank 0 alone runs a forward with grad on between steps (an evaluation that forgot
    no_grad), with the tuners that act collectively at forwards: the overlapped schedule's and
    bucket_cap_mb="auto"'s. Each acts at the first synced forward after a backward, so the
    ranks stay in step (counting every synced forward, rank 0 issued its collectives one
    forward early: a hang). Parameters against torch DDP doing the same. The evaluation comes
    before a step, never after the last one: there rank 0's tuner, if still tuning, would
    act with no training forward on rank 1 to meet it (as torch DDP's buffer broadcast would
    at any forward on one rank), and whether it still tunes then depends on the timing. The
    link probe is steady_link's (its pieces still collective): with the real one's fit failing,
    as it can on a loaded machine, autotune would decide at once and log one line."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer.testing import steady_link
    from pyreducer import DistributedDataParallel
    from pyreducer.tuning import AutotuneConfig

    steady_link.install()

    torch.manual_seed(0)
    base = _model()
    out = {}
    for name in ("torch", "overlap", "bucket_autotune"):
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        cap = AutotuneConfig(warmup_iterations=2, measure_iterations=2, probe_every=1) \
            if name == "bucket_autotune" else CAP_MB
        model = cls(copy.deepcopy(base), bucket_cap_mb=cap)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        if name == "overlap":
            opt = model.overlap_optimizer(opt)
        gen = torch.Generator().manual_seed(rank)
        for step in range(14):
            if rank == 0 and step > 0:
                model(torch.randn(2, WIDTH)).sum().item()
            _train(model, opt, gen, steps=1)
        if name != "torch":
            model.synchronize()
        out[name] = [p.detach().clone() for p in model.parameters()]
        if name == "overlap":
            out["log"] = [entry["event"] for entry in opt.schedule_log]
        if name == "bucket_autotune":
            out["autotune"] = [entry.get("event") for entry in model.autotune_log]
    return out


def test_a_forward_on_one_rank_alone_keeps_the_tuners_in_step(ranks_once):
    results = ranks_once(one_rank_eval_worker, 2, ())
    for rank, r in enumerate(results):
        assert "planned" in r["log"], r["log"]  # the schedule tuner's collectives ran
        assert r["log"] == results[0]["log"], (rank, r["log"])
        assert len(r["autotune"]) > 1 and r["autotune"] == results[0]["autotune"], r["autotune"]
        for ours, theirs in zip(r["overlap"], r["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}"


def trials_worker(rank, world_size):
    """schedule="auto": the model's best few schedules are each installed and timed, then the
    fastest for good; the same decisions on every rank, and torch DDP's parameters."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.overlap import contention, schedule_tuner

    # on loopback this model's all-reduces overlap its compute for about a millisecond, near
    # the threshold under which the tuner keeps the probe's contention: measure it in place
    contention.MIN_BUSY_MS = 1e-3
    # the rounds pick the first overlapped candidate, whatever loopback's timing, so that the
    # run-off (and its gather) always runs; the run-off decides with the real choose()
    real_choose, calls = schedule_tuner.choose, []

    def rounds_pick_an_overlap(candidates):
        calls.append(len(candidates))
        if len(calls) == 1:
            return next(k for k, c in enumerate(candidates) if not c.get("barrier"))
        return real_choose(candidates)

    schedule_tuner.choose = rounds_pick_an_overlap
    torch.manual_seed(0)
    base = _model()
    out = {}
    for name in ("torch", "ours"):
        cls = TorchDDP if name == "torch" else DistributedDataParallel
        model = cls(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
        if name == "ours":
            opt = model.overlap_optimizer(opt)
        # rebuild, warm-up, the held iterations, then each trial (the barrier's too) takes
        # 1 + TRIAL_ITERATIONS steps per round, and the run-off's windows if an overlap won
        steps = 8 + schedule_tuner.HELD_ITERATIONS + 1 + (schedule_tuner.ROUNDS * (
            schedule_tuner.TRIALS + 1) + 2 * schedule_tuner.RUNOFF_WINDOWS) * (
            schedule_tuner.TRIAL_ITERATIONS + 1) + 3
        gen = torch.Generator().manual_seed(rank)
        decided = []
        for step in range(steps):
            if name == "ours" and step % 3 == 0:  # a forward whose backward never comes: the
                model(torch.randn(2, WIDTH))       # next install must still be allowed
            _train(model, opt, gen, steps=1)
            if name == "ours":
                decided.append(opt.tuner.decided)
        if name == "ours":
            out["decided"] = decided
            model.synchronize()
            out["log"] = opt.schedule_log
            out["set"] = (model.reducer.launch_order(), model.reducer.launch_chunks())
            out["barrier_now"] = opt.barrier
        out[name] = [p.detach().clone() for p in model.parameters()]
    # both modes by hand, between iterations: what a backward leaves in flight
    in_flight = {}
    for barrier in (True, False, True):
        opt._set_barrier(barrier)
        model(torch.randn(8, WIDTH)).sum().backward()
        in_flight[barrier] = (len(model.reducer.pending_buckets()), len(opt.pending))
        opt.step()
        opt.zero_grad()
    out["in_flight"] = in_flight
    return out


def test_auto_schedule_measures_the_best_candidates_and_keeps_the_fastest(ranks_once):
    results = ranks_once(trials_worker, 2, ())
    for r in results:
        events = [e["event"] for e in r["log"]]
        trials = len(r["log"][0]["trials"])
        assert events == ["planned"] + ["measured"] * trials + ["runoff", "chosen"], events
        # whole buckets in two orders at least, chunks of 256 KB; and torch DDP's barrier
        assert 3 <= trials <= schedule_tuner_trials() + 1
        assert r["log"][0]["trials"][-1]["barrier"]
        # the contention was measured in place (held iterations, the compute alone, against
        # the profiled ones) and logged; the model planned on the held compute and the probe's
        measured, planned = r["log"][0]["contention_in_place"], r["log"][0]
        # (one forward in three has no backward here: it counts, but records nothing)
        assert 2 <= measured["held_records"] <= schedule_tuner_held()
        assert measured["loaded_records"] >= 2
        # kept for offline checks: every held record, the last one's forward not yet run
        assert len(measured["records"]["held"]) == measured["held_records"] + 1
        assert 0.0 <= measured["contention"] <= 0.9
        assert planned["link"]["contention"] == planned["link"]["probed_contention"]
        assert planned["profile"]["backward_ms"] == measured["backward_ms"]
        assert "barrier" in r["log"][trials]["describe"]  # the last candidate
        chosen = r["log"][-1]
        # decided (what the benchmark waits for) once, from the step that chose, for good
        first = r["decided"].index(True)  # (raises if never)
        assert 0 < first < len(r["decided"]) - 1 and all(r["decided"][first:]), r["decided"]
        assert r["set"] == (chosen["order"], chosen["chunks"])
        assert r["barrier_now"] == chosen["barrier"]
        # barrier: the backward completes everything; overlapped: the last buckets stay in flight
        assert r["in_flight"][True] == (0, 0) and r["in_flight"][False][0] > 0
        for ours, theirs in zip(r["ours"], r["torch"]):
            assert torch.equal(ours, theirs)
    _check_the_choice([r["log"] for r in results])


def _check_the_choice(logs):
    """Every rank decided on the same gathered windows and installed the same choice: the rounds
    picked the first overlapped candidate (trials_worker makes them), which ran off against the
    barrier; the fresh windows alone decided (choose, tested by hand in test_schedule.py)."""
    from pyreducer.overlap.schedule_tuner import choose

    assert all(log[-1]["order"] == logs[0][-1]["order"] for log in logs)
    assert all(log[-2] == logs[0][-2] for log in logs)  # the run-off, the same everywhere
    log = logs[0]
    trials = log[0]["trials"]
    for k, m in enumerate(log[1:1 + len(trials)]):
        assert all(other[1 + k]["windows_ms"] == m["windows_ms"] for other in logs)
        # a window is its slowest rank's mean step; a candidate is the median window
        assert len(m["windows_ms"]) == schedule_tuner_rounds()
        assert m["measured_ms"] == pytest.approx(statistics.median(m["windows_ms"]))
        assert all(w >= w0 for w, w0 in zip(m["windows_ms"], m["rank0_windows_ms"]))
    runoff, best = log[-2], trials[0]
    assert runoff["event"] == "runoff" and runoff["describe"] == best["describe"]
    assert len(runoff["windows_ms"]) == len(runoff["barrier_windows_ms"]) == \
        schedule_tuner_runoff()
    assert runoff["measured_ms"] == pytest.approx(statistics.median(runoff["windows_ms"]))
    assert runoff["barrier_ms"] == pytest.approx(
        statistics.median(runoff["barrier_windows_ms"]))
    fresh = [dict(measured_ms=runoff["measured_ms"]),
             dict(measured_ms=runoff["barrier_ms"], barrier=True)]
    assert log[-1]["describe"] == (best, trials[-1])[choose(fresh)]["describe"]
    assert log[-1]["measured_ms"] == fresh[choose(fresh)]["measured_ms"]


def failed_plan_worker(rank, world_size):
    """Rank 0's planning fails after the held iterations: every rank goes back to the order
    the profile was recorded under (torch DDP's), not the held one, and keeps training."""
    from pyreducer import DistributedDataParallel
    from pyreducer.overlap import schedule_tuner

    def broken(*args, **kwargs):
        raise RuntimeError("planning failed on purpose")

    schedule_tuner.schedule_model.best_schedule = broken  # only rank 0 plans
    held_records = []  # and, on rank 0, the complete held records the profile was given
    measure = schedule_tuner.contention.measure_in_place

    def measuring(loaded, held):
        held_records.append(sum(schedule_tuner.contention.has_forward(r) for r in held))
        return measure(loaded, held)

    schedule_tuner.contention.measure_in_place = measuring
    torch.manual_seed(0)
    model = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(rank)
    count, held = None, None
    for _ in range(2 + opt.tuner.warmup + schedule_tuner.HELD_ITERATIONS + 4):
        _train(model, opt, gen, steps=1)
        count = len(model.bucket_plan())
        if opt.tuner.held_left and held is None:
            held = model.reducer.launch_order()
    model.synchronize()
    return dict(held=held, order=model.reducer.launch_order(), count=count,
                log=opt.schedule_log, tried=opt.tuner.planned_for is not None,
                decided=opt.tuner.decided,
                held_records=held_records)


def test_a_failed_plan_after_the_held_iterations_restores_the_profiled_order(ranks_once):
    results = ranks_once(failed_plan_worker, 2, ())
    for r in results:
        assert r["held"] is not None and r["held"][0] == r["count"] - 1  # the held phase ran
        assert r["tried"] and r["log"] == []  # planned once, nothing installed
        assert r["decided"]  # torch DDP's order stays: nothing more to wait for
        assert r["order"] == list(range(r["count"]))
    # rank 0 profiled every held iteration whose next forward ran (all of them but the last)
    assert results[0]["held_records"] == [schedule_tuner_held()]


def unusable_probe_worker(rank, world_size):
    """The link probe's fit fails (as it can on a loaded machine: times that do not grow with
    size; every rank fits the slowest rank's times, so every rank fails alike): the schedule
    tuner says so in its log and keeps torch DDP's order, and training goes on, equal to a
    plain SGD step on the same data."""
    from pyreducer import DistributedDataParallel
    from pyreducer.overlap import schedule_tuner
    from pyreducer.tuning import control

    def unusable(self):
        raise ValueError("link fit failed: times do not grow with size (on purpose)")

    control.BucketTuning.probe = unusable
    torch.manual_seed(0)
    base = _model()
    out = {}
    for name in ("overlap", "chunks", "plain"):
        model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if name != "plain":  # chunks: a size the user fixed, kept without the link model
            opt = model.overlap_optimizer(opt, schedule=CAP_MB / 4 if name == "chunks" else
                                          "auto")
            steps = 2 + opt.tuner.warmup + schedule_tuner.HELD_ITERATIONS + 4
        _train(model, opt, torch.Generator().manual_seed(rank), steps=steps)
        if name != "plain":
            model.synchronize()
            out[f"{name}_schedule"] = dict(
                log=opt.schedule_log, decided=opt.tuner.decided, count=len(model.bucket_plan()),
                order=model.reducer.launch_order(), chunks=model.reducer.launch_chunks())
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def test_an_unusable_link_probe_keeps_the_order_and_a_fixed_chunk_size(ranks_once):
    results = ranks_once(unusable_probe_worker, 2, ())
    for rank, r in enumerate(results):
        for name in ("overlap", "chunks"):
            s = r[f"{name}_schedule"]
            assert [e["event"] for e in s["log"]] == ["not planned"], (name, s["log"])
            assert "link probe unusable: link fit failed" in s["log"][0]["reason"]
            assert s["decided"], name
            for ours, plain in zip(r[name], r["plain"]):
                assert torch.equal(ours, plain), f"rank {rank}: {name}"
        auto, fixed = r["overlap_schedule"], r["chunks_schedule"]
        assert auto["order"] == list(range(auto["count"])) and set(auto["chunks"]) == {1}
        # the user's chunk size stays in force, its chunks in torch DDP's bucket order
        assert max(fixed["chunks"]) > 1, fixed["chunks"]
        assert fixed["order"] == [b for b, n in enumerate(fixed["chunks"]) for _ in range(n)]


def schedule_tuner_held():
    from pyreducer.overlap import schedule_tuner

    return schedule_tuner.HELD_ITERATIONS


def schedule_tuner_trials():
    from pyreducer.overlap import schedule_tuner

    return schedule_tuner.TRIALS


def errors_worker(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    count = len(model.bucket_plan())
    messages = []
    for order, chunks in (([0] * (count + 1), [1] * count),
                          (list(range(count)), [0] + [1] * (count - 1)),
                          (list(range(count)), [1] * (count + 1)),
                          (list(range(count)) + [0], [2] + [1] * (count - 1))):
        try:
            model.reducer.set_launch_order(order, chunks)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    model.reducer.set_launch_order(list(range(count)) + [0], [2] + [1] * (count - 1))
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        messages.append(None)
    except RuntimeError as error:
        messages.append(str(error))
    hooked = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        hooked.reducer.set_launch_order([0] * 2 + list(range(1, count)), [2] + [1] * (count - 1))
        messages.append(None)
    except ValueError as error:
        messages.append(str(error))
    for options in (dict(hold_back=1), dict(schedule=0), dict(schedule="fast")):
        try:
            model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_launch_sequences_that_cannot_run_are_refused_by_name(ranks_once):
    messages = ranks_once(errors_worker, 2, ())[0]
    assert "bucket 0 must appear once per chunk, 1 time(s), found" in messages[0]
    assert "bucket 0 can be split into 1 to" in messages[1] and "got 0" in messages[1]
    assert "expected a chunk count for each of the" in messages[2]
    assert messages[3] is None  # bucket 0 in 2 chunks, launched first and last
    assert "communication hook sees whole buckets" in messages[4] and "bucket 0" in messages[4]
    assert "a communication hook sees whole buckets" in messages[5]
    assert "hold_back applies to schedule='fifo'" in messages[6]
    for message in messages[7:]:
        assert "schedule must be 'auto', 'fifo' or a chunk size in MB > 0" in message


def schedule_tuner_rounds():
    from pyreducer.overlap import schedule_tuner

    return schedule_tuner.ROUNDS


def schedule_tuner_runoff():
    from pyreducer.overlap import schedule_tuner

    return schedule_tuner.RUNOFF_WINDOWS


def caps_for_the_barrier_worker(rank, world_size):
    """bucket_cap_mb="auto" under an overlapped optimizer: per synced backward, whether bucket
    autotune had decided and how many reductions the backward left in flight."""
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import steady_link
    from pyreducer.tuning import AutotuneConfig

    steady_link.install()
    torch.manual_seed(0)
    model = DistributedDataParallel(_model(), bucket_cap_mb=AutotuneConfig(
        warmup_iterations=2, measure_iterations=2, probe_every=1))
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(40):
        loss = model(torch.randn(8, WIDTH, generator=gen)).pow(2).mean()
        decided = model._autotune.done  # (it decides at the start of a forward)
        loss.backward()
        seen.append((decided, len(model.reducer.pending_buckets())))
        opt.step()
        opt.zero_grad()
    model.synchronize()
    return seen


def test_bucket_autotune_measures_the_barrier(ranks_once):
    """Note [Caps tuned for the barrier] (schedule_tuner.py): while bucket autotune decides,
    every backward completes its reductions (torch DDP's step, as bucket_cap_mb="auto" alone
    runs); once it has, the schedule's profile runs overlapped iterations."""
    for rank, seen in enumerate(ranks_once(caps_for_the_barrier_worker, 2, ())):
        tuning = [in_flight for decided, in_flight in seen[1:] if not decided]
        after = [in_flight for decided, in_flight in seen if decided]
        assert len(tuning) >= 4 and not any(tuning), f"rank {rank}: {seen}"
        assert after and any(after), (rank, seen)
