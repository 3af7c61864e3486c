"""The benchmark suite's third-party models (pyreducer/testing/third_party.py): reached through
models.spec like the project's own, the shapes their docstring states, a loss from a batch, and
a clear reason where a package cannot be imported."""
import pytest
import torch

from pyreducer.testing import models, third_party

pytest.importorskip("transformers")

# (parameters, parameter tensors, buffers) as the module docstring states them
SHAPES = {"hf_resnet18": (11_227_812, 62, 60), "hf_bert": (11_073_284, 73, 2),
          "hf_gpt2": (16_058_112, 52, 0)}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_model_builds_with_the_stated_shape_and_trains(name):
    spec = models.spec(name)
    torch.manual_seed(0)
    model = spec.build()
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params), len(list(model.buffers()))) \
        == SHAPES[name]
    assert name in models.BENCH_BATCH
    loss = spec.loss(model, spec.batch(torch.Generator().manual_seed(0), 2))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in params if p.requires_grad)


def test_a_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(third_party.PACKAGES, "hf_bert", "no_such_package_here")
    why = third_party.unavailable("hf_bert")
    assert why is not None and "no_such_package_here" in why and "hf_bert" in why, why
    assert third_party.unavailable("hf_resnet18") is None
    assert third_party.unavailable("vgg") is None  # the project's own


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="hf_resnet18"):
        models.spec("no_such_model")
