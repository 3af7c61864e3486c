"""Differential fuzzing against torch DDP: random models and DDP options, trained a few steps with
torch's DistributedDataParallel and with pyreducer's from the same seed and data; parameters,
gradients (and whether each is None) and buffers must be equal bit for bit.

A third of the cases train pyreducer with its overlapped optimizer (model.overlap_optimizer),
against torch DDP with the same optimizer: updates deferred to the next forward must not change
a bit. A case is a pure function of its seed (make_case), so a failure is reproduced by its
seed alone (`python -m pyreducer fuzz --replay SEED`). Cases are valid DDP configurations: a
parameter that may go unused comes with find_unused_parameters=True, and usage that changes
between iterations never with static_graph. Where torch DDP itself refuses a case, pyreducer
must refuse it too (the case passes as "both refused").
"""
from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

from pyreducer.wrapper import torch_versions

STEPS = 3
BATCH = 8
CAPS_MB = (None, 0.0005, 0.002, 0.01, 1.0)  # None: torch DDP's default (25 MB)


def make_case(seed: int) -> dict:
    """The configuration of case `seed`: model shape, DDP options, training pattern."""
    rng = random.Random(seed)
    depth = rng.randint(1, 4)
    widths = [rng.choice((3, 8, 16, 33, 64)) for _ in range(depth + 2)]
    layers = [dict(width=widths[i + 1], dtype=rng.choice(("float32",) * 4 + ("float64",)),
                   frozen=rng.random() < 0.15, bias=rng.random() < 0.8,
                   norm=rng.random() < 0.2) for i in range(depth)]
    unused = rng.choice(("none",) * 3 + ("never", "alternate", "rank"))
    ddp = dict(find_unused_parameters=unused != "none" or rng.random() < 0.3,
               gradient_as_bucket_view=rng.random() < 0.4,
               broadcast_buffers=rng.random() < 0.8,
               batched_grad_copy=rng.random() < 0.3)
    if not torch_versions.DDP_HAS_BATCHED_GRAD_COPY:  # drawn all the same: the same cases
        del ddp["batched_grad_copy"]  # torch 2.11: no oracle for it
    micro = rng.choice((1, 1, 2, 3))
    # static_graph with no_sync: torch DDP 2.13 fails an internal assert (expect_autograd_hooks_),
    # so there is no oracle for it
    if unused in ("none", "never") and micro == 1 and rng.random() < 0.4:
        ddp["static_graph"] = True
    if rng.random() < 0.2:
        ddp["bucket_cap_mb_list"] = [rng.choice(CAPS_MB[1:]) for _ in range(rng.randint(1, 3))]
    else:
        ddp["bucket_cap_mb"] = rng.choice(CAPS_MB)
    world_size = rng.choice((2, 3))
    return dict(seed=seed, world_size=world_size, inputs=widths[0], outputs=widths[-1],
                layers=layers, tied=rng.random() < 0.3, unused=unused, ddp=ddp,
                hook=rng.choice((None,) * 5 + ("allreduce", "fp16")),
                micro=micro, set_to_none=rng.random() < 0.7,
                overlap=_overlap_option(rng, world_size))


def _overlap_option(rng: random.Random, world_size: int) -> dict | None:
    """pyreducer's overlapped optimizer (against torch DDP + the same optimizer): torch DDP's
    order with the first layers' last buckets held back, or (2 ranks: the sums are the whole
    buckets' bit for bit) chunks of 1 KB in the planned order, installed after the warm-up."""
    if rng.random() > 0.3:
        return None
    if world_size == 2 and rng.random() < 0.4:
        return dict(schedule=1 / 1024, hold_back=0)
    return dict(schedule="fifo", hold_back=rng.choice((0, 1, 2)))


def describe(case: dict) -> str:
    """One line: what case `seed` trains."""
    layers = ",".join(f"{l['width']}{'d' if l['dtype'] == 'float64' else ''}"
                      f"{'F' if l['frozen'] else ''}{'N' if l['norm'] else ''}"
                      for l in case["layers"])
    options = {k: v for k, v in case["ddp"].items() if v not in (False, None)}
    return (f"seed {case['seed']}: {case['world_size']} ranks, layers [{layers}]"
            f"{', tied' if case['tied'] else ''}, unused {case['unused']}, hook {case['hook']}, "
            f"micro {case['micro']}, {options}"
            + (f", overlap {case['overlap']}" if case.get("overlap") else ""))


class FuzzNet(nn.Module):
    """Linear layers of mixed dtypes (some frozen, some with BatchNorm buffers), optionally a
    square layer whose weight is read again by the parent (F.linear: tied, used twice), and a
    branch used never, every other step, or on rank 0 only."""

    def __init__(self, case: dict):
        super().__init__()
        width, blocks = case["inputs"], []
        for spec in case["layers"]:
            dtype = getattr(torch, spec["dtype"])
            block = [nn.Linear(width, spec["width"], bias=spec["bias"], dtype=dtype)]
            if spec["norm"]:
                block.append(nn.BatchNorm1d(spec["width"], dtype=dtype))
            seq = nn.Sequential(*block)
            if spec["frozen"]:
                seq.requires_grad_(False)
            blocks.append(seq)
            width = spec["width"]
        self.blocks = nn.ModuleList(blocks)
        self.square = nn.Linear(width, width) if case["tied"] else None
        self.branch = nn.Linear(width, width) if case["unused"] != "none" else None
        self.head = nn.Linear(width, case["outputs"])
        self.unused = case["unused"]

    def forward(self, x, step: int, rank: int):
        for block in self.blocks:
            x = torch.tanh(block(x.to(block[0].weight.dtype)))
        x = x.float()
        if self.square is not None:
            x = torch.tanh(F.linear(self.square(x), self.square.weight))  # read twice
        if self.branch is not None and _branch_used(self.unused, step, rank):
            x = x + self.branch(x)
        return self.head(x)


def _branch_used(unused: str, step: int, rank: int) -> bool:
    return unused == "alternate" and step % 2 == 0 or unused == "rank" and (rank == 0 or step % 2)


def _hook(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook}[name]


def train(cls, base: nn.Module, case: dict, rank: int) -> dict:
    """STEPS steps with wrapper `cls`; the parameters, gradients (None kept) and buffers."""
    model = cls(copy.deepcopy(base), **case["ddp"])
    if case["hook"]:
        model.register_comm_hook(None, _hook(case["hook"]))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9, foreach=False)
    overlap = case.get("overlap")
    if overlap and hasattr(model, "overlap_optimizer"):  # pyreducer's
        opt = model.overlap_optimizer(opt, **overlap)
    gen = torch.Generator().manual_seed(case["seed"] * 10 + rank)
    # chunks are planned after the overlapped optimizer's warm-up (4 synced iterations)
    steps = STEPS + (5 if overlap and overlap["schedule"] != "fifo" else 0)
    for step in range(steps):
        opt.zero_grad(set_to_none=case["set_to_none"])
        for m in range(case["micro"]):
            x = torch.randn(BATCH, case["inputs"], generator=gen)
            y = torch.randn(BATCH, case["outputs"], generator=gen)
            if m < case["micro"] - 1:
                with model.no_sync():
                    F.mse_loss(model(x, step, rank), y).backward()
            else:
                F.mse_loss(model(x, step, rank), y).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    state.update({f"{n}.grad": None if p.grad is None else p.grad.detach().clone()
                  for n, p in model.module.named_parameters()})
    return state


def compare(theirs: dict, ours: dict) -> list[str]:
    """What differs between two train() results (empty: equal bit for bit)."""
    problems = []
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name, "missing"), ours.get(name, "missing")
        if (a is None) != (b is None) or isinstance(a, str) or isinstance(b, str):
            problems.append(f"{name}: torch DDP {_what(a)}, pyreducer {_what(b)}")
        elif a is not None and not (a.dtype == b.dtype and torch.equal(a, b)):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else None
            problems.append(f"{name}: differs (max |diff| {diff}, dtypes {a.dtype}/{b.dtype})")
    return problems


def _what(value) -> str:
    return value if isinstance(value, str) else "None" if value is None else "a tensor"


def run_case(seed: int, rank: int) -> dict:
    """Case `seed` on this rank: {"status": "ok" | "both refused" | "torch DDP failed" (an
    internal assert: no oracle) | "refused by one" | "mismatch", "detail": [...]}."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    case = make_case(seed)
    torch.manual_seed(seed + 7919 * rank)  # ranks start different: both must broadcast
    base = FuzzNet(case)
    outcome = {}
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        try:
            outcome[name] = train(cls, base, case, rank)
        except Exception as error:  # noqa: BLE001 - a refusal is compared, not propagated
            outcome[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    refused = [n for n in ("torch", "ours") if isinstance(outcome[n], str)]
    if refused == ["torch"] and "INTERNAL ASSERT" in outcome["torch"]:
        return dict(status="torch DDP failed", detail=[outcome["torch"]])  # no oracle
    if len(refused) == 2:
        return dict(status="both refused", detail=[outcome["torch"], outcome["ours"]])
    if refused:
        return dict(status="refused by one", detail=[f"{refused[0]}: {outcome[refused[0]]}"])
    problems = compare(outcome["torch"], outcome["ours"])
    return dict(status="mismatch" if problems else "ok", detail=problems[:5])


def batch_worker(rank: int, world_size: int, seeds: list[int]) -> dict:
    """Runs the cases `seeds` (all of this world size) one after the other on this rank."""
    import warnings

    with warnings.catch_warnings():  # torch DDP's advice (find_unused_parameters, ...)
        warnings.simplefilter("ignore")
        return {seed: run_case(seed, rank) for seed in seeds}
