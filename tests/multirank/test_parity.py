"""Parity with torch DDP: same seed, same data, same parameters after N steps.

Every scenario trains the same model twice on each rank, once wrapped in torch's
DistributedDataParallel and once in pyreducer's, from the same (deliberately rank-dependent)
initialisation, so both must also broadcast rank 0's state. After STEPS steps every parameter,
gradient and buffer must match torch DDP's (float32, atol 1e-6) and be bitwise identical across
ranks.
"""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

STEPS = 5
ATOL = 1e-6

class Branchy(nn.Module):
    """A branch skipped on some iterations on every rank, on some only on rank 1; a head that
    is never used (its .grad must stay as it was)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head, self.never = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing, the same block checkpointed twice (its hooks fire
    twice per backward), and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.shared = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head, self.unused = nn.Linear(16, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.stem(x)
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, h, use_reentrant=True)
        return self.head(h)


class MixedDtypes(nn.Module):
    """float32, float64 and bfloat16 parameters, and a frozen layer in between."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4).bfloat16()

    def forward(self, x):
        h = self.frozen(torch.relu(self.a(x)))
        h = torch.relu(self.b(h.double())).float()
        return self.c(h.bfloat16()).float()


def _regression(gen, size):
    return torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen)


def _branch_loss(model, batch, step, rank):
    use = step % 3 != 0 and not (rank == 1 and step % 2 == 0)
    x, y = batch
    return torch.nn.functional.mse_loss(model(x, use_branch=use), y)


def _plain_loss(model, batch, step, rank):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


LOCAL_MODELS = {"branchy": (Branchy, _regression, _branch_loss),
                "checkpointed": (Checkpointed, _regression, _plain_loss),
                "mixed_dtypes": (MixedDtypes, _regression, _plain_loss)}

SCENARIOS = {
    "mlp_sgd": dict(model="mlp", opt="sgd"),
    "mlp_adam": dict(model="mlp", opt="adam"),
    "cnn_batchnorm_sgd": dict(model="cnn", opt="sgd"),
    "cnn_batchnorm_adam": dict(model="cnn", opt="adam"),
    "tied_weights_adam": dict(model="tied", opt="adam"),
    "bucket_per_param": dict(model="mlp", opt="adam", ddp=dict(bucket_cap_mb=0.001)),
    "one_bucket": dict(model="cnn", opt="sgd", ddp=dict(bucket_cap_mb=1000)),
    "bucket_cap_list": dict(model="mlp", opt="sgd", ddp=dict(bucket_cap_mb_list=[0.001, 0.01])),
    "no_sync_4_micro_batches": dict(model="mlp", opt="adam", micro=4, how="no_sync"),
    "no_sync_batchnorm": dict(model="cnn", opt="sgd", micro=4, how="no_sync"),
    "require_backward_grad_sync_toggle": dict(model="cnn", opt="adam", micro=3, how="attribute"),
    # find_unused_parameters: skipped branch (all ranks / one rank), a never-used head
    "find_unused_sgd": dict(model="branchy", opt="sgd", ddp=dict(find_unused_parameters=True)),
    "find_unused_adam_no_sync": dict(model="branchy", opt="adam", micro=2, how="no_sync",
                                     ddp=dict(find_unused_parameters=True)),
    # static_graph: reentrant checkpointing with hooks firing twice, an unused parameter
    "static_graph_checkpoint": dict(model="checkpointed", opt="sgd", ddp=dict(static_graph=True)),
    "static_graph_checkpoint_adam": dict(model="checkpointed", opt="adam",
                                         ddp=dict(static_graph=True, bucket_cap_mb=0.001)),
    # gradient_as_bucket_view with both zero_grad styles, and across the rebuild under no_sync
    "bucket_view_set_to_none": dict(model="mlp", opt="adam",
                                    ddp=dict(gradient_as_bucket_view=True)),
    "bucket_view_zero_fill": dict(model="cnn", opt="sgd", set_to_none=False,
                                  ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.001)),
    "bucket_view_no_sync_rebuild": dict(model="mlp", opt="sgd", micro=3, how="no_sync",
                                        set_to_none=False,
                                        ddp=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.3)),
    # batched_grad_copy: one fused copy per bucket (pyreducer::bucket_copy_in)
    "batched_grad_copy": dict(model="cnn", opt="adam", ddp=dict(batched_grad_copy=True)),
    "batched_grad_copy_views": dict(model="mlp", opt="sgd", micro=2, how="no_sync",
                                    ddp=dict(batched_grad_copy=True, bucket_cap_mb=0.3,
                                             gradient_as_bucket_view=True)),
    "batched_grad_copy_channels_last": dict(model="cnn", opt="sgd", channels_last=True,
                                            ddp=dict(batched_grad_copy=True)),
    "channels_last": dict(model="cnn", opt="adam", channels_last=True),
    # mixed dtypes (float32 + float64 + bfloat16) and a frozen layer
    "mixed_dtypes_frozen": dict(model="mixed_dtypes", opt="sgd", ddp=dict(bucket_cap_mb=0.001)),
}


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _model_fns(name):
    if name in LOCAL_MODELS:
        build, batch, loss = LOCAL_MODELS[name]
        return build, batch, loss
    from pyreducer.testing import models

    spec = models.spec(name)
    return spec.build, spec.batch, lambda model, batch, step, rank: spec.loss(model, batch)


def _train(cls, base, scenario, rank):
    _, make_batch, loss_fn = _model_fns(scenario["model"])
    model = cls(copy.deepcopy(base), **scenario.get("ddp", {}))
    opt = _optimizer(scenario["opt"], [p for p in model.parameters() if p.requires_grad])
    gen = torch.Generator().manual_seed(1000 + rank)
    micro = scenario.get("micro", 1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=scenario.get("set_to_none", True))
        for m in range(micro):
            last = m == micro - 1
            if scenario.get("how") == "no_sync" and not last:
                with model.no_sync():
                    loss_fn(model, make_batch(gen, 8), step, rank).backward()
                continue
            if scenario.get("how") == "attribute":
                model.require_backward_grad_sync = last
            loss_fn(model, make_batch(gen, 8), step, rank).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state.update({f"{n}.grad": (p.grad.clone() if p.grad is not None else None)
                  for n, p in model.module.named_parameters()})
    return state, model


def parity_worker(rank, world_size, names):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    out = {}
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(17 + rank)  # ranks start different: both wrappers must broadcast
        base = _model_fns(scenario["model"])[0]()
        if scenario.get("channels_last"):
            base = base.to(memory_format=torch.channels_last)
        torch_state, _ = _train(TorchDDP, base, scenario, rank)
        ours_state, ours = _train(DistributedDataParallel, base, scenario, rank)
        out[name] = dict(torch=torch_state, ours=ours_state, buckets=ours.bucket_plan(),
                         num_params=len(list(ours.parameters())))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def parity(request, ranks_once):
    return request.param, ranks_once(parity_worker, request.param, (tuple(SCENARIOS),))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_torch_ddp(parity, name):
    world_size, results = parity
    for rank, result in enumerate(results):
        theirs, ours = result[name]["torch"], result[name]["ours"]
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if theirs[key] is None or ours[key] is None:
                assert ours[key] is None and theirs[key] is None, f"rank {rank}: {key}"
                continue
            assert ours[key].dtype == theirs[key].dtype, key
            if ours[key].is_floating_point():
                diff = (ours[key] - theirs[key]).abs().max().item()
                assert diff <= ATOL, f"rank {rank}: {key} differs from torch DDP by {diff:.3g}"
            else:
                assert torch.equal(ours[key], theirs[key]), f"rank {rank}: {key}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bitwise_identical_across_ranks(parity, name):
    world_size, results = parity
    reference = results[0][name]["ours"]
    for rank in range(1, world_size):
        for key, value in results[rank][name]["ours"].items():
            if key.startswith(tuple(k.rsplit(".", 1)[0] for k in reference if "running" in k)):
                continue  # BatchNorm running stats are local between buffer broadcasts, as in DDP
            if value is None:
                assert reference[key] is None
                continue
            assert torch.equal(value, reference[key]), f"rank {rank}: {key} differs from rank 0"


def test_parameters_actually_trained(parity):
    """Guards against a vacuous pass: parameters moved away from their broadcast start."""
    _, results = parity
    state = results[0]["mlp_sgd"]["ours"]
    assert all(state[k].abs().sum() > 0 for k in state if k.endswith(".grad"))


def test_bucket_caps_shape_the_plan(parity):
    _, results = parity
    per_param = results[0]["bucket_per_param"]
    assert len(per_param["buckets"]) == per_param["num_params"]
    assert len(results[0]["one_bucket"]["buckets"]) == 1
