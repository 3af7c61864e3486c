"""max_grad_norm on shards (Note [Clipping shards]).

Note [Clipping shards]
torch.nn.utils.clip_grad_norm_ takes the norm of each parameter's whole gradient (_foreach_norm
per device and dtype, where foreach applies: CPU and CUDA), the total norm of those norms stacked
in parameter order (grouped by device and dtype), and multiplies every gradient by
min(max_norm / (total + 1e-6), 1) (_foreach_mul_ per device and dtype). The last step is
elementwise; the norms are reductions whose float rounding depends on their order, so they are
taken as torch takes them, over whole gradients:
  - a parameter whose gradient lies in one rank's shard: that rank takes its norm (a 1-D view
    of the same elements in the same memory order reduces to the same value: checked in
    tests/unit/test_sharded_layout.py; on CUDA _foreach_norm also reads a tensor whose start
    is a multiple of 4 elements' bytes 4 elements at a time, summing in another order than for
    one that does not, and torch's gradients are allocations of their own: a piece that starts
    elsewhere is copied to such a place first);
  - a parameter cut by a shard boundary (at most N-1 per bucket): the pieces of all of them are
    all-gathered at once (one all-gather per dtype, each rank's padded to the longest) and each
    one's lowest owner lays out the whole and takes its norm; this is the clip's extra
    communication;
  - every rank then has every norm (one all-reduce of one float per parameter, each contributed
    by one rank, zeros elsewhere: x + 0 = x), and computes the total and the coefficient as
    torch does, bit for bit.
Which parameters have a gradient (torch's list skips None) needs no collective and no read of
the device: every parameter the backward reduced has one (its shard), and every rank knows which
those are (the Reducer's globally_unused(), from the used map all ranks reduced); a parameter
unused on every rank keeps its own whole .grad on every rank (Note [Sharded gradients] in
csrc/reducer.h), and each rank lists it if its own .grad is not None, as torch's clip on that
rank does. Its norm is taken from the pieces (its owners' .grad, which its step uses, as clipped
by a clip_grad_value_ before), like any other; which parameters are gathered depends on the
layout alone, so no collective depends on which have a gradient. (Where ranks' .grad of such a
parameter differ in being None, their totals differ, as torch DDP's clips would.) The
per-parameter work is on the host: on the device the clip costs a fixed number of kernels per
dtype (foreach kernels, whose launches grow only with the tensors one launch takes, as torch's),
not a few per parameter, and no host sync (the index tensors are made once per layout and copied
without one).
"""
from __future__ import annotations

import torch

from pyreducer.sharded.layout import flat_view

# ATen's multi-tensor kernels read kILP = 4 elements at a time from a tensor whose start is a
# multiple of 4 elements' bytes (MultiTensorApply.cuh: is_aligned), one at a time otherwise.
ILP = 4


class Clip:
    """max_grad_norm on one sharded optimizer's shards. Keeps, per layout, what the layout alone
    decides: the cut parameters' all-gathers, and the index tensors on the device (made once,
    not at every step)."""

    def __init__(self):
        self.layout = None
        self.indices: dict[tuple[int, ...], torch.Tensor] = {}
        self.cuts: dict[tuple[int, ...], tuple] = {}
        self.orders: dict[tuple, list[torch.dtype]] = {}  # dtypes -> torch's group order

    def __call__(self, pieces, order: list[int], max_norm: float, comm,
                 unused: set[int]) -> torch.Tensor:
        """Clips the pieces' gradients as clip_grad_norm_(params in `order`, max_norm) clips
        the whole gradients, and returns its total norm (collective: every rank calls it).

        Args:
            pieces: the optimizer's Pieces, their .grad set (Pieces.take_grads).
            order: the optimizer's parameters (indices into pieces.params), in its order.
            unused: the parameters unused on every rank (Reducer.globally_unused()).
        """
        layout, params = pieces.layout, pieces.params
        device = params[0].device
        if self.layout is not layout:
            self.layout, self.indices, self.cuts = layout, {}, {}
        held: dict[int, list[torch.Tensor]] = {}  # param -> this rank's pieces of its gradient
        for piece, tensor in zip(layout.pieces, pieces.tensors):
            if tensor.grad is not None:
                held.setdefault(piece.param, []).append(tensor.grad)
        owners = pieces.owners()
        local = {i: held[i][0] for i in held if owners[i] == [comm.rank]}
        cut = [i for i, of in enumerate(owners) if len(of) > 1]  # (the layout's: every rank's)
        for dtype, group in _by_dtype(cut, params).items():
            local.update(_gather_cut(comm, pieces, self._cut(group, owners, comm.rank), held,
                                     dtype, device))
        norms = torch.zeros(len(params), dtype=torch.float64, device=device)  # (x + 0 == x)
        mine = sorted(local)
        if mine:
            norms.index_copy_(0, self._index(mine, device), _stacked_norms(mine, local, params))
        comm.all_reduce_sum(norms, "all-reduce of the gradients' norms (max_grad_norm)")
        # (a parameter unused on every rank: listed if its .grad here is not None, as torch's
        # clip on this rank lists it; see Note [Clipping shards])
        own = {i for i in unused if _own_grad(params[i]) is not None}
        listed = [i for i in dict.fromkeys(order) if i not in unused or i in own]
        if not listed:
            return torch.tensor(0.0)  # (torch's, for no gradients)
        parts = [norms.index_select(0, self._index(group, device)).to(dtype)
                 for dtype, group in self._torch_groups(listed, params, device).items()]
        total = torch.linalg.vector_norm(parts[0] if len(parts) == 1 else torch.cat(parts))
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        grads = [grad for i in sorted(held) for grad in held[i]]
        for group in _by_dtype(range(len(grads)), grads).values():
            torch._foreach_mul_([grads[k] for k in group], coefficient)
        return total

    def _cut(self, group: list[int], owners: list[list[int]], rank: int) -> tuple:
        """For _gather_cut, once per layout: each rank's pieces of the `group` of cut
        parameters (one dtype), the most elements a rank sends, and those this rank is the
        lowest owner of."""
        key = tuple(group)
        if key not in self.cuts:
            wanted = set(group)
            sent = [[p for p in self.layout.pieces_of(r) if p.param in wanted]
                    for r in range(self.layout.world_size)]
            self.cuts[key] = (sent, max(sum(p.numel for p in mine) for mine in sent),
                              [i for i in group if owners[i][0] == rank])
        return self.cuts[key]

    def _torch_groups(self, listed: list[int], params, device) -> dict[torch.dtype, list[int]]:
        """`listed` grouped by dtype in the order torch's clip stacks the groups' norms: that of
        torch's own grouping (_group_tensors_by_device_and_dtype: a hash map's, not the order
        of appearance), asked once per sequence of dtypes with empty stand-ins (the total's
        rounding depends on it where dtypes mix)."""
        groups = _by_dtype(listed, params)
        key = tuple(groups)
        if key not in self.orders:
            from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

            stand_ins = [torch.empty(0, dtype=dtype, device=device) for dtype in key]
            self.orders[key] = [dtype for _, dtype in
                                _group_tensors_by_device_and_dtype([stand_ins])]
        return {dtype: groups[dtype] for dtype in self.orders[key]}

    def _index(self, positions: list[int], device: torch.device) -> torch.Tensor:
        """`positions` as an index tensor on `device`, made once per layout."""
        key = tuple(positions)
        if key not in self.indices:
            if len(self.indices) > 64:  # (the parameters with their own .grad vary)
                self.indices = {}
            host = torch.tensor(key, dtype=torch.long)
            # (a pageable host-to-device copy waits for the stream; a pinned one does not)
            self.indices[key] = host if device.type == "cpu" else \
                host.pin_memory().to(device, non_blocking=True)
        return self.indices[key]


def _by_dtype(indices, tensors) -> dict[torch.dtype, list[int]]:
    """`indices` grouped by their tensors' dtype, groups and members in order of appearance
    (one device: a sharded optimizer's parameters are on one)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i in indices:
        groups.setdefault(tensors[i].dtype, []).append(i)
    return groups


def _stacked_norms(indices: list[int], grads: dict[int, torch.Tensor], params) -> torch.Tensor:
    """The 2-norms of grads[i] for i in `indices`, each taken as torch takes it (_foreach_norm
    per dtype), as float64 (exact), in `indices`' order."""
    values: dict[int, torch.Tensor] = {}
    for group in _by_dtype(indices, params).values():
        tensors = _aligned([grads[i] for i in group])
        values.update(zip(group, torch._foreach_norm(tensors)))
    return torch.stack([values[i] for i in indices]).double()


def _aligned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` (one dtype) where _foreach_norm reduces them as it reduces torch's gradients:
    on CUDA, those that do not start at a multiple of ILP elements' bytes copied (in one kernel)
    into one buffer where each does (see Note [Clipping shards]); elsewhere as they are.
    Compiled, not run on CUDA: no GPU here."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors
    off = [k for k, t in enumerate(tensors) if t.data_ptr() % (ILP * t.element_size())]
    if not off:
        return tensors
    sizes = [-(-tensors[k].numel() // ILP) * ILP for k in off]
    buffer = torch.empty(sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)
    places = [place[:tensors[k].numel()] for place, k in zip(buffer.split(sizes), off)]
    torch._foreach_copy_(places, [flat_view(tensors[k]) for k in off])
    out = list(tensors)
    for place, k in zip(places, off):
        out[k] = place
    return out


def _gather_cut(comm, pieces, plan: tuple, held: dict, dtype: torch.dtype,
                device: torch.device) -> dict[int, torch.Tensor]:
    """The whole gradients (1-D, memory order) of the parameters cut by a shard boundary (of
    `dtype`) of which this rank is the lowest owner and holds a gradient (`held`): one
    all-gather of every rank's pieces of all of them, whatever has a gradient (`plan`, from
    Clip._cut: the same on every rank; a piece without a gradient sends zeros)."""
    sent, longest, owned = plan
    mine = torch.empty(longest, dtype=dtype, device=device)
    grads = {piece: tensor.grad for piece, tensor in zip(pieces.layout.pieces, pieces.tensors)}
    sizes = [piece.numel for piece in sent[comm.rank]]
    places = dict(zip(sent[comm.rank], mine[:sum(sizes)].split(sizes)))
    own = [piece for piece in sent[comm.rank] if grads[piece] is not None]
    if len(own) < len(sizes):  # (a parameter unused on every rank, without .grad here)
        mine.zero_()
    if own:
        torch._foreach_copy_([places[p] for p in own], [grads[p] for p in own])
    out = torch.empty(longest * len(sent), dtype=dtype, device=device)
    comm.wait(comm.all_gather(out, mine),
              "all-gather of the cut parameters' gradients (max_grad_norm)")
    return _lay_out([i for i in owned if i in held], sent, out, longest,
                    pieces.layout.numels, dtype, device)


def _lay_out(owned: list[int], sent: list, out: torch.Tensor, longest: int, numels: list[int],
             dtype: torch.dtype, device: torch.device) -> dict[int, torch.Tensor]:
    """Each of the `owned` parameters' whole gradient, from the gathered `out` (rank r's pieces
    `sent[r]` at r * longest, in order), in one buffer where each starts at a multiple of ILP
    elements (see _aligned), in one copy."""
    if not owned:
        return {}
    sizes = [-(-numels[i] // ILP) * ILP for i in owned]
    buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
    wholes = {i: place[:numels[i]] for i, place in zip(owned, buffer.split(sizes))}
    destinations, sources = [], []
    for rank, rank_pieces in enumerate(sent):
        offset = rank * longest
        for piece in rank_pieces:
            if piece.param in wholes:
                destinations.append(wholes[piece.param][piece.start:piece.stop])
                sources.append(out[offset:offset + piece.numel])
            offset += piece.numel
    torch._foreach_copy_(destinations, sources)
    return wholes


def _own_grad(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's own .grad (read as no torch function: it may wear the pending class)."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.grad
