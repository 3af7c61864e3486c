"""The sharded overlapped optimizer against torch DDP + the same unsharded optimizer
(tests/multirank/test_sharded.py): one training loop, run with either."""
from __future__ import annotations

import copy
import io

import torch
from torch import nn

from pyreducer.testing.parity import _model_fns

STEPS = 6


def optimizer(kind: str, params):
    """The optimizers a sharded step accepts (pyreducer/sharded/checks.py), each implementation."""
    params = list(params)
    table = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True,
                                       weight_decay=1e-3, foreach=False),
        "sgd_foreach": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
        "adam": lambda: torch.optim.Adam(params, lr=1e-2, foreach=False),
        "adam_foreach": lambda: torch.optim.Adam(params, lr=1e-2, foreach=True),
        "adam_amsgrad": lambda: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
        "adamw_groups": lambda: torch.optim.AdamW(
            [dict(params=[p for p in params if p.dim() > 1]),
             dict(params=[p for p in params if p.dim() <= 1], lr=3e-3, weight_decay=0.0)],
            lr=1e-2, weight_decay=0.1),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9, centered=True),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=1e-2, lr_decay=1e-3),
    }
    return table[kind]()


SCHEDULERS = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                                 total_steps=STEPS),
}


def _build(cls, base, case, ours: bool, plan=None):
    extra = dict(bucket_plan=plan) if plan is not None else {}
    model = cls(base, **case.get("ddp", {}), **extra)
    opt = optimizer(case["opt"], model.module.parameters())
    if ours:
        opt = model.overlap_optimizer(opt, shard=True, max_grad_norm=case.get("clip"),
                                      hold_back=case.get("hold_back", 0))
    scheduler = SCHEDULERS[case["scheduler"]](opt) if "scheduler" in case else None
    return model, opt, scheduler


def _round_trip(obj):
    """What torch.save then torch.load gives back (a checkpoint on disk)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _step(model, opt, case: dict, ours: bool, data, step: int, rank: int, deferred: list) -> list:
    """Step `step` of `case`: its backward(s) and optimizer step, by step(closure) (as Lightning
    steps) or after the optimizer's own clip (as the frameworks' loops clip); returns what the
    closure or the clip returned. Appends the reductions left in flight to `deferred` (ours)."""
    make_batch, loss_fn, gen = data
    if case.get("closure"):
        batch = make_batch(gen, 8)

        def closure():
            loss = loss_fn(model, batch, step, rank)
            loss.backward()
            return loss

        loss = opt.step(closure).detach().clone()
        if ours:
            deferred.append(len(model.reducer.pending_buckets()))
        return [loss]
    for micro in range(case.get("micro", 1)):
        batch = make_batch(gen, 8)
        if micro < case.get("micro", 1) - 1:
            with model.no_sync():
                loss_fn(model, batch, step, rank).backward()
            continue
        loss_fn(model, batch, step, rank).backward()
    if ours:
        deferred.append(len(model.reducer.pending_buckets()))
    if case.get("clip") and not ours:
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
    returned = []
    if case.get("method_clip"):
        kind, value = case["method_clip"]
        if kind == "value":
            (opt.clip_grad_value_ if ours else lambda v: torch.nn.utils.clip_grad_value_(
                model.parameters(), v))(value)
        else:
            returned.append((opt.clip_grad_norm_ if ours else lambda v: torch.nn.utils.
                             clip_grad_norm_(model.parameters(), v))(value).detach().clone())
    opt.step()
    return returned


def train(cls, base, case: dict, rank: int, resume_at: int | None = None,
          resume_from: str = "sharded") -> dict:
    """STEPS steps of `case` with wrapper `cls` (torch's DDP + the plain optimizer, or
    pyreducer's + overlap_optimizer(shard=True)) around a copy of `base`. resume_at: the run is
    checkpointed there (model, optimizer, scheduler) and resumed in a new wrapper, from the
    sharded checkpoint ("sharded", "sharded_same_plan") or the gathered one ("whole")."""
    ours = not cls.__module__.startswith("torch")
    _, make_batch, loss_fn = _model_fns(case["model"])
    model, opt, scheduler = _build(cls, copy.deepcopy(base), case, ours)
    gen = torch.Generator().manual_seed(1000 + rank)
    deferred, updates_in_forward, snapshot, returned = [], 0, {}, []
    for step in range(STEPS):
        if step == resume_at:
            saved = _round_trip(dict(
                model=model.module.state_dict(), sched=scheduler.state_dict() if scheduler else None,
                opt=opt.state_dict() if resume_from == "whole" else opt.sharded_state_dict(),
                plan=model.bucket_plan()))
            plan = saved["plan"] if resume_from == "sharded_same_plan" else None
            model, opt, scheduler = _build(cls, copy.deepcopy(base), case, ours, plan=plan)
            model.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            if scheduler:
                scheduler.load_state_dict(saved["sched"])
        returned += _step(model, opt, case, ours, (make_batch, loss_fn, gen), step, rank,
                          deferred)
        if scheduler:
            scheduler.step()
        if case.get("read_after_step"):  # a read outside the forward: the update runs first
            snapshot = {k: v.clone() for k, v in model.module.state_dict().items()}
        opt.zero_grad(set_to_none=case.get("set_to_none", True))
        if ours and step > 0:
            events = opt.events(model.reducer.num_iterations - 1) or {}
            updates_in_forward += sum(1 for e in events.get("updates", ())
                                      if e["module"] is not None)
    last = {}
    if ours:
        model.synchronize()
        last = model.timeline(1)[-1].get("overlap") or {}  # the last step's updates
    state = opt.state_dict()  # (collective with shard=True: every rank gathers)
    return dict(
        params={n: p.detach().clone() for n, p in model.module.named_parameters()},
        grads={n: None if p.grad is None else p.grad.clone()
               for n, p in model.module.named_parameters()},
        state={k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
               for k, s in state["state"].items()},
        groups=[{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        param_groups=state["param_groups"],
        deferred=deferred, updates_in_forward=updates_in_forward, snapshot=snapshot,
        returned=returned,
        last_overlap=last,
        memory=opt.memory_bytes() if ours else _torch_memory(opt))


def _torch_memory(opt) -> dict:
    return dict(optimizer_state=sum(v.numel() * v.element_size() for s in opt.state.values()
                                    for v in s.values() if torch.is_tensor(v)))


def plain_state_loads(kind: str, base: nn.Module, state_dict: dict) -> bool:
    """Whether a plain optimizer of `kind` over `base` loads `state_dict` (torch's format)."""
    opt = optimizer(kind, copy.deepcopy(base).parameters())
    opt.load_state_dict(state_dict)
    return len(opt.state) == len(state_dict["state"])
