"""Stepping some of an optimizer's parameters with its own math: the overlapped optimizer's
per-bucket updates (Note [Overlapped step] in pyreducer/overlap/optimizer.py).

Note [One step, in buckets]
torch steps every parameter in one call of the optimizer's step(), with the settings in force
then, outside the forward. A bucket's update is one call of the class's step on the
param_groups cut down to the bucket's parameters, so that each call must see what the single
call would have seen:
  - each param group's settings as at step() (Settings; a tensor lr is copied: a scheduler
    changes it in place before the next forward), and only the groups of step(): a group
    added since is stepped from the next step() on, as torch does;
  - the optimizer's own scalar attributes as at step(): a counter some optimizers keep on the
    instance (`self.t += 1`) starts every bucket from step()'s value, and its successor is kept.
    A group-level counter is treated the same way;
  - the modes of a step() outside the forward (as_step): not the forward's autocast (a matmul
    in the step would run in bfloat16) nor its inference mode (the state the first update
    creates would be inference tensors, refused by every later update), and without grad.
What a step changes in place (a tensor in a param group, a tensor on the instance) is not
restored between buckets: no torch optimizer does it. Statistics across parameters computed
inside a step (a global gradient norm) are computed per bucket: that cannot be detected here.
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.optim import optimizer as torch_optimizer

_SCALARS = (bool, int, float, str, type(None))


def _changed(value, before) -> bool:
    """Whether an optimizer's step set an entry to another value (a tensor: to another tensor;
    a tensor the step changes in place is step()'s copy, and that change is not kept)."""
    if value is before or torch.is_tensor(value) or torch.is_tensor(before):
        return value is not before
    try:
        return bool(value != before)
    except Exception:  # values that do not compare: set anew
        return True


def _scalars(optimizer) -> dict:
    """The optimizer instance's own scalar attributes."""
    return {k: v for k, v in vars(optimizer).items() if isinstance(v, _SCALARS)}


class Settings:
    """What step() fixes for every bucket's update (Note [One step, in buckets])."""

    def __init__(self, optimizer):
        self.groups = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()
                        if k != "params"} for g in optimizer.param_groups]
        self.scalars = _scalars(optimizer)


@contextlib.contextmanager
def as_step(device: torch.device):
    """The modes a step() outside the forward runs in (Note [One step, in buckets])."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))  # (turns grad mode on: then off)
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if device.type != "cpu":
            stack.enter_context(torch.autocast(device.type, enabled=False))
        yield


def math_step(optimizer) -> None:
    """The optimizer's step on its param_groups as they are: its class's step without torch's
    hook wrapper (the hooks run once per step() of the overlapped optimizer) and without an
    LR scheduler's counting wrapper on the instance. A parent class's step that torch hooked
    too (a subclass's step calling super().step()) runs no step hook either: the hooks are
    set aside meanwhile (torch's global ones too: a step on another thread in that window
    would miss them)."""
    step = type(optimizer).step
    own = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    everyone = [hooks for hooks in (torch_optimizer._global_optimizer_pre_hooks,
                                    torch_optimizer._global_optimizer_post_hooks) if hooks]
    saved = [dict(hooks) for hooks in everyone]
    optimizer._optimizer_step_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_step_post_hooks = collections.OrderedDict()
    for hooks in everyone:
        hooks.clear()
    try:
        getattr(step, "__wrapped__", step)(optimizer)
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = own
        for hooks, kept in zip(everyone, saved):
            hooks.update(kept)


def step_subset(optimizer, members: set, settings: Settings | None) -> None:
    """The optimizer's step over the parameters in `members` (ids), with `settings` (step()'s;
    None: as they are). Afterwards each group has its parameters and settings back, and the
    instance its scalars, except what the step itself set."""
    groups = optimizer.param_groups
    # Groups added since step() are left out (torch steps them from the next step() on): run
    # over with no member, a step's group-level counter there would advance once per bucket.
    kept = len(groups) if settings is None else min(len(groups), len(settings.groups))
    added = groups[kept:]
    del groups[kept:]  # (in place: the overlapped optimizer shares this list)
    saved = [dict(g) for g in groups]
    saved_scalars = _scalars(optimizer)
    given, given_scalars = [], saved_scalars
    try:
        for index, g in enumerate(groups):
            if settings is not None:  # the group as at step() (without a key added since)
                g.clear()
                g.update(settings.groups[index], params=saved[index]["params"])
            given.append(dict(g))
            g["params"] = [p for p in g["params"] if id(p) in members]
        if settings is not None:
            for key in saved_scalars.keys() - settings.scalars.keys():  # added since step()
                delattr(optimizer, key)
            for key, value in settings.scalars.items():
                setattr(optimizer, key, value)
            given_scalars = _scalars(optimizer)
        math_step(optimizer)
    finally:
        for g, old, start in zip(groups, saved, given):
            set_by_step = {k: v for k, v in g.items()
                           if k != "params" and (k not in start or _changed(v, start[k]))}
            g.clear()
            g.update(old)
            g.update(set_by_step)
        groups.extend(added)
        now = _scalars(optimizer)
        for key, value in saved_scalars.items():
            setattr(optimizer, key, value)
        for key, value in now.items():
            if key not in given_scalars or _changed(value, given_scalars[key]):
                setattr(optimizer, key, value)
