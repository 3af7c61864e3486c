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

STEPS = 5
ATOL = 1e-6

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
}


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def _train(cls, base, scenario, rank):
    from pyreducer import models

    spec = models.spec(scenario["model"])
    model = cls(copy.deepcopy(base), **scenario.get("ddp", {}))
    opt = _optimizer(scenario["opt"], model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    micro = scenario.get("micro", 1)
    for _ in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            last = m == micro - 1
            if scenario.get("how") == "no_sync" and not last:
                with model.no_sync():
                    spec.loss(model, spec.batch(gen, 8)).backward()
                continue
            if scenario.get("how") == "attribute":
                model.require_backward_grad_sync = last
            spec.loss(model, spec.batch(gen, 8)).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state.update({f"{n}.grad": p.grad.clone() for n, p in model.module.named_parameters()})
    return state, model


def parity_worker(rank, world_size, names):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel, models

    out = {}
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(17 + rank)  # ranks start different: both wrappers must broadcast
        base = models.spec(scenario["model"]).build()
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
