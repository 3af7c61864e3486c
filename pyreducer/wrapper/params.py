"""The reduced parameters of one wrapper, as one object (the wrapper's only internal interface).

DistributedDataParallel builds a ReducedParams once, at construction, and hands it to the
modules that work beside it (join, timeline, tuning, tracing): they learn what they need from
it and never read the wrapper's private attributes. It is also where the per-parameter facts
are computed, each once: names, sizes in bytes and (dtype, device) group keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pyreducer._ext import _C


@dataclass(frozen=True, eq=False)
class ReducedParams:
    """The parameters a wrapper reduces, in DDP's order, with what helpers need to know of them.

    Attributes:
        names: fully qualified parameter names (the module's, without the wrapper's prefix).
        tensors: the parameters, one per name.
        sizes_bytes: bytes per parameter (csrc/bucket.h size_bytes).
        group_keys: "dtype/device" per parameter (csrc/bucket.h group_key): parameters with
            different keys never share a bucket; a parameter with sparse gradients has a key of
            its own ("dtype/device/sparse<i>"), so every plan made from these keys (initial,
            tuned) gives it a bucket of its own.
        process_group: the group gradients are averaged over.
        sparse: per parameter, whether it produces sparse gradients (it belongs to an
            nn.Embedding or nn.EmbeddingBag with sparse=True, as torch DDP decides).
        module: the wrapped module (for its buffers, looked up at every use).
        ignored: names of parameters and buffers excluded from reduction and syncing.
    """
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    sizes_bytes: tuple[int, ...]
    group_keys: tuple[str, ...]
    process_group: object
    sparse: tuple[bool, ...] = ()
    module: nn.Module | None = None
    ignored: frozenset = frozenset()

    @staticmethod
    def of(named: list[tuple[str, torch.Tensor]], process_group=None, module=None,
           ignored=frozenset(), sparse=None) -> "ReducedParams":
        """From (name, parameter) pairs in reduction order (and sparse flags, default none)."""
        tensors = tuple(p for _, p in named)
        sparse = tuple(sparse) if sparse else (False,) * len(tensors)
        return ReducedParams(names=tuple(n for n, _ in named), tensors=tensors,
                             sizes_bytes=tuple(_C.size_bytes(p) for p in tensors),
                             group_keys=tuple(_C.group_key(p) + (f"/sparse{i}" if sparse[i] else "")
                                              for i, p in enumerate(tensors)),
                             process_group=process_group, sparse=sparse,
                             module=module, ignored=frozenset(ignored))

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def device(self) -> torch.device:
        """The parameters' device (the first one's, as torch DDP): where this wrapper's own
        collectives (votes, maps, broadcasts) run."""
        return self.tensors[0].device

    @property
    def rank(self) -> int:
        if self.process_group is not None and not _registered(self.process_group):
            return self.process_group.rank()  # a group of its own (pyreducer.torchft's)
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        if self.process_group is not None and not _registered(self.process_group):
            return self.process_group.size()
        return dist.get_world_size(self.process_group)

    def buffers(self) -> list[torch.Tensor]:
        """The module's synced buffers; looked up at every use (modules may reassign them)."""
        return [b for n, b in self.module.named_buffers() if n not in self.ignored]

    def states(self, with_buffers: bool) -> list[torch.Tensor]:
        """What rank 0's copy overwrites on the others: every parameter that is not ignored
        (frozen ones too, as torch DDP), then the synced buffers if asked."""
        params = [p for n, p in self.module.named_parameters() if n not in self.ignored]
        return params + (self.buffers() if with_buffers else [])


def reduced_parameters(module: nn.Module, ignored) -> tuple[list, list[bool]]:
    """(name, param) of every parameter that requires grad and is not ignored, de-duplicated
    (tied parameters appear once, under their first name), in torch DDP's order; and per
    parameter whether its (first) module makes its gradient sparse, as torch DDP decides."""
    seen, named, sparse = set(), [], []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and fqn not in ignored and param not in seen:
                seen.add(param)
                named.append((fqn, param))
                sparse.append(isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse)
    return named, sparse


def _registered(group) -> bool:
    """Whether torch.distributed knows `group` (made by init_process_group or new_group)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_group_ranks


def backend_name(group) -> str:
    """dist.get_backend(group), also for a group torch.distributed does not know of."""
    if group is not None and not _registered(group):
        return group.name()
    return dist.get_backend(group)
