"""mixed_precision against a reference computation (torch's own DDP mixed precision needs CUDA:
on CPU it fails with "cpu backend doesn't support events", so it cannot be the oracle here).

The reference is torch DDP's mixed-precision algorithm written out by hand: a low-precision copy
of the model runs forward and backward on inputs cast to param_dtype; its gradients are cast to
reduce_dtype, flattened in the wrapper's buckets, all-reduced (SUM) and divided by the world
size, then written into the full-precision parameters' .grad; SGD steps the full-precision
parameters, and the low-precision copy takes their values again. Gradients and parameters must
match the wrapper bit for bit on every rank, at 2 and 3 ranks; with the overlapped optimizer
too (updates deferred to the next forward, whose low-precision copies are cast from them).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

STEPS = 4
CONFIGS = {
    "bf16_reduce_fp32": (torch.bfloat16, torch.float32, torch.bfloat16),
    "fp16_reduce_fp16": (torch.float16, torch.float16, torch.float16),
    "bf16_reduce_bf16_no_buffer_cast": (torch.bfloat16, torch.bfloat16, None),
}


class Probe(nn.Module):
    """Two layers, a tied output (read twice), a buffer, a frozen parameter; records the dtypes
    forward sees."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16, bias=False)
        self.out.weight = self.mid.weight  # tied
        self.frozen = nn.Parameter(torch.randn(16), requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.seen = []

    def forward(self, x):
        self.seen.append((x.dtype, self.inp.weight.dtype, self.scale.dtype))
        h = torch.tanh(self.inp(x)) * self.scale.to(x.dtype) + self.frozen
        return self.out(torch.relu(self.mid(h)))


def _batch(gen):
    return torch.randn(6, 8, generator=gen), torch.randn(6, 16, generator=gen)


def _ours(base, config, rank, overlapped=False):
    """overlapped: with the overlapped optimizer (torch DDP's order, whole buckets)."""
    from torch.nn.parallel.distributed import _MixedPrecision

    from pyreducer import DistributedDataParallel

    param_dtype, reduce_dtype, buffer_dtype = config
    model = DistributedDataParallel(copy.deepcopy(base), mixed_precision=_MixedPrecision(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if overlapped:
        opt = model.overlap_optimizer(opt, schedule="fifo")
    gen = torch.Generator().manual_seed(rank)
    plans, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = _batch(gen)
        out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        plans.append([b["params"] for b in model.bucket_plan()])
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()
                      if p.grad is not None})
        opt.step()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return dict(plans=plans, grads=grads, params=params, seen=model.module.seen,
                buffer=model.module.scale.dtype,
                dtypes={n: (p.dtype, p.grad.dtype) for n, p in model.module.named_parameters()
                        if p.grad is not None})


def _reference(base, config, rank, plans):
    param_dtype, reduce_dtype, buffer_dtype = config
    master = copy.deepcopy(base)
    # rank 0's state everywhere (the wrapper's construction broadcast)
    for tensor in list(master.parameters()) + list(master.buffers()):
        dist.broadcast(tensor.data, src=0)
    low = copy.deepcopy(master).to(param_dtype)
    low.scale.data = master.scale.to(buffer_dtype or master.scale.dtype)
    params = dict(master.named_parameters())
    opt = torch.optim.SGD([p for p in master.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        low.zero_grad(set_to_none=True)
        x, y = _batch(gen)
        torch.nn.functional.mse_loss(low(x.to(param_dtype)).float(), y).backward()
        low_grads = dict(low.named_parameters())
        for bucket in plans[step]:
            flat = torch.cat([low_grads[n].grad.reshape(-1).to(reduce_dtype) for n in bucket])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            offset = 0
            for n in bucket:
                numel = params[n].numel()
                params[n].grad = flat[offset:offset + numel].view_as(params[n]).to(
                    params[n].dtype)
                offset += numel
        grads.append({n: p.grad.clone() for n, p in master.named_parameters()
                      if p.grad is not None})
        opt.step()
        with torch.no_grad():
            for (_, p), (_, q) in zip(master.named_parameters(), low.named_parameters()):
                q.copy_(p)  # cast down, as the next forward's copies
    return dict(grads=grads, params={n: p.detach().clone() for n, p in master.named_parameters()})


def mixed_precision_worker(rank, world_size):
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(100 + rank)  # ranks start different: rank 0's state must win
        base = Probe()
        ours = _ours(base, config, rank)
        out[name] = dict(ours=ours, reference=_reference(base, config, rank, ours["plans"]),
                         overlapped=_ours(base, config, rank, overlapped=True))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def mixed(request, ranks_once):
    return request.param, ranks_once(mixed_precision_worker, request.param, ())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_and_parameters_match_the_reference_bit_for_bit(mixed, name):
    _, results = mixed
    for rank, r in enumerate(results):
        ours, reference = r[name]["ours"], r[name]["reference"]
        for step, (a, b) in enumerate(zip(ours["grads"], reference["grads"])):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), f"rank {rank} step {step}: {key}.grad"
        for key, value in ours["params"].items():
            assert torch.equal(value, reference["params"][key]), f"rank {rank}: {key}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_runs_in_param_dtype_and_the_optimizer_in_full_precision(mixed, name):
    param_dtype, _, buffer_dtype = CONFIGS[name]
    _, results = mixed
    ours = results[0][name]["ours"]
    assert set(ours["seen"]) == {(param_dtype, param_dtype, buffer_dtype or torch.float32)}
    assert ours["buffer"] == (buffer_dtype or torch.float32)
    assert all(dtypes == (torch.float32, torch.float32) for dtypes in ours["dtypes"].values())
    assert "frozen" not in ours["dtypes"]  # no gradient for the frozen parameter


def test_ranks_agree_and_training_moved(mixed):
    world_size, results = mixed
    for name in CONFIGS:
        first = results[0][name]["ours"]["params"]
        for rank in range(1, world_size):
            for key, value in results[rank][name]["ours"]["params"].items():
                assert torch.equal(value, first[key]), f"{name} rank {rank}: {key}"
        grads = results[0][name]["ours"]["grads"][-1]
        assert all(g.abs().sum() > 0 for g in grads.values()), name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_overlapped_optimizer_matches_the_reference_bit_for_bit(mixed, name):
    """The updates deferred to the next forward: the forward's low-precision copies are cast
    from the updated parameters (the cast reads them), gradients and parameters as the
    reference's."""
    _, results = mixed
    for rank, r in enumerate(results):
        ours, ref = r[name]["overlapped"], r[name]["reference"]
        for step, (got, want) in enumerate(zip(ours["grads"], ref["grads"])):
            for key, value in want.items():
                assert torch.equal(got[key], value), f"rank {rank} step {step}: grad {key}"
        for key, value in ref["params"].items():
            assert torch.equal(ours["params"][key], value), f"rank {rank}: param {key}"
