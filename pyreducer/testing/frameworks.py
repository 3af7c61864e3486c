"""The framework tests' shared steps (tests/multirank/test_lightning.py, test_accelerate.py,
test_hf_trainer.py): run a training script of pyreducer/testing under torchrun, and compare two
runs' results bit for bit."""
from __future__ import annotations

import torch

from pyreducer.testing.ranks import torchrun_module

TORCH_DDP = "torch.nn.parallel.distributed"


def train(module: str, tmp_path, name: str, *args, **env) -> dict:
    """Runs `module` (a script that writes its results to --out on rank 0) under torchrun with
    `args`; returns what it wrote."""
    out = tmp_path / f"{name}.pt"
    torchrun_module(module, ["--out", out, *args], cwd=tmp_path, out=out, **env)
    return torch.load(out)


def assert_same_run(theirs: dict, ours: dict, what: str, our_wrapper: str) -> None:
    """The framework's torch DDP run and pyreducer's: the wrappers they trained with (the
    modules of their classes), then the same losses and parameters, bit for bit."""
    assert theirs["wrapper"] == TORCH_DDP, theirs["wrapper"]
    assert ours["wrapper"] == our_wrapper, f"{what}: trained with {ours['wrapper']}"
    assert ours["losses"] == theirs["losses"], f"{what}: loss curves differ"
    for key, value in theirs["params"].items():
        assert torch.equal(ours["params"][key], value), \
            f"{what}: {key} differs by {(ours['params'][key] - value).abs().max():.3g}"
