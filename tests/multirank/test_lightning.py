"""PyTorch Lightning with pyreducer (pyreducer/lightning.py): the same small training run
(pyreducer/testing/train_lightning.py, 2 CPU processes on Gloo, launched by Lightning itself) with
Lightning's own DDPStrategy and with pyreducer's, compared bit for bit: losses and parameters.
Skipped where lightning is not installed (`pip install .[lightning]`)."""
import subprocess
import sys

import pytest
import torch

from pyreducer.testing.ranks import subprocess_env

pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install .[lightning])")


def _train(tmp_path, name, *args):
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, "-m", "pyreducer.testing.train_lightning",
                           "--out", str(out), *args], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return torch.load(out)


def _assert_same(theirs, ours, what):
    assert theirs["wrapper"] == "torch.nn.parallel.distributed", theirs["wrapper"]
    assert ours["wrapper"] == "pyreducer.distributed", f"{what}: trained without pyreducer"
    assert ours["losses"] == theirs["losses"], f"{what}: loss curves differ"
    for key, value in theirs["params"].items():
        assert torch.equal(ours["params"][key], value), \
            f"{what}: {key} differs by {(ours['params'][key] - value).abs().max():.3g}"


@pytest.mark.parametrize("how", [["--accumulate", "2"], ["--manual"]],
                         ids=["accumulate_grad_batches", "manual_optimisation"])
def test_trains_like_lightnings_ddp(tmp_path, how):
    """Automatic optimisation with gradient accumulation (Lightning's no_sync), and manual
    optimisation (Note [Lightning's manual optimisation]): the same losses and parameters."""
    theirs = _train(tmp_path, "torch", "--strategy", "torch", *how)
    ours = _train(tmp_path, "pyreducer", "--strategy", "pyreducer", *how)
    assert len(ours["losses"]) == (24 if "--accumulate" in how else 12)
    _assert_same(theirs, ours, " ".join(how))


def test_the_strategy_name_works_once_imported(tmp_path):
    theirs = _train(tmp_path, "torch", "--strategy", "torch")
    ours = _train(tmp_path, "pyreducer", "--strategy", "pyreducer_name")
    _assert_same(theirs, ours, 'strategy="pyreducer_ddp"')


def test_a_checkpoint_resumes_as_with_lightnings_ddp(tmp_path):
    """trainer.save_checkpoint after 16 steps, resumed to 24: the same end state as Lightning's
    DDP strategy doing the same. (Lightning's resumed run does not repeat its uninterrupted one
    exactly with either strategy: from the second step after the resume on, the losses differ.)"""
    runs = {}
    for strategy in ("torch", "pyreducer"):
        first = _train(tmp_path, f"{strategy}_first", "--strategy", strategy, "--steps", "16",
                       "--save", str(tmp_path / f"{strategy}.ckpt"))
        resumed = _train(tmp_path, f"{strategy}_resumed", "--strategy", strategy, "--steps", "24",
                         "--resume", str(tmp_path / f"{strategy}.ckpt"))
        assert len(first["losses"]) == 16 and len(resumed["losses"]) == 8
        runs[strategy] = first, resumed
    _assert_same(runs["torch"][0], runs["pyreducer"][0], "before the checkpoint")
    _assert_same(runs["torch"][1], runs["pyreducer"][1], "resumed")
