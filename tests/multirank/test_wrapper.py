"""The wrapper around the C++ Reducer, on 2 spawned Gloo ranks: checkpoints move between torch
DDP and pyreducer, buckets are rebuilt from the ready order, clear errors for misuse, and no
Python runs on the per-gradient path during backward."""
import copy
import os
import sys
import threading

import pytest
import torch
from torch import nn


def _state_dict_checks(results):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    torch.manual_seed(0)
    base = models.spec("cnn").build()
    ours, theirs = DistributedDataParallel(base), TorchDDP(models.spec("cnn").build())
    results["ours_keys"] = list(ours.state_dict())
    results["torch_keys"] = list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())  # a DDP checkpoint loads into pyreducer ...
    results["loaded_equal"] = all(torch.equal(a, b) for a, b in
                                  zip(ours.state_dict().values(), theirs.state_dict().values()))
    theirs.load_state_dict(ours.state_dict())  # ... and back
    results["module_is_base"] = ours.module is base


def _misuse_checks(results):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    frozen = nn.Linear(2, 2).requires_grad_(False)
    for key, make in [("no_grad_params", lambda: DistributedDataParallel(frozen)),
                      ("wrap_ours", lambda: DistributedDataParallel(
                          DistributedDataParallel(nn.Linear(2, 2)))),
                      ("wrap_torch", lambda: DistributedDataParallel(
                          nn.Sequential(TorchDDP(nn.Linear(2, 2)))))]:
        try:
            make()
            results[key] = None
        except (RuntimeError, ValueError) as error:
            results[key] = f"{type(error).__name__}: {error}"


def _rebuild_checks(results, rank):
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=0.3)
    gen = torch.Generator().manual_seed(rank)
    results["plan_before"] = model.bucket_plan()
    spec.loss(model, spec.batch(gen, 4)).backward()
    results["plan_after_one_backward"] = model.bucket_plan()
    with model.no_sync():  # the rebuild happens at this forward; accumulated grads must survive
        before = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        spec.loss(model, spec.batch(gen, 4)).backward()
    results["plan_after_rebuild"] = model.bucket_plan()
    local = {n: p.grad - before[n] for n, p in model.module.named_parameters()}
    results["no_sync_kept"] = all(torch.equal(p.grad, before[n] + local[n])
                                  for n, p in model.module.named_parameters())


def _no_python_checks(results, rank):
    import pyreducer
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    torch.manual_seed(0)
    model = DistributedDataParallel(spec.build(), bucket_cap_mb=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):  # past the first iteration and the rebuild: many buckets
        spec.loss(model, spec.batch(gen, 4)).backward()
    model.zero_grad()
    package_dir = os.path.dirname(pyreducer.__file__)
    ours, control = [], []

    def profile(frame, event, arg):
        if event == "call":
            if frame.f_code.co_filename.startswith(package_dir):
                ours.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
            if frame.f_code.co_name == "control_hook":
                control.append(1)

    def control_hook(grad):  # a Python hook the engine calls: proves the profiler sees backward
        return grad

    loss = spec.loss(model, spec.batch(gen, 4))
    loss.register_hook(control_hook)
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    results["python_calls_in_backward"] = ours
    results["control_seen"] = len(control)
    results["grads"] = [p.grad.clone() for p in model.parameters()]
    results["num_buckets"] = len(model.bucket_plan())


def _plan_replay_checks(results, rank, tmp_dir):
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    torch.manual_seed(3)
    base = spec.build()
    first = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.3)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the second forward rebuilds from the ready order
        spec.loss(first, spec.batch(gen, 4)).backward()
    path = os.path.join(tmp_dir, f"plan-rank{rank}.json")
    first.save_bucket_plan(path)
    replay = DistributedDataParallel(copy.deepcopy(base), bucket_plan=path)
    results["plan_saved"] = first.bucket_plan()
    results["plan_replayed"] = replay.bucket_plan()
    spec.loss(replay, spec.batch(gen, 4)).backward()
    spec.loss(replay, spec.batch(gen, 4)).backward()  # never rebuilt
    results["plan_after_training"] = replay.bucket_plan()
    names = [b["params"] for b in first.bucket_plan()]
    try:
        DistributedDataParallel(copy.deepcopy(base), bucket_plan=[names[0]])
        results["incomplete_plan"] = None
    except ValueError as error:
        results["incomplete_plan"] = str(error)


def _sequence_checks(results, rank):
    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    model = DistributedDataParallel(spec.build())
    gen = torch.Generator().manual_seed(rank)
    model(spec.batch(gen, 4)[0])  # a forward that is never backpropagated is allowed
    loss = spec.loss(model, spec.batch(gen, 4))
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        results["second_backward"] = None
    except RuntimeError as error:
        results["second_backward"] = str(error)
    spec.loss(model, spec.batch(gen, 4)).backward()  # the next iteration works
    results["recovered"] = all(p.grad is not None for p in model.parameters())


def _outlived_checks(results, rank):
    """A graph that outlives its wrapper: backward must not touch the deleted reducer."""
    import gc

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import models

    spec = models.spec("mlp")
    module = spec.build()
    model = DistributedDataParallel(module)
    loss = spec.loss(model, spec.batch(torch.Generator().manual_seed(rank), 4))
    del model
    gc.collect()
    loss.backward()  # local gradients only: the hooks went with the reducer
    results["outlived_grads"] = all(p.grad is not None for p in module.parameters())


def _short_lived_checks(results, rank):
    """Wrappers dropped right after their backward, with a communication hook whose future's
    callback (it stamps the timeline's done time) may run after the wait for it returned: the
    callback must not write into a freed timeline (it did: "corrupted double-linked list")."""
    import gc

    from pyreducer import DistributedDataParallel

    for i in range(60):
        model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)),
                                        bucket_cap_mb=0.01, gradient_predivide_factor=2.0)
        model(torch.randn(4, 64)).sum().backward()
        del model
        gc.collect()
        churn = [torch.empty(n % 13 + 1) for n in range(200)]  # reuse freed blocks at once
        del churn
    results["short_lived"] = i + 1


class _LossInside(nn.Module):
    """Returns its loss, as Hugging Face models do, which the caller then scales in place."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.net(x), y)}


def _inplace_output_checks(results, rank):
    """The forward's outputs accept in-place updates (the HF Trainer's `loss *= scale`), as torch
    DDP's do, with the same gradients (they failed: views of a multi-output autograd function)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    grads = {}
    for name, wrap in [("ours", DistributedDataParallel), ("torch", TorchDDP)]:
        torch.manual_seed(0)
        model = wrap(_LossInside())
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            loss = model(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))["loss"]
            loss *= 3.0
            loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    results["inplace_equal"] = all(torch.equal(a, b) for a, b in zip(grads["ours"], grads["torch"]))


def wrapper_worker(rank, world_size, tmp_dir):
    results = {}
    _state_dict_checks(results)
    _misuse_checks(results)
    _rebuild_checks(results, rank)
    _no_python_checks(results, rank)
    _plan_replay_checks(results, rank, tmp_dir)
    _sequence_checks(results, rank)
    _outlived_checks(results, rank)
    _short_lived_checks(results, rank)
    _inplace_output_checks(results, rank)
    return results


@pytest.fixture(scope="module")
def wrapper(ranks_once, tmp_path_factory):
    return ranks_once(wrapper_worker, 2, (str(tmp_path_factory.mktemp("plans")),))


def test_state_dict_keys_match_torch_ddp(wrapper):
    for r in wrapper:
        assert r["ours_keys"] == r["torch_keys"]
        assert all(k.startswith("module.") for k in r["ours_keys"])
        assert r["loaded_equal"] and r["module_is_base"]


@pytest.mark.parametrize("key,words", [
    ("no_grad_params", ["RuntimeError", "any parameter that requires a gradient"]),
    ("wrap_ours", ["ValueError", "already wrapped", "pyreducer.distributed.DistributedDataParallel"]),
    ("wrap_torch", ["ValueError", "already wrapped", "submodule '0'"]),
])
def test_misuse_is_a_clear_error(wrapper, key, words):
    message = wrapper[0][key]
    assert message is not None, f"{key}: no error raised"
    for word in words:
        assert word in message


def test_buckets_rebuilt_from_ready_order_identically_on_all_ranks(wrapper):
    for r in wrapper:
        assert len(r["plan_before"]) == 1  # DDP's first iteration: one bucket
        assert r["plan_after_one_backward"] == r["plan_before"]
        assert len(r["plan_after_rebuild"]) > 1
        # ready order is roughly reverse definition order: the last layer comes first
        assert r["plan_after_rebuild"][0]["params"][0] == "4.bias"
        assert r["no_sync_kept"]
    assert wrapper[0]["plan_after_rebuild"] == wrapper[1]["plan_after_rebuild"]


def test_no_python_on_the_gradient_path(wrapper):
    for r in wrapper:
        assert r["control_seen"] == 1, "the profiler did not see the control hook"
        assert r["python_calls_in_backward"] == []
        assert r["num_buckets"] > 1
    # the backward did reduce: different data on each rank, identical averaged gradients
    for a, b in zip(wrapper[0]["grads"], wrapper[1]["grads"]):
        assert torch.equal(a, b)


def test_saved_plan_replays_exactly(wrapper):
    for r in wrapper:
        assert len(r["plan_saved"]) > 1
        assert r["plan_replayed"] == r["plan_saved"]
        assert r["plan_after_training"] == r["plan_saved"]
    assert wrapper[0]["plan_saved"] == wrapper[1]["plan_saved"]


def test_incomplete_plan_names_missing_parameters(wrapper):
    message = wrapper[0]["incomplete_plan"]
    assert message is not None and "in no bucket" in message and "0.weight" in message


def test_second_backward_after_one_forward_is_an_error(wrapper):
    for rank, r in enumerate(wrapper):
        message = r["second_backward"]
        assert message is not None, "second backward passed silently"
        assert "second backward" in message and f"rank {rank}" in message
        assert r["recovered"]


def test_graph_outliving_its_wrapper_is_safe(wrapper):
    assert all(r["outlived_grads"] for r in wrapper)


def test_short_lived_wrappers_with_hooks_are_safe(wrapper):
    assert all(r["short_lived"] == 60 for r in wrapper)


def test_outputs_accept_in_place_updates_like_torch_ddp(wrapper):
    assert all(r["inplace_equal"] for r in wrapper)
