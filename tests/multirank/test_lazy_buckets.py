"""lazy_bucket_allocation (torch DDP's, from torch 2.15; csrc/reducer.h, Note [Lazy bucket
allocation]) on 2 spawned Gloo ranks, on any torch: the Reducer holds no bucket memory outside
backward (with gradient_as_bucket_view the .grad views keep the last backward's buffers, the
Reducer does not), and the parameters and gradients are those of the same run without it, bit for
bit, with either zero_grad. Against torch 2.15's own DDP with the option: the parity scenarios
"lazy_buckets*" (tests/multirank/test_parity.py)."""
import copy

import pytest
import torch

STEPS = 4
CASES = {
    "plain": dict(),
    "bucket_view": dict(gradient_as_bucket_view=True),
    "bucket_view_zero_fill": dict(gradient_as_bucket_view=True),  # zero_grad(set_to_none=False)
    "no_sync": dict(),
}


def _held_bytes(model) -> int:
    return sum(flat.untyped_storage().nbytes() for flat in model.reducer.bucket_buffers())


def _train(base, spec, rank, name, lazy):
    from pyreducer import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.3,
                                    lazy_bucket_allocation=lazy, **CASES[name])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    held = dict(at_construction=_held_bytes(model), after_forward=[], after_backward=[])
    views = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=name != "bucket_view_zero_fill")
        if name == "no_sync":
            with model.no_sync():
                spec.loss(model, spec.batch(gen, 8)).backward()
        loss = spec.loss(model, spec.batch(gen, 8))
        held["after_forward"].append(_held_bytes(model))
        loss.backward()
        held["after_backward"].append(_held_bytes(model))
        views.append(all(p.grad._base is not None for p in model.parameters()))
        opt.step()
    return dict(held=held, grads_are_views=views,
                params=[p.detach().clone() for p in model.parameters()],
                grads=[p.grad.clone() for p in model.parameters()])


def lazy_worker(rank, world_size):
    from pyreducer.testing import models

    spec = models.spec("mlp")
    torch.manual_seed(0)
    base = spec.build()
    return {name: dict(lazy=_train(base, spec, rank, name, True),
                       eager=_train(base, spec, rank, name, False)) for name in CASES}


@pytest.fixture(scope="module")
def results(ranks_once):
    return ranks_once(lazy_worker, 2, ())


@pytest.mark.parametrize("name", list(CASES))
def test_same_results_as_without(results, name):
    for rank, result in enumerate(results):
        lazy, eager = result[name]["lazy"], result[name]["eager"]
        for key in ("params", "grads"):
            for i, (a, b) in enumerate(zip(lazy[key], eager[key])):
                assert torch.equal(a, b), f"rank {rank}: {key}[{i}] differs"


@pytest.mark.parametrize("name", list(CASES))
def test_the_reducer_holds_bucket_memory_only_in_backward(results, name):
    """Eager: the buckets are allocated at construction and kept. Lazy: the Reducer's buffers
    hold no memory at construction, after a forward, nor after backward; with
    gradient_as_bucket_view the .grad tensors are views (of the buffer they were written in)."""
    for result in results:
        eager, lazy = result[name]["eager"]["held"], result[name]["lazy"]["held"]
        assert eager["at_construction"] > 0 and min(eager["after_backward"]) > 0, eager
        assert lazy == dict(at_construction=0, after_forward=[0] * STEPS,
                            after_backward=[0] * STEPS), lazy
        views = "gradient_as_bucket_view" in CASES[name]
        assert result[name]["lazy"]["grads_are_views"] == [views] * STEPS
