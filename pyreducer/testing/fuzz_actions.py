"""Differential fuzzing of what users do around the overlapped and sharded steps: random models,
DDP options and optimizers, trained a few steps with torch DDP + the plain optimizer and with
pyreducer + `overlap_optimizer` (`shard=False` or `True`), both doing the same random user
actions before the forward, between backward() and step(), and between step() and the next
forward. Every value an action returns, the parameters, buffers and gradients at the end, and an
EMA of the parameters must be equal bit for bit; a pyreducer error that names the problem is a
refusal, anything else (another error, a hang) a failure.

The actions (ACTIONS; each where it applies): evaluation forwards through the wrapper and of
model.module, the model's and the optimizer's state_dict() and load_state_dict(), a checkpoint
written and resumed in a new wrapper and optimizer, .data, view and metadata reads, gradient
reads (shard=False), the user's own clip_grad_norm_ / clip_grad_value_ (the optimizer's methods
with shard=True, whose gradients are shards), an EMA of the parameters, synchronize(); around
them no_sync() accumulation, LR schedulers, zero_grad(set_to_none=False), max_grad_norm=.

A case is a pure function of its seed (make_case): `python -m pyreducer fuzz --actions --replay
SEED` reproduces one. The runner is pyreducer/tools/fuzz.py's, with this module as the family.
"""
from __future__ import annotations

import copy
import io
import random

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8
CAPS_MB = (None, 0.0005, 0.002, 0.01)  # None: torch DDP's default (25 MB)
POSITIONS = ("before_forward", "after_backward", "after_step")
# action -> the positions it is drawn at; "overlap only": not with shard=True
ACTIONS = {
    "eval_forward": POSITIONS,
    "module_forward": POSITIONS,
    "model_state_dict": POSITIONS,
    "optimizer_state_dict": POSITIONS,
    "optimizer_reload": POSITIONS,  # load_state_dict(state_dict())
    "data_read": POSITIONS,
    "view_read": POSITIONS,
    "metadata_read": POSITIONS,
    "synchronize": POSITIONS,
    "ema": ("before_forward", "after_step"),
    "checkpoint_resume": ("before_forward", "after_step"),
    "clip_norm": ("after_backward",),
    "clip_value": ("after_backward",),
    "grad_read": ("after_backward",),  # overlap only
}
OPTIMIZERS = ("sgd", "sgd_nesterov", "adam", "adamw", "rmsprop", "adagrad")


def make_case(seed: int) -> dict:
    """The configuration of case `seed`: model, DDP and optimizer options, the actions."""
    rng = random.Random(seed)
    world_size = rng.choice((2, 3))
    shard = rng.random() < 0.5
    depth = rng.randint(1, 3)
    widths = [rng.choice((4, 8, 16, 33)) for _ in range(depth + 2)]
    layers = [dict(width=widths[i + 1], dtype=rng.choice(("float32",) * 5 + ("float64",)),
                   norm=rng.random() < 0.25) for i in range(depth)]
    unused = rng.random() < 0.15  # a branch never used: find_unused_parameters
    ddp = dict(bucket_cap_mb=rng.choice(CAPS_MB), gradient_as_bucket_view=rng.random() < 0.3,
               broadcast_buffers=rng.random() < 0.7, find_unused_parameters=unused)
    chunked = not shard and world_size == 2 and rng.random() < 0.3  # sums bitwise at 2 ranks
    overlap = dict(schedule=1 / 1024 if chunked else "fifo",
                   hold_back=0 if chunked else rng.choice((0, 0, 1, 2)),
                   max_grad_norm=rng.choice((0.05, 1.0)) if rng.random() < 0.2 else None)
    steps = 4 + (5 if chunked else 0)  # chunks are planned after 4 synced iterations
    actions = []
    for step in range(steps):
        for position in POSITIONS:
            if rng.random() < 0.5:
                choices = [a for a, where in ACTIONS.items() if position in where
                           and not (shard and a == "grad_read")]
                actions.append(dict(step=step, position=position, action=rng.choice(choices),
                                    how=rng.random()))
    return dict(seed=seed, world_size=world_size, shard=shard, inputs=widths[0],
                outputs=widths[-1], layers=layers, tied=rng.random() < 0.3, unused=unused,
                ddp=ddp, overlap=overlap, optimizer=rng.choice(OPTIMIZERS),
                scheduler=rng.random() < 0.3, micro=rng.choice((1, 1, 2, 3)),
                set_to_none=rng.random() < 0.7, steps=steps, actions=actions)


def describe(case: dict) -> str:
    """One line: what case `seed` trains and does."""
    layers = ",".join(f"{l['width']}{'d' if l['dtype'] == 'float64' else ''}"
                      f"{'N' if l['norm'] else ''}" for l in case["layers"])
    options = {k: v for k, v in case["ddp"].items() if v not in (False, None)}
    overlap = {k: v for k, v in case["overlap"].items() if v not in (None, 0)}
    actions = " ".join(f"{a['step']}{a['position'][6] if a['position'] != 'before_forward' else 'f'}"
                       f":{a['action']}" for a in case["actions"])
    return (f"seed {case['seed']}: {case['world_size']} ranks, "
            f"{'sharded' if case['shard'] else 'overlapped'} {case['optimizer']}, "
            f"layers [{layers}]{', tied' if case['tied'] else ''}"
            f"{', unused branch' if case['unused'] else ''}, micro {case['micro']}, "
            f"{options}, {overlap}{', scheduler' if case['scheduler'] else ''}"
            f"{'' if case['set_to_none'] else ', zeros'}; actions {actions}")


class ActionNet(nn.Module):
    """Linear layers (some float64, some with BatchNorm buffers), optionally a square layer whose
    weight the parent reads again (tied), and optionally a branch never used."""

    def __init__(self, case: dict):
        super().__init__()
        width, blocks = case["inputs"], []
        for spec in case["layers"]:
            dtype = getattr(torch, spec["dtype"])
            block = [nn.Linear(width, spec["width"], dtype=dtype)]
            if spec["norm"]:
                block.append(nn.BatchNorm1d(spec["width"], dtype=dtype))
            blocks.append(nn.Sequential(*block))
            width = spec["width"]
        self.blocks = nn.ModuleList(blocks)
        self.square = nn.Linear(width, width) if case["tied"] else None
        self.branch = nn.Linear(width, width) if case["unused"] else None
        self.head = nn.Linear(width, case["outputs"])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x.to(block[0].weight.dtype)))
        x = x.float()
        if self.square is not None:
            x = torch.tanh(F.linear(self.square(x), self.square.weight))  # read twice
        return self.head(x)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    params = list(params)
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
        "sgd_nesterov": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
        "adam": lambda: torch.optim.Adam(params, lr=1e-2),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2),
    }[kind]()


class _Run:
    """One side of a case: the wrapper, its optimizer and scheduler, rebuilt on a resume."""

    def __init__(self, cls, case: dict, base: nn.Module, ours: bool):
        self.cls, self.case, self.ours = cls, case, ours
        self.build(copy.deepcopy(base))

    def build(self, module: nn.Module, checkpoint: dict | None = None) -> None:
        case = self.case
        self.model = self.cls(module, **case["ddp"])
        inner = _optimizer(case["optimizer"], self.model.parameters())
        if checkpoint is not None:
            inner.load_state_dict(checkpoint["optimizer"])
        self.opt = inner
        if self.ours:
            self.opt = self.model.overlap_optimizer(inner, shard=case["shard"], **case["overlap"])
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.7) \
            if case["scheduler"] else None
        if checkpoint is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(checkpoint["scheduler"])

    def clip_before_step(self) -> None:
        """max_grad_norm=: torch's clip before the plain step (ours clips in the update)."""
        norm = self.case["overlap"]["max_grad_norm"]
        if norm is not None and not self.ours:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), norm)


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _act(run: _Run, action: dict, x_eval: torch.Tensor, ema: list, case: dict, base: nn.Module):
    """Does `action` on one side; returns what it read (compared across the sides)."""
    model, opt, name = run.model, run.opt, action["action"]
    params = list(model.module.parameters())
    if name == "eval_forward":
        model.eval()
        with torch.no_grad():
            out = model(x_eval)
        model.train()
        return out
    if name == "module_forward":
        with torch.no_grad():
            return model.module(x_eval)
    if name == "model_state_dict":
        return {k: v.clone() for k, v in model.state_dict().items()}
    if name == "optimizer_state_dict":
        return copy.deepcopy(opt.state_dict())
    if name == "optimizer_reload":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        return None
    if name == "data_read":
        return [p.data.clone() for p in params]
    if name == "view_read":
        return [p.reshape(-1)[:3].detach().clone() for p in params]
    if name == "metadata_read":
        return [(tuple(p.shape), p.numel(), p.requires_grad, str(p.dtype)) for p in params]
    if name == "synchronize":
        if run.ours:
            model.synchronize()
        return None
    if name == "ema":
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.mul_(0.9).add_(p.detach(), alpha=0.1)
        return None
    if name == "checkpoint_resume":
        saved = _saved(dict(model=model.module.state_dict(), optimizer=opt.state_dict(),
                            scheduler=run.scheduler.state_dict() if run.scheduler else None))
        module = copy.deepcopy(base)
        module.load_state_dict(saved["model"])
        run.build(module, saved)  # (the EMA is the script's: it carries over)
        return None
    if name == "grad_read":
        return [None if p.grad is None else p.grad.clone() for p in params]
    if name in ("clip_norm", "clip_value"):
        # shard=True: the optimizer's methods (its gradients are shards); else, half the time,
        # torch's functions on the model's parameters as a user would call them
        own = run.ours and (case["shard"] or action["how"] < 0.5)
        if name == "clip_norm":
            if own:
                return opt.clip_grad_norm_(0.5)
            return torch.nn.utils.clip_grad_norm_(params, 0.5)
        if own:
            opt.clip_grad_value_(0.01)
        else:
            torch.nn.utils.clip_grad_value_(params, 0.01)
        return None
    raise ValueError(f"unknown action {name!r}")


def train(cls, base: nn.Module, case: dict, rank: int, ours: bool) -> dict:
    """The case's steps and actions with wrapper `cls`; what was read, and the end state."""
    run = _Run(cls, case, base, ours)
    gen = torch.Generator().manual_seed(case["seed"] * 10 + rank)
    x_eval = torch.randn(BATCH, case["inputs"], generator=torch.Generator().manual_seed(7))
    ema = [p.detach().clone() for p in run.model.module.parameters()]
    reads = []
    by_place: dict = {}
    for action in case["actions"]:
        by_place.setdefault((action["step"], action["position"]), []).append(action)

    def act_at(step: int, position: str) -> None:
        for action in by_place.get((step, position), ()):
            value = _act(run, action, x_eval, ema, case, base)
            reads.append((step, position, action["action"], value))

    for step in range(case["steps"]):
        run.opt.zero_grad(set_to_none=case["set_to_none"])
        act_at(step, "before_forward")
        for m in range(case["micro"]):
            x = torch.randn(BATCH, case["inputs"], generator=gen)
            y = torch.randn(BATCH, case["outputs"], generator=gen)
            if m < case["micro"] - 1:
                with run.model.no_sync():
                    F.mse_loss(run.model(x), y).backward()
            else:
                F.mse_loss(run.model(x), y).backward()
        act_at(step, "after_backward")
        run.clip_before_step()
        run.opt.step()
        if run.scheduler is not None:
            run.scheduler.step()
        act_at(step, "after_step")
    run.opt.zero_grad(set_to_none=case["set_to_none"])
    with torch.no_grad():
        final = run.model(x_eval)  # (ours: the last updates run here)
    module = run.model.module
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    state.update({f"{n}.grad": None if p.grad is None else p.grad.detach().clone()
                  for n, p in module.named_parameters()})
    return dict(reads=reads, state=state, ema=[e.clone() for e in ema], final=final)


def _differences(a, b, where: str) -> list[str]:
    """Where two read values differ (empty: equal bit for bit, None matching None)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{where}: torch DDP {type(a).__name__}, pyreducer {type(b).__name__}"]
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            return []
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else None
        return [f"{where}: differs (max |diff| {diff}, dtypes {a.dtype}/{b.dtype})"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} / {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} / {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: torch DDP {a!r}, pyreducer {b!r}"]


def compare(theirs: dict, ours: dict) -> list[str]:
    """What differs between two train() results (empty: equal bit for bit)."""
    problems = []
    for (step, position, action, a), (_, _, _, b) in zip(theirs["reads"], ours["reads"]):
        problems += _differences(a, b, f"step {step} {position} {action}")
    for key in ("state", "ema", "final"):
        problems += _differences(theirs[key], ours[key], key)
    return problems


def _refusal(message: str) -> bool:
    """A pyreducer error that names the problem (it says so itself)."""
    return message.split(":", 1)[-1].strip().startswith(("pyreducer", "overlap_optimizer"))


def run_case(seed: int, rank: int) -> dict:
    """Case `seed` on this rank: {"status": "ok" | "both refused" | "torch DDP failed" |
    "refused" (a pyreducer error naming the problem) | "refused by one" (another error) |
    "mismatch", "detail": [...]}."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel

    case = make_case(seed)
    torch.manual_seed(seed + 7919 * rank)  # ranks start different: both must broadcast
    base = ActionNet(case)
    outcome = {}
    for name, cls in (("torch", TorchDDP), ("ours", DistributedDataParallel)):
        try:
            outcome[name] = train(cls, base, case, rank, ours=name == "ours")
        except Exception as error:  # noqa: BLE001 - a refusal is compared, not propagated
            outcome[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    refused = [n for n in ("torch", "ours") if isinstance(outcome[n], str)]
    if refused == ["torch"]:
        return dict(status="torch DDP failed", detail=[outcome["torch"]])  # no oracle
    if len(refused) == 2:
        return dict(status="both refused", detail=[outcome["torch"], outcome["ours"]])
    if refused:
        status = "refused" if _refusal(outcome["ours"]) else "refused by one"
        return dict(status=status, detail=[f"ours: {outcome['ours']}"])
    problems = compare(outcome["torch"], outcome["ours"])
    return dict(status="mismatch" if problems else "ok", detail=problems[:5])


def batch_worker(rank: int, world_size: int, seeds: list[int]) -> dict:
    """Runs the cases `seeds` (all of this world size) one after the other on this rank."""
    import warnings

    with warnings.catch_warnings():  # torch DDP's advice (find_unused_parameters, ...)
        warnings.simplefilter("ignore")
        return {seed: run_case(seed, rank) for seed in seeds}
