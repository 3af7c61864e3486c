"""The pieces a rank steps (Note [Sharded optimizer state] in pyreducer/sharded/__init__.py):
one tensor per Piece of the layout, a view of the rank's own region of its bucket's buffer,
stepped by the inner optimizer (the wrapped optimizer's class), whose state is kept per piece.
"""
from __future__ import annotations

import collections

import torch

from pyreducer.sharded import state as state_module
from pyreducer.sharded.layout import Layout, flat_view

SHARDED_FORMAT = "pyreducer.sharded_optimizer"


class Pieces:
    """This rank's piece tensors and the inner optimizer's parameters and state.

    Args:
        inner: the optimizer that steps the pieces (its param groups mirror the wrapped one's).
        params: the wrapper's reduced parameters (ReducedParams.tensors)."""

    def __init__(self, inner: torch.optim.Optimizer, params):
        self.inner, self.params = inner, list(params)
        self.layout: Layout | None = None
        self.tensors: list[torch.Tensor] = []
        self.flats: list[torch.Tensor] = []
        self.groups_seen: list[list[int]] | None = None
        self._last_groups: list[dict] = []
        self._owners = None  # (layout, owners()) once asked
        self._slots = None  # (layout, {parameter: slot()}) once asked
        self.held: list | None = None  # per piece, its state, while let_go() holds it

    # -- layout ----------------------------------------------------------------------------------
    def _views(self, layout: Layout, flats) -> list[torch.Tensor]:
        return [flats[p.bucket].narrow(0, layout.rank * layout.shard_numel[p.bucket] +
                                       p.shard_offset, p.numel) for p in layout.pieces]

    def move_to(self, layout: Layout, flats, comm, param_groups) -> None:
        """Pieces for `layout`; the state moves from the previous layout's pieces (collective:
        every rank gathers each parameter's state whole, then keeps its new pieces; each old
        piece's state is let go once its parameter has moved)."""
        tensors = self._views(layout, flats)
        state = collections.defaultdict(dict)
        if self.layout is not None:
            old = self._states()
            owner = [piece.param for piece in self.layout.pieces]
            for param, whole in state_module.gather_whole(comm, self.layout, old,
                                                          self._device()):
                for index, piece_state in state_module.cut(layout, param, whole).items():
                    state[tensors[index]] = piece_state
                for index, of in enumerate(owner):
                    if of == param:
                        old[index] = None
        self.layout, self.tensors, self.flats, self.held = layout, tensors, list(flats), None
        self.inner.state = state
        self.assign_groups(param_groups, force=True)

    def rebind(self, flats) -> None:
        """The same layout on new buffers (the Reducer reallocated them), or again after
        let_go(): state kept by piece."""
        if self.held is None and \
                all(f.data_ptr() == g.data_ptr() for f, g in zip(flats, self.flats)):
            return
        held = self._states()
        tensors = self._views(self.layout, flats)
        self.inner.state = collections.defaultdict(dict, {
            new: s for new, s in zip(tensors, held) if s})
        self.tensors, self.flats, self.held = tensors, list(flats), None
        self.assign_groups(None, force=True)

    def let_go(self) -> None:
        """Before the Reducer replaces its buffers (a new plan): the pieces' views of them are
        dropped, so the old buffers are freed at once; the state is kept by piece until the
        pieces are made again (move_to or rebind)."""
        if self.held is None and self.layout is not None:
            self.held = self._states()
            self.inner.state = collections.defaultdict(dict)
            for group in self.inner.param_groups:
                group["params"] = []
            self.tensors, self.flats = [], []

    def _states(self) -> list:
        """Per piece of the current layout, its state (None: none), held or live."""
        if self.held is not None:
            return self.held
        return [self.inner.state.get(t) for t in self.tensors]

    def _set_states(self, states: list) -> None:
        """Per piece of the current layout, its state (None: none), held or live."""
        if self.held is not None:
            self.held = list(states)
            return
        self.inner.state = collections.defaultdict(dict, {
            t: s for t, s in zip(self.tensors, states) if s})

    def assign_groups(self, param_groups, force: bool = False) -> None:
        """The inner optimizer's groups hold the pieces of the wrapped optimizer's groups' params
        (None: the groups last seen); a group added since is added, with its settings."""
        if param_groups is None:
            param_groups = self._last_groups
        seen = [[id(p) for p in g["params"]] for g in param_groups]
        if not force and seen == self.groups_seen:
            return
        self._last_groups, self.groups_seen = param_groups, seen
        group_of = {}
        for index, ids in enumerate(seen):
            for key in ids:
                group_of.setdefault(key, index)
        inner_groups = self.inner.param_groups
        for index, group in enumerate(param_groups[len(inner_groups):], len(inner_groups)):
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": []})
        for group in inner_groups:
            group["params"] = []
        for piece, tensor in zip(self.layout.pieces, self.tensors):
            index = group_of.get(id(self.params[piece.param]))
            if index is not None:
                inner_groups[index]["params"].append(tensor)

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    # -- one step --------------------------------------------------------------------------------
    def own_region(self, b: int) -> torch.Tensor:
        """This rank's 1/world_size of bucket b's buffer (where its pieces live)."""
        size = self.layout.shard_numel[b]
        return self.flats[b].narrow(0, self.layout.rank * size, size)

    def take_grads(self, buckets, shards, unused: set) -> None:
        """Each piece's .grad: its slice of the bucket's reduced shard; for a parameter unused
        on every rank, its own .grad as it is (None: skipped by the step), as torch DDP leaves
        it."""
        wanted = set(buckets)
        for piece, tensor in zip(self.layout.pieces, self.tensors):
            if piece.bucket not in wanted:
                continue
            if piece.param in unused:
                grad = self.params[piece.param].grad
                tensor.grad = None if grad is None else \
                    flat_view(grad)[piece.start:piece.stop].clone()
            else:
                tensor.grad = shards[piece.bucket].narrow(0, piece.shard_offset, piece.numel)

    def load_values(self, b: int, params=None) -> set[int]:
        """Bucket b's pieces (of `params` only, a set of parameter indices, if given) take
        their parameters' current values; returns the ids of those the inner optimizer steps."""
        members = set()
        stepped = {id(t) for g in self.inner.param_groups for t in g["params"]}
        for piece, tensor in zip(self.layout.pieces, self.tensors):
            if piece.bucket == b and (params is None or piece.param in params):
                tensor.copy_(flat_view(self.params[piece.param])[piece.start:piece.stop])
                if id(tensor) in stepped:
                    members.add(id(tensor))
        return members

    def owners(self) -> list[list[int]]:
        """Per parameter, the ranks holding a piece of it (lowest first)."""
        if self._owners is None or self._owners[0] is not self.layout:
            owners = [[] for _ in self.params]
            for rank in range(self.layout.world_size):
                for piece in self.layout.pieces_of(rank):
                    if not owners[piece.param] or owners[piece.param][-1] != rank:
                        owners[piece.param].append(rank)
            self._owners = (self.layout, owners)
        return self._owners[1]

    def slot(self, i: int) -> tuple[int, int, int]:
        """Parameter i's slot: (bucket, first element, end) in the bucket's buffer."""
        if self._slots is None or self._slots[0] is not self.layout:
            slots = {}
            for b, (indices, offsets) in enumerate(zip(self.layout.buckets,
                                                       self.layout.slot_offsets)):
                for index, offset in zip(indices, offsets):
                    slots[index] = (b, offset, offset + self.layout.numels[index])
            self._slots = (self.layout, slots)
        return self._slots[1][i]

    def write_param(self, i: int) -> None:
        """Parameter i takes its gathered value from its bucket's buffer."""
        b, begin, end = self.slot(i)
        flat_view(self.params[i]).copy_(self.flats[b][begin:end])

    # -- state -----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for s in self._states() if s
                   for v in s.values() if torch.is_tensor(v))

    def load_whole(self, whole: dict) -> None:
        """{parameter index: whole state} (state.from_torch's) cut into this rank's pieces;
        every other piece's state is dropped."""
        states = [None] * len(self.layout.pieces)
        for param, param_state in whole.items():
            for index, piece_state in state_module.cut(self.layout, param, param_state).items():
                states[index] = piece_state
        self._set_states(states)

    def whole_state_dict(self, optimizer, comm) -> dict:
        """torch's state_dict format, every parameter's state gathered whole (collective)."""
        result = optimizer.state_dict()
        index_of = _torch_indices(optimizer)
        states = self._states()
        for param, whole in state_module.gather_whole(comm, self.layout, states,
                                                      self._device()):
            index = index_of.get(id(self.params[param]))
            if index is not None:
                result["state"][index] = state_module.as_torch(self.params[param], whole)
        return result

    def load_state_dict(self, state_dict: dict, optimizer, comm) -> None:
        """torch's format, or a sharded checkpoint (sharded_state_dict's)."""
        if state_dict.get("format") == SHARDED_FORMAT:
            return self._load_sharded(state_dict, optimizer, comm)
        optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        index_of = _torch_indices(optimizer)
        position = {id(p): i for i, p in enumerate(self.params)}
        whole = {}
        for key, index in index_of.items():
            if index in state_dict["state"]:
                param = position[key]
                whole[param] = state_module.from_torch(self.params[param],
                                                       state_dict["state"][index])
        self.load_whole(whole)
        self.assign_groups(optimizer.param_groups, force=True)

    def sharded_state_dict(self, optimizer) -> dict:
        """This rank's piece states, its layout and the param groups (no collective)."""
        return dict(format=SHARDED_FORMAT, layout=self.layout.describe(),
                    param_groups=optimizer.state_dict()["param_groups"],
                    pieces=[dict(s or {}) for s in self._states()])

    def _load_sharded(self, checkpoint: dict, optimizer, comm) -> None:
        saved = Layout.from_description(checkpoint["layout"])
        if (saved.world_size, saved.rank) != (self.layout.world_size, self.layout.rank):
            raise ValueError(f"overlap_optimizer(shard=True): this sharded checkpoint was saved "
                             f"by rank {saved.rank} of {saved.world_size}; expected rank "
                             f"{self.layout.rank} of {self.layout.world_size} (load each "
                             "rank's own file, at the same world size; or save state_dict())")
        if len(checkpoint["pieces"]) != len(saved.pieces):
            raise ValueError(f"overlap_optimizer(shard=True): the sharded checkpoint holds "
                             f"{len(checkpoint['pieces'])} pieces, its layout "
                             f"{len(saved.pieces)}")
        optimizer.load_state_dict({"state": {}, "param_groups": checkpoint["param_groups"]})
        device = self._device()
        moved = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in s.items()}
                 for s in checkpoint["pieces"]]
        if saved.same_as(self.layout):
            states = [s or None for s in moved]
        else:  # saved on other buckets: each parameter gathered whole, then cut (collective)
            states = [None] * len(self.layout.pieces)
            for param, whole in state_module.gather_whole(comm, saved, moved, device):
                for index, piece_state in state_module.cut(self.layout, param, whole).items():
                    states[index] = piece_state
        self._set_states(states)
        self.assign_groups(optimizer.param_groups, force=True)


def _torch_indices(optimizer) -> dict[int, int]:
    """id(parameter) -> its index in torch's state_dict (groups in order, first occurrence)."""
    index_of: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_of.setdefault(id(p), len(index_of))
    return index_of


def memory_bytes(params, reducer, state_bytes: int) -> dict:
    """This rank's bytes: parameters, .grad tensors not aliasing a bucket, bucket buffers (held
    now: Note [Released bucket buffers]), their shards, optimizer state."""
    flats = reducer.bucket_buffers()
    bucket_storages = {f.untyped_storage().data_ptr() for f in flats} - {0}
    grads = {}
    for p in params:
        with torch._C.DisableTorchFunctionSubclass():  # (a pending parameter's .grad)
            g = p.grad
        if g is not None and g.untyped_storage().data_ptr() not in bucket_storages:
            grads[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    return dict(parameters=sum(p.numel() * p.element_size() for p in params),
                gradients=sum(grads.values()),
                gradient_buckets=sum(f.untyped_storage().nbytes() for f in flats),
                gradient_shards=sum(s.numel() * s.element_size()
                                    for s in reducer.shard_buffers() if s is not None),
                optimizer_state=state_bytes)
