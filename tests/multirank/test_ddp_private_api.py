"""torch DDP's private API that research code calls, against torch DDP itself on 2 Gloo ranks:
_get_ddp_logging_data() (the same keys, types and values, timings aside, which must be
consistent), _set_ddp_runtime_logging_sample_rate() and _set_static_graph()."""
import copy
import warnings

import pytest
import torch
from torch import nn

# Keys whose values are measured times: compared for presence and consistency, not equality.
TIMES = {"forward_compute_time", "backward_compute_time", "backward_comm_time",
         "backward_compute_comm_overlap_time", "forward_compute_time_start",
         "backward_compute_time_start", "backward_comm_time_start", "backward_compute_time_end",
         "backward_comm_time_end"}
TIMES |= {f"avg_{k}" for k in list(TIMES) if k.endswith("_time")}


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 4)
        self.c.bias.requires_grad_(False)

    def forward(self, x, skip=False):
        h = torch.relu(self.a(x))
        return self.c(h if skip else h + self.b(h))


def _run(cls, base, rank, steps, sample_rate=None, skip_every=0, **kwargs):
    model = cls(copy.deepcopy(base), **kwargs)
    if sample_rate is not None:
        model._set_ddp_runtime_logging_sample_rate(sample_rate)
    snapshots = [model._get_ddp_logging_data()]
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        skip = bool(skip_every) and step % skip_every == 0
        model(torch.randn(4, 10, generator=gen), skip=skip).sum().backward()
        model.zero_grad()
        snapshots.append(model._get_ddp_logging_data())
    return model, snapshots


def _errors(cls, base):
    """The logged errors of a late _set_static_graph and of a bad sample rate."""
    late = cls(copy.deepcopy(base))
    late(torch.randn(4, 10)).sum().backward()
    try:
        late._set_static_graph()
    except RuntimeError as error:
        raised = str(error)
    rate = cls(copy.deepcopy(base))
    try:
        rate._set_ddp_runtime_logging_sample_rate(0)
    except ValueError as error:
        rate_raised = str(error)
    return dict(static=(raised, late._get_ddp_logging_data()),
                rate=(rate_raised, rate._get_ddp_logging_data()))


def logging_worker(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    base = Branchy()
    out = {}
    for key, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        runs = {}
        runs["rate2"] = _run(cls, base, rank, 20, sample_rate=2)[1]
        runs["unused"] = _run(cls, base, rank, 6, skip_every=2, find_unused_parameters=True,
                              bucket_cap_mb=0.0005)[1]
        runs["static"] = _run(cls, base, rank, 4, static_graph=True)[1]
        hooked = cls(copy.deepcopy(base))
        before = hooked._get_ddp_logging_data().get("comm_hook")
        hooked.register_comm_hook(None, default_hooks.allreduce_hook)
        runs["hook"] = (before, hooked._get_ddp_logging_data().get("comm_hook"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            twice = cls(copy.deepcopy(base), static_graph=True)
            twice._set_static_graph()
        runs["twice"] = [str(w.message) for w in caught]
        runs["errors"] = _errors(cls, base)
        out[key] = runs
    return out


@pytest.fixture(scope="module")
def logged(ranks_once):
    return ranks_once(logging_worker, 2, ())


def _compare(theirs: dict, ours: dict, where: str) -> None:
    assert list(ours) == list(theirs), where  # same keys, in torch's order
    for key, value in theirs.items():
        assert type(ours[key]) is type(value), f"{where}: {key}"
        if key in TIMES:
            assert (ours[key] > 0) == (value > 0), f"{where}: {key} {ours[key]} vs {value}"
        else:
            assert ours[key] == value, f"{where}: {key} {ours[key]!r} vs torch's {value!r}"


@pytest.mark.parametrize("run", ["rate2", "unused", "static"])
def test_logging_data_matches_torch_at_every_step(logged, run):
    for rank, r in enumerate(logged):
        for step, (theirs, ours) in enumerate(zip(r["torch"][run], r["ours"][run])):
            _compare(theirs, ours, f"rank {rank} {run} after {step} steps")


def test_sampled_timings_are_consistent(logged):
    """As torch's own test asserts: times of a sampled iteration are positive, the overlap is
    within both compute and communication, timestamps are ordered."""
    for step, d in enumerate(logged[0]["ours"]["rate2"]):
        if step >= 2 and (step - 1 <= 10 or (step - 1) % 2 == 0):
            assert d["iteration"] == step - 1
            assert d["forward_compute_time"] >= 1 and d["backward_compute_time"] >= 1
            assert d["backward_comm_time"] >= 1
            assert d["backward_compute_time"] >= d["backward_compute_comm_overlap_time"]
            assert d["backward_comm_time"] >= d["backward_compute_comm_overlap_time"]
            assert d["backward_comm_time_end"] >= d["backward_comm_time_start"] >= \
                d["backward_compute_time_start"] >= d["forward_compute_time_start"]


def test_comm_hook_and_static_graph_warnings_as_torch(logged):
    for r in logged:
        assert r["ours"]["hook"] == r["torch"]["hook"] == (None, "allreduce_hook")
        assert r["ours"]["twice"] == r["torch"]["twice"]
        assert r["ours"]["twice"] == ["You've set static_graph to be True, no need to set it "
                                      "again."]


def test_errors_are_raised_and_logged_with_torchs_words(logged):
    for r in logged:
        for kind in ("static", "rate"):
            (raised_theirs, data_theirs), (raised_ours, data_ours) = \
                r["torch"]["errors"][kind], r["ours"]["errors"][kind]
            assert raised_ours.startswith(raised_theirs), (raised_ours, raised_theirs)
            assert data_ours["error"] == data_theirs["error"]
            assert data_ours["has_error"] == data_theirs["has_error"] == 1
            assert data_ours["iteration"] == data_theirs["iteration"]
