"""Small reference models used by the demo, the trace command, the tests and the benchmarks.

Each entry builds a model and a matching batch generator; `loss(model, batch)` gives a scalar.
Sizes are chosen for one CPU core: a step takes milliseconds to a few hundred milliseconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F


class TiedLM(nn.Module):
    """Embedding -> MLP -> output layer sharing the embedding's weight (tied weights)."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


class SmallCNN(nn.Module):
    """Conv + BatchNorm (running-stat buffers) + pooling + linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels),
            nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Linear(8 * channels, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, both residual."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token + position embedding, `layers` blocks, output layer tied to the token embedding."""

    def __init__(self, vocab: int = 8192, dim: int = 256, heads: int = 4, layers: int = 4,
                 seq: int = 64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, 4 * dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ResidualCNN(nn.Module):
    """A small ResNet-like CNN: three stages of two residual conv blocks with BatchNorm."""

    def __init__(self, widths=(32, 64, 128), classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                                   nn.BatchNorm2d(widths[0]), nn.ReLU()]
        channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(2):
                stride = 2 if block == 0 and stage > 0 else 1
                layers.append(_ResBlock(channels, width, stride))
                channels = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class VGGLike(nn.Module):
    """VGG-like: convolutions with few parameters and most of the compute first, then a large
    fully connected head (most of the parameters, little compute): the shape where the next
    forward's first reads are small buckets and crossing the step barrier pays."""

    def __init__(self, widths=(64, 128, 256), hidden: int = 1024, classes: int = 10,
                 batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for stage, width in enumerate(widths):
            for _ in range(2 if stage < len(widths) - 1 else 1):
                layers += [nn.Conv2d(channels, width, 3, padding=1)]
                layers += [nn.BatchNorm2d(width), nn.ReLU()] if batch_norm else [nn.ReLU()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(channels * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
            nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def mlp(width: int = 64, depth: int = 3, inputs: int = 32, outputs: int = 8) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


class Jitter(nn.Module):
    """Identity whose backward sleeps a random time up to `max_s`, drawn from `gen` (different
    on every rank and step when each rank seeds its own); with gen=None it does nothing. For
    tests that ranks agree whatever their timing."""

    def __init__(self, gen: torch.Generator | None, max_s: float):
        super().__init__()
        self.gen, self.max_s = gen, max_s

    def forward(self, x):
        if self.gen is None:
            return x
        return _Sleep.apply(x, float(torch.rand(1, generator=self.gen)) * self.max_s)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@dataclass
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _regression(inputs: int, outputs: int):
    def batch(gen, size):
        return torch.randn(size, inputs, generator=gen), torch.randn(size, outputs, generator=gen)
    return batch


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _images(gen, size):
    return torch.randn(size, 3, 8, 8, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def _tokens(gen, size):
    return (torch.randint(0, 64, (size, 6), generator=gen),
            torch.randint(0, 64, (size, 6), generator=gen))


def _images32(gen, size):
    return torch.randn(size, 3, 32, 32, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def _tokens_lm(gen, size):
    return (torch.randint(0, 8192, (size, 64), generator=gen),
            torch.randint(0, 8192, (size, 64), generator=gen))


def _ce(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


SPECS: dict[str, Spec] = {
    # tests and demo: tiny
    # 288 wide: every tensor, biases included, exceeds 0.001 MiB (one bucket each at that cap)
    "mlp": Spec(lambda: mlp(288, 3, 32, 288), _regression(32, 288), _mse),
    "cnn": Spec(SmallCNN, _images, _ce),
    "tied": Spec(TiedLM, _tokens, _ce),
    "demo": Spec(lambda: mlp(512, 6, 256, 16), _regression(256, 16), _mse),
    # benchmarks: a few large tensors; hundreds of small tensors
    "mlp_large": Spec(lambda: mlp(1024, 6, 1024, 1024), _regression(1024, 1024), _mse),
    "deep_narrow": Spec(lambda: mlp(96, 200, 96, 96), _regression(96, 96), _mse),
    "transformer": Spec(TinyTransformer, _tokens_lm, _ce),
    "resnet": Spec(ResidualCNN, _images32, _ce),
    "vgg": Spec(VGGLike, _images32, _ce),
    # with BatchNorm: buffers broadcast every forward (Note [Buffers beside deferred reductions])
    "vgg_bn": Spec(lambda: VGGLike(batch_norm=True), _images32, _ce),
}

# Batch sizes for the emulated-network benchmarks: one step takes 50-500 ms on one core.
BENCH_BATCH = {"mlp_large": 128, "deep_narrow": 512, "transformer": 8, "resnet": 32, "vgg": 24,
               "vgg_bn": 24}


def spec(name: str) -> Spec:
    """The model `name`: one of SPECS, or of pyreducer/testing/third_party.py (models from
    transformers and torchvision, registered here when first asked for)."""
    if name not in SPECS:
        from pyreducer.testing import third_party

        for own, theirs in ((SPECS, third_party.SPECS), (BENCH_BATCH, third_party.BENCH_BATCH)):
            own.update({k: v for k, v in theirs.items() if k not in own})
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(SPECS)}") from None
