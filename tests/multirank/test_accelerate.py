"""Hugging Face Accelerate with pyreducer (pyreducer/accelerate.py): the same small training run
(pyreducer/testing/train_accelerate.py, torchrun, 2 CPU processes on Gloo) with Accelerate's own
Accelerator (torch DDP) and with pyreducer's, compared bit for bit: losses and parameters, with
`accumulate`, with trigger_sync_in_backward, through save_state / load_state, and what
unwrap_model / save_model give. Then pyreducer's overlapped and sharded optimizers
(ddp_options overlap_optimizer / shard) against Accelerate's torch DDP with the plain optimizer:
with accumulation, param groups, an LR scheduler, clip_grad_value_ and clip_grad_norm_ (the norms
returned), a checkpoint resumed (the optimizer file in torch's format), bf16 autocast, a clip
over other parameters, and what shard=True refuses. Skipped where accelerate is not
installed."""
import pytest
import torch
from torch import nn

from pyreducer.testing.frameworks import assert_same_run, train

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[accelerate])")

WRAPPER = "pyreducer.accelerate"  # the module of the class pyreducer wraps with here
MODULE = "pyreducer.testing.train_accelerate"
# AdamW in two param groups, a warm-up LR scheduler, and on each synchronising step
# clip_grad_value_(0.02) then clip_grad_norm_(0.3) over model.parameters()
RECIPE = ["--accumulate", "2", "--steps", "16", "--adamw", "--scheduler", "--clip-value", "0.02",
          "--clip-norm", "0.3"]
KINDS = {"overlap": "OverlapOptimizer", "shard": "ShardedOptimizer"}  # --overlap -> its class


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """16 batches with gradient_accumulation_steps=2, each Accelerator."""
    tmp_path = tmp_path_factory.mktemp("accumulate")
    return {which: train(MODULE, tmp_path, which, "--accelerator", which, "--accumulate", "2",
                         "--steps", "16") for which in ("torch", "pyreducer")}


def test_accumulate_trains_like_accelerates_ddp(accumulated):
    assert len(accumulated["pyreducer"]["losses"]) == 16
    assert_same_run(accumulated["torch"], accumulated["pyreducer"], "accumulate", WRAPPER)


def test_unwrap_model_and_save_model_give_the_models_own_keys(accumulated):
    """unwrap_model strips pyreducer's wrapper (Accelerate's own needs a torch DDP by isinstance),
    so save_model writes the keys Accelerate writes with torch DDP: no "module." prefix."""
    theirs, ours = accumulated["torch"], accumulated["pyreducer"]
    assert ours["unwrapped"] == theirs["unwrapped"] == "Sequential"
    assert ours["saved_keys"] == theirs["saved_keys"] == ["0.bias", "0.weight", "2.bias",
                                                         "2.weight"]


def test_trigger_sync_in_backward_syncs_like_accelerates_ddp(tmp_path):
    """Two forwards under no_sync, the second backward inside trigger_sync_in_backward: the same
    as torch DDP (unreplaced, Accelerate's method skips pyreducer and gradients stay local). A
    plain loss.backward() inside the context is refused by name."""
    theirs = train(MODULE, tmp_path, "torch", "--accelerator", "torch", "--trigger")
    ours = train(MODULE, tmp_path, "pyreducer", "--accelerator", "pyreducer", "--trigger")
    assert_same_run(theirs, ours, "trigger_sync_in_backward", WRAPPER)
    assert ours["misuse"] is not None
    assert "no accelerator.backward(loss) ran inside" in ours["misuse"], ours["misuse"]


def test_save_state_and_load_state_resume_exactly(tmp_path, accumulated):
    """save_state after 8 batches, load_state and 8 more: the uninterrupted run's end state, bit
    for bit, with each Accelerator."""
    for which in ("torch", "pyreducer"):
        state = tmp_path / f"{which}_state"
        first = train(MODULE, tmp_path, f"{which}_first", "--accelerator", which,
                      "--accumulate", "2", "--steps", "8", "--save", state)
        resumed = train(MODULE, tmp_path, f"{which}_resumed", "--accelerator", which,
                        "--accumulate", "2", "--steps", "16", "--resume", state)
        whole = accumulated[which]
        assert first["losses"] + resumed["losses"] == whole["losses"], f"{which}: losses differ"
        for key, value in whole["params"].items():
            assert torch.equal(resumed["params"][key], value), f"{which}: {key} differs"


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    """The RECIPE with Accelerate's Accelerator (torch DDP, the plain optimizer) and with
    pyreducer's, overlap_optimizer and shard, each saving its state after 8 batches and going
    on to 16 (the sharded run prepares its optimizer before its model, and ends with what
    shard=True refuses); then pyreducer's two resumed from their states at 8."""
    tmp_path = tmp_path_factory.mktemp("overlapped")
    runs = {}
    for name, extra in (("torch", ["--accelerator", "torch"]),
                        ("overlap", ["--accelerator", "pyreducer", "--overlap", "overlap"]),
                        ("shard", ["--accelerator", "pyreducer", "--overlap", "shard",
                                   "--optimizer-first", "--misuse-shard"])):
        runs[name] = train(MODULE, tmp_path, name, *extra, *RECIPE,
                           "--save", tmp_path / f"{name}_state", "--save-at", "8")
    for kind in KINDS:
        runs[f"{kind}_resumed"] = train(MODULE, tmp_path, f"{kind}_resumed", "--accelerator",
                                        "pyreducer", "--overlap", kind, *RECIPE,
                                        "--resume", tmp_path / f"{kind}_state")
    return tmp_path, runs


def _assert_overlapped(run: dict, kind: str) -> None:
    """The run stepped pyreducer's optimizer of `kind`, and some of its bucket updates ran
    during a forward (the overlap itself, not a step at step())."""
    assert run["optimizer"] == KINDS[kind], run["optimizer"]
    assert run["updates_in_forward"], f"{kind}: no update ran in a forward"


def _assert_same_norms(theirs: list, ours: list, what: str) -> None:
    assert len(ours) == len(theirs) > 0, (len(ours), len(theirs))
    for index, (mine, torchs) in enumerate(zip(ours, theirs)):
        assert torch.equal(mine, torchs), f"{what}: norm {index}: {mine} vs {torchs}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_overlapped_optimizers_train_like_accelerates_ddp(overlapped, kind):
    """accumulate, AdamW in param groups (not model.parameters()' order: the clip's norm is
    taken in the caller's order), the warm-up scheduler built on the plain optimizer, both
    clips through the Accelerator: the losses, the norms returned, the learning rates and the
    parameters of torch DDP with the plain optimizer, bit for bit; unwrap_model and save_model
    as with torch DDP."""
    _, runs = overlapped
    theirs, ours = runs["torch"], runs[kind]
    _assert_overlapped(ours, kind)
    assert len(ours["losses"]) == 16
    assert (ours["unwrapped"], ours["saved_keys"]) == (theirs["unwrapped"], theirs["saved_keys"])
    assert_same_run(theirs, ours, kind, WRAPPER)
    _assert_same_norms(theirs["norms"], ours["norms"], kind)
    assert max(norm.item() for norm in theirs["norms"]) > 0.3  # the norm clip clipped
    assert ours["lrs"] == theirs["lrs"] and theirs["lrs"][0] != theirs["lrs"][-1], ours["lrs"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_overlapped_optimizers_resume_from_save_state(overlapped, kind):
    """load_state of the state saved after 8 batches, and 8 more: the uninterrupted torch DDP
    run's last losses, norms, learning rates and parameters. The optimizer file save_state wrote
    (the sharded optimizer's gathered on every rank) is torch's format: equal to the one torch
    DDP's run wrote, and a plain AdamW loads it."""
    tmp_path, runs = overlapped
    theirs, resumed = runs["torch"], runs[f"{kind}_resumed"]
    _assert_overlapped(resumed, kind)
    assert resumed["losses"] == theirs["losses"][8:], f"{kind}: losses differ"
    _assert_same_norms(theirs["norms"][4:], resumed["norms"], kind)
    assert resumed["lrs"] == theirs["lrs"][4:]
    for key, value in theirs["params"].items():
        assert torch.equal(resumed["params"][key], value), f"{kind}: {key} differs"
    torchs = torch.load(tmp_path / "torch_state" / "optimizer.bin")
    ours = torch.load(tmp_path / f"{kind}_state" / "optimizer.bin")
    assert ours["param_groups"] == torchs["param_groups"]
    assert sorted(ours["state"]) == sorted(torchs["state"]) == [0, 1, 2, 3]
    for index, state in torchs["state"].items():
        for name, value in state.items():
            assert torch.equal(ours["state"][index][name], value), f"{kind}: {index} {name}"
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = torch.optim.AdamW([{"params": [model[0].weight, model[2].weight]},
                               {"params": [model[0].bias, model[2].bias]}])
    plain.load_state_dict(ours)
    assert torch.equal(plain.state[model[2].bias]["exp_avg"], torchs["state"][3]["exp_avg"])


def test_sharded_optimizer_refusals_name_the_problem(overlapped):
    """With shard=True, each refused by name (and none of them stepped: the run's parameters
    are torch DDP's, test_overlapped_optimizers_train_like_accelerates_ddp): a second optimizer
    over the same model, a GradScaler (Accelerate makes one for fp16 on GPUs; given one here as
    it would be there), a clip over other parameters than the optimizer's, and the optimizer's
    own clip given other parameters as its order."""
    _, runs = overlapped
    refused = runs["shard"]["misuse"]
    assert "a second optimizer (SGD)" in refused["second_optimizer"], refused
    assert "already steps" in refused["second_optimizer"], refused
    assert "GradScaler unscales whole gradients" in refused["grad_scaler"], refused
    assert "shard=True" in refused["grad_scaler"], refused
    assert "clip_grad_norm_ over 2 parameters" in refused["clip_subset"], refused
    assert "expected those (e.g. model.parameters())" in refused["clip_subset"], refused
    # the optimizer's own clip_grad_norm_(parameters=...): a reordering of its parameters only
    assert "takes this optimizer's 4 parameters" in refused["clip_order"], refused
    assert "2 of its missing" in refused["clip_order"], refused


def test_sharded_optimizer_with_bf16_autocast(tmp_path, overlapped):
    """mixed_precision="bf16" (Accelerate's autocast on CPU, no scaler) with shard=True:
    torch DDP's bf16 run, bit for bit (and the autocast is on: the first loss differs from
    float32's)."""
    recipe = ["--accumulate", "2", "--steps", "16", "--adamw", "--clip-norm", "0.3",
              "--mixed-precision", "bf16"]
    theirs = train(MODULE, tmp_path, "torch", "--accelerator", "torch", *recipe)
    ours = train(MODULE, tmp_path, "shard", "--accelerator", "pyreducer", "--overlap", "shard",
                 *recipe)
    _assert_overlapped(ours, "shard")
    assert theirs["losses"][0] != overlapped[1]["torch"]["losses"][0]  # bf16, not float32
    assert_same_run(theirs, ours, "bf16", WRAPPER)
    _assert_same_norms(theirs["norms"], ours["norms"], "bf16")


def test_clip_over_other_parameters_falls_back_to_accelerates_clip(tmp_path):
    """overlap_optimizer: accelerator.clip_grad_norm_ over the first layer's parameters only
    (not the optimizer's) is Accelerate's own clip, which reads .grad: each read waits for its
    bucket, so the result is torch DDP's (that step's updates are not overlapped); then the clip
    over model.parameters() goes to the optimizer's."""
    recipe = ["--accumulate", "2", "--steps", "16", "--adamw", "--clip-subset", "0.05",
              "--clip-norm", "0.3"]
    theirs = train(MODULE, tmp_path, "torch", "--accelerator", "torch", *recipe)
    ours = train(MODULE, tmp_path, "overlap", "--accelerator", "pyreducer", "--overlap",
                 "overlap", *recipe)
    assert ours["optimizer"] == "OverlapOptimizer"
    assert_same_run(theirs, ours, "clip over other parameters", WRAPPER)
    _assert_same_norms(theirs["subset_norms"], ours["subset_norms"], "first layer's clip")
    assert max(norm.item() for norm in theirs["subset_norms"]) > 0.05  # it clipped
    _assert_same_norms(theirs["norms"], ours["norms"], "model's clip")
