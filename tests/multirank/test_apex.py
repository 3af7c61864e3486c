"""pyreducer.apex.DistributedDataParallel: Apex's DDP options against a reference of Apex's own
arithmetic (apex.parallel.DistributedDataParallel.allreduce_bucket, written out here: flatten,
float32 if allreduce_always_fp32, x 1/f, SUM all-reduce, x f/world_size if gradient_average,
copy back), bucket by bucket in the wrapper's buckets, bit for bit, at 2 and 3 ranks."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
CASES = {
    "defaults": dict(),
    "predivide_4": dict(gradient_predivide_factor=4.0),
    "no_average": dict(gradient_average=False),
    "fp32_bf16_predivide": dict(allreduce_always_fp32=True, gradient_predivide_factor=2.0,
                                dtype=torch.bfloat16),
    "fp16_in_fp16": dict(dtype=torch.float16, gradient_predivide_factor=3.0),
    "delay_allreduce": dict(delay_allreduce=True),
    "retain_buffers_small_messages": dict(retain_allreduce_buffers=True, message_size=50),
    "trigger_params": dict(trigger=True),
    # pyreducer's own wrapper, keyword-only options: the same arithmetic (gradient_average=True)
    "own_predivide_fp32_bf16": dict(own=True, gradient_predivide_factor=4.0,
                                    allreduce_always_fp32=True, dtype=torch.bfloat16),
    "own_reduce_fp32_fp16": dict(own=True, allreduce_always_fp32=True, dtype=torch.float16),
}


def _model(dtype):
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3)).to(dtype)


def _batch(gen, dtype):
    return torch.randn(5, 12, generator=gen).to(dtype), torch.randn(5, 3, generator=gen)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _apex_bucket(grads, always_fp32, factor, average):
    """Apex's allreduce_bucket on one bucket's gradients (collective)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = flat.float() if always_fp32 else flat
    if factor != 1.0:
        work.mul_(1.0 / factor)
    dist.all_reduce(work)
    if average:
        work.mul_(factor / dist.get_world_size())
    if work is not flat:
        flat.copy_(work)
    return flat


def _ours(case, rank):
    from pyreducer import DistributedDataParallel as Own
    from pyreducer.apex import DistributedDataParallel

    options = {k: v for k, v in case.items() if k not in ("dtype", "trigger", "own")}
    module = _model(case.get("dtype", torch.float32))
    if case.get("trigger"):
        options["allreduce_trigger_params"] = [module[2].weight, module[0].bias]
    if case.get("own"):
        model = Own(module, gradient_predivide_factor=options.get("gradient_predivide_factor"),
                    reduce_dtype=torch.float32 if options.get("allreduce_always_fp32") else None)
    else:
        model = DistributedDataParallel(module, **options)
    gen = torch.Generator().manual_seed(rank)
    plans, grads, views = [], [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=False)
        _loss(model, _batch(gen, case.get("dtype", torch.float32))).backward()
        plans.append([b["params"] for b in model.bucket_plan()])
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        if getattr(model, "retain_allreduce_buffers", False):
            views.append(all(any(p.grad.untyped_storage().data_ptr() ==
                                 b.untyped_storage().data_ptr() for b in model.allreduce_buffers)
                             for p in model.module.parameters()))
    return dict(plans=plans, grads=grads, views=views)


def _reference(case, rank, plans):
    dtype = case.get("dtype", torch.float32)
    module = _model(dtype)
    for p in module.parameters():
        dist.broadcast(p.data, src=0)
    params = dict(module.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for step in range(STEPS):
        module.zero_grad(set_to_none=False)
        _loss(module, _batch(gen, dtype)).backward()
        for bucket in plans[step]:
            flat = _apex_bucket([params[n].grad for n in bucket],
                                case.get("allreduce_always_fp32", False),
                                case.get("gradient_predivide_factor", 1.0),
                                case.get("gradient_average", True))
            offset = 0
            for n in bucket:
                numel = params[n].numel()
                params[n].grad.copy_(flat[offset:offset + numel].view_as(params[n]))
                offset += numel
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    return grads


def _refusals():
    from pyreducer.apex import DistributedDataParallel

    out = {}
    for key, kwargs in [("streams", dict(num_allreduce_streams=2)),
                        ("communicators", dict(allreduce_communicators=([], []))),
                        ("shared_param", dict(shared_param=True)),
                        ("trigger_and_delay", dict(delay_allreduce=True,
                                                   allreduce_trigger_params=[])),
                        ("streams_and_delay", dict(delay_allreduce=True,
                                                   num_allreduce_streams=2))]:
        try:
            DistributedDataParallel(_model(torch.float32), **kwargs)
            out[key] = None
        except (ValueError, NotImplementedError) as error:
            out[key] = f"{type(error).__name__}: {error}"
    return out


def _toggle(rank):
    """disable_allreduce() accumulates locally (as no_sync), enable_allreduce() syncs again."""
    from pyreducer.apex import DistributedDataParallel

    model = DistributedDataParallel(_model(torch.float32))
    gen = torch.Generator().manual_seed(rank)
    model.disable_allreduce()
    _loss(model, _batch(gen, torch.float32)).backward()
    local = model.module[0].weight.grad.clone()
    model.enable_allreduce()
    _loss(model, _batch(gen, torch.float32)).backward()
    return dict(local=local, synced=model.module[0].weight.grad.clone())


def apex_worker(rank, world_size):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, case in CASES.items():
            ours = _ours(case, rank)
            out[name] = dict(ours=ours, reference=_reference(case, rank, ours["plans"]))
        out["refusals"] = _refusals()
        out["toggle"] = _toggle(rank)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def apex(request, ranks_once):
    return request.param, ranks_once(apex_worker, request.param, ())


@pytest.mark.parametrize("name", list(CASES))
def test_numerics_are_apexs_bit_for_bit(apex, name):
    _, results = apex
    for rank, r in enumerate(results):
        for step, (ours, ref) in enumerate(zip(r[name]["ours"]["grads"], r[name]["reference"])):
            for key in ref:
                assert ours[key].dtype == ref[key].dtype, key
                assert torch.equal(ours[key], ref[key]), f"rank {rank} step {step}: {key}.grad"


def test_every_rank_ends_with_the_same_gradients(apex):
    world_size, results = apex
    for name in CASES:
        last = results[0][name]["ours"]["grads"][-1]
        assert all(g.abs().sum() > 0 for g in last.values()), name
        for rank in range(1, world_size):
            for key, value in results[rank][name]["ours"]["grads"][-1].items():
                assert torch.equal(value, last[key]), f"{name} rank {rank}: {key}"


def test_buckets_follow_apexs_options(apex):
    _, results = apex
    r = results[0]
    assert r["defaults"]["ours"]["plans"][0] == [["0.weight", "0.bias", "2.weight", "2.bias",
                                                  "4.weight", "4.bias"]]  # first: one bucket
    assert r["delay_allreduce"]["ours"]["plans"][-1] == r["defaults"]["ours"]["plans"][0]
    small = r["retain_buffers_small_messages"]["ours"]["plans"][-1]
    assert len(small) == 3  # 50 elements per message: 4.*, 2.*, 0.* after the first iteration
    assert all(r["retain_buffers_small_messages"]["ours"]["views"])
    # trigger params: buckets close after 2.weight and 0.bias (backward order: 4.*, 2.*, 0.*)
    assert r["trigger_params"]["ours"]["plans"][-1] == [["4.bias", "4.weight", "2.bias",
                                                         "2.weight"], ["0.bias"], ["0.weight"]]


@pytest.mark.parametrize("key,words", [
    ("streams", ["NotImplementedError", "num_allreduce_streams=2"]),
    ("communicators", ["NotImplementedError", "allreduce_communicators"]),
    ("shared_param", ["ValueError", "shared_param is no longer supported"]),
    ("trigger_and_delay", ["ValueError", "allreduce_trigger_params is only valid if "
                                         "delay_allreduce=False"]),
    ("streams_and_delay", ["ValueError", "may only be used if delay_allreduce=False"]),
])
def test_options_pyreducer_cannot_honour_raise_naming_them(apex, key, words):
    message = apex[1][0]["refusals"][key]
    assert message is not None, key
    for word in words:
        assert word in message, message


def test_disable_and_enable_allreduce(apex):
    _, results = apex
    assert not torch.equal(results[0]["toggle"]["local"], results[1]["toggle"]["local"])
    assert torch.equal(results[0]["toggle"]["synced"], results[1]["toggle"]["synced"])
