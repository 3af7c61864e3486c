"""Which elements of which parameters each rank owns (Note [Sharded optimizer state] in
pyreducer/sharded/__init__.py): a pure function of the bucket plan, the parameters' element
counts and the world size, the same on every rank.
"""
from __future__ import annotations

import dataclasses

import torch

from pyreducer._ext import _C


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter that one rank owns in one bucket.

    bucket: the bucket's index; param: the parameter's index (ReducedParams order);
    start, stop: its elements [start, stop) in the parameter's memory order (flat_view);
    shard_offset: where they begin in the rank's shard of the bucket."""
    bucket: int
    param: int
    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class Layout:
    """The shards of a bucket plan: bucket b's buffer, padded as csrc/bucket.cpp pads it, is cut
    into world_size equal shards, rank r owning elements [r * shard_numel[b], (r + 1) *
    shard_numel[b]); shard_numel is _C.shard_numel (csrc/bucket.h: the chunks of Gloo's ring
    all-reduce, so a rank's shard may hold fewer real elements than another's, or none).

    Args:
        buckets: parameter indices per bucket, in slot order (Reducer.bucket_layout()).
        numels, element_sizes: element count and bytes per element, per parameter.
        world_size, rank: the group's.
    """

    def __init__(self, buckets: list[list[int]], numels: list[int], element_sizes: list[int],
                 world_size: int, rank: int):
        self.buckets = [list(b) for b in buckets]
        self.numels, self.element_sizes = list(numels), list(element_sizes)
        self.world_size, self.rank = world_size, rank
        self.slot_offsets: list[list[int]] = []  # per bucket, per slot: first element in it
        self.shard_numel: list[int] = []
        for indices in self.buckets:
            offsets, offset = [], 0
            for i in indices:
                offsets.append(offset)
                offset += numels[i]
            self.slot_offsets.append(offsets)
            self.shard_numel.append(_C.shard_numel(offset, world_size,
                                                   self.element_sizes[indices[0]]))
        self.pieces = self.pieces_of(rank)

    def pieces_of(self, rank: int) -> list[Piece]:
        """Rank `rank`'s pieces, bucket by bucket, in slot order."""
        pieces = []
        for b, indices in enumerate(self.buckets):
            first = rank * self.shard_numel[b]
            last = first + self.shard_numel[b]
            for i, offset in zip(indices, self.slot_offsets[b]):
                begin, end = max(offset, first), min(offset + self.numels[i], last)
                if begin < end:
                    pieces.append(Piece(b, i, begin - offset, end - offset, begin - first))
        return pieces

    def same_as(self, other: Layout | None) -> bool:
        return other is not None and (self.buckets, self.numels, self.world_size) == \
            (other.buckets, other.numels, other.world_size) and \
            self.shard_numel == other.shard_numel

    def describe(self) -> dict:
        """What a sharded checkpoint records to rebuild this layout (from_description)."""
        return dict(buckets=self.buckets, numels=self.numels, element_sizes=self.element_sizes,
                    world_size=self.world_size, rank=self.rank)

    @classmethod
    def from_description(cls, description: dict) -> Layout:
        return cls(description["buckets"], description["numels"], description["element_sizes"],
                   description["world_size"], description["rank"])


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `tensor`'s elements in memory order, the order of its slot in a bucket
    (csrc/bucket.cpp keeps a dense parameter's strides: channels-last stays channels-last).
    ValueError for a tensor whose elements overlap or leave gaps (no such view exists)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))
    permuted = tensor.permute(order)
    if not permuted.is_contiguous():
        raise ValueError(f"sharded step: a tensor of shape {tuple(tensor.shape)} and strides "
                         f"{tensor.stride()} is not dense in memory; expected a dense layout "
                         "(contiguous, channels-last, or another permutation)")
    return permuted.view(-1)
