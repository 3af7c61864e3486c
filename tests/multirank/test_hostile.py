"""Hostile input (issue 15): a bucket plan that is truncated, foreign, names the wrong
parameters, or differs between ranks, given to ONE rank only: every rank raises a clear error
naming that rank and the problem, promptly, instead of the others waiting in a collective (as
they did before: the rank with the bad plan raised alone). Also apply_bucket_plan with a bad
plan on rank 0."""
import copy
import json
import os
import time

import pytest
import torch
from torch import nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _bad_plans(tmp_dir, good):
    """name -> rank 1's plan (rank 0 gets the good one)."""
    names = [n for b in good for n in b]
    path = os.path.join(tmp_dir, "plan-{}.json")
    with open(path.format("good"), "w") as f:
        json.dump({"format": "pyreducer.bucket_plan", "version": 1, "buckets": good}, f)
    text = open(path.format("good")).read()
    files = {"truncated": text[: len(text) // 2],
             "foreign": json.dumps({"state_dict": {}, "epoch": 3}),
             "version": json.dumps({"format": "pyreducer.bucket_plan", "version": 7,
                                    "buckets": good})}
    for name, content in files.items():
        with open(path.format(name), "w") as f:
            f.write(content)
    return {"truncated": path.format("truncated"), "foreign": path.format("foreign"),
            "version": path.format("version"), "no file": path.format("missing"),
            "wrong name": [["0.weight", "2.wieght"]] + [[n] for n in names if n != "0.weight"],
            "duplicate": [names, [names[0]]],
            "missing": [names[:-1]],
            "other model": [["encoder.weight"], ["encoder.bias"]],
            "not names": [[0, 1], [2, 3]],
            "differs": [list(reversed(names))]}


def hostile_worker(rank, world_size, tmp_dir):
    from pyreducer import DistributedDataParallel

    base = _model()
    good = [[n] for n, _ in reversed(list(base.named_parameters()))]
    bad = _bad_plans(tmp_dir, good) if rank == 1 else None
    out = {}
    for name in ("truncated", "foreign", "version", "no file", "wrong name", "duplicate",
                 "missing", "other model", "not names", "differs"):
        plan = bad[name] if rank == 1 else good
        start = time.monotonic()
        try:
            DistributedDataParallel(copy.deepcopy(base), bucket_plan=plan)
            out[name] = (None, time.monotonic() - start)
        except ValueError as error:
            out[name] = (str(error), time.monotonic() - start)
    model = DistributedDataParallel(copy.deepcopy(base), bucket_plan=good)
    start = time.monotonic()
    try:  # rank 0's plan is the one applied: its bad plan stops every rank
        model.apply_bucket_plan([["0.weight", "9.weight"]] if rank == 0 else good)
        out["apply"] = (None, time.monotonic() - start)
    except ValueError as error:
        out["apply"] = (str(error), time.monotonic() - start)
    return out


WORDS = {"truncated": ["rank 1", "not valid JSON", "truncated?"],
         "foreign": ["rank 1", "not a pyreducer bucket plan"],
         "version": ["rank 1", "version 7"],
         "no file": ["rank 1", "No such file"],
         "wrong name": ["rank 1", "'2.wieght'", "not a reduced parameter"],
         "duplicate": ["rank 1", "is in bucket 0 and bucket 1"],
         "missing": ["rank 1", "in no bucket", "'0.weight'"],
         "other model": ["rank 1", "'encoder.weight'"],
         "not names": ["rank 1", "must list parameter names"],
         "differs": ["differs between ranks", "rank 1"],
         "apply": ["apply_bucket_plan: rank 0's plan cannot be used", "'9.weight'"]}


@pytest.fixture(scope="module")
def hostile(ranks_once, tmp_path_factory):
    return ranks_once(hostile_worker, 2, (str(tmp_path_factory.mktemp("hostile")),))


@pytest.mark.parametrize("case", list(WORDS))
def test_one_ranks_bad_plan_is_an_error_on_every_rank(hostile, case):
    for rank, result in enumerate(hostile):
        message, seconds = result[case]
        assert message is not None, f"rank {rank} accepted {case}"
        for word in WORDS[case]:
            assert word in message, f"rank {rank}, {case}: {word!r} not in {message!r}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s"  # no waiting for a timeout


def changed_worker(rank, world_size):
    """Parameters changed after wrapping (pyreducer/wrapper/watch.py), on every rank alike."""
    from pyreducer import DistributedDataParallel

    out = {}
    for case in ("added", "replaced", "removed", "resized", "same", "deepcopy"):
        net = _model()
        model = DistributedDataParallel(net)
        model(torch.randn(4, 8)).sum().backward()
        if case == "added":
            net.append(nn.Linear(4, 4))
        elif case == "replaced":
            net[0].weight = nn.Parameter(torch.randn(8, 8))
        elif case == "removed":
            net[2] = nn.Identity()
        elif case == "resized":
            with torch.no_grad():
                net[2].weight.data = net[2].weight.data[:2]
                net[2].bias.data = net[2].bias.data[:2]
        elif case == "same":
            net[0].weight = net[0].weight  # the same parameter again
            net[1] = nn.ReLU()  # a module without parameters
        elif case == "deepcopy":
            model = copy.deepcopy(model)
        try:
            model(torch.randn(4, 8)).sum().backward()
            out[case] = None
        except RuntimeError as error:
            out[case] = str(error)
    return out


CHANGED = {"added": "submodule '3' with parameters was added",
           "replaced": "parameter '0.weight' was replaced",
           "removed": "submodule '2' with parameters was replaced",
           "resized": "parameter '2.weight' was resized from (4, 8) to (2, 8)"}


def test_parameters_changed_after_wrapping_are_named(ranks_once):
    for rank, out in enumerate(ranks_once(changed_worker, 2, ())):
        for case, words in CHANGED.items():
            assert out[case] is not None and words in out[case], (case, out[case])
            assert f"on rank {rank}" in out[case] and "wrap it again" in out[case]
        assert out["same"] is None and out["deepcopy"] is None, out


def wrong_device_worker(rank, world_size, tmp_dir):
    """Rank 1's input is on another device than the module (the meta device stands in for a
    GPU here). pyreducer does not second-guess it (modules may move their inputs themselves;
    with device_ids inputs are moved, as in DDP): the module's own error is raised on rank 1,
    and once rank 1 leaves, rank 0's backward raises naming it, instead of waiting."""
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(_model())
    x = torch.randn(4, 8, device="meta" if rank == 1 else "cpu")
    start = time.monotonic()
    try:
        model(x).sum().backward()
        error = None
    except (RuntimeError, NotImplementedError) as caught:
        error = str(caught)
    if rank == 1:
        with open(os.path.join(tmp_dir, "rank1.txt"), "w") as f:
            f.write(error or "")
        os._exit(1)  # a script that does not catch the error ends here
    return dict(error=error, seconds=time.monotonic() - start)


def test_input_on_the_wrong_device_is_an_error_on_every_rank(tmp_path):
    from pyreducer.testing import run_ranks

    result = run_ranks(wrong_device_worker, 2, (str(tmp_path),), timeout_s=90, pg_timeout_s=20,
                       may_die=(1,))[0]
    assert "meta" in (tmp_path / "rank1.txt").read_text()  # torch's own words, on rank 1
    assert result["error"] is not None and "lost rank(s) 1 of 2" in result["error"], result
    assert result["seconds"] < 20, result
