"""Hugging Face Accelerate with pyreducer (pyreducer/accelerate.py): the same small training run
(pyreducer/testing/train_accelerate.py, torchrun, 2 CPU processes on Gloo) with Accelerate's own
Accelerator (torch DDP) and with pyreducer's, compared bit for bit: losses and parameters, with
`accumulate`, with trigger_sync_in_backward, through save_state / load_state, and what
unwrap_model / save_model give. Skipped where accelerate is not installed."""
import pytest
import torch

from pyreducer.testing.frameworks import assert_same_run, train

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install .[accelerate])")

WRAPPER = "pyreducer.accelerate"  # the module of the class pyreducer wraps with here
MODULE = "pyreducer.testing.train_accelerate"




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
