"""Remembered tuning decisions (pyreducer/tuning/memory.py) on 2 spawned Gloo ranks: a second run
of the same model starts from the first run's bucket plan and overlapped schedule, confirmed in
one window each; a remembered decision that measures slow is dropped and the search runs; a
different model does not match; gradients stay those of the untuned run; each decision is said
in one line on rank 0 (pyreducer/tuning/announce.py)."""
import copy
import logging

import pytest
import torch

# The whole search of both tuners, from scratch, fits however its measurements fall: bucket
# autotune at most 3 warm-up + 37 (the probe's 6 pieces, one every 6) + 4 candidates x 4 + the
# confirm's 2 x 4 = 65 synced steps, then the schedule 4 warm-up + 6 held + 2 rounds x 4
# trials x 5 + the run-off's 2 x 3 windows x 5 = 80: 145 (94-134 measured; 140 steps was too few
# for a run whose measurements asked for every phase).
STEPS = 160


def _run(base, spec, rank, config, overlap):
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if overlap:
        opt = model.overlap_optimizer(opt)
    gen = torch.Generator().manual_seed(rank)
    decided_at, phases = None, []
    for step in range(STEPS):
        opt.zero_grad()
        spec.loss(model, spec.batch(gen, 8)).backward()
        opt.step()
        phases.append(model.tuning_phase()[0])
        tuner = getattr(opt, "tuner", None)
        if decided_at is None and model._autotune.done and (tuner is None or tuner.decided):
            decided_at = step + 1
    model.synchronize()
    return dict(log=model.autotune_log, schedule_log=getattr(opt, "schedule_log", []),
                decided_at=decided_at, plan=model.bucket_plan(), phases=phases,
                logs=sorted(model.tuning_phase()[1]),
                params=[p.detach().clone() for p in model.parameters()])


def memory_worker(rank, world_size, cache_path, overlap):
    from pyreducer.testing import steady_link
    from pyreducer.testing import models
    from pyreducer.tuning import AutotuneConfig, memory

    steady_link.install()  # a search in every run that does not recall (steady_link.py)

    # Loopback links swing between runs far more than a real link does: here the runs must
    # match (link_matches has its own unit test), and recalled windows must be kept unless a
    # run says otherwise.
    memory.BANDWIDTH_FACTOR, memory.LATENCY_FACTOR = 1e9, 1e9
    memory.RECALL_TOLERANCE = float("inf")  # however slow a window on a loaded machine
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("pyreducer.tuning").addHandler(handler)
    logging.getLogger("pyreducer.tuning").setLevel(logging.INFO)
    spec = models.spec("mlp")
    torch.manual_seed(0)
    base = spec.build()
    config = AutotuneConfig(cache=cache_path)
    out = dict(first=_run(base, spec, rank, config, overlap))
    out["first_lines"], lines[:] = list(lines), []
    out["second"] = _run(base, spec, rank, config, overlap)
    out["second_lines"], lines[:] = list(lines), []
    memory.RECALL_TOLERANCE = -0.999  # any window is "too slow": the search runs again
    out["rejected"] = _run(base, spec, rank, config, overlap)
    memory.RECALL_TOLERANCE = float("inf")
    other = models.spec("deep_narrow")
    torch.manual_seed(0)
    out["other"] = _run(other.build(), other, rank, config, overlap)
    out["off"] = _run(base, spec, rank, AutotuneConfig(cache=False), overlap)
    if overlap:  # a plain bucket_cap_mb="auto" run first: its buckets are the overlap's barrier
        shared = AutotuneConfig(cache=cache_path + ".plain")
        out["plain"] = _run(base, spec, rank, shared, overlap=False)
        out["overlap_after_plain"] = _run(base, spec, rank, shared, overlap=True)
    return out


def _events(log):
    return [e["event"] for e in log]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ranks_once):
    """Both tuners (bucket autotune, then the overlapped optimizer's schedule): what the
    bucket-only case does is the first half of it."""
    path = str(tmp_path_factory.mktemp("cache") / "tuning.json")
    return ranks_once(memory_worker, 2, (path, True)), True


def test_second_run_starts_from_the_first_runs_decisions(runs):
    results, overlap = runs
    for r in results:
        first, second = r["first"], r["second"]
        assert "recalled" not in _events(first["log"])
        assert _events(second["log"])[-2:] == ["recalled", "chosen"], second["log"]
        assert second["log"][-1]["plan"] == "remembered"
        assert second["plan"] == first["plan"]
        if overlap:
            assert "recalled" in _events(second["schedule_log"]), second["schedule_log"]
            chosen = [e for e in second["schedule_log"] if e["event"] == "chosen"]
            first_chosen = [e for e in first["schedule_log"] if e["event"] == "chosen"]
            assert chosen[-1]["order"] == first_chosen[-1]["order"]
            assert chosen[-1]["chunks"] == first_chosen[-1]["chunks"]
            assert "measured" not in _events(second["schedule_log"])  # no trials
        # one window per tuner instead of the search (the link probe runs in both: its
        # measurement is part of the key)
        assert not {"candidate", "measured"} & set(_events(second["log"])), second["log"]
        if overlap:  # (bucket autotune's search of this small model may be as short)
            assert second["decided_at"] <= first["decided_at"] - 30, (first["decided_at"],
                                                                      second["decided_at"])


def test_the_overlapped_optimizer_recalls_a_plain_runs_buckets(runs):
    """Note [Caps tuned for the barrier]: both autotunes answer the same question (the caps
    under the barrier), so they share one cache entry; the overlap's schedule is then planned,
    and its barrier measured, on the buckets the plain run chose."""
    results, overlap = runs
    assert overlap
    for r in results:
        plain, after = r["plain"], r["overlap_after_plain"]
        assert "recalled" not in _events(plain["log"]) and plain["schedule_log"] == []
        assert _events(after["log"])[-2:] == ["recalled", "chosen"], after["log"]
        assert after["plan"] == plain["plan"]
        assert "measured" in _events(after["schedule_log"])  # its own schedule search


def test_recalled_decisions_keep_the_results(runs):
    results, _ = runs
    for r in results:  # the same plan and schedule from the same start: the same parameters
        for a, b, c in zip(r["first"]["params"], r["second"]["params"], r["off"]["params"]):
            assert torch.equal(a, c) and torch.equal(b, c)


def test_a_slow_recalled_decision_is_dropped_for_the_search(runs):
    results, overlap = runs
    for r in results:
        events = _events(r["rejected"]["log"])
        assert "recall rejected" in events and events.index("recall rejected") < \
            events.index("candidate"), events
        assert r["rejected"]["log"][-1]["event"] == "chosen"
        assert r["rejected"]["log"][-1]["plan"] != "remembered"


def test_another_model_or_no_cache_searches(runs):
    results, _ = runs
    for r in results:
        for key in ("other", "off"):
            assert "recalled" not in _events(r[key]["log"]), key
            assert r[key]["log"][-1]["event"] == "chosen", key


def test_each_decision_is_said_once_on_rank_0(runs):
    results, overlap = runs
    rank0, rank1 = results
    assert rank1["first_lines"] == [] and rank1["second_lines"] == []
    first = rank0["first_lines"]
    assert len(first) == (2 if overlap else 1), first
    assert first[0].startswith("pyreducer autotune: ") and " chosen after " in first[0]
    assert "ms/step measured against" in first[0] and "with torch DDP's caps" in first[0]
    if overlap:
        assert first[1].startswith("pyreducer overlapped optimizer: ")
        assert " chosen after " in first[1] and "measured" in first[1]
    second = rank0["second_lines"]
    assert len(second) == len(first), second
    assert all(" recalled from " in line and " kept after " in line for line in second), second


def test_the_phase_in_words_follows_the_tuners(runs):
    """DistributedDataParallel.tuning_phase(): what the report draws (observe/recorder.py)."""
    results, _ = runs
    for r in results:
        kinds = [p.split(":")[0] for p in r["first"]["phases"]]
        runs_of = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
        assert runs_of == ["buckets", "schedule", "decided"], runs_of
        assert "buckets: measure_current" in r["first"]["phases"]
        assert any(p.startswith("schedule: trial ") for p in r["first"]["phases"])
        assert r["first"]["logs"] == ["buckets", "schedule"]
        assert r["first"]["decided_at"] == kinds.index("decided") + 1
