"""A sharded optimizer's state across layouts: gathered whole (torch's format, a checkpoint a
plain optimizer loads), cut into a layout's pieces (a full checkpoint loaded, or the state moved
to new buckets), saved and resumed as this rank's pieces (Note [Sharded optimizer state] in
pyreducer/sharded/__init__.py).

A piece's state holds, per key, either a 1-D tensor with one value per element of the piece
(elementwise: exp_avg, momentum_buffer, ...) or a 0-dim tensor or number that is the same on
every piece of its parameter (a per-parameter scalar: step). Whole states are gathered one
parameter at a time (a parameter's full state is the most any rank holds at once beyond its
own), with an all-gather of every rank's piece padded to the longest.
"""
from __future__ import annotations

import torch

from pyreducer.sharded.layout import Layout, flat_view
from pyreducer.wrapper import sync


def _kind(value, piece_numel: int):
    """("elementwise", dtype) or ("scalar", value as a plain description) of one piece state."""
    if torch.is_tensor(value):
        if value.dim() == 1 and value.numel() == piece_numel:
            return ("elementwise", str(value.dtype).removeprefix("torch."))
        if value.dim() == 0:
            return ("scalar", value.item(), str(value.dtype).removeprefix("torch."),
                    value.device.type)
    elif isinstance(value, (int, float, bool)):
        return ("number", value)
    shape = f" and shape {tuple(value.shape)}" if torch.is_tensor(value) else ""
    raise ValueError(f"sharded step: a state value of type {type(value).__name__}{shape} is "
                     f"neither per element ({piece_numel} values) nor per parameter")


def schema(group, layout: Layout, states: list[dict | None], device) -> dict[int, dict]:
    """{parameter: {key: kind}} over every rank's pieces (collective on `group`, bytes on
    `device`): what each parameter's state holds. Ranks must agree on per-parameter scalars
    (ValueError otherwise)."""
    mine: dict[int, dict] = {}
    for piece, state in zip(layout.pieces, states):
        for key, value in (state or {}).items():
            mine.setdefault(piece.param, {})[key] = _kind(value, piece.numel)
    everyone = sync.all_gather_object(mine, group, device)
    merged: dict[int, dict] = {}
    for rank, theirs in enumerate(everyone):
        for param, keys in theirs.items():
            for key, kind in keys.items():
                seen = merged.setdefault(param, {}).setdefault(key, kind)
                if seen != kind:
                    raise ValueError(f"sharded step: parameter {param}'s state '{key}' is "
                                     f"{seen} on one rank and {kind} on rank {rank}")
    return merged


def _scalar(kind):
    if kind[0] == "number":
        return kind[1]
    return torch.tensor(kind[1], dtype=getattr(torch, kind[2]))


def gather_param(comm, layout: Layout, states: list[dict | None], param: int, key: str,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Parameter `param`'s elementwise state `key`, whole (1-D, memory order), on every rank:
    an all-gather of each rank's piece (zeros where a rank has none), padded to the longest."""
    owners = [[p for p in layout.pieces_of(r) if p.param == param] for r in
              range(layout.world_size)]
    longest = max((p.numel for pieces in owners for p in pieces), default=0)
    mine = torch.zeros(longest, dtype=dtype, device=device)
    for piece, state in zip(layout.pieces, states):
        if piece.param == param and state and key in state:
            mine[:piece.numel].copy_(state[key])
    out = torch.zeros(longest * layout.world_size, dtype=dtype, device=device)
    comm.wait(comm.all_gather(out, mine), f"gather of parameter {param}'s state '{key}'")
    whole = torch.zeros(layout.numels[param], dtype=dtype, device=device)
    for rank, pieces in enumerate(owners):
        for piece in pieces:
            whole[piece.start:piece.stop].copy_(out[rank * longest:rank * longest + piece.numel])
    return whole


def gather_whole(comm, layout: Layout, states: list[dict | None], device: torch.device):
    """Yields (parameter, its whole state {key: 1-D tensor in memory order, or scalar}) for
    every parameter with state, in parameter order, on every rank (collective)."""
    kinds = schema(comm.group, layout, states, device)
    for param in sorted(kinds):
        whole = {}
        for key, kind in sorted(kinds[param].items()):
            if kind[0] == "elementwise":
                whole[key] = gather_param(comm, layout, states, param, key,
                                          getattr(torch, kind[1]), device)
            else:
                whole[key] = _scalar(kind)
        yield param, whole


def cut(layout: Layout, param: int, whole: dict) -> dict:
    """{index of a piece in layout.pieces: its state} for parameter `param`'s whole state
    (elementwise values as 1-D tensors in memory order)."""
    out = {}
    for index, piece in enumerate(layout.pieces):
        if piece.param != param:
            continue
        out[index] = {key: value[piece.start:piece.stop].clone() if _elementwise(value)
                      else (value.clone() if torch.is_tensor(value) else value)
                      for key, value in whole.items()}
    return out


def _elementwise(value) -> bool:
    return torch.is_tensor(value) and value.dim() == 1


def as_torch(param: torch.Tensor, whole: dict) -> dict:
    """A whole state in torch's format: elementwise values shaped and strided like `param`."""
    out = {}
    for key, value in whole.items():
        if _elementwise(value) and not (param.dim() == 0 and key == "step"):
            shaped = torch.empty_like(param, dtype=value.dtype, device=value.device)
            flat_view(shaped).copy_(value)
            out[key] = shaped
        else:
            out[key] = value
    return out


def from_torch(param: torch.Tensor, state: dict) -> dict:
    """A parameter's state in torch's format as a whole state (elementwise values flattened in
    the parameter's memory order; a value shaped like the parameter is elementwise, except a
    0-dim parameter's 'step'). Floating elementwise values take the parameter's dtype and
    device, as torch's load_state_dict casts them."""
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and tuple(value.shape) == tuple(param.shape) and \
                not (param.dim() == 0 and key == "step"):
            laid_out = torch.empty_like(param, dtype=param.dtype if value.is_floating_point()
                                        else value.dtype)  # the parameter's strides
            laid_out.copy_(value)
            out[key] = flat_view(laid_out)
        elif torch.is_tensor(value) and value.dim() > 0:
            raise ValueError(f"sharded step: state '{key}' has shape {tuple(value.shape)}, "
                             f"expected the parameter's {tuple(param.shape)} or a scalar")
        else:
            out[key] = value
    return out
