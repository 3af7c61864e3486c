"""The two models of benchmarks/bench_gpu.py, in plain torch.nn (torchvision is not assumed),
and what each of its ranks runs with them (`step_rank`).

    gpt2:     GPT-2 small: 12 layers, d_model 768, 12 heads, vocab 50257, 1024 positions,
              head tied to the token embedding (124.4M parameters); batch 8 x seq 512.
    resnet50: ResNet-50: bottleneck blocks [3, 4, 6, 3], BatchNorm, 1000 classes (25.6M
              parameters); batch 32 x 3 x 224 x 224.

`workload(name, tiny=True)` gives the same architecture at toy size (2 layers, d_model 64,
vocab 512; a two-stage bottleneck CNN) for the CPU rehearsal (`bench_gpu.py --smoke`).
`step_rank` builds torch DDP and pyreducer around copies of one model in every rank, checks
that their first step agrees, then times interleaved steps (bench_gpu.py's docstring).

GPU memory, GPT-2 in float32, per rank: two wrappers x (parameters 0.5 GB + gradients 0.5 +
bucket 0.5 + AdamW state 1.0) = 5 GB, plus one step's activations at batch 8 x 512 (about
0.3 GB per layer-stack sample and 0.3 GB of logits per sample: ~5 GB); two ranks sharing one
GPU need about 25 GB of its 78.
"""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("gpt2", "resnet50")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """Token + position embeddings, pre-norm blocks, final LayerNorm, head tied to `wte`."""

    def __init__(self, vocab: int, positions: int, layers: int, d_model: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(positions, d_model)
        self.blocks = nn.ModuleList(GPT2Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's ResNet v1.5), 1x1 expand x4; residual."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(True), nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out else nn.Sequential(
            nn.Conv2d(in_channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks: tuple, widths: tuple, stem: int, classes: int):
        super().__init__()
        layers = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(True),
                  nn.MaxPool2d(3, 2, 1)]
        channels = stem
        for stage, (count, width) in enumerate(zip(blocks, widths)):
            for i in range(count):
                layers.append(Bottleneck(channels, width, 2 if i == 0 and stage > 0 else 1))
                channels = 4 * width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(self.features(x))


@dataclass(frozen=True)
class Workload:
    """A model and its batches: `build()` (on the current default device), `batch(generator,
    device)` -> (inputs, targets); the loss is cross-entropy of model(inputs) against targets."""
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, torch.device], tuple]
    batch_desc: str


def workload(name: str, tiny: bool = False) -> Workload:
    if name == "gpt2":
        vocab, positions, layers, d_model, heads = (512, 64, 2, 64, 4) if tiny else \
            (50257, 1024, 12, 768, 12)
        batch, seq = (2, 32) if tiny else (8, 512)

        def tokens(gen, device):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=gen, device=device)
            return x[:, :-1].contiguous(), x[:, 1:].contiguous()
        return Workload(name, lambda: GPT2(vocab, positions, layers, d_model, heads), tokens,
                        f"batch {batch} x seq {seq}")
    if name == "resnet50":
        blocks, widths, stem, classes = ((1, 1), (8, 16), 8, 10) if tiny else \
            ((3, 4, 6, 3), (64, 128, 256, 512), 64, 1000)
        batch, side = (2, 32) if tiny else (32, 224)

        def images(gen, device):
            x = torch.randn(batch, 3, side, side, generator=gen, device=device)
            return x, torch.randint(0, classes, (batch,), generator=gen, device=device)
        return Workload(name, lambda: ResNet(blocks, widths, stem, classes), images,
                        f"batch {batch} x 3 x {side} x {side}")
    raise ValueError(f"unknown model {name!r}: expected one of {MODELS}")


def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def parameter_shapes(name: str, tiny: bool = False) -> list[torch.Size]:
    """Shapes of the model's parameters in `parameters()` order (tied ones once), without
    allocating them (built on the meta device)."""
    with torch.device("meta"):
        return [p.shape for p in workload(name, tiny).build().parameters()]


# ---- what each rank runs (spawned by bench_gpu.py; module-level, so it pickles by name) ----

def _forward_backward(model, opt, batch, device_type, precision) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        value = loss(model, batch)
    value.backward()
    return value.detach().float()


def _check_first_step(wrapped, opts, batch, device_type, precision) -> dict:
    """One untimed step of both wrappers on the same batch; raises if they disagree."""
    losses = {n: _forward_backward(m, opts[n], batch, device_type, precision)
              for n, m in wrapped.items()}
    ours, theirs = (list(wrapped[n].module.parameters()) for n in ("pyreducer", "torch"))
    missing = [i for i, (a, b) in enumerate(zip(ours, theirs))
               if (a.grad is None) != (b.grad is None)]
    pairs = [(a.grad, b.grad) for a, b in zip(ours, theirs) if a.grad is not None]
    diff = torch.stack([(a - b).abs().max() for a, b in pairs]).max().item()
    scale = torch.stack([b.abs().max() for _, b in pairs]).max().item()
    rtol = 1e-2 if precision == "bf16" else 1e-4
    check = dict(torch_loss=losses["torch"].item(), pyreducer_loss=losses["pyreducer"].item(),
                 bitwise_equal=bool(torch.equal(losses["torch"], losses["pyreducer"])),
                 close=bool(torch.allclose(losses["pyreducer"], losses["torch"], rtol=rtol)),
                 grad_max_abs_diff=diff, grad_max_abs=scale, grads_missing_on_one=missing)
    check["passed"] = check["close"] and not missing and diff <= 1e-2 * max(scale, 1e-30)
    if not check["passed"]:
        raise AssertionError(f"results disagree before timing (expected equal loss and "
                             f"gradients within 1e-2 of max |grad|): {check}")
    for opt in opts.values():
        opt.step()
    return check


def step_rank(rank, world_size, config):
    """Rank body of one setting: each (model, precision) in turn, fresh wrappers from the same
    weights; each finished case is saved at once to out_dir (it survives a later failure)."""
    import gc

    for model, precision in config["cases"]:
        start = time.monotonic()
        result = _measure(rank, config, model, precision)
        result["duration_s"] = time.monotonic() - start
        path = os.path.join(config["out_dir"], f"{model}-{precision}.rank{rank}.pt")
        torch.save(result, path)
        del result
        gc.collect()
        if config["cuda"]:
            torch.cuda.empty_cache()
    return len(config["cases"])


def _measure(rank, config, model, precision) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    cuda = config["cuda"]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    work = workload(model, tiny=config["smoke"])
    torch.manual_seed(1234)
    with torch.device(device):
        base = work.build()
    ids = [device.index] if cuda else None
    wrapped = {"torch": TorchDDP(copy.deepcopy(base), device_ids=ids),
               "pyreducer": DistributedDataParallel(copy.deepcopy(base), device_ids=ids)}
    params = sum(p.numel() for p in base.parameters())
    del base
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)
            for k, m in wrapped.items()}
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    batches = [work.batch(gen, device) for _ in range(2)]
    check = _check_first_step(wrapped, opts, batches[0], device.type, precision)
    if rank == 0:
        print(f"   [rank 0] {model} {precision}: results agree (loss "
              f"{check['torch_loss']:.5f}, bitwise {check['bitwise_equal']}); timing", flush=True)
    seconds = {name: [] for name in wrapped}
    order = list(wrapped)
    for step in range(config["warmup"] + config["steps"]):
        for name in order if step % 2 == 0 else order[::-1]:  # alternate who goes first
            sync()
            start = time.perf_counter()
            _forward_backward(wrapped[name], opts[name], batches[step % 2], device.type,
                              precision)
            opts[name].step()
            sync()
            if step >= config["warmup"]:
                seconds[name].append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return dict(seconds=seconds, check=check, params=params, batch=work.batch_desc,
                peak_memory_gib=peak)
