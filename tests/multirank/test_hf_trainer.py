"""The Hugging Face Trainer with pyreducer (pyreducer/transformers.py): a 2-layer GPT-2 built from a
config (pyreducer/testing/train_hf_trainer.py, torchrun, 2 CPU processes on Gloo) trained by
transformers.Trainer (torch DDP through Accelerate) and by pyreducer's Trainer, compared bit for
bit: logged losses and parameters, with gradient accumulation (the Trainer's no_sync), its
find_unused_parameters default for a PreTrainedModel, the tied embedding, and a checkpoint
resumed. Skipped where transformers is not installed."""
import json

import pytest
import torch

from pyreducer.testing.frameworks import assert_same_run, train

pytest.importorskip("transformers", reason="transformers is not installed "
                                           "(pip install .[transformers])")

WRAPPER = "pyreducer.accelerate"  # the module of the class pyreducer wraps with here
MODULE = "pyreducer.testing.train_hf_trainer"




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 steps of 2 accumulated micro-batches, a checkpoint every 4, each Trainer; pyreducer's with
    small buckets through ddp_options (several buckets: the option reaches the wrapper), and the
    timeline recorded (PYREDUCER_TRACE)."""
    tmp_path = tmp_path_factory.mktemp("hf")
    common = ["--accumulate", "2", "--steps", "8", "--save-at", "4"]
    return tmp_path, {
        "torch": train(MODULE, tmp_path, "torch", "--trainer", "torch", *common),
        "pyreducer": train(MODULE, tmp_path, "pyreducer", "--trainer", "pyreducer", *common,
                           "--ddp-options", '{"bucket_cap_mb": 0.02}',
                           PYREDUCER_TRACE=str(tmp_path / "trace"))}


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
        resumed = train(MODULE, tmp_path, f"{which}_resumed", "--trainer", which,
                        "--accumulate", "2", "--steps", "8", "--resume-from",
                        tmp_path / f"{which}.pt.trainer" / "checkpoint-4")
        assert resumed["wrapper"] == result[which]["wrapper"]
        assert resumed["losses"] == result[which]["losses"], f"{which}: losses differ"
        for key, value in result[which]["params"].items():
            assert torch.equal(resumed["params"][key], value), f"{which}: {key} differs"
