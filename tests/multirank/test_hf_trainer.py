"""The Hugging Face Trainer with pyreducer (pyreducer/transformers.py): a 2-layer GPT-2 built from a
config (pyreducer/testing/train_hf_trainer.py, torchrun, 2 CPU processes on Gloo) trained by
transformers.Trainer (torch DDP through Accelerate) and by pyreducer's Trainer, compared bit for
bit: logged losses and parameters, with gradient accumulation (the Trainer's no_sync), its
find_unused_parameters default for a PreTrainedModel, the tied embedding, its linear warm-up
scheduler and max_grad_norm clipping, and a checkpoint resumed; and with ddp_options'
overlap_optimizer / shard, the Trainer's own AdamW overlapped or sharded: the same losses, grad
norms, learning rates and parameters as the stock Trainer's, optimizer.pt in torch's format (the
stock Trainer resumes from the sharded run's checkpoint), and resumes. Skipped where
transformers is not installed."""
import json

import pytest
import torch

from pyreducer.testing.frameworks import assert_same_run, train

pytest.importorskip("transformers", reason="transformers is not installed "
                                           "(pip install .[transformers])")

WRAPPER = "pyreducer.accelerate"  # the module of the class pyreducer wraps with here
MODULE = "pyreducer.testing.train_hf_trainer"
# 8 steps of 2 accumulated micro-batches, a checkpoint every 4, 2 warm-up steps, max_grad_norm 0.5
# (the norms exceed it: every step clips); torch's AdamW without the fused kernel (optim
# "adamw_torch": sharded, the fused CPU kernel is within 1e-6, docs/pages/guides/sharded-optimizer.md)
COMMON = ["--accumulate", "2", "--steps", "8", "--save-at", "4", "--warmup-steps", "2",
          "--max-grad-norm", "0.5", "--optim", "adamw_torch"]
OVERLAP = {"overlap": ('{"bucket_cap_mb": 0.02, "overlap_optimizer": true}', "OverlapOptimizer"),
           "shard": ('{"bucket_cap_mb": 0.02, "shard": true}', "ShardedOptimizer")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """COMMON, each Trainer; pyreducer's with small buckets through ddp_options (several buckets:
    the option reaches the wrapper), and the timeline recorded (PYREDUCER_TRACE); and pyreducer's
    with the overlapped and the sharded optimizer."""
    tmp_path = tmp_path_factory.mktemp("hf")
    result = {
        "torch": train(MODULE, tmp_path, "torch", "--trainer", "torch", *COMMON),
        "pyreducer": train(MODULE, tmp_path, "pyreducer", "--trainer", "pyreducer", *COMMON,
                           "--ddp-options", '{"bucket_cap_mb": 0.02}',
                           PYREDUCER_TRACE=str(tmp_path / "trace"))}
    for kind, (options, _) in OVERLAP.items():
        result[kind] = train(MODULE, tmp_path, kind, "--trainer", "pyreducer", *COMMON,
                             "--ddp-options", options)
    return tmp_path, result


def test_trains_like_the_trainers_ddp(runs):
    _, result = runs
    assert len(result["pyreducer"]["losses"]) == 8
    assert len(result["pyreducer"]["buckets"]) > 1, "ddp_options did not reach the wrapper"
    assert_same_run(result["torch"], result["pyreducer"], "gradient_accumulation_steps=2", WRAPPER)


def test_the_timeline_is_recorded_under_the_trainer(runs):
    """PYREDUCER_TRACE works as with the plain wrapper: each rank writes its bucket timeline (the
    last 8 synced backward passes: 8 steps of 2 micro-batches, one synced)."""
    tmp_path, result = runs
    for rank in (0, 1):
        trace = json.load(open(tmp_path / "trace" / f"rank{rank}.json"))
        iterations = trace["timeline"]
        assert len(iterations) == 8, len(iterations)
        assert all(len(it["buckets"]) == len(result["pyreducer"]["buckets"]) for it in iterations)


def test_a_checkpoint_resumes_exactly(runs):
    """resume_from_checkpoint=checkpoint-4: the uninterrupted run's losses (the Trainer restores
    its log) and parameters, bit for bit, with each Trainer."""
    tmp_path, result = runs
    for which in ("torch", "pyreducer"):
        resumed = train(MODULE, tmp_path, f"{which}_resumed", "--trainer", which, *COMMON,
                        "--resume-from", tmp_path / f"{which}.pt.trainer" / "checkpoint-4")
        assert resumed["wrapper"] == result[which]["wrapper"]
        assert resumed["losses"] == result[which]["losses"], f"{which}: losses differ"
        for key, value in result[which]["params"].items():
            assert torch.equal(resumed["params"][key], value), f"{which}: {key} differs"


def _assert_overlapped(run: dict, kind: str) -> None:
    """The run stepped pyreducer's optimizer of `kind`, and some of its bucket updates ran
    during a forward (the overlap itself, not a step at step())."""
    assert run["optimizer"] == OVERLAP[kind][1], run["optimizer"]
    assert run["updates_in_forward"], f"{kind}: no update ran in a forward"


@pytest.mark.parametrize("kind", list(OVERLAP))
def test_overlapped_optimizers_train_like_the_trainers_ddp(runs, kind):
    """The Trainer's AdamW (decay and no-decay param groups: not model.parameters()' order, in
    which the Trainer clips) overlapped or sharded through ddp_options, with its warm-up
    scheduler, max_grad_norm and accumulation: the stock Trainer's logged losses, grad norms and
    learning rates, and its parameters, bit for bit."""
    _, result = runs
    theirs, ours = result["torch"], result[kind]
    _assert_overlapped(ours, kind)
    assert len(ours["buckets"]) > 1
    assert theirs["optimizer"] == "AdamW"
    assert_same_run(theirs, ours, kind, WRAPPER)
    assert ours["grad_norms"] == theirs["grad_norms"], (ours["grad_norms"], theirs["grad_norms"])
    assert min(theirs["grad_norms"]) > 0.5  # every step clipped
    assert ours["learning_rates"] == theirs["learning_rates"]
    assert theirs["learning_rates"][0] < theirs["learning_rates"][1]  # warming up


def test_optimizer_checkpoints_are_torchs_format(runs):
    """checkpoint-4's optimizer.pt (the sharded optimizer's gathered on every rank, written by
    rank 0) equals the stock Trainer's, bit for bit, and loads into a plain torch AdamW."""
    tmp_path, _ = runs
    torchs = torch.load(tmp_path / "torch.pt.trainer" / "checkpoint-4" / "optimizer.pt")
    for kind in OVERLAP:
        ours = torch.load(tmp_path / f"{kind}.pt.trainer" / "checkpoint-4" / "optimizer.pt")
        assert ours["param_groups"] == torchs["param_groups"], kind
        assert sorted(ours["state"]) == sorted(torchs["state"]), kind
        for index, state in torchs["state"].items():
            for name, value in state.items():
                assert torch.equal(ours["state"][index][name], value), f"{kind}: {index} {name}"
        sizes = [len(group["params"]) for group in ours["param_groups"]]
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(sum(sizes))]
        groups = [{"params": params[:sizes[0]]}, {"params": params[sizes[0]:]}]
        plain = torch.optim.AdamW(groups)
        plain.load_state_dict(ours)  # (checks the groups' sizes; the state is torch's)
        assert len(plain.state) == len(torchs["state"])


def test_overlapped_checkpoints_resume_exactly(runs):
    """The sharded run resumed from its own checkpoint-4; the stock Trainer resumed from the
    sharded run's checkpoint-4 (its optimizer.pt and the rest); the overlapped run resumed from
    the stock Trainer's checkpoint-4: each ends as the stock Trainer's uninterrupted run."""
    tmp_path, result = runs
    whole = result["torch"]
    cases = {"shard_own": ("pyreducer", "shard", "shard"),
             "torch_from_shard": ("torch", None, "shard"),
             "overlap_from_torch": ("pyreducer", "overlap", "torch")}
    for name, (trainer, kind, source) in cases.items():
        options = ["--ddp-options", OVERLAP[kind][0]] if kind else []
        resumed = train(MODULE, tmp_path, name, "--trainer", trainer, *COMMON, *options,
                        "--resume-from", tmp_path / f"{source}.pt.trainer" / "checkpoint-4")
        if kind:
            _assert_overlapped(resumed, kind)
        assert resumed["losses"] == whole["losses"], f"{name}: losses differ"
        assert resumed["grad_norms"][4:] == whole["grad_norms"][4:], f"{name}: grad norms"
        for key, value in whole["params"].items():
            assert torch.equal(resumed["params"][key], value), f"{name}: {key} differs"
