"""check_finite=True (issue 15, beyond DDP): a NaN or Inf gradient on some rank makes backward
raise on every rank, naming the parameter and the rank(s) it came from, before the optimizer
steps; with finite gradients the results equal torch DDP's bit for bit (the check changes
nothing it does not reject)."""
import pytest
import torch
from torch import nn

from pyreducer.testing import run_ranks


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).to(dtype)


def poison_worker(rank, world_size, poison, views=False, delayed=False):
    """poison: {rank: (parameter name, value)}: that rank's gradient of that parameter gets
    value in one element at step 2. Returns each step's error (or None) and the parameters.
    views: gradient_as_bucket_view (the local check then runs before each launch). delayed: the
    last layer's all-reduce delayed (delay_all_reduce_named_params, hooked on the first's)."""
    from pyreducer import DistributedDataParallel

    module = _model()
    extra = dict(delay_all_reduce_named_params=list(module[4].named_parameters(prefix="4")),
                 param_to_hook_all_reduce=module[0].weight) if delayed else {}
    model = DistributedDataParallel(module, bucket_cap_mb=0.0005, check_finite=True,
                                    gradient_as_bucket_view=views, **extra)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.module.named_parameters())
    if rank in poison:
        name, value = poison[rank]

        def hook(grad):
            grad = grad.clone()
            grad.view(-1)[3] = value
            return grad
        params[name].register_hook(lambda grad: hook(grad) if state["step"] == 2 else grad)
    state, errors = {"step": 0}, []
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        state["step"] = step
        before = {n: p.detach().clone() for n, p in params.items()}
        optimizer.zero_grad()
        try:
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        except RuntimeError as error:
            errors.append(str(error))
            # the loop's optimizer.step() is never reached; parameters are as before the step
            assert all(torch.equal(before[n], p) for n, p in params.items())
            continue
        errors.append(None)
        optimizer.step()
    return dict(errors=errors, params=[p.detach().clone() for p in model.parameters()])


@pytest.mark.parametrize("views", [False, True], ids=["grads", "bucket_views"])
@pytest.mark.parametrize("poison, names, ranks", [
    ({1: ("2.weight", float("nan"))}, ["2.weight (NaN)"], "rank(s) 1 "),
    ({0: ("4.bias", float("inf")), 1: ("4.bias", float("-inf"))}, ["4.bias (NaN)"],
     "rank(s) 0, 1 "),
    ({0: ("0.weight", float("inf"))}, ["0.weight (Inf)"], "rank(s) 0 ")])
def test_non_finite_gradient_raises_on_every_rank_naming_parameter_and_rank(poison, names,
                                                                           ranks, views):
    results = run_ranks(poison_worker, 2, (poison, views), timeout_s=120)
    for rank, result in enumerate(results):
        first, error, third = result["errors"]
        assert first is None and third is None, result["errors"]  # training goes on after it
        assert error.startswith("pyreducer: check_finite: non-finite averaged gradients"), error
        assert f"seen on rank {rank} of 2" in error
        for name in names:
            assert f"parameter(s) {name} in bucket" in error, error
        assert f"from {ranks}" in error, error
        assert error.count("parameter(s)") == 1, error  # only the poisoned parameter's bucket
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("poison, names, ranks", [
    ({1: ("4.bias", float("nan"))}, "4.bias (NaN)", "from rank(s) 1 "),
    ({0: ("4.weight", float("inf"))}, "4.weight (Inf)", "from rank(s) 0 ")])
def test_non_finite_delayed_gradient_raises_on_every_rank(poison, names, ranks):
    """The delayed all-reduce's parameters are checked too (they are not in the Reducer's
    buckets): named, with the rank, on every rank; training goes on after it."""
    results = run_ranks(poison_worker, 2, (poison, False, True), timeout_s=120)
    for rank, result in enumerate(results):
        first, error, third = result["errors"]
        assert first is None and third is None, result["errors"]
        assert error.startswith("pyreducer: check_finite: non-finite averaged gradients of the "
                                "delayed all-reduce"), error
        assert f"seen on rank {rank} of 2" in error and f"parameter(s) {names}: " in error, error
        assert ranks in error, error
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def parity_worker(rank, world_size, check_finite):
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(_model(), bucket_cap_mb=0.0005, check_finite=check_finite)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        optimizer.step()
    refused = {}
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name, attempt in (("overlap", lambda: model.overlap_optimizer(optimizer)),
                          ("join", lambda: model.join().__enter__()),
                          ("python_hook", lambda: model.register_comm_hook(
                              None, default_hooks.allreduce_hook))):
        try:
            attempt()
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
        if not check_finite:
            break  # the plain wrapper accepts the first; the others need a fresh one
    return dict(params=[p.detach().clone() for p in model.parameters()], refused=refused)


def test_finite_gradients_train_exactly_as_without_the_check():
    checked = run_ranks(parity_worker, 2, (True,), timeout_s=120)
    plain = run_ranks(parity_worker, 2, (False,), timeout_s=120)
    for a, b in zip(checked, plain):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert plain[0]["refused"] == {"overlap": None}
    refused = checked[0]["refused"]  # each would break the ranks' shared verdict
    assert "check_finite=True cannot be combined with overlap_optimizer" in refused["overlap"]
    assert "join() cannot be combined with check_finite=True" in refused["join"]
    assert "check_finite=True cannot be combined with a Python communication hook" in \
        refused["python_hook"]


def overflow_worker(rank, world_size):
    """float16 gradients, each rank's finite, whose sum overflows: averaged after the sum
    (gradient_predivide_factor=1), the reduced bucket holds Inf."""
    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    layer = nn.Linear(4, 1, bias=False).to(torch.float16)
    model = DistributedDataParallel(layer, check_finite=True, gradient_predivide_factor=1.0)
    x = torch.full((1, 4), 200.0, dtype=torch.float16)
    try:
        (model(x).float() * 200.0).sum().backward()  # gradient 40000 per element per rank
    except RuntimeError as error:
        return str(error)
    return None


def test_an_overflowing_sum_is_named_as_such():
    for error in run_ranks(overflow_worker, 2, (), timeout_s=120):
        assert error is not None and "weight (Inf)" in error, error
        assert "every rank's own gradient was finite: the sum overflowed in Half" in error, error
